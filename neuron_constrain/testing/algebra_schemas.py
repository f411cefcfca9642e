"""Random schemas for each rewrite of the schema algebra (``structured/schema/algebra``), and the check that a
rewrite keeps the meaning.

    @given(case=algebra_case("conditional"))          # (schema, instances): if/then/else around deciders
    def test(case):
        assert not meaning_changes(*case)              # jsonschema: the schema as sent vs as lowered

``REGIONS`` names one strategy per rewrite: ``dependent`` (dependentRequired/dependentSchemas beside
properties and additionalProperties), ``conditional`` (if/then/else deciding by type, required, a
property's const/enum, a bound, a pattern), ``negation`` (not over the same, nested), ``one_of`` (branches that
overlap or not), ``contains`` (contains/minContains/maxContains with items, prefixItems, maxItems),
``unevaluated`` (unevaluatedProperties/Items through allOf/anyOf/oneOf/if/$ref/dependentSchemas),
``dynamic`` ($dynamicRef scopes), ``unique`` (uniqueItems over finite item domains, and unbounded ones
the host's tracker takes), ``dialects``
(draft-4/6/7/2019-09 spellings), ``finite`` (keywords beside a finite enum), ``conjunction`` (allOf
branches sharing keywords, overlapping patternProperties, min/maxProperties), ``property_names``
(``propertyNames`` taking finitely many names, or none, beside properties, patternProperties and
additionalProperties). Instances are drawn from a
small domain around the schemas' own names and literals, so about half are invalid.
"""
from __future__ import annotations

import json

from hypothesis import strategies as st

from neuron_constrain.structured.schema import algebra
from neuron_constrain.structured.schema.keywords import post_validate

KEYS = ("a", "b", "k")
SCALARS = (None, True, False, -1, 0, 1, 2, 3, 1.5, "", "a", "b", "ab", "ba", "a\n", "\u0663")
# patterns a complement or an intersection is made of (regular.py): anchors, sets, counts, a shorthand class
PATTERNS = ("^a", "b$", "^a.?b$", "[ab]{2}", "^$", "\\d", "^(ab|b)*$", "^[^\\d]$")
REGIONS = ("dependent", "conditional", "negation", "one_of", "contains", "unevaluated", "dynamic", "unique",
           "dialects", "finite", "conjunction", "property_names")


def _either(*strategies):
    return st.sampled_from(strategies).flatmap(lambda s: s)


SCALAR = st.sampled_from(SCALARS)
VALUES = st.recursive(SCALAR, lambda inner: _either(st.lists(inner, max_size=3),
                                                     st.dictionaries(st.sampled_from(KEYS), inner, max_size=3)),
                      max_leaves=6)
NAMES = st.lists(st.sampled_from(KEYS), min_size=1, max_size=2, unique=True)
LEAF = st.sampled_from(({}, False, {"type": "integer"}, {"type": "string"}, {"type": ["string", "null"]},
                        {"const": 1}, {"const": "a"}, {"enum": [1, "a", None]}, {"minimum": 2}, {"maxLength": 1},
                        {"type": "integer", "maximum": 2}, {"type": "boolean"}, {"type": "number", "minimum": 1}))
DECIDER = _either(
    st.sampled_from(("string", "integer", "number", "object", "array", "null", "boolean")).map(lambda t: {"type": t}),
    NAMES.map(lambda n: {"required": n}),
    st.tuples(st.sampled_from(KEYS), SCALAR).map(lambda p: {"properties": {p[0]: {"const": p[1]}}, "required": [p[0]]}),
    st.tuples(st.sampled_from(KEYS), st.lists(SCALAR, min_size=1, max_size=3)).map(
        lambda p: {"properties": {p[0]: {"enum": p[1]}}}),
    st.tuples(st.sampled_from(("minimum", "maximum", "exclusiveMinimum", "minLength", "maxItems")),
              st.integers(0, 2)).map(lambda p: {p[0]: p[1]}),
    SCALAR.map(lambda v: {"const": v}), st.lists(SCALAR, min_size=1, max_size=3).map(lambda v: {"enum": v}),
    st.sampled_from(PATTERNS).map(lambda p: {"pattern": p}),
)
TYPE = st.sampled_from(({}, {"type": "object"}, {"type": "array"}, {"type": "integer"}, {"type": ["string", "number"]}))


def _object(sub):
    return st.fixed_dictionaries({}, optional={
        "type": st.just("object"), "properties": st.dictionaries(st.sampled_from(KEYS), sub, min_size=1, max_size=2),
        "required": NAMES, "additionalProperties": st.one_of(st.booleans(), sub),
        "patternProperties": st.just({"^a": {"type": "integer"}})})


def _dependent():
    required = st.dictionaries(st.sampled_from(KEYS), st.lists(st.sampled_from(KEYS), max_size=2), min_size=1, max_size=2)
    schemas = st.dictionaries(st.sampled_from(KEYS), _either(LEAF, _object(LEAF)), min_size=1, max_size=2)
    return st.tuples(_object(LEAF), st.one_of(required.map(lambda r: {"dependentRequired": r}),
                                              schemas.map(lambda s: {"dependentSchemas": s}))).map(lambda p: {**p[0], **p[1]})


def _conditional():
    branch = _either(LEAF, DECIDER, _object(LEAF))
    return st.tuples(TYPE, DECIDER, st.one_of(st.none(), branch), st.one_of(st.none(), branch)).map(
        lambda p: {**p[0], "if": p[1], **({"then": p[2]} if p[2] is not None else {}),
                   **({"else": p[3]} if p[3] is not None else {})})


def _negation():
    inner = _either(DECIDER, LEAF, DECIDER.map(lambda d: {"not": d}), st.lists(DECIDER, min_size=1, max_size=2).map(
        lambda ds: {"anyOf": ds}), st.tuples(DECIDER, DECIDER).map(lambda p: {**p[0], **p[1]}))
    return st.tuples(TYPE, inner).map(lambda p: {**p[0], "not": p[1]})


def _one_of():
    branch = _either(LEAF, DECIDER, _object(LEAF).map(lambda o: {**o, "type": "object"}))
    return st.tuples(TYPE, st.lists(branch, min_size=1, max_size=3)).map(lambda p: {**p[0], "oneOf": p[1]})


def _contains():
    return st.fixed_dictionaries({"contains": _either(LEAF, DECIDER)}, optional={
        "type": st.just("array"), "items": _either(LEAF, st.just(False)), "prefixItems": st.lists(LEAF, min_size=1, max_size=2),
        "minContains": st.integers(0, 2), "maxContains": st.integers(0, 2), "maxItems": st.integers(0, 3),
        "minItems": st.integers(0, 2)})


def _unevaluated():
    props = _object(LEAF)
    applicator = _either(
        st.tuples(st.sampled_from(("allOf", "anyOf", "oneOf")), st.lists(props, min_size=1, max_size=3)).map(
            lambda p: {p[0]: p[1]}),
        st.tuples(DECIDER, props, props).map(lambda p: {"if": p[0], "then": p[1], "else": p[2]}),
        props.map(lambda p: {"$defs": {"d": p}, "$ref": "#/$defs/d"}),
        st.dictionaries(st.sampled_from(KEYS), props, min_size=1, max_size=2).map(lambda d: {"dependentSchemas": d}))
    objects = st.tuples(props, applicator, _either(st.just(False), LEAF)).map(
        lambda p: {**p[0], **p[1], "unevaluatedProperties": p[2]})
    prefix = st.lists(LEAF, min_size=1, max_size=2).map(lambda ps: {"prefixItems": ps})
    arrays = st.tuples(st.fixed_dictionaries({}, optional={"type": st.just("array"), "prefixItems": st.lists(LEAF, max_size=2),
                                                          "contains": LEAF}),
                       st.tuples(st.sampled_from(("allOf", "anyOf", "oneOf")), st.lists(prefix, min_size=1, max_size=2)),
                       _either(st.just(False), LEAF)).map(lambda p: {**p[0], p[1][0]: p[1][1], "unevaluatedItems": p[2]})
    return _either(objects, arrays)


def _dynamic():
    def build(pair):
        inner, outer = pair
        return st.sampled_from((
            {"$defs": {"s": {"$anchor": "s", **inner}}, "$dynamicRef": "#s"},
            {"$id": "https://example.com/o", "$ref": "list", "$defs": {
                "item": {"$dynamicAnchor": "T", **outer},
                "list": {"$id": "list", "type": "array", "items": {"$dynamicRef": "#T"},
                         "$defs": {"t": {"$dynamicAnchor": "T", **inner}}}}},
            {"$id": "https://example.com/p", "$ref": "list", "$defs": {
                "list": {"$id": "list", "type": "array", "items": {"$dynamicRef": "#T"},
                         "$defs": {"t": {"$dynamicAnchor": "T", **inner}}}}},
        ))
    typed = st.sampled_from(({"type": "integer"}, {"type": "string"}, {"minimum": 1}, {"enum": [1, "a"]}))
    return st.tuples(typed, typed).flatmap(build)


def _unique():
    finite = st.sampled_from(({"enum": ["a", "b", 1]}, {"type": "boolean"}, {"type": "integer", "minimum": 0, "maximum": 2},
                              {"const": 1}, {"type": ["boolean", "null"]}, {"enum": [1, 1.0, True]},
                              {"type": "string"}, {"type": ["integer", "boolean"]}, {}))  # unbounded: the host's tracker
    return st.fixed_dictionaries({"uniqueItems": st.just(True), "items": finite}, optional={
        "type": st.just("array"), "maxItems": st.integers(0, 3), "minItems": st.integers(0, 2),
        "prefixItems": st.lists(finite, min_size=1, max_size=2)})


_DRAFTS = ("http://json-schema.org/draft-04/schema#", "http://json-schema.org/draft-06/schema#",
           "http://json-schema.org/draft-07/schema#", "https://json-schema.org/draft/2019-09/schema", None)


def _dialects():
    body = st.fixed_dictionaries({}, optional={
        "items": _either(LEAF, st.lists(LEAF, min_size=1, max_size=2)), "additionalItems": _either(LEAF, st.just(False)),
        "dependencies": st.dictionaries(st.sampled_from(KEYS), _either(NAMES, LEAF), min_size=1, max_size=2),
        "maximum": st.integers(0, 2), "exclusiveMaximum": st.one_of(st.booleans(), st.integers(0, 2)),
        "const": SCALAR, "if": DECIDER, "then": LEAF, "prefixItems": st.lists(LEAF, min_size=1, max_size=1),
        "$ref": st.just("#/definitions/d"), "definitions": st.just({"d": {"type": ["array", "object", "integer"]}})})
    return st.tuples(st.sampled_from(_DRAFTS), body).map(_declared)


def _declared(pair) -> dict:
    draft, body = pair
    if "$ref" in body and "definitions" not in body:
        body = {k: v for k, v in body.items() if k != "$ref"}
    return {**({"$schema": draft} if draft else {}), **body}


def _finite():
    stuck = _either(DECIDER.map(lambda d: {"not": d}), st.tuples(DECIDER, LEAF).map(lambda p: {"if": p[0], "then": p[1]}),
                    st.just({"uniqueItems": True}), st.just({"contains": {"const": 1}}),
                    st.lists(DECIDER, min_size=2, max_size=2).map(lambda ds: {"oneOf": ds}))
    return st.tuples(st.lists(VALUES, min_size=1, max_size=4), stuck).map(lambda p: {"enum": p[0], **p[1]})


def _conjunction():
    count = st.integers(0, 2)
    node = st.fixed_dictionaries({}, optional={
        "type": st.sampled_from(("object", "string", ["object", "string"])), "pattern": st.sampled_from(PATTERNS),
        "minLength": count, "maxLength": count, "minimum": count, "required": NAMES,
        "properties": st.dictionaries(st.sampled_from(KEYS), LEAF, min_size=1, max_size=2),
        "patternProperties": st.dictionaries(st.sampled_from(PATTERNS), LEAF, min_size=1, max_size=3),
        "additionalProperties": _either(st.just(False), LEAF), "minProperties": count, "maxProperties": count})
    return st.tuples(node, st.lists(node, max_size=3)).map(lambda p: {**p[0], **({"allOf": p[1]} if p[1] else {})})


def _property_names():
    names = st.one_of(st.just(False), st.lists(st.sampled_from((*KEYS, "ab", "ba")), min_size=1, max_size=3, unique=True).map(
        lambda ns: {"enum": ns}), st.sampled_from(KEYS).map(lambda n: {"const": n}),
        st.sampled_from(({"type": "integer"}, {"maxLength": 1}, {"pattern": "^a"}, {"enum": ["a", 1]})))
    node = st.fixed_dictionaries({"propertyNames": names}, optional={
        "type": st.just("object"), "required": NAMES,
        "properties": st.dictionaries(st.sampled_from(KEYS), LEAF, min_size=1, max_size=2),
        "patternProperties": st.dictionaries(st.sampled_from(PATTERNS), LEAF, min_size=1, max_size=2),
        "additionalProperties": _either(st.just(False), LEAF)})
    return node


_BUILD = {"dependent": _dependent, "conditional": _conditional, "negation": _negation, "one_of": _one_of,
          "contains": _contains, "unevaluated": _unevaluated, "dynamic": _dynamic, "unique": _unique,
          "dialects": _dialects, "finite": _finite, "conjunction": _conjunction,
          "property_names": _property_names}


def algebra_case(region: str, *, count: int = 12):
    """``(schema, instances)`` for one rewrite of the algebra (``REGIONS``)."""
    if region not in _BUILD:
        raise ValueError(f"region {region!r}: pick one of {REGIONS}")
    return st.tuples(_BUILD[region](), st.lists(VALUES, min_size=count, max_size=count))


def meaning_changes(schema, instances) -> list:
    """The instances ``jsonschema`` judges differently on ``schema`` (its declared draft, formats
    asserted: ``keywords.post_validate``) and on ``algebra.lower(schema)`` (2020-12); empty: kept."""
    lowered = algebra.lower(schema)
    changed = []
    for instance in instances:
        text = json.dumps(instance)
        before = post_validate(schema, text)
        if before is not None and before.startswith("the schema"):
            return []  # jsonschema cannot apply the schema as sent: nothing to compare
        after = post_validate(lowered, text) if lowered is not False else "false"
        if (before is None) != (after is None):
            changed.append((instance, before, after))
    return changed
