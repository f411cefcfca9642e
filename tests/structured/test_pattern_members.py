"""``patternProperties`` on xgrammar: each name's region written out and the object closed
(``schema/pattern_members.py``), judged against the referee on instances around each region's edges, and
walked at random through xgrammar's masks."""
from __future__ import annotations

import json

import jsonschema
import pytest

from neuron_constrain import structured as S
from neuron_constrain.structured import engines as E
from neuron_constrain.structured.schema import pattern_members, prepare
from neuron_constrain.testing import toy_tokenizer
from neuron_constrain.testing.schemas import differential, walks

pytestmark = pytest.mark.torch_agnostic(lane="latest")  # host-side: the same on every torch

# (schema, instances): valid and invalid ones around each region
CASES = {
    "additional keys": ({"type": "object", "patternProperties": {"^a": {"type": "integer"}},
                         "additionalProperties": {"type": "string"}},
                        [{"a1": 1}, {"a1": "x"}, {"b": "x"}, {"b": 1}, {"ab": 2, "c": "d"}, {"": "e"}, {"": 3}]),
    "open, no additional schema": ({"type": "object", "patternProperties": {"^a": {"type": "integer"}}},
                                   [{"a1": 1}, {"a1": "x"}, {"b": [1]}, {}]),
    "a declared name a pattern finds": ({"type": "object", "properties": {"ab": {"type": "integer", "minimum": 5}},
                                         "patternProperties": {"^a": {"type": "integer", "maximum": 10}},
                                         "additionalProperties": False},
                                        [{"ab": 7}, {"ab": 12}, {"ab": 3}, {"ac": 3}, {"ac": 30}, {"b": 1},
                                         {"ab\u001c": 3}, {"ab\n": 3}, {"abc": 30}]),  # only "ab" is the declared one
    "a required name only a pattern covers": ({"type": "object", "patternProperties": {"^a": {"type": "integer"}},
                                               "required": ["ax"], "additionalProperties": {"type": "boolean"}},
                                              [{"ax": 1}, {"ax": "s"}, {}, {"ay": 1}, {"ax": 1, "b": True},
                                               {"ax": 1, "b": 2}]),
    "a false region, by a pattern spelled like a keyword": ({"type": "object", "patternProperties": {
        "additionalProperties": False, "c": {"type": "integer"}}}, [{"c": 1}, {"xcx": "s"}, {"additionalProperties": 1},
                                                                    {"b": "s"}, {"cadditionalProperties": 1}]),
    "a pattern finding every name": ({"type": "object", "properties": {"basic": {"type": "boolean"}},
                                      "patternProperties": {".*": {"type": ["boolean", "string"]}}},
                                     [{"basic": True}, {"basic": "x"}, {"basic": True, "z": "y"}, {"z": 1}]),
}


@pytest.fixture(scope="module")
def xgrammar():
    return E.make_engine("xgrammar", toy_tokenizer())


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_region_is_exact_on_xgrammar(xgrammar, name):
    schema, instances = CASES[name]
    view = prepare.prepare(S.json_schema(schema, strict=False)).view("xgrammar")
    assert view.schema["additionalProperties"] is False and not view.found  # closed, nothing refused
    verdict = differential(xgrammar, schema, instances, strict=False)
    judge = jsonschema.Draft202012Validator(schema)
    assert verdict.refused is None and not verdict.unsound and not verdict.over_restricted, verdict
    assert verdict.accepted_valid == sum(judge.is_valid(i) for i in instances) > 0, verdict
    compiled = xgrammar.compile(S.json_schema(schema, strict=False))
    for tokens in walks(xgrammar, compiled, 20, seed=len(name), max_tokens=40):
        text = xgrammar.tokenizer.decode(tokens)
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            continue  # cut at max_tokens
        assert judge.is_valid(value), (name, text)


def test_a_name_one_dialect_finds_is_never_written_with_the_other_schema(xgrammar):
    """Python's `\\d` finds `١` (an Arabic-Indic digit), ECMA-262's does not: the referee applies the pattern's
    schema, an engine's reading would not. The name is in no region: refused, never written with a schema the
    referee does not apply (narrower, sound)."""
    schema = {"type": "object", "patternProperties": {"^\\d+$": {"type": "integer"}},
              "additionalProperties": {"type": "string"}}
    verdict = differential(xgrammar, schema, [{"12": 1}, {"x": "s"}, {"\u0661": 1}, {"\u0661": "s"}], strict=False)
    assert not verdict.unsound and verdict.accepted_valid == 2 and verdict.over_restricted == ['{"\u0661": 1}'], verdict


def test_beside_a_negation_only_patterns_both_dialects_read_alike_are_written_out():
    """Beside a negation (where a narrower subschema could widen the schema) only patterns both dialects read
    alike are written out; `\\d` reads differently (a name only one finds would be in no region), so its node is
    left as it is, for the engine's policy to refuse by name."""
    for source, written in (("^\\d", False), ("^[0-9]", True)):  # (a final `$` reads differently too)
        schema = {"type": "object", "patternProperties": {source: {"type": "integer"}},
                  "not": {"type": "object", "patternProperties": {"^x": {"type": "string"}}}}
        pattern_members.explicit_regions(schema)
        assert (schema.get("additionalProperties") is False) == written, (source, schema)
        assert schema["not"].get("additionalProperties") is False  # `^x` reads alike: written out under the `not`


def test_auto_falls_back_to_xgrammar_where_llguidance_cannot_decide_the_regions():
    """llguidance checks each pair of `patternProperties` regexes for overlap with a fuel of 10,000 and refuses
    the schema where it runs out (the algebra's regions of overlapping patterns, complements written out); auto
    tries llguidance first (its masks are faster there) and compiles these on xgrammar, exactly."""
    engines = {name: E.make_engine(name, toy_tokenizer()) for name in ("llguidance", "auto")}
    schema = {"type": "object", "patternProperties": {"ab": {"type": "integer"}, "bc": {"type": "integer", "minimum": 3},
                                                      "cd": {"maximum": 9}}}
    instances = [{"abc": 3}, {"abc": 2}, {"bcd": 10}, {"bcd": 5}, {"x": []}, {"abcd": 4.5}]
    with pytest.raises(S.ConstraintError, match="can.t determine if patternProperty regexes"):
        engines["llguidance"].compile(S.json_schema(schema, strict=False))
    assert engines["auto"].compile(S.json_schema(schema, strict=False)).engine == "xgrammar"
    for schema, instances in ((schema, instances), CASES["a false region, by a pattern spelled like a keyword"]):
        verdict = differential(engines["auto"], schema, instances, strict=False)  # (the second: on llguidance,
        assert not verdict.unsound and not verdict.over_restricted and verdict.refused is None, verdict  # closed)


@pytest.mark.parametrize("pattern", ["^[a-z]+$", "^(?=(?!^[\\d_]$|\"{1,2}\"{1,2})$|\\t+$)"])
def test_a_name_only_the_referee_finds_never_takes_the_additional_schema(pattern):
    """Python's `$` (the referee's) also matches before a last newline: `^[a-z]+$` finds "abc\\n", ECMA-262's (the
    engines') does not. On an open object llguidance gave that name `additionalProperties` (any value), where the
    referee asks the pattern's schema: `{"abc\\n": "x"}` was accepted (found by `bench_soundness.py`, region
    patterns). Where a pattern reads differently, its object's regions are written out for llguidance too."""
    for extra in ({}, {"additionalProperties": {"type": "string"}}):
        schema = {"type": "object", "patternProperties": {pattern: {"type": "integer"}}, **extra}
        for name in ("llguidance", "auto", "xgrammar"):
            engine = E.make_engine(name, toy_tokenizer())
            verdict = differential(engine, schema, [{"abc\n": "x"}, {"\n": "x"}, {"abc": 1}, {"\t": 1}], strict=False)
            assert verdict.refused is None and not verdict.unsound, (name, verdict)


def test_a_pattern_the_referee_cannot_read_is_left_to_the_policy():
    """A named group (ECMA-262's `(?<n>...)`, which Python's `re` does not read) beside a declared name: the node is
    left as written (the name cannot be judged against it) and the policy refuses it by name, never a crash."""
    schema = {"type": "object", "properties": {"ab": {}}, "patternProperties": {"(?<n>a)": {"type": "integer"}}}
    with pytest.raises(S.ConstraintError, match="patternProperties"):
        E.make_engine("xgrammar", toy_tokenizer()).compile(S.json_schema(schema, strict=False))


def test_an_open_object_whose_pattern_ends_in_dollar_compiles_on_llguidance():
    """`^[0-9a-zA-Z_-]{1,255}$` on an open object (a real schema's, MaskBench's `Github_easy o9961`): its names'
    complement, written out for llguidance so that "ab\\n" (which only the referee's `$` finds) took the pattern's
    schema, exhausted llguidance's disjointness budget, and `auto` waited 12 s for xgrammar. Each pattern is now
    written as every name either dialect finds, no complement: llguidance compiles it, exactly but for such names
    (the pattern's schema where either dialect asks it)."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}},
              "patternProperties": {"^[0-9a-zA-Z_-]{1,255}$": {"type": "array", "items": {"type": "string"}}}}
    instances = [{"ab": ["x"]}, {"ab": 1}, {"ab\n": 1}, {"ab\n": ["x"]}, {"a b": 1}, {"n": 1}, {"n": "x"}]
    for name in ("llguidance", "auto"):
        engine = E.make_engine(name, toy_tokenizer())
        assert engine.compile(S.json_schema(schema, strict=False)).engine == "llguidance"
        verdict = differential(engine, schema, instances, strict=False)
        assert verdict.refused is None and not verdict.unsound and not verdict.over_restricted, (name, verdict)
        assert verdict.accepted_valid == 3, (name, verdict)
