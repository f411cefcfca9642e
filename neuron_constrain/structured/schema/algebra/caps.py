"""The algebra's size caps: a rewrite that would pass one is refused, naming the cap and the JSON pointer.

    with site("dependentSchemas", "#/properties/a"):   # the rewrite being made, for the message
        over("branches", len(cases))                   # CapReached past CAPS["branches"]

Every rewrite whose output grows with its input is bounded here; none is ever truncated.
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
    "pattern_chars": 16384,  # characters of the pattern written back from it
}


class CapReached(ConstraintError):
    """A rewrite of the schema algebra would pass one of :data:`CAPS`."""

    def __init__(self, cap: str, count: int, keyword: str, path: str):
        super().__init__(
            f"the schema algebra would need {count} {cap.replace('_', ' ')} (cap {CAPS[cap]}, "
            f"`algebra.CAPS[{cap!r}]`) to rewrite `{keyword}` at {path} into keywords an engine enforces; "
            "simplify the schema there (fewer branches, values or positions)")
        self.cap, self.count, self.keyword, self.path = cap, count, keyword, path


class Over(Error):
    """A cap passed deep inside a rewrite; :func:`site` names where."""

    def __init__(self, cap: str, count: int):
        super().__init__(cap, count)
        self.cap, self.count = cap, count


def over(cap: str, count: int) -> None:
    if count > CAPS[cap]:
        raise Over(cap, count)


@contextlib.contextmanager
def site(keyword: str, path: str):
    try:
        yield
    except Over as passed:
        raise CapReached(passed.cap, passed.count, keyword, path) from None
