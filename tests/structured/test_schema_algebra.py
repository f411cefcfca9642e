"""The schema algebra (``structured/schema/algebra``): each rewrite keeps the meaning, the engines compiled from
it never accept what the schema as sent rejects, and each size cap is refused by name.

Per rewrite, two searches over random schemas of its region (``testing/algebra_schemas.py``): the
values ``jsonschema`` accepts are the same before and after ``algebra.lower`` (the schema as sent
judged under its own draft), and every engine, fed the lowered schema by ``json_schema(...)``, accepts
no instance ``jsonschema`` calls invalid of the schema as sent (``testing.schemas.differential``).
Then one pinned schema per rewrite: nothing left that no engine reads, ``auto`` compiles it whole,
its valid instances taken and invalid ones refused. Each of those was refused before the algebra.
"""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings

from neuron_constrain import structured as S
from neuron_constrain.structured.schema import algebra
from neuron_constrain.structured import engines as E
from neuron_constrain.structured.schema import rewrite as rewrite
from neuron_constrain.structured.schema.algebra.conditionals import ELIMINATED
from neuron_constrain.testing import force, toy_tokenizer
from neuron_constrain.testing.algebra_schemas import REGIONS, algebra_case, meaning_changes
from neuron_constrain.testing.schemas import differential
from tests.conftest import examples

# host-side, the same on every torch: one lane runs it, the latest (the shorter; see the torch_agnostic marker)
pytestmark = pytest.mark.torch_agnostic(lane="latest")

MEANING = settings(max_examples=examples(60), deadline=None, suppress_health_check=list(HealthCheck))
ENGINES = settings(max_examples=examples(8), deadline=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def toy_engines():
    vocabulary = toy_tokenizer()
    return {name: E.make_engine(name, vocabulary) for name in E.ENGINE_CHOICES}


def _lowered_or_capped(schema):
    try:
        return algebra.lower(schema)
    except algebra.CapReached:
        return None


@pytest.mark.parametrize("region", REGIONS)
def test_each_rewrite_keeps_the_values_jsonschema_accepts(region):
    @MEANING
    @given(case=algebra_case(region))
    def check(case):
        if _lowered_or_capped(case[0]) is None:
            return
        changed = meaning_changes(*case)
        assert not changed, f"{json.dumps(case[0])} -> {json.dumps(algebra.lower(case[0]))}: {changed[:3]}"
    check()


@pytest.mark.parametrize("region", REGIONS)
def test_engines_compiled_from_a_rewrite_accept_nothing_the_schema_as_sent_rejects(toy_engines, region):
    @ENGINES
    @given(case=algebra_case(region))
    def check(case):
        if _lowered_or_capped(case[0]) is None:
            return
        for name, engine in toy_engines.items():
            verdict = differential(engine, *case)
            assert not verdict.unsound, f"{name} compiled {json.dumps(case[0])}: {verdict.unsound[:3]}"
    check()


DRAFT7 = "http://json-schema.org/draft-07/schema#"
# rewrite -> (schema, valid instances, invalid instances); each refused by both engines before the algebra
PINNED = {
    "dependentRequired": ({"type": "object", "dependentRequired": {"a": ["b"], "b": ["a"]}},
                          [{}, {"a": 1, "b": 2}, {"c": 1}], [{"a": 1}, {"b": 1}]),
    "dependentSchemas": ({"type": "object", "properties": {"x": {"type": "integer"}}, "additionalProperties": False,
                          "dependentSchemas": {"x": {"required": ["y"]}}}, [{}], [{"x": 1}, {"y": 1}]),
    "dependencies (draft-07)": ({"$schema": DRAFT7, "type": "object", "dependencies": {"a": ["b"]}},
                                [{"a": 1, "b": 2}, {"b": 1}], [{"a": 1}]),
    "if by a discriminator": ({"type": "object", "if": {"properties": {"kind": {"const": "a"}}, "required": ["kind"]},
                               "then": {"required": ["x"]}, "else": {"required": ["y"]}},
                              [{"kind": "a", "x": 1}, {"kind": "b", "y": 1}, {"y": 1}], [{"kind": "a"}, {"kind": "b"}]),
    "if by type": ({"if": {"type": "string"}, "then": {"minLength": 2}, "else": {"type": "number"}},
                   ["ab", 3, 1.5], ["a", None, True]),
    "not const": ({"type": "integer", "not": {"const": 3}}, [1, 4], [3]),
    "not enum": ({"type": "string", "not": {"enum": ["a", "b"]}}, ["c", "", "ab"], ["a", "b"]),
    "not required": ({"type": "object", "not": {"required": ["a"]}}, [{}, {"b": 1}], [{"a": 1}]),
    "not a bound": ({"not": {"minimum": 10}}, [9, -2.5], [10, "x", None]),
    # the complement of a pattern excludes what either dialect matches: Python's \d takes "٣", its $ a last newline
    "not a pattern": ({"type": "string", "not": {"pattern": "^[a-f\\d]{4}$"}}, ["abc", "abcde", "xyz1", "ab-d"],
                      ["abcd", "12ef", "\u0663\u0663\u0663\u0663", "abcd\n"]),
    "oneOf with a pattern branch": ({"oneOf": [{"type": "string", "pattern": "^[0-9]{2}$"}, {"type": "string"}]},
                                    ["abc", "1", "123"], ["12", 5]),
    "oneOf with a finite branch": ({"type": "string", "oneOf": [{"maxLength": 3}, {"enum": ["ab", "long one"]}]},
                                   ["abc", "long one", ""], ["ab", "abcd"]),
    "oneOf disjoint": ({"type": "object", "oneOf": [
        {"properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False},
        {"properties": {"b": {"type": "string"}}, "required": ["b"], "additionalProperties": False}]},
        [{"a": 1}, {"b": "x"}], [{"a": 1, "b": "x"}, {}]),
    "oneOf overlapping": ({"type": "object", "oneOf": [{"required": ["a"]}, {"required": ["b"]}]},
                          [{"a": 1}, {"b": 1}], [{"a": 1, "b": 2}, {}]),
    "contains every item": ({"type": "array", "items": {"const": 1}, "contains": {"type": "integer"},
                             "maxContains": 2}, [[1], [1, 1]], [[], [1, 1, 1]]),
    "maxContains 0": ({"type": "array", "contains": {"type": "string"}, "minContains": 0, "maxContains": 0},
                      [[], [1, 2]], [["a"], [1, "b"]]),
    "contains in a bounded array": ({"type": "array", "maxItems": 3, "contains": {"const": 3}},
                                    [[3], [1, 3], [1, 2, 3]], [[], [1, 2]]),
    "unevaluatedProperties": ({"type": "object", "anyOf": [
        {"properties": {"a": {"type": "integer"}}, "required": ["a"]},
        {"properties": {"b": {"type": "string"}}, "required": ["b"]}], "unevaluatedProperties": False},
        [{"a": 1}, {"b": "x"}, {"a": 1, "b": "x"}], [{"a": 1, "b": 2}, {"a": 1, "c": 1}]),
    "unevaluatedItems": ({"type": "array", "allOf": [{"prefixItems": [{"type": "string"}]}], "unevaluatedItems": False},
                         [["a"], []], [["a", "b"], ["a", 1]]),
    "$dynamicRef": ({"$id": "https://example.com/strings", "$ref": "list", "$defs": {
        "item": {"$dynamicAnchor": "T", "type": "string"},
        "list": {"$id": "list", "type": "array", "items": {"$dynamicRef": "#T"}, "$defs": {"t": {"$dynamicAnchor": "T"}}}}},
        [["a", "b"], []], [["a", 1], [None]]),
    "uniqueItems": ({"type": "array", "items": {"enum": ["a", "b", "c"]}, "uniqueItems": True},
                    [["a", "c"], [], ["c", "b", "a"]], [["a", "a"], ["d"]]),
    "draft-2019 items list": ({"$schema": "https://json-schema.org/draft/2019-09/schema", "type": "array",
                               "items": [{"type": "integer"}], "additionalItems": False}, [[1], []], [[1, 2], ["a"]]),
    "finite values beside any keyword": ({"enum": [1, 2, 3], "not": {"const": 2}, "uniqueItems": True}, [1, 3], [2]),
    # allOf merged into the node, then the overlapping patterns cut into disjoint regions (a name with a and b
    # meets both schemas); llguidance then counts the properties (none is declared optional)
    "allOf of overlapping patternProperties": (
        {"type": "object", "allOf": [{"patternProperties": {"a": {"type": "integer", "minimum": 10}}},
                                     {"patternProperties": {"b": {"type": "integer", "maximum": 20}}}],
         "minProperties": 1},
        [{"a": 25}, {"ab": 15}, {"b": 3}, {"c": "x"}, {"ba": 10, "c": []}], [{}, {"ab": 25}, {"ab": 5}, {"a": 5}, {"b": 30}]),
}


@pytest.mark.parametrize("rewrite_name", list(PINNED))
def test_each_rewrite_compiles_whole_and_is_enforced(toy_engines, rewrite_name):
    schema, valid, invalid = PINNED[rewrite_name]
    lowered = algebra.lower(schema)
    left = {k for _, node in rewrite.walk(lowered) for k in node if k in ELIMINATED}
    assert not left, (rewrite_name, left, lowered)
    auto = toy_engines["auto"]
    compiled = auto.compile(S.json_schema(schema, strict=False))
    assert not compiled.unenforced
    for instance in valid + invalid:
        accepted = force(auto, compiled, auto.tokenizer.encode(json.dumps(instance)))
        assert accepted == (instance in valid), (rewrite_name, compiled.engine, instance, json.dumps(lowered))


def test_the_schema_as_sent_is_never_modified():
    schema = {"type": "object", "dependentSchemas": {"a": {"required": ["b"]}}, "not": {"required": ["c"]},
              "unevaluatedProperties": False, "properties": {"a": {}}}
    before = json.dumps(schema)
    algebra.lower(schema)
    assert json.dumps(schema) == before


@pytest.mark.parametrize("schema, keyword, path", [
    ({"properties": {"x": {"type": "string", "not": {"format": "email"}}}}, "not", "#/properties/x/not"),
    ({"anyOf": [{"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, {"type": "array", "maxItems": 3}]}, "uniqueItems", "#/anyOf/0/uniqueItems"),
    ({"anyOf": [{"type": "array", "contains": {"const": 1}}, {"type": "array", "maxItems": 40}]}, "contains",
     "#/anyOf/0/contains"),
    ({"$defs": {"d": {"if": {"format": "email"}, "then": {"maxLength": 1}}}, "$ref": "#/$defs/d"}, "if", "#/$defs/d/if"),
], ids=["not-format", "uniqueItems-by-branch", "contains-mixed-unbounded", "if-by-format"])
def test_what_no_rewrite_expresses_is_refused_where_it_was_written(toy_engines, schema, keyword, path):
    with pytest.raises(S.ConstraintError) as info:
        toy_engines["auto"].compile(S.json_schema(schema, strict=False))
    assert f"`{keyword}` at {path}" in str(info.value), str(info.value)


def _chain(length: int) -> dict:
    """``length`` resources, each with a dynamic anchor and a reference to the next: as many scopes."""
    defs = {f"r{i}": {"$id": f"r{i}", "$dynamicAnchor": "T", "$ref": f"r{i + 1}"} for i in range(length)}
    defs[f"r{length}"] = {"$id": f"r{length}", "$dynamicAnchor": "T", "type": "array", "items": {"$dynamicRef": "#T"}}
    return {"$id": "https://example.com/chain", "$ref": "r0", "$defs": defs}


@pytest.mark.parametrize("schema, cap, keyword, path", [
    ({"type": "object", "properties": {"p": {"anyOf": [{"properties": {k: {}}, "required": [k]} for k in "abcdefg"],
                                             "unevaluatedProperties": False}}},
     "branches", "unevaluatedProperties", "#/properties/p"),
    ({"type": "array", "items": {"enum": list(range(8))}, "uniqueItems": True}, "enumerated", "uniqueItems", "#"),
    ({"not": {"enum": [f"s{i}" for i in range(300)]}}, "string_set", "not", "#"),
    (_chain(70), "specializations", "$ref", "#/$defs/r63"),
    ({"type": "string", "not": {"pattern": "^(?:[a-z]{1,40}-){16}$"}}, "automaton_states", "not", "#"),
    ({"type": "object", "patternProperties": {c: {"type": "integer"} for c in "abcdefg"}}, "branches",
     "patternProperties", "#"),
], ids=["branches", "enumerated", "string_set", "specializations", "automaton_states",
        "overlapping-patterns"])
def test_each_size_cap_is_refused_by_name_and_pointer(toy_engines, schema, cap, keyword, path):
    with pytest.raises(algebra.CapReached) as info:
        algebra.lower(schema)
    error = info.value
    assert (error.cap, error.keyword, error.path) == (cap, keyword, path)
    assert f"cap {algebra.CAPS[cap]}" in str(error) and f"`{keyword}` at {path}" in str(error)
    with pytest.raises(S.ConstraintError, match=f"`algebra.CAPS\\['{cap}'\\]`"):
        toy_engines["auto"].compile(S.json_schema(schema, strict=False))
