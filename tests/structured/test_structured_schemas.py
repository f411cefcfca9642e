"""Structured outputs over a few dozen JSON schemas, through a transformed tiny decoder.

- generation: the random-weight model's constrained output validates with jsonschema,
  or (max tokens reached) is a prefix a fresh xgrammar matcher accepts; counts reported;
- teacher forcing: every token of every valid instance (compact and spaced JSON) is
  chosen by the graph when forced, i.e. never masked by the runtime's rows.

(xgrammar 0.2.8 ignores maxLength next to "format", so the format schema has no maxLength.)
"""
from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch
import xgrammar as xgr

from neuron_constrain import structured as S
from neuron_constrain.structured.engines.xgrammar.grammars import compile_grammar, xgrammar_info
from neuron_constrain.testing import ForcedStep, GreedyStep, tiny_decoder, toy_tokenizer

# what this file checks is host-side, the same on every torch: the main lane runs it (see the torch_agnostic marker)
pytestmark = pytest.mark.torch_agnostic

MODEL_VOCAB = 768  # lm_head padded past the toy tokenizer's 732 tokens
BATCH = torch.export.Dim("batch")

ADDRESS = {
    "type": "object",
    "properties": {"street": {"type": "string", "maxLength": 12}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
    "required": ["street", "zip"],
    "additionalProperties": False,
}

SCHEMAS: list[tuple[str, dict, list]] = [
    ("flat_object", {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"]},
     [{"name": "Bob", "age": 42}, {"name": "", "age": 0}]),
    ("boolean_enum", {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}}, "required": ["ok", "color"]},
     [{"ok": True, "color": "blue"}]),
    ("string_enum_top", {"type": "string", "enum": ["small", "medium", "large"]}, ["medium"]),
    ("integer_range", {"type": "integer", "minimum": -5, "maximum": 250}, [-5, 17, 250]),
    ("number_bounds", {"type": "object", "properties": {"price": {"type": "number", "minimum": 0, "maximum": 100}}, "required": ["price"]},
     [{"price": 9.5}, {"price": 100}]),
    ("unbounded_number", {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}, [{"x": -1.25}]),
    ("unbounded_string", {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}, [{"s": "say \"hi\"\n"}]),
    ("int_array", {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 3}, [[], [1, 2, 99]]),
    ("array_min_max", {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 2}, [[True], [False, True]]),
    ("string_array", {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 4}}, "required": ["tags"]},
     [{"tags": ["a", "red"]}, {"tags": []}]),
    ("nested_object", {"type": "object", "properties": {"user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999}, "active": {"type": "boolean"}}, "required": ["id", "active"]}}, "required": ["user"]},
     [{"user": {"id": 7, "active": False}}]),
    ("deep_nesting", {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {"c": {"type": "null"}}, "required": ["c"]}}, "required": ["b"]}}, "required": ["a"]},
     [{"a": {"b": {"c": None}}}]),
    ("optional_fields", {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 50}, "note": {"type": "string", "maxLength": 5}}, "required": ["id"], "additionalProperties": False},
     [{"id": 3}, {"id": 4, "note": "hey"}]),
    ("all_optional", {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "null"}}, "additionalProperties": False},
     [{}, {"b": None}, {"a": True, "b": None}]),
    ("ref_defs", {"$defs": {"addr": ADDRESS}, "type": "object", "properties": {"home": {"$ref": "#/$defs/addr"}, "work": {"$ref": "#/$defs/addr"}}, "required": ["home"]},
     [{"home": {"street": "Main St", "zip": "12345"}}]),
    ("ref_array", {"$defs": {"pt": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 2}}, "type": "array", "items": {"$ref": "#/$defs/pt"}, "maxItems": 2},
     [[[1, 2]], [[0, 0], [9, 9]]]),
    ("any_of_scalar", {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "boolean"}]}, [3, False]),
    ("any_of_objects", {"type": "object", "properties": {"v": {"anyOf": [{"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["unit"], "additionalProperties": False}, {"type": "null"}]}}, "required": ["v"]},
     [{"v": {"unit": "celsius"}}, {"v": None}]),
    ("one_of_types", {"type": ["string", "null"], "maxLength": 4}, [None, "ok"]),
    ("const_field", {"type": "object", "properties": {"type": {"const": "user"}, "level": {"type": "integer", "minimum": 1, "maximum": 3}}, "required": ["type", "level"]},
     [{"type": "user", "level": 2}]),
    ("pattern_string", {"type": "object", "properties": {"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}}, "required": ["date"]},
     [{"date": "2024-01-31"}]),
    # email is off xgrammar's list (its quoted local part takes escapes JSON has not); a format it keeps:
    ("format_uuid", {"type": "object", "properties": {"id": {"type": "string", "format": "uuid"}}, "required": ["id"]},
     [{"id": "123e4567-e89b-12d3-a456-426614174000"}]),
    ("string_length", {"type": "string", "minLength": 2, "maxLength": 4}, ["ab", "abcd"]),
    ("array_of_objects", {"type": "array", "items": {"type": "object", "properties": {"name": {"enum": ["red", "green"]}, "count": {"type": "integer", "minimum": 0, "maximum": 5}}, "required": ["name", "count"]}, "maxItems": 3},
     [[{"name": "red", "count": 1}, {"name": "green", "count": 5}]]),
    ("enum_mixed", {"enum": [1, "two", None, True]}, [1, "two", None, True]),
    ("numbers_exclusive", {"type": "object", "properties": {"score": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}}, "required": ["score"]},
     [{"score": 1}, {"score": 9}]),
    ("null_only", {"type": "null"}, [None]),
    ("boolean_only", {"type": "boolean"}, [True, False]),
    ("tool_args", {"type": "object", "properties": {"location": {"type": "string", "maxLength": 10}, "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["location", "unit"], "additionalProperties": False},
     [{"location": "Paris", "unit": "celsius"}]),
    ("nested_arrays", {"type": "object", "properties": {"grid": {"type": "array", "items": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}, "maxItems": 2}}, "required": ["grid"]},
     [{"grid": [[True], []]}]),
    ("additional_props_typed", {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 9}, "maxProperties": 2},
     [{}, {"k": 1}]),
    ("unicode_enum", {"enum": ["café", "naïve"]}, ["café"]),
]


@pytest.fixture(scope="module")
def vocab():
    return toy_tokenizer()


@pytest.fixture(scope="module")
def model(vocab):
    assert vocab.vocab_size < MODEL_VOCAB
    return tiny_decoder("llama", vocab_size=MODEL_VOCAB, seed=0)


@pytest.fixture(scope="module")
def greedy(model, vocab):
    ids = torch.zeros(2, 8, dtype=torch.long)
    return S.transform_decoder(GreedyStep(model), (ids,), vocab_size=vocab.vocab_size, dynamic_shapes=({0: BATCH},))


@pytest.fixture(scope="module")
def forced(model, vocab):
    ids, bias = torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, MODEL_VOCAB)
    return S.transform_decoder(
        ForcedStep(model), (ids, bias), vocab_size=vocab.vocab_size, dynamic_shapes=({0: BATCH}, {0: BATCH})
    )


def test_instances_are_valid():
    assert len(SCHEMAS) >= 30
    for name, schema, instances in SCHEMAS:
        jsonschema.Draft202012Validator.check_schema(schema)
        for instance in instances:
            jsonschema.validate(instance, schema), name


def _prefix_accepted(vocab, constraint, text) -> bool:
    compiler = xgr.GrammarCompiler(xgrammar_info(vocab.info), max_threads=1)
    return xgr.GrammarMatcher(compile_grammar(compiler, constraint)).accept_string(text)


@pytest.mark.parametrize("prompt", ["Answer in JSON:", "{"])
def test_generation_validates_or_is_a_valid_prefix(greedy, vocab, prompt, record_property):
    constraints = [S.json_schema(schema) for _, schema, _ in SCHEMAS]
    result = S.generate(greedy, [prompt] * len(SCHEMAS), constraints, 40, tokenizer=vocab)
    validated, prefixes = [], []
    for (name, schema, _), constraint, out in zip(SCHEMAS, constraints, result.outputs):
        assert all(t < vocab.vocab_size for t in out.tokens), (name, out.tokens)  # no padded column
        if out.finish_reason == "stop":
            assert S.validate_output(constraint, out.text) is None, (name, out.text, S.validate_output(constraint, out.text))
            validated.append(name)
        else:
            assert len(out.tokens) == 40
            assert _prefix_accepted(vocab, constraint, out.text), (name, out.text)
            prefixes.append(name)
    print(f"\n{prompt!r}: {len(validated)}/{len(SCHEMAS)} validated, {len(prefixes)} valid prefixes at max tokens: {prefixes}")
    record_property("validated", len(validated))
    record_property("prefix", len(prefixes))
    # Bounded schemas end: unbounded numbers/strings are where a random model runs on.
    assert len(validated) >= len(SCHEMAS) // 2


def _teacher_force(forced, vocab, cases, seed):
    """Drive all ``cases`` (constraint, tokens) in one shuffled, shrinking batch; return steps."""
    runtime = S.StructuredRuntime.for_model(forced, vocab.info, max_rows=len(cases))
    for index, (constraint, _) in enumerate(cases):
        runtime.add(index, constraint)
    rng = random.Random(seed)
    position = [0] * len(cases)
    history = [[vocab.eos_id] * 8 for _ in cases]
    active, steps = list(range(len(cases))), 0
    while active:
        rng.shuffle(active)  # requests change slots between steps
        mask = runtime.step(active)
        needed = [cases[r][1][position[r]] for r in active]
        bias = torch.zeros(len(active), MODEL_VOCAB)
        bias[torch.arange(len(active)), torch.tensor(needed)] = 1e4
        ids = torch.tensor([history[r][-8:] for r in active])
        tokens = forced(ids, bias, logit_mask=mask).tolist()
        for slot, (request, want, got) in enumerate(zip(active, needed, tokens)):
            assert got == want, (
                f"request {request} step {position[request]}: token {want} ({vocab.pieces[want]!r}) was masked; "
                f"the graph chose {got}"
            )
        accepted = runtime.accept_rows(active, tokens)
        assert not accepted.failed, accepted.failed
        done = set(accepted.finished)
        for request, token in zip(active, tokens):
            history[request].append(token)
            position[request] += 1
            assert (request in done) == (position[request] == len(cases[request][1]))
        active = [r for r in active if r not in done]
        steps += 1
    return steps


@pytest.mark.parametrize("compact", [True, False])
def test_teacher_forcing_never_masks_a_needed_token(forced, vocab, compact):
    cases = []
    for _, schema, instances in SCHEMAS:
        for instance in instances:
            text = json.dumps(instance, ensure_ascii=False, **({"separators": (",", ":")} if compact else {}))
            cases.append((S.json_schema(schema, compact=compact), vocab.encode(text) + [vocab.eos_id]))
    cases.append((None, vocab.encode("free text, unconstrained") + [vocab.eos_id]))
    cases.append((S.any_json(), vocab.encode('{"a": [1, 2.5, null]}') + [vocab.eos_id]))
    steps = _teacher_force(forced, vocab, cases, seed=int(compact))
    assert steps == max(len(tokens) for _, tokens in cases)


def test_teacher_forcing_catches_a_wrong_row(forced, vocab):
    """The check has teeth: feeding request A's rows to request B masks B's tokens."""
    runtime = S.StructuredRuntime.for_model(forced, vocab.info, max_rows=2)
    runtime.add("a", S.choice(["yes"]))
    runtime.add("b", S.choice(["no"]))
    mask = runtime.step(["a", "b"]).flip(0)  # rows swapped
    need = [vocab.encode("yes")[0], vocab.encode("no")[0]]
    bias = torch.zeros(2, MODEL_VOCAB)
    bias[torch.arange(2), torch.tensor(need)] = 1e4
    tokens = forced(torch.zeros(2, 8, dtype=torch.long), bias, logit_mask=mask).tolist()
    assert tokens[0] != need[0] and tokens[1] != need[1]
    failed = runtime.accept_rows(["a", "b"], tokens).failed
    assert sorted(failed) == ["a", "b"] and all(isinstance(e, S.DisallowedTokenError) for e in failed.values())
    assert "request 'a'" in str(failed["a"]) and "request 'b'" in str(failed["b"])  # both named, neither lost
    assert runtime.error("a") is failed["a"] and runtime.finished("b")


# ----------------------------------------------------------------------------- options and drafts


def test_validate_output_uses_the_declared_draft():
    draft4 = "http://json-schema.org/draft-04/schema#"
    exclusive = S.json_schema({"$schema": draft4, "type": "number", "minimum": 5, "exclusiveMinimum": True})
    assert S.validate_output(exclusive, "5") is not None  # draft-04: minimum 5 exclusive
    assert S.validate_output(exclusive, "5.5") is None
    tuple_items = S.json_schema({"$schema": "http://json-schema.org/draft-07/schema#", "type": "array",
                                 "items": [{"type": "integer"}, {"type": "string"}], "additionalItems": False}, strict=False)
    assert S.validate_output(tuple_items, '[1, "a"]') is None
    assert S.validate_output(tuple_items, '["a", 1]') is not None  # draft-07 tuple: position 0 is an integer
    assert S.validate_output(tuple_items, '[1, "a", 2]') is not None  # additionalItems: false
    dependencies = S.json_schema({"$schema": draft4, "type": "object", "dependencies": {"card": ["billing"]}})
    assert S.validate_output(dependencies, '{"card": 1}') is not None  # draft-04: card needs billing
    assert S.validate_output(dependencies, '{"card": 1, "billing": 2}') is None
    # no $schema: 2020-12, where a boolean exclusiveMinimum is not even valid and tuple items is prefixItems
    assert S.validate_output(S.json_schema({"type": "array", "prefixItems": [{"type": "integer"}]}), '["a"]') is not None


def _accepts(vocab, constraint, text) -> bool:
    matcher = xgr.GrammarMatcher(compile_grammar(xgr.GrammarCompiler(xgrammar_info(vocab.info), max_threads=1), constraint))
    return matcher.accept_string(text) and matcher.is_completed()


def test_whitespace_and_strict_options(vocab):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}}, "required": ["a", "b"]}
    none, compact, bounded = (S.json_schema(schema, whitespace=w) for w in ("none", "compact", "bounded"))
    assert _accepts(vocab, none, '{"a":1,"b":true}') and not _accepts(vocab, none, '{"a": 1, "b": true}')
    assert _accepts(vocab, compact, '{"a": 1, "b": true}') and not _accepts(vocab, compact, '{"a":1,"b":true}')
    assert _accepts(vocab, bounded, '{ "a":  1,\n "b": true }')
    assert not _accepts(vocab, bounded, '{"a":   1, "b": true}')  # 3 spaces: over the bound of 2
    assert _accepts(vocab, S.json_schema(schema, whitespace="bounded", max_whitespace=4), '{"a":    1, "b": true}')
    assert S.json_schema(schema, compact=False).whitespace == "any" and S.json_schema(schema, compact=True).compact
    assert S.json_schema(schema).whitespace == "compact"  # the default: json.dumps's separators
    extra = '{"a": 1, "b": true, "c": null}'
    assert not _accepts(vocab, S.json_schema(schema), extra) and _accepts(vocab, S.json_schema(schema, strict=False), extra)
    with pytest.raises(S.ConstraintError, match="whitespace='tabs' is not one of"):
        S.json_schema(schema, whitespace="tabs")
    with pytest.raises(S.ConstraintError, match="not both"):
        S.json_schema(schema, whitespace="none", compact=True)


def test_constraint_errors_are_one_clean_line(vocab):
    compiler = xgr.GrammarCompiler(xgrammar_info(vocab.info), max_threads=1)
    for constraint in [S.json_schema({"type": "strin"}), S.regex("(unclosed"), S.ebnf("root ::= undefined_rule")]:
        with pytest.raises(S.ConstraintError) as error:
            compile_grammar(compiler, constraint)
        message = str(error.value)
        assert "\n" not in message and ".cc:" not in message and "/project" not in message, message
        assert not message.startswith("[") and any(fix in message for fix in ("resubmit", "fix the schema",
                                                                              "fix the pattern")), message
