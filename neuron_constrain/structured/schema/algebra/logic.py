"""Schemas as sets of JSON values: types, values, conjunction and disjunction.

    meet(a, b)            # allOf [a, b]: one object where the keywords stay independent, else allOf
    join([a, b])          # anyOf [a, b]: flattened, `false` branches dropped, `{}` absorbing
    atoms(s)              # the JSON types a value of ``s`` may have

Types are sets of atoms (``null boolean object array string integer fraction``: ``number`` is
``integer`` + ``fraction``). ``merge`` writes two schema objects as one where that keeps the
meaning: no keyword in both except those with a meet of their own (``type``: the common atoms,
``required``: the union, bounds: the tighter, ``enum``/``const``: the common values); the
properties unit (``properties``/``patternProperties``/``additionalProperties``) merged name by name
when ``additionalProperties`` is on one side at most and sees every name of the other, the items
unit position by position; never beside ``unevaluated*``, which sees every neighbour.
"""
from __future__ import annotations

import contextvars

from neuron_constrain.structured.schema import rewrite as rewrite
from neuron_constrain.structured.schema.algebra import regular
from neuron_constrain.structured.schema.algebra.caps import Over, over

ATOMS = frozenset({"null", "boolean", "object", "array", "string", "integer", "fraction"})
_TYPE_ATOMS = {"null": {"null"}, "boolean": {"boolean"}, "object": {"object"}, "array": {"array"},
               "string": {"string"}, "integer": {"integer"}, "number": {"integer", "fraction"}}
FAMILY_ATOMS = {"string": frozenset({"string"}), "number": frozenset({"integer", "fraction"}),
                "array": frozenset({"array"}), "object": frozenset({"object"})}
_LOWER = frozenset({"minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties", "minContains"})
_UPPER = frozenset({"maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties", "maxContains"})
# Property names in the order the schema as sent first writes them (set by algebra.lower).
ORDER: contextvars.ContextVar[dict] = contextvars.ContextVar("ORDER", default={})
OBJECT_UNIT = ("properties", "patternProperties", "additionalProperties")
ARRAY_UNIT = ("prefixItems", "items")


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
        if set(one) == {"anyOf"} and "anyOf" not in other and simple(other):
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


def simple(node: dict) -> bool:
    return not {"anyOf", "oneOf", "allOf", "$ref", "not", "if"} & set(node)


def merge(a: dict, b: dict):
    """One object holding both, or None where a keyword of each cannot be combined exactly."""
    merged, extra = assertions(a), assertions(b)
    if {"unevaluatedProperties", "unevaluatedItems"} & (set(merged) | set(extra)):
        return None  # they see every keyword beside them
    for unit, combine in ((OBJECT_UNIT, _merge_objects), (ARRAY_UNIT, _merge_arrays)):
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
    if key == "pattern" and isinstance(x, str) and isinstance(y, str) and x != y:
        try:  # one pattern for both (an engine holds one per node); past a cap both stay, in allOf
            return regular.intersect_patterns((x, y))
        except Over:
            return None
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
