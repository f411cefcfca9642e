"""Proofs that two schemas share no valid value (``oneOf`` branches, the cases of a rewrite).

    disjoint(a, b, judge, within=ATOMS)   # True: proven (within those types); False: not proven

A proof is one of: a side is ``false``; no type in common (``integer`` inside ``number``); every
value a finite side (``enum``/``const``) allows fails the other side (``jsonschema`` judges); a
conjunct of one side (``allOf`` branch, ``$ref`` target) is disjoint from the other, or every
``anyOf`` (or ``oneOf``) branch is; and per type both allow, disjoint numeric ranges, disjoint length windows
(strings, arrays, objects), an array position both must have with disjoint item schemas, or a
property one side requires whose schemas on the two sides are disjoint (``required`` against
``additionalProperties: false``, discriminator ``const`` values).

    apart_beyond_empty(a, b, judge, within)   # disjoint but for the empty array, object and string
    empty_overlap(branches, judge)            # those several branches accept: keywords that exclude them

Branches that differ from their first item or member on may still all accept the empty value
(``prefixItems`` asks nothing of ``[]``): a finite overlap, enumerated and excluded by ``minItems``,
``minProperties``, ``minLength`` 1 (each asks nothing of the other types).
"""
from __future__ import annotations

import re

from neuron_constrain.structured.schema.algebra.logic import ATOMS, atoms, is_true, meet, value_atom

_DEPTH = 8


def disjoint(a, b, judge, within=ATOMS, depth: int = 0) -> bool:
    if a is False or b is False:
        return True
    if depth > _DEPTH or is_true(a) or is_true(b):
        return False
    for x, y in ((a, b), (b, a)):
        if any(disjoint(part, y, judge, within, depth + 1) for part in _parts(x, judge)):
            return True
        for key in ("anyOf", "oneOf"):  # a value of x satisfies one of these branches at least
            branches = x.get(key) if isinstance(x.get(key), list) else None
            if branches is not None and all(disjoint(br, y, judge, within, depth + 1) for br in branches):
                return True
    shared = atoms(a) & atoms(b) & within
    if not shared:
        return True
    for x, y in ((a, b), (b, a)):
        values = finite_values(x)
        try:
            if values is not None and all(value_atom(v) not in within or not judge.valid(y, v) for v in values):
                return True
        except judge.Unjudged:
            pass
    proofs = {"integer": _numbers, "fraction": _numbers, "string": _strings, "array": _arrays, "object": _objects}
    return all(atom in proofs and proofs[atom](a, b, judge, within, depth) for atom in shared)


EMPTY = (([], "minItems"), ({}, "minProperties"), ("", "minLength"))


def apart_beyond_empty(a, b, judge, within=ATOMS) -> bool:
    """Whether no value but ``[]``, ``{}`` or ``""`` is valid under both (proven as :func:`disjoint`)."""
    return disjoint(meet(a, {keyword: 1 for value, keyword in EMPTY if value_atom(value) in within}), b, judge, within)


def empty_overlap(branches: list, judge, within=ATOMS) -> dict | None:
    """The keywords excluding each empty value (of a type ``within``) two ``branches`` or more accept (``{}``:
    none; None: unjudged)."""
    try:
        return {keyword: 1 for value, keyword in EMPTY
                if value_atom(value) in within and sum(judge.valid(b, value) for b in branches) > 1}
    except judge.Unjudged:
        return None


def finite_values(node) -> list | None:
    if not isinstance(node, dict):
        return None
    if "const" in node:
        return [node["const"]]
    return node["enum"] if isinstance(node.get("enum"), list) else None


def _parts(node: dict, judge) -> list:
    parts = list(node["allOf"]) if isinstance(node.get("allOf"), list) else []
    if isinstance(node.get("$ref"), str):
        target = judge.resolve(node["$ref"])
        if target is not None:
            parts.append(target)
    return parts


def _window(node: dict, low: str, high: str) -> tuple:
    lo, hi = node.get(low, 0), node.get(high)
    return (lo if isinstance(lo, int) else 0), (hi if isinstance(hi, int) else None)


def _apart(first: tuple, second: tuple) -> bool:
    (lo1, hi1), (lo2, hi2) = first, second
    return (hi1 is not None and hi1 < lo2) or (hi2 is not None and hi2 < lo1)


def _numbers(a, b, judge, within, depth) -> bool:
    def bounds(node):
        low, high = (float("-inf"), False), (float("inf"), False)
        for key, strict in (("minimum", False), ("exclusiveMinimum", True)):
            v = node.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and (v, strict) > low:
                low = (v, strict)
        for key, strict in (("maximum", False), ("exclusiveMaximum", True)):
            v = node.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and (v, not strict) < (high[0], not high[1]):
                high = (v, strict)
        return low, high
    (lo1, hi1), (lo2, hi2) = bounds(a), bounds(b)
    return _below(hi1, lo2) or _below(hi2, lo1)


def _below(high: tuple, low: tuple) -> bool:
    """Every number under ``high`` is below every number over ``low``."""
    return high[0] < low[0] or (high[0] == low[0] and (high[1] or low[1]))


def _strings(a, b, judge, within, depth) -> bool:
    return _apart(_window(a, "minLength", "maxLength"), _window(b, "minLength", "maxLength"))


def _arrays(a, b, judge, within, depth) -> bool:
    wa, wb = _window(a, "minItems", "maxItems"), _window(b, "minItems", "maxItems")
    if _apart(wa, wb):
        return True
    present = max(wa[0], wb[0])  # every array valid under both has at least this many items
    for index in range(min(present, 8)):
        if disjoint(_item(a, index), _item(b, index), judge, ATOMS, depth + 1):
            return True
    return False


def _item(node: dict, index: int):
    prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
    return prefix[index] if index < len(prefix) else node.get("items", {})


def _objects(a, b, judge, within, depth) -> bool:
    if _apart(_window(a, "minProperties", "maxProperties"), _window(b, "minProperties", "maxProperties")):
        return True
    required = [*_names(a.get("required")), *_names(b.get("required"))]
    for name in dict.fromkeys(required):
        first, second = _property(a, name), _property(b, name)
        if first is not None and second is not None and disjoint(first, second, judge, ATOMS, depth + 1):
            return True
    return False


def _names(value) -> list:
    return [n for n in value if isinstance(n, str)] if isinstance(value, list) else []


def _property(node: dict, name: str):
    """The schema ``node`` applies to property ``name`` (None: a pattern it cannot read)."""
    found = []
    properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    if name in properties:
        found.append(properties[name])
    patterns = node.get("patternProperties") if isinstance(node.get("patternProperties"), dict) else {}
    for pattern, sub in patterns.items():
        try:
            if re.search(pattern, name):
                found.append(sub)
        except re.error:
            return None
    if not found:
        return node.get("additionalProperties", {})
    out = found[0]
    for sub in found[1:]:
        out = meet(out, sub)
    return out
