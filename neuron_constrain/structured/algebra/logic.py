"""Schemas as sets of JSON values: types, conjunction, disjunction, and the complement written positively.

    meet(a, b)            # allOf [a, b]: merged into one object where the keywords stay independent
    join([a, b])          # anyOf [a, b]: flattened, `false` branches dropped, `{}` absorbing
    complement(s, ref)    # the values ``s`` rejects, without `not` (None: no positive form here)

Types are sets of atoms (``null boolean object array string integer fraction``: ``number`` is
``integer`` + ``fraction``). A schema object is the conjunction of its keywords, except the
adjacency units of ``schema_rewrite.ADJACENT`` (a unit is one conjunct), so its complement is the
disjunction of its conjuncts' complements, each typed: ``{"minimum": 3}`` rejects only numbers
below 3, so ``not {"minimum": 3}`` is ``{"type": "number", "exclusiveMaximum": 3}``. The keywords
with a positive complement: ``type`` (not a lone ``integer``: "a number that is no integer" has
none), ``enum``/``const`` of scalars (numbers -> open intervals; strings -> length windows and a
prefix pattern, never an end anchor: ``$`` reads differently in Python and ECMA-262), single bounds
of every family, ``required``, ``properties`` alone in its unit, ``prefixItems``, ``items: false``,
``contains`` alone, ``allOf``/``anyOf``/``not``/``$ref`` recursively.
"""
from __future__ import annotations

import contextvars
import copy
import json

from neuron_constrain.structured import schema_rewrite as rewrite
from neuron_constrain.structured.algebra.caps import over

ATOMS = frozenset({"null", "boolean", "object", "array", "string", "integer", "fraction"})
_TYPE_ATOMS = {"null": {"null"}, "boolean": {"boolean"}, "object": {"object"}, "array": {"array"},
               "string": {"string"}, "integer": {"integer"}, "number": {"integer", "fraction"}}
FAMILY_ATOMS = {"string": frozenset({"string"}), "number": frozenset({"integer", "fraction"}),
                "array": frozenset({"array"}), "object": frozenset({"object"})}
ANNOTATIONS = frozenset({"$schema", "$id", "$anchor", "$comment", "$defs", "definitions", "title", "description",
                         "default", "examples", "deprecated", "readOnly", "writeOnly", "$vocabulary"})
# single bounds: keyword -> (its family, the keyword its complement uses, how the limit moves)
_BOUNDS = {
    "minimum": ("number", "exclusiveMaximum", 0), "maximum": ("number", "exclusiveMinimum", 0),
    "exclusiveMinimum": ("number", "maximum", 0), "exclusiveMaximum": ("number", "minimum", 0),
    "minLength": ("string", "maxLength", -1), "maxLength": ("string", "minLength", 1),
    "minItems": ("array", "maxItems", -1), "maxItems": ("array", "minItems", 1),
    "minProperties": ("object", "maxProperties", -1), "maxProperties": ("object", "minProperties", 1),
}
_LOWER = frozenset({"minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties", "minContains"})
_UPPER = frozenset({"maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties", "maxContains"})
# Property names in the order the schema as sent first writes them (set by algebra.lower).
ORDER: contextvars.ContextVar[dict] = contextvars.ContextVar("ORDER", default={})
_OBJECT_UNIT = ("properties", "patternProperties", "additionalProperties")
_ARRAY_UNIT = ("prefixItems", "items")


def family_of(keyword: str) -> str | None:
    return next((f for f, words in rewrite.FAMILIES.items() if keyword in words), None)


def atoms(node) -> frozenset:
    """The atoms a value valid under ``node`` may have (from ``type``, ``enum``, ``const``; all when untyped)."""
    if node is False:
        return frozenset()
    if not isinstance(node, dict):
        return ATOMS
    found = ATOMS
    kind = node.get("type")
    if isinstance(kind, str):
        kind = [kind]
    if isinstance(kind, list):
        found = frozenset().union(*(_TYPE_ATOMS.get(k, ()) for k in kind))
    values = node["enum"] if isinstance(node.get("enum"), list) else [node["const"]] if "const" in node else None
    if values is not None:
        found &= frozenset(value_atom(v) for v in values)
    return found


def value_atom(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "integer" if float(value).is_integer() else "fraction"
    return {str: "string", list: "array", dict: "object"}[type(value)]


def type_keyword(found: frozenset):
    """``type``'s value for a set of atoms; None where there is none (fractions without integers)."""
    if "fraction" in found and "integer" not in found:
        return None
    names = sorted((found - {"integer", "fraction"}) | ({"number"} if "fraction" in found else
                                                       {"integer"} & found))
    return names[0] if len(names) == 1 else names


def is_true(node) -> bool:
    return node is True or (isinstance(node, dict) and not any(k in rewrite.VOCABULARY for k in node))


def assertions(node: dict) -> dict:
    """``node``'s keywords that assert something (``then``/``else`` with their ``if``)."""
    return {k: v for k, v in node.items() if k in rewrite.VOCABULARY or k in ("then", "else")}


def same(a, b) -> bool:
    """JSON Schema's equality of two values (1 == 1.0, True != 1, key order ignored)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def distinct(values) -> list:
    out: list = []
    for value in values:
        if not any(same(value, seen) for seen in out):
            out.append(value)
    return out


# --------------------------------------------------------------------------- disjunction, conjunction
def join(branches) -> object:
    """anyOf over ``branches``: nested bare anyOfs flattened, ``false`` dropped, ``{}`` absorbing."""
    flat: list = []
    for branch in branches:
        if branch is False:
            continue
        if is_true(branch):
            return {}
        if isinstance(branch, dict) and set(branch) == {"anyOf"}:
            flat.extend(b for b in branch["anyOf"] if b is not False)
        else:
            flat.append(branch)
    if not flat:
        return False
    return flat[0] if len(flat) == 1 else {"anyOf": flat}


def meet(a, b) -> object:
    """allOf [a, b], written as one object where that keeps the meaning (else ``{"allOf": [a, b]}``)."""
    if a is False or b is False:
        return False
    if is_true(a):
        return b if not isinstance(b, bool) else ({} if b else False)
    if is_true(b):
        return a
    for one, other in ((a, b), (b, a)):
        if set(one) == {"anyOf"} and "anyOf" not in other and _simple(other):
            over("branches", len(one["anyOf"]))
            return join(meet(branch, other) for branch in one["anyOf"])
    merged = merge(a, b)
    if merged is not None:
        return merged
    parts = [p for x in (a, b) for p in (x["allOf"] if set(x) == {"allOf"} else [x])]
    return {"allOf": parts}


def first_seen(schema) -> dict:
    """Every string key of ``schema``'s JSON text, ranked by where it is first written."""
    ranks: dict = {}

    def visit(value):
        if isinstance(value, dict):
            for key, sub in value.items():
                ranks.setdefault(key, len(ranks))
                visit(sub)
        elif isinstance(value, list):
            for sub in value:
                visit(sub)
    visit(schema)
    return ranks


def _simple(node: dict) -> bool:
    return not {"anyOf", "oneOf", "allOf", "$ref", "not", "if"} & set(node)


def merge(a: dict, b: dict):
    """One object holding both, or None where a keyword of each cannot be combined exactly."""
    merged, extra = assertions(a), assertions(b)
    if {"unevaluatedProperties", "unevaluatedItems"} & (set(merged) | set(extra)):
        return None  # they see every keyword beside them
    for unit, combine in ((_OBJECT_UNIT, _merge_objects), (_ARRAY_UNIT, _merge_arrays)):
        if set(unit) & set(merged) and set(unit) & set(extra):
            done = combine({k: merged.pop(k) for k in unit if k in merged}, {k: extra.pop(k) for k in unit if k in extra})
            if done is None:
                return None
            merged.update(done)
    if rewrite.splits_a_unit(merged, extra):
        return None
    for key, value in extra.items():
        if key in merged:
            value = _combine(key, merged[key], value)
            if value is None or value is False:
                return value
        merged[key] = value
    kinds = atoms({"type": merged["type"]}) if "type" in merged else ATOMS
    if not kinds:
        return False
    if "const" in merged and value_atom(merged["const"]) not in kinds:
        return False
    if isinstance(merged.get("enum"), list):  # literals of a type the node excludes: dropped
        merged["enum"] = [v for v in merged["enum"] if value_atom(v) in kinds]
        if not merged["enum"]:
            return False
    return merged


def _combine(key, x, y):
    """The one value of ``key`` meaning both ``x`` and ``y`` (False: nothing satisfies both; None: none)."""
    if key == "type":
        found = atoms({"type": x}) & atoms({"type": y})
        written = type_keyword(found)
        return False if not found else written
    if key == "required" and isinstance(x, list) and isinstance(y, list):
        return list(dict.fromkeys([*x, *y]))
    if key == "enum" and isinstance(x, list) and isinstance(y, list):
        return [v for v in x if any(same(v, w) for w in y)] or False
    if key == "const":
        return x if same(x, y) else False
    if key in _LOWER | _UPPER and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (x, y)):
        return max(x, y) if key in _LOWER else min(x, y)
    if same(x, y):
        return x
    return None


def _merge_objects(x: dict, y: dict):
    """properties/patternProperties/additionalProperties of two schemas as one unit, where exact: either
    side without additionalProperties; with it on one side, the other's names and patterns among its own.
    Names keep the order they have in the schema as sent (engines generate properties in that order)."""
    if "additionalProperties" in x and "additionalProperties" in y:
        return None
    closed, other = (y, x) if "additionalProperties" in y else (x, y)
    if "additionalProperties" in closed and not (
            set(other.get("properties", {})) <= set(closed.get("properties", {}))
            and set(other.get("patternProperties", {})) <= set(closed.get("patternProperties", {}))):
        return None
    out = {}
    for key in ("properties", "patternProperties"):
        if key in x or key in y:
            first, second = x.get(key, {}), y.get(key, {})
            names = sorted(dict.fromkeys([*first, *second]), key=lambda n: ORDER.get().get(n, len(ORDER.get())))
            out[key] = {n: meet(first[n], second[n]) if n in first and n in second else first.get(n, second.get(n))
                        for n in names}
    if "additionalProperties" in closed:
        out["additionalProperties"] = closed["additionalProperties"]
    return out


def _merge_arrays(x: dict, y: dict):
    """prefixItems/items of two schemas as one unit: position by position (exact)."""
    px, py = x.get("prefixItems", []), y.get("prefixItems", [])
    if not isinstance(px, list) or not isinstance(py, list):
        return None

    def at(side, prefix, index):
        return prefix[index] if index < len(prefix) else side.get("items", {})
    out = {}
    length = max(len(px), len(py))
    if length:
        out["prefixItems"] = [meet(at(x, px, i), at(y, py, i)) for i in range(length)]
    if "items" in x or "items" in y:
        out["items"] = meet(x.get("items", {}), y.get("items", {}))
    return out


# --------------------------------------------------------------------------- complement
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
    units = (_OBJECT_UNIT, (*_ARRAY_UNIT, "additionalItems"), ("contains", "minContains", "maxContains"),
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
    if key in _OBJECT_UNIT and set(group) == {"properties"} and isinstance(value, dict):
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


def dumps(value) -> str:
    return json.dumps(value, sort_keys=True)
