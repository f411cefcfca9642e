"""The algebra's size caps: a rewrite that would pass one is refused, naming the cap and the JSON pointer.

    with site("dependentSchemas", "#/properties/a"):   # the rewrite being made, for the message
        over("branches", len(cases))                   # CapReached past CAPS["branches"]

    work = Work()                                      # one automaton's construction, its steps counted
    work.spend(len(subset))                            # Over("automaton_work") past CAPS["automaton_work"]

Every rewrite whose output grows with its input is bounded here; none is ever truncated. The
automata count their work (``Work``) rather than time it: the same pattern is refused alike on an
idle machine and a busy one.
"""
from __future__ import annotations

import contextlib

from neuron_constrain.core.errors import Error
from neuron_constrain.structured.constraints import ConstraintError

CAPS = {
    "branches": 64,  # anyOf branches one rewrite makes (presence cases, if/oneOf/unevaluated cases, distribution)
    "enumerated": 512,  # values one rewrite enumerates (arrays of a finite item domain, a finite node's values)
    "positions": 16,  # array positions a `contains` rewrite spells out (past it: the host's item tracker counts)
    "string_set": 256,  # strings a complement of `enum`/`const` excludes by pattern
    "specializations": 64,  # copies of a subschema made to resolve `$dynamicRef` per dynamic scope
    "nfa_states": 8192,  # states of the automaton a pattern's complement or intersection starts from
    "automaton_states": 512,  # states of the deterministic automaton made from it
    "automaton_work": 200_000,  # steps of one automaton's construction (caps.Work): subsets, moves, refinements
    "pattern_chars": 16384,  # characters of the pattern written back from it
}


_BUILT = ("pattern", "patternProperties")  # keywords whose pattern is built as it is (``limits.py``), not rewritten


class CapReached(ConstraintError):
    """A rewrite of the schema algebra would pass one of :data:`CAPS` (or a schema pattern built by automata
    for an engine would): ``cap``, ``count`` (what it would need), ``keyword``, ``path`` (its JSON pointer),
    ``pattern`` (the pattern, or the patterns, being built; None for other caps)."""

    def __init__(self, cap: str, count: int, keyword: str, path: str, maximum: int | None = None, pattern=None):
        maximum = CAPS[cap] if maximum is None else maximum
        of = "" if pattern is None else f" for the pattern {pattern!r}" if isinstance(pattern, str) else \
            f" for the patterns {', '.join(map(repr, pattern))}"
        need = f"more than {maximum} steps of automaton work" if cap == "automaton_work" else \
            f"{count} {cap.replace('_', ' ')}"
        doing = f"to build `{keyword}` at {path} exactly for an engine" if keyword in _BUILT else \
            f"to rewrite `{keyword}` at {path} into keywords an engine enforces"
        super().__init__(
            f"the schema algebra would need {need}{of} (cap {maximum}, `algebra.CAPS[{cap!r}]`) {doing}; simplify "
            f"the schema there ({'a simpler pattern' if pattern else 'fewer branches, values or positions'})")
        self.cap, self.count, self.keyword, self.path, self.pattern = cap, count, keyword, path, pattern


class Over(Error):
    """A cap passed deep inside a rewrite (``maximum``: the cap's value there); :func:`site` names where,
    ``pattern`` the pattern (or the patterns, a tuple) being built when an automaton passed it."""

    def __init__(self, cap: str, count: int, maximum: int | None = None):
        super().__init__(cap, count)
        self.cap, self.count = cap, count
        self.maximum = CAPS[cap] if maximum is None else maximum
        self.pattern = None


def over(cap: str, count: int) -> None:
    """Raise :class:`Over` when ``count`` passes ``CAPS[cap]``.

    Raises:
        Over: past the cap.
    """
    if count > CAPS[cap]:
        raise Over(cap, count)


class Work:
    """The steps one automaton construction has taken, counted where it works (NFA states a subset holds,
    moves followed, closures made, states refined or eliminated), deterministic and independent of the
    machine's load: past ``budget`` (``CAPS["automaton_work"]`` unless given), :class:`Over` names it.
    A step is about a microsecond of Python here; a pattern refused by the count has cost at most the budget."""

    __slots__ = ("steps", "budget")

    def __init__(self, budget: int | None = None):
        self.steps, self.budget = 0, CAPS["automaton_work"] if budget is None else budget

    def spend(self, steps: int) -> None:
        """Count ``steps`` more.

        Raises:
            Over: the count passed the budget.
        """
        self.steps += steps
        if self.steps > self.budget:
            raise Over("automaton_work", self.steps, self.budget)


@contextlib.contextmanager
def site(keyword: str, path: str):
    try:
        yield
    except Over as passed:
        raise CapReached(passed.cap, passed.count, keyword, path, passed.maximum, passed.pattern) from None
