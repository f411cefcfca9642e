"""Large and hostile constraints, one per class, for the limits' tests and ``bench_hostile``.

    for name, (kind, spec) in hostile_constraints().items():     # kind: a vLLM structured-output kind
        ...                                                        # (json, regex, grammar, choice)

Each class is what one request can send to make a grammar engine work hard: size (a long
``enum``, thousands of properties, a 200,000-character regex), depth, large repetition bounds,
huge numbers, ambiguous grammars, patterns engines cannot read, and constraints no value
satisfies. ``ordinary_schema(i)``: a small object schema, a new one for each ``i``, as a
server's ordinary traffic sends.
"""
from __future__ import annotations

import json


def _nested_object(depth: int) -> dict:
    node: dict = {"type": "integer"}
    for _ in range(depth):
        node = {"type": "object", "properties": {"a": node}, "required": ["a"], "additionalProperties": False}
    return node


def _words(count: int, prefix: str = "w") -> list[str]:
    return [f"{prefix}{i:05d}" for i in range(count)]


def hostile_constraints() -> dict[str, tuple[str, str]]:
    """``{class name: (kind, spec text)}``; kinds as vLLM names them."""
    schema = {
        "deep_object": _nested_object(300),
        "huge_enum": {"enum": _words(30_000)},
        "described_properties": {
            "type": "object", "additionalProperties": False,
            "properties": {f"p{i}": {"type": "string", "description": f"property number {i} of many"}
                           for i in range(8_000)}},
        "long_min_length": {"type": "string", "minLength": 20_000},
        "many_required": {"type": "object", "properties": {f"r{i}": {"type": "integer"} for i in range(2_000)},
                          "required": [f"r{i}" for i in range(2_000)], "additionalProperties": False},
        "wide_any_of": {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "string", "maxLength": 5}},
                                   "required": [f"k{i}"], "additionalProperties": False} for i in range(500)]},
        "ref_cycle": {"$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}},
                                         "required": ["next"], "additionalProperties": False}},
                      "$ref": "#/$defs/node"},
        "huge_integer_bounds": {"type": "integer", "minimum": -10 ** 300, "maximum": 10 ** 300},
        "many_min_items": {"type": "array", "items": {"type": "integer"}, "minItems": 5_000},
        "contradictory_bounds": {"type": "object", "properties": {
            "n": {"type": "integer", "minimum": 10, "maximum": 3}}, "required": ["n"], "additionalProperties": False},
        "ref_fan_out": _ref_fan_out(40),
    }
    out = {name: ("json", json.dumps(value)) for name, value in schema.items()}
    out["huge_regex"] = ("regex", "(" + "|".join(_words(28_000, "x")) + ")")  # ~200,000 characters
    out["nested_repetitions"] = ("regex", "((([a-z]{1,40}){1,40}){1,40}){1,40}")
    out["lookahead"] = ("regex", "(?=[a-z0-9]*[0-9])(?=[a-z0-9]*[a-z])[a-z0-9]{8,64}")
    out["long_regex_match"] = ("regex", "([a-z][0-9]){5000,}")  # no match under 10,000 characters
    out["ambiguous_ebnf"] = ("grammar", 'root ::= s\ns ::= s s | s s s | "a" | "aa" | ""\n')
    out["huge_choice"] = ("choice", json.dumps(_words(20_000, "c")))
    return out


def _ref_fan_out(levels: int) -> dict:
    """Each definition an object of two copies of the one before: 2^levels leaves if expanded."""
    defs = {"d0": {"type": "integer"}}
    for i in range(1, levels + 1):
        defs[f"d{i}"] = {"type": "object", "properties": {"l": {"$ref": f"#/$defs/d{i - 1}"},
                                                          "r": {"$ref": f"#/$defs/d{i - 1}"}},
                         "required": ["l", "r"], "additionalProperties": False}
    return {"$defs": defs, "$ref": f"#/$defs/d{levels}"}


def ordinary_schema(i: int) -> dict:
    """A small object schema, different for each ``i`` (so each one compiles)."""
    return {"type": "object", "properties": {f"name{i}": {"type": "string", "maxLength": 8},
                                             "count": {"type": "integer", "minimum": 0, "maximum": 99}},
            "required": [f"name{i}", "count"], "additionalProperties": False}
