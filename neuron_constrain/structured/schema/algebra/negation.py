"""The complement of a schema written positively: what ``not`` means, without ``not``.

    complement(s, resolve)    # the values ``s`` rejects (None: no positive form here)

A schema object is the conjunction of its keywords, except the adjacency units (a unit is one
conjunct), so its complement is the disjunction of its conjuncts' complements, each typed:
``{"minimum": 3}`` rejects only numbers below 3, so ``not {"minimum": 3}`` is
``{"type": "number", "exclusiveMaximum": 3}``. With a positive complement: ``type`` (not a lone
``integer``: "a number that is no integer" has none), ``enum``/``const`` of scalars (numbers -> open
intervals; strings -> length windows and a ``^``-anchored prefix pattern, never an end anchor: ``$``
reads differently in Python and ECMA-262), single bounds of every family, ``required``,
``properties`` alone in its unit, ``prefixItems``, ``items: false``, ``contains`` alone,
``allOf``/``anyOf``/``not``/``$ref`` recursively, ``pattern`` (the complement of its language,
``regular.py``). ``multipleOf``, ``format``, ``additionalProperties``, ``items``, ``uniqueItems``,
``propertyNames``, ``oneOf`` have none here.
"""
from __future__ import annotations

import copy

from neuron_constrain.structured.schema.algebra.caps import over
from neuron_constrain.structured.schema.algebra.regular import complement_pattern
from neuron_constrain.structured.schema.algebra.logic import (
    ARRAY_UNIT, ATOMS, FAMILY_ATOMS, OBJECT_UNIT, assertions, atoms, distinct, is_true, join, meet, type_keyword,
)

# single bounds: keyword -> (its family, the keyword its complement uses, how the limit moves)
_BOUNDS = {
    "minimum": ("number", "exclusiveMaximum", 0), "maximum": ("number", "exclusiveMinimum", 0),
    "exclusiveMinimum": ("number", "maximum", 0), "exclusiveMaximum": ("number", "minimum", 0),
    "minLength": ("string", "maxLength", -1), "maxLength": ("string", "minLength", 1),
    "minItems": ("array", "maxItems", -1), "maxItems": ("array", "minItems", 1),
    "minProperties": ("object", "maxProperties", -1), "maxProperties": ("object", "minProperties", 1),
}


def complement(node, resolve, seen: frozenset = frozenset()):
    """The values ``node`` rejects, written without ``not``; None where this algebra has no positive form.
    ``resolve(ref)`` returns the schema a local ``$ref`` names (None: it does not resolve)."""
    if node is False:
        return {}
    if is_true(node):
        return False
    parts = []
    for conjunct in conjuncts(assertions(node)):
        negated = _complement_conjunct(conjunct, resolve, seen)
        if negated is None:
            return None
        parts.append(negated)
    return join(parts)


def conjuncts(node: dict) -> list[dict]:
    """``node``'s keywords grouped into independent conjuncts (an adjacency unit is one)."""
    groups, done = [], set()
    units = (OBJECT_UNIT, (*ARRAY_UNIT, "additionalItems"), ("contains", "minContains", "maxContains"),
             ("if", "then", "else"))
    for key in node:
        if key in done:
            continue
        unit = next((u for u in units if key in u), (key,))
        group = {k: node[k] for k in unit if k in node}
        done |= set(group)
        groups.append(group)
    return groups


def _typed(family: str, **keywords) -> dict:
    return {"type": type_keyword(FAMILY_ATOMS[family]), **keywords}


def _complement_conjunct(group: dict, resolve, seen):
    (key, value), = list(group.items())[:1]
    if len(group) == 1:
        if key == "type":
            rest = ATOMS - atoms(group)
            written = type_keyword(rest)
            return False if not rest else (None if written is None else {"type": written})
        if key in ("enum", "const"):
            values = value if key == "enum" else [value]
            return complement_of_values(values) if isinstance(values, list) else None
        if key in _BOUNDS and isinstance(value, (int, float)) and not isinstance(value, bool):
            family, opposite, step = _BOUNDS[key]
            if step and value + step < 0:
                return False  # minLength 0 and the like: every value of the family satisfies it
            return _typed(family, **{opposite: value + step})
        if key == "required" and isinstance(value, list):
            return join(_typed("object", properties={name: False}) for name in value)
        if key == "uniqueItems" and value is False:
            return False
        if key == "allOf" and isinstance(value, list):
            negated = [complement(b, resolve, seen) for b in value]
            return None if any(n is None for n in negated) else join(negated)
        if key == "anyOf" and isinstance(value, list):
            out: object = {}
            for branch in value:
                negated = complement(branch, resolve, seen)
                if negated is None:
                    return None
                out = meet(out, negated)
            return out
        if key == "not":
            return copy.deepcopy(value) if isinstance(value, dict) else ({} if value is True else False)
        if key == "$ref" and isinstance(value, str) and value not in seen:
            target = resolve(value)
            return None if target is None else complement(target, resolve, seen | {value})
    if key == "pattern" and len(group) == 1 and isinstance(value, str):
        # the strings the pattern does not match (every other value satisfies `pattern`: none is rejected)
        written = complement_pattern(value)
        return written if written is None or written is False else _typed("string", pattern=written)
    if key in OBJECT_UNIT and set(group) == {"properties"} and isinstance(value, dict):
        cases = []
        for name, sub in value.items():
            negated = complement(sub, resolve, seen)
            if negated is None:
                return None
            if negated is not False:
                cases.append(_typed("object", required=[name], properties={name: negated}))
        return join(cases)
    if key in ("prefixItems", "items") and set(group) <= {"prefixItems", "items"}:
        return _complement_items(group, resolve, seen)
    if key == "contains" and set(group) == {"contains"}:
        negated = complement(value, resolve, seen)
        return None if negated is None else _typed("array", items=negated)
    return None


def _complement_items(group: dict, resolve, seen):
    prefix, items = group.get("prefixItems", []), group.get("items", {})
    if not isinstance(prefix, list):
        return None
    cases = []
    for index, sub in enumerate(prefix):
        negated = complement(sub, resolve, seen)
        if negated is None:
            return None
        if negated is not False:
            cases.append(_typed("array", minItems=index + 1, prefixItems=[{}] * index + [negated]))
    if items is False:
        cases.append(_typed("array", minItems=len(prefix) + 1))
    elif not is_true(items):
        return None  # "some later item fails `items`": no positive form without `contains`
    return join(cases)


def complement_of_values(values: list):
    """Every value but ``values`` (scalars; None with an array or object among them)."""
    values = distinct(values)
    rest, cases = set(ATOMS), []
    if any(isinstance(v, (list, dict)) for v in values):
        return None
    if any(v is None for v in values):
        rest.discard("null")
    booleans = {v for v in values if isinstance(v, bool)}
    if booleans:
        rest.discard("boolean")
        cases += [{"const": b} for b in (True, False) if b not in booleans]
    numbers = sorted(v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool))
    if numbers:
        rest -= {"integer", "fraction"}
        cases.append({"type": "number", "exclusiveMaximum": numbers[0]})
        cases += [{"type": "number", "exclusiveMinimum": lo, "exclusiveMaximum": hi} for lo, hi in zip(numbers, numbers[1:])]
        cases.append({"type": "number", "exclusiveMinimum": numbers[-1]})
    strings = [v for v in values if isinstance(v, str)]
    if strings:
        rest.discard("string")
        cases += other_strings(strings)
    if rest:
        cases.insert(0, {"type": type_keyword(frozenset(rest))})
    return join(cases)


def other_strings(strings: list[str]) -> list[dict]:
    """Every string but ``strings``: lengths none of them has, and per length a ``^``-anchored prefix
    pattern (a character no listed string of that length has after the same prefix)."""
    over("string_set", len(strings))
    lengths = sorted({len(s) for s in strings})
    cases, low = [], 0
    for length in lengths:
        if length > low:
            cases.append({"type": "string", "minLength": low, "maxLength": length - 1} if low else
                         {"type": "string", "maxLength": length - 1})
        same_length = [s for s in strings if len(s) == length]
        if length:
            cases.append({"type": "string", "minLength": length, "maxLength": length,
                          "pattern": "^(?:" + "|".join(_escape(p) + "[^" + "".join(map(_escape, sorted(cs))) + "]"
                                                       for p, cs in _branch_points(same_length)) + ")"})
        low = length + 1
    cases.append({"type": "string", "minLength": low})
    return cases


def _branch_points(strings: list[str]):
    """``(prefix, next characters)`` for every prefix the strings share: a string of their length that
    is none of them leaves the trie at one of these prefixes with a character not among the next ones."""
    found: dict[str, set] = {}
    for s in strings:
        for i in range(len(s)):
            found.setdefault(s[:i], set()).add(s[i])
    return sorted(found.items())


def _escape(text: str) -> str:
    """Characters as both regex dialects read them: alphanumerics as is, others as ``\\uHHHH`` (BMP)."""
    return "".join(c if c.isascii() and c.isalnum() or ord(c) > 0xFFFF else f"\\u{ord(c):04x}" for c in text)
