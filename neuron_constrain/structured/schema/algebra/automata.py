"""Automata over code-point intervals, and the pattern trees they are written back as.

    dfa = Dfa.of([tree, other])      # the complete DFA of the strings both trees match in full
    dfa.complement().minimal()       # complemented, minimized (Moore), the start kept as state 0
    dfa.expression()                 # the language as a tree again (state elimination), None if empty

Thompson's NFA (``Nfa``), the subset construction over the intervals its labels cut the code points
into (surrogates are never text), Moore's refinement and state elimination, with the tree
combinators (``seq``, ``alt``, ``star``) that keep what is written short. ``regular.py`` writes the
trees as pattern text; ``lookaround.py`` builds the DFA of a tree with zero-width assertions. Every
step is bounded (``caps.CAPS``: ``nfa_states``, ``automaton_states``, and ``automaton_work``: the steps
counted by one ``caps.Work`` that a DFA carries from its construction through ``minimal`` and
``expression``): past a cap, :class:`caps.Over`, before the work is done rather than after.
"""
from __future__ import annotations

import bisect
import collections

from neuron_constrain.structured.schema.algebra.caps import Work, over
from neuron_constrain.structured.schema.code_points import MAX_CODE, normalize

EMPTY = ("seq", ())


# --------------------------------------------------------------------------- NFA
class Nfa:
    """Thompson's construction: per state its epsilon targets and its ``(ranges, target)`` moves."""

    def __init__(self):
        self.eps: list[list[int]] = []
        self.moves: list[list[tuple]] = []

    def state(self) -> int:
        self.eps.append([])
        self.moves.append([])
        over("nfa_states", len(self.eps))
        return len(self.eps) - 1

    def build(self, node) -> tuple[int, int]:
        kind = node[0]
        if kind == "chars":
            start, end = self.state(), self.state()
            self.moves[start].append((node[1], end))
            return start, end
        if kind == "seq":
            start = end = self.state()
            for child in node[1]:
                end = self._then(end, child)
            return start, end
        if kind == "alt":
            start, end = self.state(), self.state()
            for child in node[1]:
                inner_start, inner_end = self.build(child)
                self.eps[start].append(inner_start)
                self.eps[inner_end].append(end)
            return start, end
        if kind == "repeat":
            inner, low, high = node[1], node[2], node[3]
            start = end = self.state()
            for _ in range(low):
                end = self._then(end, inner)
            done = self.state()
            if high is None:
                inner_start, inner_end = self.build(inner)
                self.eps[end] += [inner_start, done]
                self.eps[inner_end] += [inner_start, done]
            else:
                for _ in range(high - low):
                    self.eps[end].append(done)  # the optional copies: each may be the last
                    end = self._then(end, inner)
                self.eps[end].append(done)
            return start, done
        return self.assertion(node)

    def assertion(self, node) -> tuple[int, int]:
        """A zero-width node (an anchor, a lookaround): ``lookaround.LookNfa`` builds them."""
        raise ValueError(f"no automaton for a {node[0]!r} node here (lookaround.py builds assertions)")

    def _then(self, end: int, node) -> int:
        """``node``'s automaton entered from ``end``; its own end."""
        inner_start, inner_end = self.build(node)
        self.eps[end].append(inner_start)
        return inner_end

    def closure(self, states) -> frozenset:
        seen, stack = set(states), list(states)
        while stack:
            for target in self.eps[stack.pop()]:
                if target not in seen:
                    seen.add(target)
                    stack.append(target)
        return frozenset(seen)


# --------------------------------------------------------------------------- DFA
class Dfa:
    """A complete DFA over ``atoms`` (disjoint code-point intervals covering every character):
    ``moves[state][atom]`` the next state, ``accepting`` a set of states, state 0 the start; ``work`` the
    steps counted since its construction began (``caps.Work``), carried to what is made from it."""

    def __init__(self, atoms: list, moves: list[list[int]], accepting: set, work: Work | None = None):
        self.atoms, self.moves, self.accepting = atoms, moves, accepting
        self.work = Work() if work is None else work

    @classmethod
    def of(cls, trees: list, work: Work | None = None) -> "Dfa":
        """The DFA of the strings every tree matches in full (no tree: no string)."""
        work = Work() if work is None else work
        nfas = []
        for tree in trees:
            nfa = Nfa()
            nfas.append((nfa, *nfa.build(tree)))
            work.spend(len(nfa.eps))
        intervals = atoms(ranges for nfa, _, _ in nfas for moves in nfa.moves for ranges, _ in moves)
        lows = [low for low, _ in intervals]
        spans = [[(atom_span(lows, ranges), target) for ranges, target in moves] for nfa, _, _ in nfas
                 for moves in nfa.moves]
        # atoms in the same labels move alike: each class is followed once, from its first atom
        member: dict = collections.defaultdict(list)
        for label, (span, _) in enumerate(label for labels in spans for label in labels):
            for atom in span:
                member[atom].append(label)
        classes: dict = {}
        atom_class = [classes.setdefault(tuple(member.get(atom, ())), atom) for atom in range(len(intervals))]
        firsts = sorted(classes.values())
        work.spend(len(intervals) + sum(map(len, member.values())))
        labelled, at = [], 0
        for nfa, _, _ in nfas:
            labelled.append([[([a for a in span if atom_class[a] == a], target) for span, target in labels]
                             for labels in spans[at:at + len(nfa.moves)]])
            at += len(nfa.moves)
        weights = [[1 + sum(len(span) for span, _ in labels) for labels in part] for part in labelled]
        starts = tuple(nfa.closure([start]) for nfa, start, _ in nfas)
        index, moves, accepting, queue = {starts: 0}, [], set(), collections.deque([starts])
        closed: dict = {}  # the NFA states one atom moves to -> their closure
        while queue:
            key = queue.popleft()
            state = index[key]
            work.spend(len(firsts) + sum(weight[source] for part, weight in zip(key, weights) for source in part))
            moves.append([])
            if nfas and all(end in part for part, (_, _, end) in zip(key, nfas)):
                accepting.add(state)
            per_part = []
            for part, labels in zip(key, labelled):
                targets = collections.defaultdict(set)
                for source in part:
                    for span, target in labels[source]:
                        for atom in span:
                            targets[atom].add(target)
                per_part.append(targets)
            by_class = {}
            for atom in firsts:
                if not nfas or any(atom not in targets for targets in per_part):
                    by_class[atom] = -1
                    continue
                moved = tuple(frozenset(targets[atom]) for targets in per_part)
                if moved not in closed:
                    closed[moved] = tuple(nfa.closure(part) for (nfa, _, _), part in zip(nfas, moved))
                    work.spend(sum(map(len, closed[moved])))
                next_key = closed[moved]
                if next_key not in index:
                    index[next_key] = len(index)
                    over("automaton_states", len(index))
                    queue.append(next_key)
                by_class[atom] = index[next_key]
            moves[state] = [by_class[first] for first in atom_class]
        return cls(intervals, moves, accepting, work).completed()

    def completed(self) -> "Dfa":
        if all(target >= 0 for row in self.moves for target in row):
            return self
        dead = len(self.moves)
        moves = [[dead if target < 0 else target for target in row] for row in self.moves]
        moves.append([dead] * len(self.atoms))
        return Dfa(self.atoms, moves, self.accepting, self.work)

    def complement(self) -> "Dfa":
        return Dfa(self.atoms, self.moves, set(range(len(self.moves))) - self.accepting, self.work)

    def minimal(self) -> "Dfa":
        """Moore's refinement over the reachable states; the start stays state 0."""
        block = [1 if state in self.accepting else 0 for state in range(len(self.moves))]
        # atoms every state moves on alike refine alike: each distinct column is read once (\w's hundreds
        # of intervals are a few columns)
        columns = list(dict.fromkeys(zip(*self.moves)))
        rows = list(zip(*columns))
        self.work.spend(len(self.atoms) + len(self.moves))
        while True:  # a round builds one small tuple per state, in a comprehension: a step per 4 entries (measured)
            self.work.spend(len(rows) * (len(columns) + 1) // 4)
            signatures: dict = {}
            refined = [signatures.setdefault((block[s], tuple(block[t] for t in rows[s])), len(signatures))
                       for s in range(len(rows))]
            if len(signatures) == len(set(block)):
                break
            block = refined
        order, reachable = {}, list(self._depths())  # breadth first from the start: the start stays 0
        for state in reachable:
            order.setdefault(block[state], len(order))
        moves = [None] * len(order)
        for state in reachable:
            moves[order[block[state]]] = [order[block[t]] for t in self.moves[state]]
        accepting = {order[block[s]] for s in self.accepting if block[s] in order}
        return Dfa(self.atoms, moves, accepting, self.work)

    def expression(self):
        """The language as a pattern tree (state elimination), or None when it is empty."""
        live = self.live()
        if 0 not in live:
            return None
        self.work.spend(len(live) * len(self.atoms))
        start, final = -1, -2
        edges: dict = collections.defaultdict(dict)  # source -> target -> tree
        for state in live:
            by_target = collections.defaultdict(list)
            for atom, target in enumerate(self.moves[state]):
                if target in live:
                    by_target[target].append(self.atoms[atom])
            for target, ranges in by_target.items():
                edges[state][target] = ("chars", joined(ranges))
            if state in self.accepting:
                edges[state][final] = EMPTY
        edges[start][0] = EMPTY
        remaining, depth = set(live), self._depths()
        while True:
            self.work.spend(sum(map(len, edges.values())))  # one search for a chain reads every edge
            if (chain := _counter_chain(edges)) is None:
                break
            _count_chain(edges, chain, remaining, depth)
        into = collections.defaultdict(set)  # target -> its sources
        for source, targets in edges.items():
            for target in targets:
                into[target].add(source)

        def cost(k):  # the fewest paths made first; among equals the farthest from the start
            return len(into[k] - {k}) * len([t for t in edges.get(k, {}) if t != k]), -depth.get(k, 0), k
        while remaining:
            state = min(remaining, key=cost)
            remaining.discard(state)
            outgoing = edges.pop(state, {})
            self.work.spend(1 + len(into[state]) * len(outgoing))  # the paths made through it
            loop = outgoing.pop(state, None)
            middle = EMPTY if loop is None else star(loop)
            for target in outgoing:
                into[target].discard(state)
            for source in into.pop(state, set()) - {state}:
                incoming = edges[source].pop(state)
                for target, out in outgoing.items():
                    path = seq(incoming, middle, out)
                    edges[source][target] = alt(edges[source][target], path) if target in edges[source] else path
                    into[target].add(source)
        return edges[start].get(final)

    def _depths(self) -> dict[int, int]:
        """Each reachable state's distance from the start, in breadth-first order."""
        depth, queue = {0: 0}, collections.deque([0])
        while queue:
            state = queue.popleft()
            for target in self.moves[state]:
                if target not in depth:
                    depth[target] = depth[state] + 1
                    queue.append(target)
        return depth

    def live(self) -> set[int]:
        """The states from which an accepting state is reachable."""
        backward = collections.defaultdict(set)
        for state, row in enumerate(self.moves):
            for target in row:
                backward[target].add(state)
        live, stack = set(self.accepting), list(self.accepting)
        while stack:
            for source in backward[stack.pop()]:
                if source not in live:
                    live.add(source)
                    stack.append(source)
        return live


def _counter_chain(edges) -> list | None:
    """States ``q1 .. qn`` in a row (each entered only from the one before) whose first ``n - 1`` leave
    the same way: one set to the next and the same other edges (the shape ``x{m,n}`` leaves in a
    DFA), or None. Left to state elimination, a chain of ``n`` writes its exits ``n`` times over."""
    into = collections.Counter(target for source in edges for target in edges[source] if target != source)
    for head in list(edges):
        chain, shape = [head], None
        while True:
            here = chain[-1]
            step = None
            for target, label in edges.get(here, {}).items():
                if target in chain or target < 0 or into[target] != 1 or label[0] != "chars":
                    continue
                rest = {k: v for k, v in edges[here].items() if k != target}
                if here in rest or shape not in (None, (label, rest)):
                    continue
                step, shape = target, (label, rest)
                break
            if step is None:
                break
            chain.append(step)
        if len(chain) >= 4:  # three alike and the last: worth counting
            return chain
    return None


def _count_chain(edges, chain: list, remaining: set, depth: dict) -> None:
    """``q1 -x-> q2 -x-> .. -x-> qn``, with ``q1 .. q(n-1)`` leaving alike, rewritten as
    ``q1 -x{0,n-2}-> m`` (m: their other edges) and ``q1 -x{n-1}-> qn``."""
    first, last = chain[0], chain[-1]
    label = edges[first][chain[1]]
    rest = {k: v for k, v in edges[first].items() if k != chain[1]}
    merged = max(max(edges), max(remaining)) + 1
    for state in chain[1:-1]:
        edges.pop(state, None)
        remaining.discard(state)
    steps = len(chain) - 1
    edges[merged] = rest
    edges[first] = {merged: ("repeat", label, 0, steps - 1), last: ("repeat", label, steps, steps)}
    remaining.add(merged)
    depth[merged] = depth.get(first, 0) + 1


def atoms(labels) -> list[tuple[int, int]]:
    """The intervals the label boundaries cut the characters into (surrogates left out)."""
    cuts = {0, 0xD800, 0xE000, MAX_CODE + 1}
    for ranges in labels:
        for low, high in ranges:
            cuts.update((low, high + 1))
    cuts = sorted(cuts)
    return [(low, nxt - 1) for low, nxt in zip(cuts, cuts[1:]) if not (low >= 0xD800 and nxt - 1 <= 0xDFFF)]


def joined(ranges: list) -> tuple:
    """Atoms in order (sorted, disjoint, no surrogates) as ``normalize`` writes them: neighbours joined."""
    out: list = []
    for low, high in ranges:
        if out and low == out[-1][1] + 1:
            out[-1] = (out[-1][0], high)
        else:
            out.append((low, high))
    return tuple(out)


def atom_span(lows: list[int], ranges) -> list[int]:
    span = []
    for low, high in ranges:
        span += range(bisect.bisect_left(lows, low), bisect.bisect_right(lows, high))
    return span


# --------------------------------------------------------------------------- trees
def fold(tree, combine):
    """``combine(node, [its children's values])`` from the leaves up, iteratively (no recursion), each shared
    subtree once (state elimination shares them): the root's value."""
    values: dict[int, object] = {}
    stack = [(tree, False)]
    while stack:
        node, expanded = stack.pop()
        if id(node) in values:
            continue
        children = node[1] if node[0] in ("seq", "alt") else (node[1],) if node[0] == "repeat" else ()
        if not expanded and children:
            stack.append((node, True))
            stack.extend((child, False) for child in children if id(child) not in values)
            continue
        values[id(node)] = combine(node, [values[id(child)] for child in children])
    return values[id(tree)]


def written_size(tree) -> int:
    """The items (set ranges, groups, counts) ``tree`` holds written out: a subtree state elimination
    shares is written each time it is used; measured once per shared subtree, without writing it."""
    return fold(tree, lambda node, sizes: (len(node[1]) if node[0] == "chars" else 1) + sum(sizes))


def _items(node) -> list:
    return list(node[1]) if node[0] == "seq" else [node]


def seq(*parts):
    """The concatenation; runs of one item counted (``x x{1,3}`` -> ``x{2,4}``)."""
    items: list = []
    for part in parts:
        for item in _items(part):
            last = items[-1] if items else None
            (node, more_low, more_high) = _counted(item)
            if last is not None and node[0] != "repeat" and _counted(last)[0] == node:
                _, low, high = _counted(last)
                items[-1] = ("repeat", node, low + more_low, None if None in (high, more_high) else high + more_high)
            else:
                items.append(item)
    return items[0] if len(items) == 1 else ("seq", tuple(items))


def _counted(item):
    """``item`` as (what repeats, low, high): a lone item counts once."""
    if item[0] == "repeat" and item[1][0] != "repeat":
        return item[1], item[2], item[3]
    return item, 1, 1


def alt(a, b):
    """The union; shared first and last items factored out (``ab|ac`` -> ``a(?:b|c)``), sets merged."""
    if a == b:
        return a
    if a[0] == "chars" and b[0] == "chars":
        return ("chars", normalize(a[1] + b[1]))
    if a[0] != "alt" and b[0] != "alt":
        left, right = _items(a), _items(b)
        if left and right and left[0] == right[0] and (len(left) > 1 or len(right) > 1):
            return seq(left[0], alt(seq(*left[1:]), seq(*right[1:])))  # seq() of nothing is EMPTY
        if left and right and left[-1] == right[-1] and (len(left) > 1 or len(right) > 1):
            return seq(alt(seq(*left[:-1]), seq(*right[:-1])), left[-1])
    branches: list = []
    for part in (a, b):
        for branch in part[1] if part[0] == "alt" else [part]:
            merged = False
            for i, seen in enumerate(branches):
                if seen == branch:
                    merged = True
                elif seen[0] == "chars" and branch[0] == "chars":
                    branches[i], merged = ("chars", normalize(seen[1] + branch[1])), True
                if merged:
                    break
            if not merged:
                branches.append(branch)
    if EMPTY in branches:  # x | "" -> x?
        rest = [branch for branch in branches if branch != EMPTY]
        if not rest:
            return EMPTY
        inner = rest[0] if len(rest) == 1 else ("alt", tuple(rest))
        return inner if inner[0] == "repeat" and inner[2] == 0 else ("repeat", inner, 0, 1)
    return branches[0] if len(branches) == 1 else ("alt", tuple(branches))


def star(node):
    if node[0] == "repeat" and node[2] in (0, 1) and node[3] in (1, None):
        node = node[1]
    return ("repeat", node, 0, None)
