"""Rewrites over finite sets of values, and the counting keywords of arrays.

    {enum: [1, 2, 3], not: {const: 2}}              -> {enum: [1, 3]}      (any keywords beside a finite set)
    {items: {enum: [a, b]}, uniqueItems: true}      -> {enum: [[], [a], [b], [a, b], [b, a]]}  (arrays typed)
    {items: S, contains: C, minContains: m, ...}    -> minItems / maxItems where every position's schema
                                                       lies inside C or outside it (the count is the length's)
    {contains: C, maxContains: 0}                   -> items: S ∧ not-C
    {maxItems: 3, contains: C}                      -> anyOf over the first position holding C
    {properties: P, additionalProperties: false,
     propertyNames: N}                              -> the properties of P whose names N takes

A node whose values are finite (``enum``, ``const``, an ``allOf`` branch with one, or a ``type`` of
``null``/``boolean``) becomes the ``enum`` of the values ``jsonschema`` accepts for the whole node,
whatever else it holds. Arrays over a finite item domain (``enum``/``const``/``boolean``/``null``/
a small integer range per position) with ``uniqueItems`` are enumerated and judged alike. Both are
capped by ``CAPS["enumerated"]``; the first-match ``contains`` form is written up to ``CAPS["positions"]``
positions (past it, ``contains`` is left to the host's item tracker).
"""
from __future__ import annotations

import itertools

from neuron_constrain.structured.schema import rewrite as rewrite
from neuron_constrain.structured.schema.algebra import logic
from neuron_constrain.structured.schema.algebra.caps import CAPS, over
from neuron_constrain.structured.schema.algebra.conditionals import attach, stuck
from neuron_constrain.structured.schema.algebra.disjoint import disjoint, finite_values
from neuron_constrain.structured.schema.algebra.logic import join, meet
from neuron_constrain.structured.schema.algebra.negation import _escape, complement
from neuron_constrain.structured.schema.algebra.regular import complement_pattern, intersect_patterns

_SMALL_RANGE = 16


def domain(node) -> list | None:
    """Every value ``node`` may accept, when that set is finite and small (else None)."""
    if node is False:
        return []
    if not isinstance(node, dict):
        return None
    values = finite_values(node)
    if values is None and isinstance(node.get("allOf"), list):
        values = next((domain(b) for b in node["allOf"] if domain(b) is not None), None)
    if values is None:
        found = logic.atoms(node)
        if found <= {"null", "boolean"}:
            values = ([None] if "null" in found else []) + ([True, False] if "boolean" in found else [])
        elif found <= {"integer", "null", "boolean"} and "integer" in found:
            low, high = node.get("minimum"), node.get("maximum")
            if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (low, high)):
                return None
            if high - low > _SMALL_RANGE:
                return None
            values = [v for v in range(int(-(-low // 1)), int(high // 1) + 1)]
            values += ([None] if "null" in found else []) + ([True, False] if "boolean" in found else [])
    return logic.distinct(values) if values is not None else None


def collapse(node, judge):
    """Top-down: a node with a finite domain and a keyword no engine may read becomes the ``enum`` of its
    valid values (judged by ``jsonschema`` on the node as written)."""
    if not isinstance(node, dict):
        return node
    values = domain(node)
    if values is not None and len(values) <= CAPS["enumerated"] and set(logic.assertions(node)) - {"enum"} and stuck(node):
        try:
            kept = [v for v in values if judge.valid(node, v)]
        except judge.Unjudged:
            kept = None
        if kept is not None:
            for key in logic.assertions(node):
                del node[key]
            return attach(node, values_schema(kept))
    for _, container, key in list(rewrite.children(node)):
        container[key] = collapse(container[key], judge)
    return node


def unique_items(node: dict, path: str, judge):
    if node.get("uniqueItems") is not True:
        return node
    prefix = node.get("prefixItems", [])
    prefix = prefix if isinstance(prefix, list) else None
    items = node.get("items", {})
    if prefix is None:
        return node
    domains = [domain(s) for s in prefix] + ([] if items is False else [domain(items)])
    if any(d is None for d in domains):
        return node
    values = logic.distinct(v for d in domains for v in d)
    longest = len(values) if items is not False else min(len(prefix), len(values))
    if isinstance(node.get("maxItems"), int):
        longest = min(longest, node["maxItems"])
    shortest = node.get("minItems", 0) if isinstance(node.get("minItems"), int) else 0
    count = sum(_permutations(len(values), k) for k in range(shortest, longest + 1))
    over("enumerated", count)
    arrays = [list(p) for k in range(shortest, longest + 1) for p in itertools.permutations(values, k)]
    try:
        kept = [a for a in arrays if judge.valid(node, a)]
    except judge.Unjudged:
        return node
    for key in rewrite.FAMILIES["array"] & set(node):
        del node[key]
    others = logic.atoms(node) - {"array"}
    return attach(node, join([{"type": logic.type_keyword(others)} if others else False, values_schema(kept)]))


def closed_names(node: dict, path: str, judge):
    """``propertyNames`` of a closed object (``additionalProperties: false``, no ``patternProperties``):
    every key is a declared property, so the names are judged here, once: those ``propertyNames``
    refuses leave ``properties`` (absent is forbidden there), and the keyword goes. A refused name that
    is ``required`` leaves the node as it is (no object is valid; the engines' policies decide).
    ``propertyNames`` taking finitely many names (``false``, an ``enum``/``const``, no string type)
    closes an open object on them (:func:`finite_names`); a ``pattern`` alone, on patterns
    (:func:`pattern_names`)."""
    names, properties = node.get("propertyNames"), node.get("properties", {})
    if names is None or not isinstance(properties, dict) or "unevaluatedProperties" in node:
        return node
    if node.get("additionalProperties") is not False or "patternProperties" in node:
        beside = {"properties", "patternProperties", "additionalProperties"} & set(node)  # alone: xgrammar takes it
        if beside and isinstance(names, dict) and set(names) <= {"pattern", "type"} \
                and isinstance(names.get("pattern"), str) and names.get("type", "string") == "string":
            return pattern_names(node, names, properties, judge)
        return finite_names(node, names, properties, judge)
    try:
        refused = {name for name in properties if not judge.valid(names, name)}
    except judge.Unjudged:
        return node
    required = node.get("required") if isinstance(node.get("required"), list) else []
    if refused & set(required):
        return node
    node["properties"] = {name: sub for name, sub in properties.items() if name not in refused}
    del node["propertyNames"]
    return node


def finite_names(node: dict, names, properties: dict, judge):
    """An open object whose ``propertyNames`` takes finitely many names: each of them declared with
    the schema its value must meet there (its ``properties`` entry and every ``patternProperties``
    schema whose pattern it matches, else ``additionalProperties``), and nothing else
    (``additionalProperties: false``). ``{"propertyNames": false}``: only the empty object."""
    candidates = _name_domain(names)
    patterns = node.get("patternProperties", {})
    if candidates is None or not isinstance(patterns, dict):
        return node
    try:
        taken = [n for n in candidates if judge.valid(names, n)]
        declared = {}
        for name in taken:
            matched = [sub for pattern, sub in patterns.items() if judge.valid({"pattern": pattern}, name)]
            if name in properties:
                matched.insert(0, properties[name])
            elif not matched:
                matched.append(node.get("additionalProperties", {}))
            schema: object = {}
            for sub in matched:
                schema = meet(schema, sub)
            declared[name] = schema
    except judge.Unjudged:
        return node
    required = node.get("required") if isinstance(node.get("required"), list) else []
    if set(required) - set(declared):
        return node  # a required name propertyNames refuses: no object is valid (the policies decide)
    node.pop("patternProperties", None)
    del node["propertyNames"]
    node["properties"], node["additionalProperties"] = declared, False
    return node


def pattern_names(node: dict, names: dict, properties: dict, judge):
    """An open object whose ``propertyNames`` is a ``pattern`` alone: closed on patterns. The declared
    names it refuses leave ``properties``; each ``patternProperties`` pattern is met with it; the names
    ``additionalProperties`` took become one pattern (the names pattern, less every other pattern and the
    declared names: ``regular.py``) holding its schema. Left as written where a pattern has no
    complement here (the policies decide)."""
    patterns, extra = node.get("patternProperties", {}), node.get("additionalProperties", {})
    if not isinstance(patterns, dict):
        return node
    required = node.get("required") if isinstance(node.get("required"), list) else []
    try:
        kept = {name: sub for name, sub in properties.items() if judge.valid(names, name)}
        if not all(judge.valid(names, name) for name in required if isinstance(name, str)):
            return node  # a required name propertyNames refuses: no object is valid (the policies decide)
    except judge.Unjudged:
        return node
    met: dict = {}
    for source, sub in patterns.items():
        both = intersect_patterns((source, names["pattern"]))
        if both is None or both in met:
            return node
        if both is not False:
            met[both] = sub
    if extra is not False:
        declared = "^(?:" + "|".join(_escape(name) for name in properties) + ")$" if properties else None
        others = [complement_pattern(source) for source in (*patterns, *([declared] if declared else []))]
        if any(other is None for other in others):
            return node
        rest = intersect_patterns((names["pattern"], *(o for o in others if o is not False))) \
            if all(o is not False for o in others) else False
        if rest is None or rest in met:
            return node
        if rest is not False:
            met[rest] = extra
    node.pop("patternProperties", None)
    del node["propertyNames"]
    node.update(properties=kept, additionalProperties=False)
    if met:
        node["patternProperties"] = met
    return node


def _name_domain(names) -> list | None:
    """The strings ``propertyNames`` may take, where finitely many (before judging them): None where
    not finite here."""
    if names is False:
        return []
    if not isinstance(names, dict):
        return None
    values = finite_values(names)
    if values is not None:
        over("string_set", len(values))
        return list(dict.fromkeys(v for v in values if isinstance(v, str)))
    kinds = rewrite.declared_types(names)
    return [] if kinds is not None and "string" not in kinds else None


def values_schema(values: list):
    """Exactly ``values``: scalars as one ``enum``, each array or object spelled out position by position
    and property by property (xgrammar matches an ``enum`` of arrays or objects as text, so a valid value
    written with other whitespace would be refused)."""
    scalars = [v for v in values if not isinstance(v, (list, dict))]
    return join([{"enum": scalars} if scalars else False,
                 *(spelled(v) for v in values if isinstance(v, (list, dict)))])


def spelled(value):
    """The schema whose one valid value is ``value``."""
    if isinstance(value, list):
        positions = {"prefixItems": [spelled(v) for v in value], "minItems": len(value)} if value else {}
        return {"type": "array", **positions, "items": False}
    if isinstance(value, dict):
        names = {"properties": {k: spelled(v) for k, v in value.items()}, "required": list(value)} if value else {}
        return {"type": "object", **names, "additionalProperties": False}
    return {"const": value}


def _permutations(n: int, k: int) -> int:
    out = 1
    for i in range(k):
        out *= n - i
    return out


def contains(node: dict, path: str, judge):
    if "contains" not in node:
        return node
    wanted = node["contains"]
    low, high = node.get("minContains", 1), node.get("maxContains")
    prefix = node.get("prefixItems", [])
    prefix = prefix if isinstance(prefix, list) else None
    items = node.get("items", {})
    if prefix is None or stuck(wanted) or not isinstance(low, int) or not (high is None or isinstance(high, int)):
        return node
    negated = complement(wanted, judge.resolve)
    sides = [_side(s, wanted, negated, judge) for s in [*prefix, items]]
    if high is not None and low > high:
        conjunct = _no_arrays()
    elif None not in sides:
        conjunct = _by_length(sides[:-1], sides[-1] if items is not False else None, low, high)
    elif high == 0 and negated is not None:
        conjunct = {"items": meet(items, negated)}
        if prefix:
            conjunct["prefixItems"] = [meet(s, negated) for s in prefix]
    elif low == 1 and high is None and negated is not None:
        conjunct = _first_match(prefix, items, wanted, negated, node)
        if conjunct is None:
            return node
    else:
        return node
    for key in ("contains", "minContains", "maxContains"):
        node.pop(key, None)
    return attach(node, conjunct)


def _side(schema, wanted, negated, judge):
    """True: every value of ``schema`` satisfies ``wanted``; False: none does; None: unknown."""
    values = domain(schema)
    if values is not None:
        try:
            matched = {judge.valid(wanted, v) for v in values if judge.valid(schema, v)}
        except judge.Unjudged:
            matched = {True, False}
        if len(matched) < 2:
            return True if matched != {False} else False
    if negated is not None and disjoint(schema, negated, judge):
        return True
    if disjoint(schema, wanted, judge):
        return False
    return None


def _no_arrays():
    return {"type": logic.type_keyword(logic.ATOMS - {"array"})}


def _by_length(prefix_sides: list, items_side, low: int, high):
    """The lengths whose count of matching positions lies in [low, high] (the count grows with the length)."""
    n = len(prefix_sides)

    def count(length):
        return sum(1 for side in prefix_sides[:length] if side) + (max(0, length - n) if items_side else 0)
    if not items_side and count(n) < low:
        return _no_arrays()
    shortest = next(length for length in itertools.count() if count(length) >= low)
    if high is None or (not items_side and count(n) <= high):
        longest = None
    elif count(shortest) > high:
        return _no_arrays()
    else:
        longest = next(length for length in itertools.count(shortest) if count(length + 1) > high)
    bounds = {"minItems": shortest} if shortest else {}
    if longest is not None:
        bounds["maxItems"] = longest
    return bounds


def _first_match(prefix: list, items, wanted, negated, node: dict):
    """At least one match in an array of at most ``maxItems`` items: anyOf over where the first one is."""
    top = node.get("maxItems") if isinstance(node.get("maxItems"), int) else (len(prefix) if items is False else None)
    if top is None or top > CAPS["positions"]:
        return None  # left to the host's item tracker (item_tracker.py), or refused by the policy
    cases = []
    for first in range(top):
        positions = [meet(_at(prefix, items, i), negated) for i in range(first)]
        positions.append(meet(_at(prefix, items, first), wanted))
        positions += [_at(prefix, items, i) for i in range(first + 1, len(prefix))]
        cases.append({"minItems": first + 1, "prefixItems": positions, "items": items})
    return join([_no_arrays(), *cases])


def _at(prefix: list, items, index: int):
    return prefix[index] if index < len(prefix) else items
