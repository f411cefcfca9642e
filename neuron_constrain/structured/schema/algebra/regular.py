"""Patterns as regular languages: the complement and the intersection of patterns, written back as one.

    complement_pattern(r"^[A-Fa-f\\d]{24}$")   # a pattern matching the strings this one does not
    intersect_patterns((p, q))                # a pattern matching the strings both match
    referee_match(pattern, text)              # what the referee says of a pattern, one written here too

JSON Schema's ``pattern`` is a search. Its complement holds every string neither dialect finds the
pattern in, so the pattern is read wide (``patterns.parse(source, wide=True)``: each set the union
of ECMA-262's and Python's, a final ``$`` also before a last newline); an intersection reads each
pattern narrow (what both dialects match), as the engines do. The language goes through automata
over code-point intervals: Thompson's NFA, the subset construction over the intervals its labels
cut the code points into (surrogates are never text), completed and complemented or multiplied,
minimized (Moore's refinement), then written back by state elimination as explicit sets, groups,
alternation and counted repetition: a text the library's parser and Python's ``re`` read alike,
anchored ``^(?:...)$``. What is written is exact for the engines' reading and may refuse a string
only one dialect would take; the algebra's judge (``jsonschema``, the referee) reads a pattern
written here as what it stands for (:func:`referee_match`: not the first, or all of them, each
read by Python's ``re``), never as its text.

Every step is bounded (``caps.CAPS``: ``nfa_states``, ``automaton_states``, ``pattern_chars``): past a
cap the rewrite is refused by name, never truncated. A pattern with a feature no engine enforces
(lookaround, back-references, ...) has no complement here (None).
"""
from __future__ import annotations

import bisect
import collections
import functools
import re

from neuron_constrain.structured.schema import patterns
from neuron_constrain.structured.schema.algebra.caps import over
from neuron_constrain.structured.schema.code_points import MAX_CODE, normalize
from neuron_constrain.structured.constraints import ConstraintError

# a pattern written here -> what it stands for: ("not", source) or ("all", sources)
_WRITTEN: "collections.OrderedDict[str, tuple]" = collections.OrderedDict()
_WRITTEN_KEPT = 4096
_EMPTY = ("seq", ())


def referee_match(source: str, text: str) -> bool:
    """Whether the referee (Python's ``re``, a search) finds ``source`` in ``text``; for a pattern written
    here, whether it finds what that pattern stands for (not the pattern complemented, or all of them)."""
    meaning = _WRITTEN.get(source)
    if meaning is None:
        return re.search(source, text) is not None
    if meaning[0] == "not":
        return not referee_match(meaning[1], text)
    return all(referee_match(part, text) for part in meaning[1])


@functools.lru_cache(maxsize=256)
def complement_pattern(source: str):
    """A pattern (search semantics, like every JSON Schema ``pattern``) that matches exactly the strings
    ``source`` matches in neither dialect; ``False`` when it matches every string; None when ``source``
    has a feature read differently or not at all (no complement is sound then)."""
    pattern = _parsed(source, wide=True)
    if pattern is None:
        return None
    tree = patterns.full_match(pattern, search=True)
    dfa = _Dfa.of([tree] if tree is not None else [])
    return _written(dfa.complement().minimal(), ("not", source))


@functools.lru_cache(maxsize=256)
def intersect_patterns(sources: tuple, wide: bool = False):
    """A pattern matching exactly the strings every one of ``sources`` matches (each read narrow, as the
    engines read it, or ``wide``: in either dialect); ``False`` when no string does; None when one has a
    refused feature."""
    trees = []
    for source in sources:
        pattern = _parsed(source, wide=wide)
        if pattern is None:
            return None
        tree = patterns.full_match(pattern, search=True)
        if tree is None:
            return False
        trees.append(tree)
    return _written(_Dfa.of(trees).minimal(), ("all", sources))


def _parsed(source: str, wide: bool):
    try:
        pattern = patterns.parse(source, wide)
    except ConstraintError:
        return None
    return None if pattern.refused is not None else pattern


def _written(dfa: "_Dfa", meaning: tuple):
    tree = dfa.expression()
    if tree is None:
        return False
    over("pattern_chars", _length(tree, {}))  # before writing: shared subtrees would be written out each time
    body = _write(tree)
    source = f"^(?:{body})$"
    _WRITTEN[source] = meaning
    _WRITTEN.move_to_end(source)
    while len(_WRITTEN) > _WRITTEN_KEPT:
        _WRITTEN.popitem(last=False)
    return source


# --------------------------------------------------------------------------- NFA
class _Nfa:
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
        raise ValueError(f"no automaton for a {kind!r} node")  # anchors and refused nodes never get here

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
class _Dfa:
    """A complete DFA over ``atoms`` (disjoint code-point intervals covering every character):
    ``moves[state][atom]`` the next state, ``accepting`` a set of states, state 0 the start."""

    def __init__(self, atoms: list, moves: list[list[int]], accepting: set):
        self.atoms, self.moves, self.accepting = atoms, moves, accepting

    @classmethod
    def of(cls, trees: list) -> "_Dfa":
        """The DFA of the strings every tree matches in full (no tree: no string)."""
        nfas = []
        for tree in trees:
            nfa = _Nfa()
            nfas.append((nfa, *nfa.build(tree)))
        atoms = _atoms(ranges for nfa, _, _ in nfas for moves in nfa.moves for ranges, _ in moves)
        lows = [low for low, _ in atoms]
        labelled = [[[(_atom_span(lows, ranges), target) for ranges, target in moves] for moves in nfa.moves]
                    for nfa, _, _ in nfas]
        starts = tuple(nfa.closure([start]) for nfa, start, _ in nfas)
        index, moves, accepting, queue = {starts: 0}, [], set(), collections.deque([starts])
        closed: dict = {}  # the NFA states one atom moves to -> their closure
        while queue:
            key = queue.popleft()
            state = index[key]
            moves.append([])
            if nfas and all(end in part for part, (_, _, end) in zip(key, nfas)):
                accepting.add(state)
            per_part = []
            for part, (nfa, _, _), labels in zip(key, nfas, labelled):
                targets = collections.defaultdict(set)
                for source in part:
                    for span, target in labels[source]:
                        for atom in span:
                            targets[atom].add(target)
                per_part.append(targets)
            row = []
            for atom in range(len(atoms)):
                if not nfas or any(atom not in targets for targets in per_part):
                    row.append(-1)
                    continue
                moved = tuple(frozenset(targets[atom]) for targets in per_part)
                if moved not in closed:
                    closed[moved] = tuple(nfa.closure(part) for (nfa, _, _), part in zip(nfas, moved))
                next_key = closed[moved]
                if next_key not in index:
                    index[next_key] = len(index)
                    over("automaton_states", len(index))
                    queue.append(next_key)
                row.append(index[next_key])
            moves[state] = row
        return cls(atoms, moves, accepting)._completed()

    def _completed(self) -> "_Dfa":
        if all(target >= 0 for row in self.moves for target in row):
            return self
        dead = len(self.moves)
        moves = [[dead if target < 0 else target for target in row] for row in self.moves]
        moves.append([dead] * len(self.atoms))
        return _Dfa(self.atoms, moves, self.accepting)

    def complement(self) -> "_Dfa":
        return _Dfa(self.atoms, self.moves, set(range(len(self.moves))) - self.accepting)

    def minimal(self) -> "_Dfa":
        """Moore's refinement over the reachable states; the start stays state 0."""
        block = [1 if state in self.accepting else 0 for state in range(len(self.moves))]
        while True:
            signatures: dict = {}
            refined = [signatures.setdefault((block[s], tuple(block[t] for t in self.moves[s])), len(signatures))
                       for s in range(len(self.moves))]
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
        return _Dfa(self.atoms, moves, accepting)

    def expression(self):
        """The language as a pattern tree (state elimination), or None when it is empty."""
        live = self._live()
        if 0 not in live:
            return None
        start, final = -1, -2
        edges: dict = collections.defaultdict(dict)  # source -> target -> tree
        for state in live:
            by_target = collections.defaultdict(list)
            for atom, target in enumerate(self.moves[state]):
                if target in live:
                    by_target[target].append(self.atoms[atom])
            for target, ranges in by_target.items():
                edges[state][target] = ("chars", normalize(ranges))
            if state in self.accepting:
                edges[state][final] = _EMPTY
        edges[start][0] = _EMPTY
        remaining, depth = set(live), self._depths()
        while (chain := _counter_chain(edges)) is not None:
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
            loop = outgoing.pop(state, None)
            middle = _EMPTY if loop is None else _star(loop)
            for target in outgoing:
                into[target].discard(state)
            for source in into.pop(state, set()) - {state}:
                incoming = edges[source].pop(state)
                for target, out in outgoing.items():
                    path = _seq(incoming, middle, out)
                    edges[source][target] = _alt(edges[source][target], path) if target in edges[source] else path
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

    def _live(self) -> set[int]:
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


def _atoms(labels) -> list[tuple[int, int]]:
    """The intervals the label boundaries cut the characters into (surrogates left out)."""
    cuts = {0, 0xD800, 0xE000, MAX_CODE + 1}
    for ranges in labels:
        for low, high in ranges:
            cuts.update((low, high + 1))
    cuts = sorted(cuts)
    return [(low, nxt - 1) for low, nxt in zip(cuts, cuts[1:]) if not (low >= 0xD800 and nxt - 1 <= 0xDFFF)]


def _atom_span(lows: list[int], ranges) -> list[int]:
    span = []
    for low, high in ranges:
        span += range(bisect.bisect_left(lows, low), bisect.bisect_right(lows, high))
    return span


# --------------------------------------------------------------------------- trees and their text
def _items(node) -> list:
    return list(node[1]) if node[0] == "seq" else [node]


def _seq(*parts):
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


def _alt(a, b):
    """The union; shared first and last items factored out (``ab|ac`` -> ``a(?:b|c)``), sets merged."""
    if a == b:
        return a
    if a[0] == "chars" and b[0] == "chars":
        return ("chars", normalize(a[1] + b[1]))
    if a[0] != "alt" and b[0] != "alt":
        left, right = _items(a), _items(b)
        if left and right and left[0] == right[0] and (len(left) > 1 or len(right) > 1):
            return _seq(left[0], _alt(_seq(*left[1:]), _seq(*right[1:])))  # _seq() of nothing is _EMPTY
        if left and right and left[-1] == right[-1] and (len(left) > 1 or len(right) > 1):
            return _seq(_alt(_seq(*left[:-1]), _seq(*right[:-1])), left[-1])
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
    if _EMPTY in branches:  # x | "" -> x?
        rest = [branch for branch in branches if branch != _EMPTY]
        if not rest:
            return _EMPTY
        inner = rest[0] if len(rest) == 1 else ("alt", tuple(rest))
        return inner if inner[0] == "repeat" and inner[2] == 0 else ("repeat", inner, 0, 1)
    return branches[0] if len(branches) == 1 else ("alt", tuple(branches))


def _star(node):
    if node[0] == "repeat" and node[2] in (0, 1) and node[3] in (1, None):
        node = node[1]
    return ("repeat", node, 0, None)


def _write_code(code: int) -> str:
    char = chr(code)
    if char.isascii() and char.isalnum() or code > 0xFFFF:
        return char
    return f"\\u{code:04x}"


def _count_text(low: int, high) -> str:
    return "*" if (low, high) == (0, None) else "?" if (low, high) == (0, 1) else \
        f"{{{low},}}" if high is None else f"{{{low},{high}}}"


def _length(node, memo: dict) -> int:
    """``len(_write(node))``, each shared subtree measured once (state elimination shares them)."""
    known = memo.get(id(node))
    if known is not None:
        return known
    kind = node[0]
    if kind == "chars":
        size = len(_write(node))
    elif kind == "seq":
        size = sum(_length(child, memo) + (4 if child[0] == "alt" else 0) for child in node[1])
    elif kind == "alt":
        size = sum(_length(child, memo) for child in node[1]) + len(node[1]) - 1
    else:
        size = _length(node[1], memo) + (0 if node[1][0] == "chars" else 4) + len(_count_text(node[2], node[3]))
    memo[id(node)] = size
    return size


def _write(node) -> str:
    kind = node[0]
    if kind == "chars":
        ranges = node[1]
        if len(ranges) == 1 and ranges[0][0] == ranges[0][1]:
            return _write_code(ranges[0][0])
        return "[" + "".join(_write_code(low) if low == high else f"{_write_code(low)}-{_write_code(high)}"
                             for low, high in ranges) + "]"
    if kind == "seq":
        return "".join(f"(?:{_write(child)})" if child[0] == "alt" else _write(child) for child in node[1])
    if kind == "alt":
        return "|".join(_write(child) for child in node[1])
    inner = _write(node[1])
    if node[1][0] != "chars":
        inner = f"(?:{inner})"
    return inner + _count_text(node[2], node[3])
