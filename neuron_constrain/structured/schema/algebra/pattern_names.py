"""Overlapping ``patternProperties`` made disjoint: one pattern per set of patterns a name can match.

    {patternProperties: {a: A, b: B}}
        -> {patternProperties: {<a, not b>: A, <b, not a>: B, <a and b>: A ∧ B}}

A key matched by several patterns must satisfy each of their schemas; llguidance refuses patterns
that overlap, and an engine that tried the first match only would drop the others. Each region
(the names matched by exactly the patterns of one nonempty set, by the automata of ``regular.py``)
gets the meet of those schemas; an empty region is left out, so the patterns written are pairwise
disjoint and cover the same names. A pattern reads differently in ECMA-262 and Python for a few
names (``\\d`` over other scripts' digits, ``$`` before a final newline): regions are cut by the wide
reading (a name either dialect matches), so such a name meets every schema a dialect could apply,
never fewer; beside ``additionalProperties`` (a name no pattern matches in one dialect is
``additionalProperties``'s in the other) every pattern must read alike. At most ``CAPS["branches"]``
regions are tried (2**n - 1 for n patterns).
"""
from __future__ import annotations

import functools
import itertools

from neuron_constrain.structured.schema import patterns
from neuron_constrain.structured.schema.algebra import regular
from neuron_constrain.structured.schema.algebra.caps import over
from neuron_constrain.structured.schema.algebra.logic import meet
from neuron_constrain.structured.constraints import ConstraintError


def disjoint_patterns(node: dict, path: str, judge):
    table = node.get("patternProperties")
    if not isinstance(table, dict) or len(table) < 2 or not overlap(tuple(table)):
        return node
    sources = list(table)
    if "additionalProperties" in node and not all(reads_alike(s) for s in sources):
        return node
    over("branches", 2 ** len(sources) - 1)
    regions = {}
    for size in range(len(sources), 0, -1):
        for inside in itertools.combinations(sources, size):
            outside = [regular.complement_pattern(q) for q in sources if q not in inside]
            if any(c is None for c in outside):
                return node  # a feature with no complement: the engines' policies decide
            if any(c is False for c in outside):
                continue  # a pattern matching every name leaves no region outside it
            region = regular.intersect_patterns((*inside, *outside), wide=True)
            if region is None:
                return node
            if region is not False:
                regions[region] = functools.reduce(meet, (table[s] for s in inside))
    node["patternProperties"] = regions
    return node


def overlap(sources: tuple) -> bool:
    """Whether two of ``sources`` find a name in common (either dialect); False where one has a refused feature."""
    for pair in itertools.combinations(sources, 2):
        both = regular.intersect_patterns(pair, wide=True)
        if both is None:
            return False
        if both is not False:
            return True
    return False


def reads_alike(source: str) -> bool:
    """Whether ECMA-262 and Python match the same names with ``source`` (its wide and narrow readings agree)."""
    try:
        wide, narrow = (patterns.full_match(patterns.parse(source, w), search=True) for w in (True, False))
    except ConstraintError:
        return False
    return wide == narrow
