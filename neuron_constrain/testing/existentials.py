"""The differential test's ``existentials`` region (``schemas.REGIONS``): counts and existentials over an
object's names (``minProperties``/``maxProperties`` on open objects, ``propertyNames``, ``not`` over object
subschemas, overlapping ``oneOf``, ``dependent*``, ``unevaluated*``), drawn with values around them."""
from __future__ import annotations

import json

from hypothesis import strategies as st

_OBJECT_VALUES = ({}, {"a": 1}, {"b": "x"}, {"a": 1, "b": "x"}, {"a": "x", "b": 1}, {"a": 1, "b": 2, "c": None},
                  {"ab": [1], "c": {}}, {"c": 1}, {"x1": 1, "x2": 2, "y": None}, {"a": {"a": 1, "b": 2}, "b": [{}]},
                  {"a": {}, "c": 3}, [{"a": 1, "b": 2}], [{"a": 1}, {}], [], "ab", 1, None)
_OBJECT_KEYWORDS = st.sampled_from((
    {"minProperties": 2}, {"minProperties": 3}, {"maxProperties": 1}, {"propertyNames": False},
    {"propertyNames": {"enum": ["a", "c"]}}, {"propertyNames": {"maxLength": 1}}, {"propertyNames": {"pattern": "^[ab]"}},
    {"patternProperties": {"^x": {"type": "integer"}}}, {"patternProperties": {"b": {"type": "string"}}},
    {"not": {"patternProperties": {"^a": {"type": "integer"}}}}, {"not": {"properties": {"a": {"type": "integer"}}}},
    {"not": {"required": ["a"]}}, {"dependentRequired": {"a": ["b"]}}, {"dependentSchemas": {"a": {"required": ["c"]}}},
    {"oneOf": [{"required": ["a"]}, {"minProperties": 2}]}, {"oneOf": [{"properties": {"a": {"type": "integer"}}},
                                                                       {"properties": {"a": {"type": "string"}}}]},
    {"anyOf": [{"required": ["b"]}, {"properties": {"a": {"const": 1}}}], "unevaluatedProperties": False},
    {"allOf": [{"properties": {"a": {}}}], "unevaluatedProperties": {"type": "integer"}},
    {"additionalProperties": False, "properties": {"a": {}, "b": {}}}, {"additionalProperties": {"type": "integer"}},
    {"properties": {"a": {"type": "integer"}}}, {"required": ["a"]}))


def existentials_case():
    """A drawn object schema of name counts and existentials, and 8 distinct values to judge against it."""
    def build(picked):
        parts, typed, nested = picked
        node = {"type": "object"} if typed else {}
        for part in parts:
            node.update(part)
        return {"type": "array", "items": node, "maxItems": 2} if nested else node
    schema = st.tuples(st.lists(_OBJECT_KEYWORDS, min_size=1, max_size=3), st.booleans(),
                       st.sampled_from((False, False, True))).map(build)
    return st.tuples(schema, st.lists(st.sampled_from(_OBJECT_VALUES), min_size=8, max_size=8, unique_by=json.dumps))
