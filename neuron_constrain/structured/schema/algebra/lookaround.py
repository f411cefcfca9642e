"""Lookarounds, word boundaries and anchors anywhere: the exact regular language, by automata.

    language(parse(r"^(?!admin$)\\w+$"), search=True)   # a plain tree (sets, groups, repeats), or None
    dfa([tree, other])                                 # the DFA of the strings every tree matches in full

A lookahead ``(?=X)`` at a position asks the whole rest of the text to start with a match of ``X``
(beyond its group, inside repetitions alike); a lookbehind ``(?<=Y)`` asks the text before it to end
with one; the negative forms ask the opposite; ``\\b`` is a lookbehind and a lookahead of one ``\\w``
character; ``^`` and ``$`` are lookarounds of one character (``$`` read wide also before a final
newline, as Python's). Each is built exactly: the pattern's NFA (``automata.Nfa``) gets a check edge
per assertion, and the subset construction runs over *configurations*: an NFA state with the
obligations its path took on, each obligation the configurations of a lookahead's body (met when one
finishes with its own obligations met; a negative one when none does), nested as the lookaheads are.
A lookbehind reads a tracker: the subset of ``.*Y``'s NFA over the text so far, one per lookbehind
(its body has a fixed width, as Python's ``re`` demands, and no assertion: ``patterns.py`` refuses
the rest by name). The DFA's states are the trackers and the configuration set; it is minimized
and written back by state elimination (``automata.Dfa.expression``), so an engine reads only sets.

``\\b``'s ``\\w`` is ASCII in ECMA-262 and Unicode in Python's ``re``: the narrow reading is the
boundary both readings see (both conditions at once), the wide one either (their union). Bounded by
``caps.CAPS["nfa_states"]``, ``["automaton_states"]`` and ``["automaton_work"]`` (the steps of the
construction, counted as it goes: a pattern whose subsets grow large is refused early, not after
seconds of work; the tree written back counts too, each item as written out: an engine reads it so);
past a cap :func:`language` refuses by name (``schema/limits.py`` builds each schema pattern's
language first, so that its refusal names the JSON pointer; the engines then reuse what was built).
"""
from __future__ import annotations

import collections
import threading

from neuron_constrain.structured.constraints import ConstraintError
from neuron_constrain.structured.schema import patterns
from neuron_constrain.structured.schema.algebra.automata import Dfa, Nfa, atom_span, atoms, fold, written_size
from neuron_constrain.structured.schema.algebra.caps import Over, Work, over
from neuron_constrain.structured.schema.code_points import ANY, shorthand

_ASSERTIONS = ("start", "end", "look", "boundary")
_DONE = -1  # a configuration whose lookahead body has matched: only its own obligations are left
_NONE: frozenset = frozenset()
_MET, _FAILED = "met", "failed"  # an obligation settled
_ANY_CHAR = ("chars", ANY)
_AT_END = ("look", True, True, _ANY_CHAR)  # no character follows


def has_assertion(tree) -> bool:
    """Whether ``tree`` holds a zero-width node (anchor, lookaround, word boundary) only this module builds."""
    kind = tree[0]
    if kind in ("seq", "alt"):
        return any(has_assertion(child) for child in tree[1])
    return kind in _ASSERTIONS or kind == "repeat" and has_assertion(tree[1])


_BUILT: "collections.OrderedDict[tuple, tuple | None]" = collections.OrderedDict()  # (pattern, search) -> tree
_BUILT_KEPT = 256
_BUILT_LOCK = threading.Lock()  # admission threads build patterns side by side


def language(pattern: patterns.Pattern, *, search: bool):
    """``patterns.full_match(pattern, search=...)`` with every zero-width node built in: a plain tree
    (sets, sequences, alternations, repeats) of the same strings, or None when no string matches.

    Args:
        pattern: a parsed pattern (``patterns.parse``).
        search: read it as a search (JSON Schema's ``pattern``) rather than a full match.

    Returns:
        The plain tree, or None when no string matches (the last 256 built are kept); or
        ``("automaton", dfa)`` where the automaton was built within the caps but its tree, written out
        as one expression, would pass ``CAPS["automaton_work"]`` (state elimination of a lookaround beside
        a bounded repetition: ``^(?!.*\\.\\.)[a-z.]{1,30}$`` writes 14 million items from 60 states).
        ``pattern_text`` writes it as grammar rules, a state each, for xgrammar; a regex engine refuses it.

    Raises:
        ConstraintError: the automaton would pass a cap (``CAPS``), named with its value and
            the pattern; ``.cap`` names it (``automaton_work``, ``automaton_states``, ``nfa_states``).
    """
    key = (pattern, search)
    with _BUILT_LOCK:
        if key in _BUILT:
            return _BUILT[key]
    tree = patterns.full_match(pattern, search=search)
    if tree is None or not has_assertion(tree):
        return tree
    counted = Work()
    try:
        automaton = dfa([tree], counted).minimal()
        try:
            built = automaton.expression()
            if built is not None:  # what an engine reads: a tree whose shared parts write out large costs it
                counted.spend(written_size(built))
        except Over as passed:
            if passed.cap != "automaton_work":
                raise
            built = ("automaton", automaton)  # too large as one expression: kept whole (grammar rules, a state each)
    except Over as passed:
        needs = f"more than {passed.maximum} {passed.cap.replace('_', ' ')}" if passed.cap != "automaton_work" else \
            f"more than {passed.maximum} steps of automaton work"
        refusal = ConstraintError(
            f"the pattern {pattern.source!r} needs {needs} (`algebra.CAPS[{passed.cap!r}]`) to build its "
            "lookarounds, word boundaries or anchors exactly; simplify the pattern")
        refusal.cap, refusal.count, refusal.maximum = passed.cap, passed.count, passed.maximum
        raise refusal from None
    with _BUILT_LOCK:
        _BUILT[key] = built
        while len(_BUILT) > _BUILT_KEPT:
            _BUILT.popitem(last=False)  # the oldest built
    return built


DEEP = 32  # nesting levels of a built language past which xgrammar's compiled grammar grows quadratically


def built_deep(source: str, *, search: bool) -> bool:
    """Whether ``source``'s language had to be built by automata (lookarounds, ``\\b``, inner anchors) and its
    tree, written back by state elimination, nests more than :data:`DEEP` levels: ``(?=.*\\d)[a-z\\d]{8,64}``
    nests 118. xgrammar makes a rule of every level and keeps a copy of the whole automaton per rule in its
    compiled grammar (0.7 GB of JSON for that one, where its compile took 0.3 s); llguidance reads the same
    text lazily. False for a pattern that does not parse, holds a refused feature or that :func:`language` refuses
    (the policy names each)."""
    try:
        pattern = patterns.parse(source)
        if pattern.refusal({patterns.CONTROLS_WITHOUT_ESCAPES}) is not None:
            return False  # a feature no engine enforces (a back-reference): the policy names it
        if not has_assertion(patterns.full_match(pattern, search=search) or ("seq", ())):
            return False
        tree = language(pattern, search=search)
    except ConstraintError:
        return False
    return tree is not None and fold(tree, lambda node, levels: 1 + max(levels, default=0)) > DEEP


def dfa(trees: list, work: Work | None = None) -> Dfa:
    """The complete DFA of the strings every tree matches in full (``automata.Dfa.of`` where no tree holds
    an assertion; else one tree, the others as lookaheads anchored at the end: ``(?=T$)`` is ``T``);
    ``work`` counts its steps (a fresh ``caps.Work`` unless given)."""
    work = Work() if work is None else work
    if not any(has_assertion(tree) for tree in trees):
        return Dfa.of(trees, work)
    main = trees[0]
    for other in trees[1:]:
        main = ("seq", (("look", True, False, ("seq", (other, _AT_END))), main))
    return _Alternating(main, work).dfa()


def _boundary(word: tuple, negated: bool) -> tuple:
    """``\\b`` (or ``\\B``) for the word characters ``word``: a word character on one side only (or not)."""
    def side(ahead: bool, is_word: bool):
        return ("look", ahead, not is_word, ("chars", word))
    pairs = ((True, True), (False, False)) if negated else ((True, False), (False, True))
    return ("alt", tuple(("seq", (side(False, before), side(True, after))) for before, after in pairs))


class LookNfa(Nfa):
    """Thompson's NFA with a check edge per assertion: ``checks[state]`` holds ``(kind, negated, what),
    target``: a lookahead's body start (``ahead``) or a lookbehind's tracker index (``behind``)."""

    def __init__(self):
        super().__init__()
        self.checks: list[list[tuple]] = []
        self.body_ends: set[int] = set()  # where a lookahead's body has matched
        self.trackers: list[tuple[int, int]] = []  # each lookbehind's `.*Y`: start, end

    def state(self) -> int:
        self.checks.append([])
        return super().state()

    def assertion(self, node) -> tuple[int, int]:
        kind = node[0]
        if kind == "start":  # no character before
            return self.assertion(("look", False, True, _ANY_CHAR))
        if kind == "end":  # read wide: also a final newline ahead
            final_newline = ("look", True, False, ("seq", (("chars", ((0x0A, 0x0A),)), _AT_END)))
            return self.build(("alt", (_AT_END, final_newline)) if node[1] else _AT_END)
        if kind == "boundary":  # narrow: both readings see one (both hold); wide: either
            _, negated, wide = node
            both = [_boundary(shorthand("w", wide=reading), negated) for reading in (False, True)]
            if negated and not wide:  # Python's \B (before 3.14) never matches in an empty text, ECMA's does
                both.append(("alt", (("look", False, False, _ANY_CHAR), ("look", True, False, _ANY_CHAR))))
            return self.build(("alt" if wide else "seq", tuple(both)))
        if kind != "look":
            raise ValueError(f"no automaton for a {kind!r} node")
        _, ahead, negated, body = node
        start, end = self.state(), self.state()
        if ahead:
            body_start, body_end = self.build(body)
            self.body_ends.add(body_end)
            self.checks[start].append((("ahead", negated, body_start), end))
        else:
            if has_assertion(body):
                raise ValueError("a lookbehind holding an assertion (patterns.py refuses it)")
            self.trackers.append(self.build(("seq", (("repeat", _ANY_CHAR, 0, None), body))))
            self.checks[start].append((("behind", negated, len(self.trackers) - 1), end))
        return start, end


def _settle(negated: bool, configs: frozenset):
    """An obligation: met, failed, or ``(negated, configs)`` still open."""
    if (_DONE, _NONE) in configs:
        return _FAILED if negated else _MET
    if not configs:
        return _MET if negated else _FAILED
    return negated, configs


class _Alternating:
    """The subset construction over configurations ``(NFA state or _DONE, obligations)`` (the module docstring)."""

    def __init__(self, tree, work: Work):
        self.work = work
        self.nfa = nfa = LookNfa()
        self.start, self.end = nfa.build(tree)
        work.spend(len(nfa.eps))
        self.intervals = atoms(ranges for moves in nfa.moves for ranges, _ in moves)
        lows = [low for low, _ in self.intervals]
        # atoms in the same labels move alike: one representative per class
        member: dict = collections.defaultdict(list)
        self.table: list[dict] = [collections.defaultdict(list) for _ in nfa.moves]
        for state, moves in enumerate(nfa.moves):
            for label, (ranges, target) in enumerate(moves):
                for atom in atom_span(lows, ranges):
                    member[atom].append((state, label))
                    self.table[state][atom].append(target)
        classes: dict = {}
        self.atom_class = [classes.setdefault(tuple(member.get(atom, ())), atom) for atom in range(len(self.intervals))]
        self.firsts = sorted(classes.values())
        self.memo: dict = {}

    def targets(self, state: int, atom: int) -> list[int]:
        return self.table[state].get(atom, [])

    def closure(self, seeds, trackers: tuple) -> frozenset:
        key = ("closure", frozenset(seeds), trackers)
        if key in self.memo:
            return self.memo[key]
        seen, stack, out = set(), list(seeds), set()
        while stack:
            config = stack.pop()
            if config in seen:
                continue
            seen.add(config)
            state, obligations = config
            if state == _DONE or state in self.nfa.body_ends:
                out.add((_DONE, obligations))
                continue
            if self.nfa.moves[state] or state == self.end:
                out.add(config)
            stack += [(target, obligations) for target in self.nfa.eps[state]]
            for (kind, negated, what), target in self.nfa.checks[state]:
                if kind == "behind":
                    if (self.nfa.trackers[what][1] in trackers[what]) != negated:
                        stack.append((target, obligations))
                    continue
                obligation = _settle(negated, self.closure([(what, _NONE)], trackers))
                if obligation != _FAILED:
                    stack.append((target, obligations if obligation == _MET else obligations | {obligation}))
        self.work.spend(1 + len(seen))
        self.memo[key] = result = frozenset(out)
        return result

    def step(self, configs: frozenset, atom: int, trackers: tuple) -> frozenset:
        """The configurations after one character (of class ``atom``), ``trackers`` already past it."""
        key = ("step", configs, atom, trackers)
        if key in self.memo:
            return self.memo[key]
        self.work.spend(1 + sum(1 + len(obligations) for _, obligations in configs))
        seeds = []
        for state, obligations in configs:
            kept = set()
            for negated, inner in obligations:
                obligation = _settle(negated, self.step(inner, atom, trackers))
                if obligation == _FAILED:
                    break
                if obligation != _MET:
                    kept.add(obligation)
            else:
                kept = frozenset(kept)
                seeds += [(_DONE, kept)] if state == _DONE else [(t, kept) for t in self.targets(state, atom)]
        self.memo[key] = result = self.closure(seeds, trackers)
        return result

    def accepts(self, configs: frozenset, final: int) -> bool:
        """Whether the text may end here: a configuration at ``final`` whose obligations all hold at the end."""
        return any(state == final and all(self.accepts(inner, _DONE) != negated for negated, inner in obligations)
                   for state, obligations in configs)

    def dfa(self) -> Dfa:
        nfa = self.nfa
        trackers = tuple(nfa.closure([start]) for start, _ in nfa.trackers)
        first = (trackers, self.closure([(self.start, _NONE)], trackers))
        index, rows, accepting, queue = {first: 0}, [], set(), collections.deque([first])
        dead = None
        while queue:
            key = queue.popleft()
            trackers, configs = key
            self.work.spend(len(self.firsts) + len(self.atom_class) // 8 + len(configs) + sum(map(len, trackers)))
            if self.accepts(configs, self.end):
                accepting.add(index[key])
            by_class: dict = {}
            for representative in self.firsts:  # in atom order: states are numbered as the atoms meet them
                moved = tuple(nfa.closure({t for s in part for t in self.targets(s, representative)})
                              for part in trackers)
                self.work.spend(1 + sum(map(len, trackers)) + sum(map(len, moved)))
                after = self.step(configs, representative, moved) if configs else _NONE
                target = (moved, after) if after else dead
                if target is None:
                    dead = target = ((), _NONE)
                if target not in index:
                    index[target] = len(index)
                    over("automaton_states", len(index))
                    queue.append(target)
                by_class[representative] = index[target]
            rows.append([by_class[representative] for representative in self.atom_class])
        return Dfa(self.intervals, rows, accepting, self.work).completed()
