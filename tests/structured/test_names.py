"""Property names, counts and existentials (issue 57, items 4 and 5): each class that was refused compiles
on ``auto`` and is enforced, teacher-forced instance by instance against ``jsonschema``'s verdict.

Each pinned schema was refused (or failed to compile) before its class was built; the random regions
(``property_names`` in ``testing/algebra_schemas.py``, ``existentials`` in ``testing/schemas.py``) check the
meaning and soundness around them.
"""
from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from neuron_constrain import structured as S
from neuron_constrain.structured import engines as E
from neuron_constrain.structured.schema import algebra
from neuron_constrain.testing import force, toy_tokenizer
from neuron_constrain.structured.schema.keywords import post_validate
from neuron_constrain.testing.algebra_schemas import meaning_changes
from neuron_constrain.testing.schemas import schema_and_instances
from tests.conftest import examples
from test_item_tracker import _unpacked, random_walk

# host-side, the same on every torch: one lane runs it, the latest (the shorter; see the torch_agnostic marker)
pytestmark = pytest.mark.torch_agnostic(lane="latest")


@pytest.fixture(scope="module")
def auto():
    return E.make_engine("auto", toy_tokenizer())


# class -> (schema, valid instances, invalid instances)
PINNED = {
    "propertyNames false": ({"type": "object", "propertyNames": False}, [{}], [{"a": 1}, {"": None}]),
    "propertyNames false beside properties": (
        {"type": "object", "properties": {"a": {"type": "integer"}}, "propertyNames": False}, [{}], [{"a": 1}]),
    "propertyNames enum beside declared, pattern and additional": (
        {"type": "object", "properties": {"a": {"type": "integer"}}, "patternProperties": {"^b": {"type": "string"}},
         "additionalProperties": {"type": "null"}, "propertyNames": {"enum": ["a", "bx", "c"]}, "required": ["a"]},
        [{"a": 1}, {"a": 1, "bx": "s", "c": None}], [{}, {"a": "s"}, {"a": 1, "bx": 1}, {"a": 1, "c": 1},
                                                     {"a": 1, "d": None}, {"a": 1, "by": "s"}]),
    "propertyNames no string type": ({"type": "object", "propertyNames": {"type": "integer"}}, [{}], [{"1": 1}]),
    "propertyNames pattern beside declared and additional": (
        {"type": "object", "properties": {"a": {"type": "integer"}, "Bad": {}}, "patternProperties": {"^x": {"type": "null"}},
         "additionalProperties": {"type": "string"}, "propertyNames": {"pattern": "^[a-z]+$"}},
        [{}, {"a": 1, "b": "s"}, {"x": None, "xy": None}], [{"a": "s"}, {"Bad": 1}, {"b": 1}, {"x": "s"}, {"B": "s"}, {"b1": "s"}]),
}


def _check(auto, schema, valid, invalid):
    for instance in valid + invalid:  # the pinned verdicts are jsonschema's
        assert jsonschema.Draft202012Validator(schema).is_valid(instance) == (instance in valid), instance
    compiled = auto.compile(S.json_schema(schema, strict=False))
    assert not compiled.unenforced, compiled.unenforced
    for instance in valid + invalid:
        accepted = force(auto, compiled, auto.tokenizer.encode(json.dumps(instance)))
        assert accepted == (instance in valid), (compiled.engine, instance)


@pytest.mark.parametrize("name", list(PINNED))
def test_each_class_compiles_on_auto_and_is_enforced(auto, name):
    _check(auto, *PINNED[name])


def test_finite_property_names_close_the_object_on_them():
    lowered = algebra.lower({"propertyNames": {"enum": ["a", "b"]}, "patternProperties": {"a": {"type": "string"}}})
    assert lowered == {"properties": {"a": {"type": "string"}, "b": {}}, "additionalProperties": False}


def test_a_required_name_property_names_refuses_leaves_the_node_to_the_policy():
    schema = {"type": "object", "propertyNames": {"enum": ["a"]}, "required": ["b"]}
    assert algebra.lower(schema)["propertyNames"] == {"enum": ["a"]}


# ---- minProperties on open objects: counted on the host (item_plan.Plan.min_properties, item_tracker.Scan)
COUNTED = {
    "open object": ({"type": "object", "minProperties": 2},
                    [{"a": 1, "b": 2}, {"a": {"x": 1}, "b": [{}], "c": None}], [{}, {"a": 1}, {"a": {"x": 1, "y": 2}}]),
    "nested, beside declared properties": (
        {"type": "object", "properties": {"a": {"type": "object", "minProperties": 2}}, "minProperties": 2},
        [{"a": {"x": 1, "y": 2}, "b": 1}, {"b": 1, "c": 2}], [{"a": {"x": 1}, "b": 1}, {"a": {"x": 1, "y": 2}}]),
    "in array items, with patternProperties": (
        {"type": "array", "items": {"type": "object", "patternProperties": {"^a": {"type": "integer"}},
                                    "minProperties": 3}},
         [[], [{"a": 1, "ab": 2, "c": "x"}]], [[{"a": 1, "ab": 2}], [{"a": 1, "b": 2, "c": 3}, {}]]),
}


@pytest.mark.parametrize("name", list(COUNTED))
def test_min_properties_on_open_objects_is_counted_on_the_host(auto, name):
    _check(auto, *COUNTED[name])


# ---- minProperties on closed objects, for llguidance (rewrite.min_properties_as_required)
ONE_MORE_NAME = {
    "one of the optional names, beside other types": (
        {"type": ["object", "string"], "additionalProperties": False, "minProperties": 1,
         "properties": {"GET": {"type": "integer"}, "POST": {"type": "integer"}, "never": False}},
        [{"GET": 1}, {"GET": 1, "POST": 2}, {"POST": 2}, "x"], [{}, {"never": 1}, {"GET": "a"}, {"other": 1}]),
    "one above the required names, beside the node's own anyOf": (
        {"type": "object", "additionalProperties": False, "minProperties": 2, "required": ["a"],
         "properties": {"a": {}, "b": {}, "c": {}}, "anyOf": [{"required": ["b"]}, {"required": ["c"]}]},
        [{"a": 1, "b": 2}, {"a": 1, "c": 2}, {"a": 1, "b": 2, "c": 3}], [{"a": 1}, {"b": 1, "c": 2}]),
    "reached by the required names": (
        {"type": "object", "additionalProperties": False, "minProperties": 1, "required": ["a"],
         "properties": {"a": {}, "b": {}}}, [{"a": 1}, {"a": 1, "b": 2}], [{}, {"b": 2}]),
}


@pytest.mark.parametrize("name", list(ONE_MORE_NAME))
def test_min_properties_on_a_closed_object_compiles_on_llguidance(name):
    """llguidance counts properties only where every declared one is required (it refused MaskBench's `xs-app`
    `minProperties: 1`, and `auto` waited 3-5 s for xgrammar's grammar): a count one above the required names is
    written as which optional name makes it up; every instance teacher-forced on llguidance and on `auto`."""
    for engine in ("llguidance", "auto"):  # (llguidance refused each before)
        _check(E.make_engine(engine, toy_tokenizer()), *ONE_MORE_NAME[name])


def test_a_repeated_name_counts_once(auto):
    compiled = auto.compile(S.json_schema({"type": "object", "minProperties": 2}, strict=False))
    assert not force(auto, compiled, auto.tokenizer.encode('{"a": 1, "a": 2}'))  # json reads one property


@pytest.mark.parametrize("schema", [
    {"type": "object", "minProperties": 2, "propertyNames": {"maxLength": 1}},  # names may run out: not counted
    {"anyOf": [{"type": "object", "minProperties": 2}, {"type": "string"}]},  # a branch decides, not only objects
])
def test_min_properties_the_counter_cannot_take_stays_refused_by_name(auto, schema):
    with pytest.raises(S.ConstraintError, match="minProperties"):
        auto.compile(S.json_schema(schema, strict=False))


def test_a_walk_under_the_mask_closes_an_open_object_only_with_enough_names(auto):
    """Random tokens among those the mask allows: never a dead end (the object stays open), every finished
    output valid (jsonschema)."""
    _walk(auto, {"type": "object", "additionalProperties": {"type": "boolean"}, "minProperties": 2}, seed=3)


def _walk(auto, schema, seed: int, least: int = 5):
    validator, rng = jsonschema.Draft202012Validator(schema), random.Random(seed)
    compiled = auto.compile(S.json_schema(schema, strict=False, whitespace="none"))
    finished = 0
    for _ in range(20):
        matcher = auto.matcher(compiled)
        tokens = random_walk(auto, matcher, rng, 80, dead_ends=False)
        if matcher.is_terminated():
            finished += 1
            assert validator.is_valid(json.loads(auto.tokenizer.decode(tokens[:-1])))
    assert finished >= least, finished


# ---- not over member keywords: an existential, checked member by member (item_plan.Plan.exists)
EXISTENTIAL = {
    "not over patternProperties": ({"not": {"patternProperties": {"^a": {"type": "integer"}}}},
                                   [{"a": "x"}, {"b": 1, "ab": None}], [{}, {"a": 1}, {"b": "x"}, "a", 3]),
    "not over properties and additionalProperties": (
        {"type": "object", "not": {"properties": {"a": {"type": "integer"}}, "additionalProperties": {"type": "string"}}},
        [{"a": "x"}, {"b": 1}, {"a": 1, "c": True}], [{}, {"a": 1}, {"a": 1, "b": "s"}]),
    "nested in an allOf, under a $ref": (
        {"$ref": "#/$defs/x", "$defs": {"x": {"type": "object", "required": ["k"], "allOf": [
            {"not": {"patternProperties": {"k": {"type": "array", "items": {"minimum": 2}}}}}]}}},
        [{"k": [1]}, {"k": [3], "kk": [0]}], [{"k": [3]}, {"k": []}, {"kk": [1]}]),
}


@pytest.mark.parametrize("name", list(EXISTENTIAL))
def test_not_over_member_keywords_is_checked_member_by_member(auto, name):
    _check(auto, *EXISTENTIAL[name])


def test_an_existential_counts_a_repeated_name_by_its_last_value(auto):
    compiled = auto.compile(S.json_schema(EXISTENTIAL["not over patternProperties"][0], strict=False))
    assert not force(auto, compiled, auto.tokenizer.encode('{"a": "x", "a": 1}'))  # json reads {"a": 1}
    assert force(auto, compiled, auto.tokenizer.encode('{"a": 1, "a": "x"}'))


def test_an_existential_a_branch_decides_stays_refused_by_name(auto):
    schema = {"anyOf": [{"type": "object", "not": {"patternProperties": {"^a": {"type": "integer"}}}}, {"type": "string"}]}
    with pytest.raises(S.ConstraintError, match="not"):
        auto.compile(S.json_schema(schema, strict=False))


def test_an_existential_over_names_that_run_out_stays_refused(auto):
    """A closed object whose declared names may all be written (or skipped) before the one the `not`
    asks for: a refused brace could leave no way on (found by random walks), so it is the engines'."""
    schema = {"additionalProperties": False, "properties": {"a": {}, "b": {}},
              "not": {"patternProperties": {"^a": {"type": "integer"}}}}
    with pytest.raises(S.ConstraintError, match="not"):
        auto.compile(S.json_schema(schema, strict=False))


def test_a_walk_under_the_mask_closes_an_object_only_once_a_member_breaks_the_not(auto):
    """Never a dead end while the object may take members; every finished output valid."""
    schema = {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 9},
              "not": {"additionalProperties": {"maximum": 7}}}
    _walk(auto, schema, seed=5)


# ---- oneOf over objects the algebra cannot split: judged whole as the object closes (item_plan.judged_whole)
ROW = {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[a-f\\d]{4}$"}},
       "patternProperties": {"^[a-z]{1,8}$": {"type": ["string", "number", "boolean", "null"]}}}
WHOLE = {
    "overlapping object branches (MaskBench o9817's shape)": (
        {"oneOf": [ROW, {"type": "object", "properties": {"count": {"type": "number"},
                                                          "ids": {"type": "array", "items": {"type": "string"}}}}]},
        [{"count": "x"}, {"ids": ["a"]}, {"ids": "x"}, {"id": "ab12", "count": None}],
        [{}, {"count": 1}, {"id": "ab12"}, {"ids": ["a"], "count": "x"}]),
    # the algebra splits it into anyOf branches holding minProperties: those compiled without, the anyOf judged whole
    "branches counting names": ({"type": "array", "items": {"type": "object", "oneOf": [{"required": ["a"]},
                                                                                     {"minProperties": 2}]}},
                                [[{"a": 1}, {"b": 1, "c": 1}]], [[{}], [{"a": 1, "b": 1}], [{"b": 1}]]),
}


@pytest.mark.parametrize("name", list(WHOLE))
def test_one_of_over_objects_is_judged_whole_as_the_object_closes(auto, name):
    _check(auto, *WHOLE[name])


@pytest.mark.parametrize("inner, keyword", [
    (WHOLE["overlapping object branches (MaskBench o9817's shape)"][0], "oneOf"),
    ({"type": "object", "oneOf": [{"required": ["a"]}, {"minProperties": 2}]}, "minProperties"),
])
def test_what_is_judged_whole_inside_a_branch_the_engine_picks_stays_refused(auto, inner, keyword):
    with pytest.raises(S.ConstraintError, match=keyword):
        auto.compile(S.json_schema({"anyOf": [inner, {"type": "string"}]}, strict=False))


def test_a_walk_under_the_mask_closes_only_objects_one_branch_takes(auto):
    schema = {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 3},
              "oneOf": [{"patternProperties": {"^a": {"const": 1}}}, {"patternProperties": {"^b": {"const": 2}}}]}
    _walk(auto, schema, seed=11, least=1)  # exactly one branch: a name must break the other (a rare walk)




# ---- oneOf branches that overlap only on [], {}, "": the overlap enumerated and excluded (disjoint.py)
EMPTY_OVERLAP = {
    "unevaluatedItems through oneOf": (
        {"type": "array", "oneOf": [{"prefixItems": [{"const": "a"}, {"type": "integer"}]}, {"prefixItems": [{"const": "b"}]}],
         "unevaluatedItems": False}, [["a"], ["a", 1], ["b"]], [[], ["a", 1, 2], ["b", 1], ["c"]]),
    "oneOf by the first item": ({"type": "array", "oneOf": [{"prefixItems": [{"type": "string"}]},
                                                             {"prefixItems": [{"type": "integer"}]}]},
                                [["x"], [1, "y"]], [[], [None]]),
}


@pytest.mark.parametrize("name", list(EMPTY_OVERLAP))
def test_one_of_branches_overlapping_only_on_empty_values_compile(auto, name):
    _check(auto, *EMPTY_OVERLAP[name])


_POSITION = st.sampled_from(({"const": "a"}, {"const": "b"}, {"type": "integer"}, {"type": "string"}, {}, {"enum": [1, "a"]}))
_BRANCH = st.fixed_dictionaries({"prefixItems": st.lists(_POSITION, min_size=1, max_size=2)}, optional={
    "items": st.sampled_from(({}, False, {"type": "integer"})), "minItems": st.integers(0, 2)})
_ARRAYS = st.lists(st.lists(st.sampled_from(("a", "b", 1, 2, None, "c")), max_size=3), min_size=8, max_size=8)


@settings(max_examples=examples(60), deadline=None, suppress_health_check=list(HealthCheck))
@given(branches=st.lists(_BRANCH, min_size=2, max_size=3), typed=st.sampled_from(({}, {"type": "array"})),
       unevaluated=st.sampled_from((None, False, {"type": "string"})), instances=_ARRAYS)
def test_empty_overlap_keeps_the_meaning(branches, typed, unevaluated, instances):
    schema = {**typed, "oneOf": branches, **({} if unevaluated is None else {"unevaluatedItems": unevaluated})}
    assert not meaning_changes(schema, [*instances, [], {}, "", 1]), json.dumps(schema)


@settings(max_examples=examples(10), deadline=None, suppress_health_check=list(HealthCheck))
@given(case=schema_and_instances("existentials"), seed=st.integers(0, 99))
def test_random_walks_under_the_mask_write_only_valid_objects(auto, case, seed):
    """Of the soundness region's schemas auto compiles: every token the mask allows is accepted, and every
    walk that finishes wrote a value jsonschema takes (the tracker's checks hold token by token)."""
    schema = case[0]
    try:
        compiled = auto.compile(S.json_schema(schema, strict=False, whitespace="none"))
    except S.ConstraintError:
        return
    rng = random.Random(seed)
    for _ in range(3):
        matcher = auto.matcher(compiled)
        tokens = random_walk(auto, matcher, rng, 60)
        if matcher.is_terminated():
            assert post_validate(schema, auto.tokenizer.decode(tokens[:-1])) is None, json.dumps(schema)


@pytest.mark.parametrize("schema, text", [
    ({"type": "object", "minProperties": 2}, "{}"),
    ({"type": "array", "contains": {"type": "string"}}, "[]"),  # the same hole for contains, before any item
])
def test_a_token_opening_and_closing_a_tracked_value_at_once_is_masked(auto, schema, text):
    """Found by a random walk: the mask allowed "{}" (a whole object in one token) that accept_token refused."""
    compiled = auto.compile(S.json_schema(schema, strict=False, whitespace="none"))
    token = auto.tokenizer.encode(text)
    assert len(token) == 1, text
    matcher, buffer = auto.matcher(compiled), torch.zeros((1, auto.width), dtype=torch.int32)
    assert auto.batch_fill([matcher], buffer, [0]) == []
    assert not _unpacked(buffer[0], auto.vocab_size)[token[0]] and not matcher.accept_token(token[0])


@pytest.mark.parametrize("names, compiles", [
    ({"pattern": "[a\\]]?"}, True), ({}, True), ({"maxLength": 2}, True),  # untyped: split by type before the fix
    ({"anyOf": [{"pattern": "^a"}, {"maxLength": 1}]}, False), ({"$ref": "#/$defs/anything"}, False),
])
def test_a_name_is_written_as_a_string_whatever_its_schema_leaves_untyped(names, compiles):
    """Found by bench_soundness: xgrammar writes a name from the ``propertyNames`` schema as a value, and the
    untyped schema split by type (``values.split_types``) let a walk write ``{null: 1}``. After ``{`` only a
    string (or the brace) may start; a shape it cannot type exactly is refused by name."""
    xgrammar = E.make_engine("xgrammar", toy_tokenizer())
    schema = {"type": "object", "propertyNames": names, "$defs": {"anything": {}}}
    for strict in (False, True):
        try:
            compiled = xgrammar.compile(S.json_schema(schema, strict=strict, whitespace="none"))
        except S.ConstraintError as refused:
            assert not compiles and "xgrammar would not enforce" in str(refused)
            continue
        assert compiles
        matcher, buffer = xgrammar.matcher(compiled), torch.zeros((1, xgrammar.width), dtype=torch.int32)
        assert matcher.accept_token(xgrammar.tokenizer.encode("{")[0])
        xgrammar.batch_fill([matcher], buffer, [0])
        allowed = torch.nonzero(_unpacked(buffer[0], xgrammar.vocab_size)).flatten().tolist()
        starts = {xgrammar.tokenizer.decode([token])[:1] for token in allowed}
        assert starts <= {'"', "}"} and '"' in starts, sorted(starts)
