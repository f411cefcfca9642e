"""The differential soundness check: random schemas from JSON Schema's whole keyword vocabulary,
random instances, each engine against ``jsonschema``.

    from hypothesis import given
    @given(schema_and_instances("untyped"))
    def test(case):
        verdict = differential(engine, *case)     # Verdict: refused, or per instance accepted / valid
        assert not verdict.unsound                # an accepted instance jsonschema calls invalid

``schema_and_instances(region)`` draws a schema from one region of the vocabulary (``REGIONS``:
typed assertions, untyped assertions, combinators, references local and not, arrays and
objects with the applicators engines tend to drop) and instances from a small domain that
straddles the schema's limits (so about half are invalid). ``differential`` compiles the schema
with the default policy (``json_schema(schema, strict=False)``: JSON Schema's own semantics)
and teacher-forces every instance, written as ``json.dumps`` writes it (the ``compact``
whitespace), through the engine. An engine may refuse a schema; it must never accept an
invalid instance of one it compiled. Valid instances it rejects are counted (over-restriction),
not failed. ``benchmarks/bench_soundness.py`` runs the same check longer.
"""
from __future__ import annotations

import dataclasses
import json

from hypothesis import strategies as st

from neuron_constrain.structured.constraints import ConstraintError, json_schema
from neuron_constrain.structured.keywords import post_validate
from neuron_constrain.testing.vocabulary import force

REGIONS = ("typed", "untyped", "combinators", "references", "applicators")
TYPES = ("string", "integer", "number", "boolean", "null", "array", "object")
KEYS = ("a", "b", "c")
STRINGS = ("", "a", "ab", "abc", "ba", "a1", "Zz", "2024-01-02", "x@y.z", "a\nb")
NUMBERS = (-2, 0, 1, 2, 3, 4, 6, 0.5, 1.5, 2.5, -0.5, 1.0)
PATTERNS = ("^a", "b", "^[a-z]+$", "^a.$", "[0-9]")
FORMATS = ("date", "email", "uri", "regex", "ipv4", "flag-topic")


def _either(*strategies):
    """One of ``strategies``, each as likely (``st.one_of`` leans on the first ones when derandomized)."""
    return st.sampled_from(strategies).flatmap(lambda strategy: strategy)


def _values(depth: int = 2):
    scalars = _either(st.none(), st.booleans(), st.sampled_from(NUMBERS), st.sampled_from(STRINGS))
    if depth == 0:
        return scalars
    inner = _values(depth - 1)
    return _either(scalars, scalars, st.lists(inner, max_size=3),
                     st.dictionaries(st.sampled_from(KEYS), inner, max_size=3))


VALUES = _values()
_LIMIT = st.integers(0, 3)


def _pick(options: dict):
    """A dict of 1..3 of ``options``' keywords, each with a value drawn from its strategy."""
    return st.lists(st.sampled_from(sorted(options)), min_size=1, max_size=3, unique=True).flatmap(
        lambda names: st.fixed_dictionaries({name: options[name] for name in names}))


def _string():
    return {"minLength": _LIMIT, "maxLength": _LIMIT, "pattern": st.sampled_from(PATTERNS),
            "format": st.sampled_from(FORMATS)}


def _number():
    limit = st.sampled_from(NUMBERS)
    return {"minimum": limit, "maximum": limit, "exclusiveMinimum": limit, "exclusiveMaximum": limit,
            "multipleOf": st.sampled_from((2, 3, 0.5, 1.5))}


def _array(sub):
    return {"items": sub, "prefixItems": st.lists(sub, min_size=1, max_size=2), "minItems": _LIMIT,
            "maxItems": _LIMIT, "uniqueItems": st.booleans(), "contains": sub,
            "unevaluatedItems": st.one_of(st.just(False), sub)}


def _object(sub):
    return {"properties": st.dictionaries(st.sampled_from(KEYS), sub, min_size=1, max_size=2),
            "required": st.lists(st.sampled_from(KEYS), min_size=1, max_size=2, unique=True),
            "additionalProperties": st.one_of(st.booleans(), sub), "patternProperties": st.just({"^a": {"type": "integer"}}),
            "minProperties": _LIMIT, "maxProperties": _LIMIT, "propertyNames": st.just({"maxLength": 1}),
            "dependentRequired": st.just({"a": ["b"]}), "unevaluatedProperties": st.just(False)}


_FAMILY = {"string": "string", "integer": "number", "number": "number", "array": "array", "object": "object"}


def _leaf():
    """A typed scalar schema with assertions of its type (or a bare type, an enum, a const)."""
    typed = st.sampled_from(("string", "integer", "number")).flatmap(
        lambda t: _pick(_string() if t == "string" else _number()).map(lambda a: {"type": t, **a}))
    return _either(typed, st.sampled_from(TYPES).map(lambda t: {"type": t}),
                     st.lists(VALUES, min_size=1, max_size=3).map(lambda v: {"enum": v}),
                     VALUES.map(lambda v: {"const": v}))


def _typed(sub):
    kinds = st.sampled_from(("string", "integer", "number", "array", "object"))

    def build(kind):
        family = {"string": _string(), "integer": _number(), "number": _number(), "array": _array(sub),
                  "object": _object(sub)}[kind]
        type_value = st.one_of(st.just(kind), st.just([kind, "null"]))
        return st.tuples(type_value, _pick(family)).map(lambda pair: {"type": pair[0], **pair[1]})
    plain = kinds.flatmap(build)
    with_literals = st.tuples(plain, st.lists(VALUES, min_size=1, max_size=3)).map(
        lambda pair: {**pair[0], "enum": pair[1]})
    return _either(plain, plain, with_literals)


def _untyped(sub):
    families = st.lists(st.sampled_from(("string", "number", "array", "object")), min_size=1, max_size=2, unique=True)

    def build(names):
        parts = [_pick({"string": _string(), "number": _number(), "array": _array(sub),
                        "object": _object(sub)}[name]) for name in names]
        return st.tuples(*parts).map(lambda ds: {k: v for d in ds for k, v in d.items()})
    bare = families.flatmap(build)
    return _either(bare, st.tuples(bare, st.lists(VALUES, min_size=1, max_size=3)).map(
        lambda pair: {**pair[0], "enum": pair[1]}))


def _combinator(sub):
    branches = st.lists(sub, min_size=1, max_size=3)
    plain = st.tuples(st.sampled_from(("anyOf", "oneOf", "allOf")), branches).map(lambda p: {p[0]: p[1]})
    with_type = st.tuples(st.sampled_from(TYPES), st.sampled_from(("anyOf", "oneOf")), branches).map(
        lambda p: {"type": p[0], p[1]: p[2]})
    return _either(plain, plain, plain, with_type, with_type, sub.map(lambda s: {"not": s}),
                   st.tuples(sub, sub).map(lambda p: {"if": p[0], "then": p[1]}))


def _reference(sub):
    """A ``$ref`` to a definition: local pointers, and the non-local forms of one document."""
    def build(target):
        return st.sampled_from((
            {"$defs": {"d": target}, "$ref": "#/$defs/d"},
            {"$defs": {"d": target}, "type": "object", "properties": {"a": {"$ref": "#/$defs/d"}}},
            {"$defs": {"d": target}, "$ref": "#/$defs/d", "maxLength": 1},
            {"$defs": {"a~b": target}, "$ref": "#/$defs/a~0b"},
            {"$defs": {"a/b": target}, "$ref": "#/$defs/a~1b"},
            {"$id": "https://example.com/root.json", "$defs": {"d": {"$id": "d.json", **target}}, "$ref": "d.json"},
            {"$defs": {"d": {"$anchor": "here", **target}}, "$ref": "#here"},
            {"$id": "urn:example:root", "$defs": {"d": target}, "$ref": "urn:example:root#/$defs/d"},
            {"$defs": {"d": target}, "$ref": "https://example.com/elsewhere.json"},
            {"$dynamicAnchor": "node", "$defs": {"d": target}, "$dynamicRef": "#node"},
        ))
    return sub.flatmap(build)


_SIMPLE = ({}, {"type": "integer"}, {"type": ["string", "null"]})


def _applicators(sub):
    return _either(
        _pick(_array(sub)).map(lambda a: {"type": "array", **a}),
        _pick(_object(sub)).map(lambda a: {"type": "object", **a}),
        st.tuples(st.lists(st.sampled_from(_SIMPLE), min_size=1, max_size=2), st.sampled_from((False, *_SIMPLE))).map(
            lambda p: {"type": "array", "prefixItems": p[0], "unevaluatedItems": p[1]}),
        st.tuples(st.sampled_from(("minProperties", "maxProperties")), _LIMIT).map(
            lambda p: {"type": "object", p[0]: p[1]}),
    )


def schemas(region: str):
    """Schemas from ``region`` of the vocabulary (``REGIONS``), nested up to two levels."""
    if region not in REGIONS:
        raise ValueError(f"region {region!r}: pick one of {REGIONS}")
    sub = _either(_leaf(), _typed(_leaf()))
    outer = {"typed": _typed, "untyped": _untyped, "combinators": _combinator, "references": _reference,
             "applicators": _applicators}[region]
    return outer(_either(sub, _untyped(_leaf())) if region != "typed" else sub)


def schema_and_instances(region: str, *, count: int = 12):
    """``(schema, instances)``: the instances mix values near the schema's own literals with random ones."""
    return st.tuples(schemas(region), st.lists(VALUES, min_size=count, max_size=count))


@dataclasses.dataclass
class Verdict:
    """One schema on one engine: refused (the reason), or what happened to each instance."""

    engine: str
    schema: object
    refused: str | None = None
    unsound: list = dataclasses.field(default_factory=list)  # (instance, why jsonschema calls it invalid)
    over_restricted: list = dataclasses.field(default_factory=list)  # valid instances the grammar rejected
    accepted_valid: int = 0


def differential(engine, schema, instances, *, tokenizer=None) -> Verdict:
    """``schema`` compiled on ``engine`` (default policy), each instance teacher-forced and judged by
    ``jsonschema`` (:func:`keywords.post_validate`: the declared draft, formats asserted)."""
    verdict = Verdict(engine.name, schema)
    try:
        compiled = engine.compile(json_schema(schema, strict=False))
    except ConstraintError as error:
        verdict.refused = str(error)
        return verdict
    encode = (tokenizer or engine.tokenizer).encode
    for instance in instances:
        text = json.dumps(instance, ensure_ascii=False)
        why_invalid = post_validate(schema, text)
        if why_invalid is not None and why_invalid.startswith("the schema"):
            verdict.refused = f"jsonschema cannot apply the schema: {why_invalid}"  # an invalid schema: no judge
            return verdict
        accepted = force(engine, compiled, encode(text))
        if accepted and why_invalid is not None:
            verdict.unsound.append((text, why_invalid))
        elif not accepted and why_invalid is None:
            verdict.over_restricted.append(text)
        elif accepted:
            verdict.accepted_valid += 1
    return verdict
