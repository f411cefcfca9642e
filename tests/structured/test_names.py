"""Property names, counts and existentials (issue 57, items 4 and 5): each class that was refused compiles
on ``auto`` and is enforced, teacher-forced instance by instance against ``jsonschema``'s verdict.

Each pinned schema was refused (or failed to compile) before its class was built; the random regions
(``property_names`` in ``testing/algebra_schemas.py``, ``existentials`` in ``testing/schemas.py``) check the
meaning and soundness around them.
"""
from __future__ import annotations

import json

import jsonschema
import pytest

from neuron_constrain import structured as S
from neuron_constrain.structured import engines as E
from neuron_constrain.structured.schema import algebra
from neuron_constrain.testing import force, toy_tokenizer

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
