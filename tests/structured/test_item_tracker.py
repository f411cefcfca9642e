"""``uniqueItems`` on the host (``item_plan.py``, ``item_tracker.py``): items compared as JSON Schema
compares them, whatever their spelling; a mask that never lets a duplicate item be written; one step of
lookahead against items only their end could follow; rollback; refusal where a branch decides."""
from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from neuron_constrain import structured as S
from neuron_constrain.structured import engines as E
from neuron_constrain.structured.runtime.jump_forward import canonical_run
from neuron_constrain.testing import force, toy_tokenizer
from tests.conftest import examples

pytestmark = pytest.mark.torch_agnostic(lane="latest")

SETTINGS = settings(max_examples=examples(40), deadline=None, suppress_health_check=list(HealthCheck))
# values with equal twins under JSON Schema's equality (1 and 1.0, key order) and near misses (true vs 1)
VALUES = (1, 1.0, True, 0, False, None, "a", "b", "\u00e9", [1], [1.0], [True], {"a": 1, "b": [2]}, {"b": [2], "a": 1.0})
ITEMS = ({}, {"type": "string"}, {"type": "integer"}, {"type": ["number", "boolean", "null"]},
         {"type": "array", "items": {"type": ["integer", "boolean"]}}, {"type": "object"})


@pytest.fixture(scope="module")
def toy_engines():
    vocabulary = toy_tokenizer()
    return {name: E.make_engine(name, vocabulary) for name in E.ENGINE_CHOICES}


def _spelled(value, rng: random.Random) -> str:
    """``value`` as compact JSON, its strings ASCII-escaped or not and its keys in a random order."""
    def shuffle(v):
        if isinstance(v, dict):
            keys = list(v)
            rng.shuffle(keys)
            return {k: shuffle(v[k]) for k in keys}
        return [shuffle(x) for x in v] if isinstance(v, list) else v
    return json.dumps(shuffle(value), ensure_ascii=rng.random() < 0.5)


@SETTINGS
@given(items=st.sampled_from(ITEMS), array=st.lists(st.sampled_from(VALUES), max_size=4), seed=st.integers(0, 99))
@example(items={}, array=[1, 1.0], seed=0)
@example(items={"type": "object"}, array=[{"a": 1, "b": [2]}, {"b": [2], "a": 1.0}], seed=1)
@example(items={}, array=[True, 1, [True], [1]], seed=0)
def test_items_are_compared_as_json_schema_compares_them(toy_engines, items, array, seed):
    """The tracker refuses exactly the arrays with a repeated item: of what the engine takes without
    uniqueItems (each engine narrows some spellings on its own: llguidance \u00e9, xgrammar 1.0 as an
    integer), it takes what jsonschema calls unique."""
    schema = {"type": "array", "items": items, "uniqueItems": True}
    text = _spelled(array, random.Random(seed))
    valid = jsonschema.Draft202012Validator(schema).is_valid(array)
    for name, engine in toy_engines.items():
        compiled = engine.compile(S.json_schema(schema, strict=False))
        plain = engine.compile(S.json_schema({"type": "array", "items": items}, strict=False))
        assert not compiled.unenforced and compiled.item_checks is not None and plain.item_checks is None
        written = force(engine, plain, engine.tokenizer.encode(text))
        assert force(engine, compiled, engine.tokenizer.encode(text)) == (written and valid), (name, text, valid)


WALKED = {  # small item languages: duplicates are what a random walk writes first
    "strings": {"type": "array", "items": {"type": "string", "pattern": "^[ab]{0,2}$"},
                "maxItems": 4, "uniqueItems": True},
    "integers": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 19}, "maxItems": 5,
                 "uniqueItems": True},
    "nested": {"type": "object", "properties": {"tags": {"type": "array", "items": {
        "type": "array", "items": {"type": "boolean"}, "maxItems": 2}, "maxItems": 3, "uniqueItems": True}},
        "required": ["tags"], "additionalProperties": False},
    "objects": {"type": "array", "items": {"type": "object", "properties": {"x": {"type": "boolean"}},
                                           "additionalProperties": False}, "maxItems": 3, "uniqueItems": True},
}


@pytest.mark.parametrize("name", list(WALKED))
def test_a_walk_under_the_mask_writes_unique_items_only(toy_engines, name):
    """Random tokens among those the mask allows, every one taken by accept_token; each finished
    output is valid (jsonschema), and the walks do write arrays of several items."""
    schema, rng = WALKED[name], random.Random(7)
    validator = jsonschema.Draft202012Validator(schema)
    for engine_name, engine in toy_engines.items():
        compiled = engine.compile(S.json_schema(schema, strict=False, whitespace="none"))
        finished, longest = 0, 0
        for _ in range(30):
            # a dead end deeper than one token ends a walk: the request would fail, never write a duplicate
            matcher = engine.matcher(compiled)
            tokens = random_walk(engine, matcher, rng, 120)
            if matcher.is_terminated():
                finished += 1
                value = json.loads(engine.tokenizer.decode(tokens[:-1]))
                assert validator.is_valid(value), (engine_name, value)
                longest = max(longest, len(json.dumps(value)))
        assert finished >= 20 and longest > 12, (engine_name, finished, longest)


def _unpacked(row: torch.Tensor, size: int) -> torch.Tensor:
    bits = (row.unsqueeze(-1).to(torch.int64) >> torch.arange(32)) & 1
    return bits.flatten()[:size].bool()


def random_walk(engine, matcher, rng, limit: int, *, dead_ends: bool = True) -> list[int]:
    """Tokens drawn at random among those the mask allows, each one taken by ``accept_token``, until the matcher
    ends, ``limit`` tokens, or an empty mask (a dead end: asserted never to happen unless ``dead_ends``)."""
    buffer, tokens = torch.zeros((1, engine.width), dtype=torch.int32), []
    while not matcher.is_terminated() and len(tokens) < limit:
        assert engine.batch_fill([matcher], buffer, [0]) == []
        bits = torch.nonzero(_unpacked(buffer[0], engine.vocab_size)).flatten().tolist()
        assert bits or dead_ends, engine.tokenizer.decode(tokens)
        if not bits:
            break
        token = rng.choice(bits)
        assert matcher.accept_token(token), (engine.name, engine.tokenizer.decode(tokens + [token]))
        tokens.append(token)
    return tokens


def _allows(engine, matcher, text: str) -> bool:
    buffer = torch.zeros((1, engine.width), dtype=torch.int32)
    assert engine.batch_fill([matcher], buffer, [0]) == []
    token = engine.tokenizer.encode(text)
    assert len(token) == 1, text
    return bool(_unpacked(buffer[0], engine.vocab_size)[token[0]])


def _after(engine, compiled, prefix: str):
    matcher = engine.matcher(compiled)
    for token in [engine.tokenizer.encode(c)[0] for c in prefix]:  # byte by byte: every state is reached
        assert matcher.accept_token(token), prefix
    return matcher


@pytest.mark.parametrize("schema, prefix, refused, allowed", [
    # "ab" again would leave only its closing quote (maxLength 2): refused one step early
    ({"type": "array", "items": {"type": "string", "maxLength": 2}, "uniqueItems": True}, '["ab","a', "b", "c"),
    # 15 again: no digit may follow it under the maximum, only its end
    ({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 19}, "uniqueItems": True}, "[15,1", "5", "4"),
    # a literal's first letter is as good as the literal
    ({"type": "array", "items": {"type": ["boolean", "integer"]}, "uniqueItems": True}, "[true,", "t", "f"),
    # a whole item in one token
    ({"type": "array", "items": {"type": "string"}, "uniqueItems": True}, '["red",', '"red"', '"blue"'),
])
def test_an_item_only_its_end_could_follow_is_not_started(toy_engines, schema, prefix, refused, allowed):
    for name, engine in toy_engines.items():
        compiled = engine.compile(S.json_schema(schema, strict=False, whitespace="none"))
        matcher = _after(engine, compiled, prefix)
        assert not _allows(engine, matcher, refused), (name, prefix, refused)
        assert _allows(engine, matcher, allowed), (name, prefix, allowed)


def test_rollback_and_forced_text_keep_the_tracker_in_step(toy_engines):
    schema = {"type": "array", "items": {"type": "string", "pattern": "^abc$"}, "uniqueItems": True}
    engine = toy_engines["auto"]
    compiled = engine.compile(S.json_schema(schema, strict=False, whitespace="none"))
    matcher = _after(engine, compiled, '["abc",')
    # the grammar forces "abc" again: the forced run stops before the token that would close it
    run = canonical_run(engine, matcher, 8, torch.zeros((1, engine.width), dtype=torch.int32))
    assert engine.tokenizer.decode(run) in ('"', '"a', '"ab', '"abc')
    before = torch.zeros((1, engine.width), dtype=torch.int32)
    engine.batch_fill([matcher], before, [0])
    for token in engine.tokenizer.encode('"ab'):
        assert matcher.accept_token(token)
    assert not _allows(engine, matcher, "c")  # the duplicate is refused: a dead end, never written
    matcher.rollback(len(engine.tokenizer.encode('"ab')))
    again = torch.zeros((1, engine.width), dtype=torch.int32)
    engine.batch_fill([matcher], again, [0])
    assert torch.equal(before, again)


def test_tracked_and_plain_matchers_fill_and_accept_in_one_batch(toy_engines):
    engine = toy_engines["auto"]
    tracked = engine.compile(S.json_schema({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}))
    plain = engine.compile(S.json_schema({"type": "array", "items": {"type": "integer"}}))
    matchers = [engine.matcher(c) for c in (tracked, plain, tracked)]
    tokens = engine.tokenizer.encode("[7, 7")
    for token in tokens[:-1]:
        assert engine.batch_accept(matchers, [token] * 3) == [True] * 3
    rows = torch.zeros((3, engine.width), dtype=torch.int32)
    assert engine.batch_fill(matchers, rows, [0, 1, 2]) == []
    last = tokens[-1]
    assert [bool(_unpacked(rows[i], engine.vocab_size)[last]) for i in range(3)] == [True, True, True]
    assert engine.batch_accept(matchers, [last] * 3) == [True, True, True]
    comma = engine.tokenizer.encode(",")[0]
    assert engine.batch_accept(matchers, [comma] * 3) == [False, True, False]  # 7 ends as a duplicate


CONTAINS = {  # counted on the host: each item judged by jsonschema, the bracket refused until enough are taken
    "nested contains": ({"type": "array", "items": {"type": "array"}, "contains": {"contains": {"const": 42}}},
                        [[[42]], [[1], [2, 42]]], [[], [[1]], [[1], [2]]]),
    "min and max": ({"type": "array", "contains": {"type": "string"}, "minContains": 2, "maxContains": 3},
                    [["a", "b"], [1, "a", "b", "c"]], [["a"], ["a", "b", "c", "d"], [1, 2]]),
    "beside uniqueItems": ({"type": "array", "items": {"type": "integer"}, "contains": {"minimum": 5}, "uniqueItems": True},
                           [[5], [1, 7]], [[5, 5], [1, 2], []]),
}


@pytest.mark.parametrize("name", list(CONTAINS))
def test_contains_is_counted_item_by_item(toy_engines, name):
    schema, valid, invalid = CONTAINS[name]
    for engine_name, engine in toy_engines.items():
        compiled = engine.compile(S.json_schema(schema, strict=False))
        assert compiled.item_checks is not None and not compiled.unenforced
        for instance in valid + invalid:
            accepted = force(engine, compiled, engine.tokenizer.encode(json.dumps(instance)))
            assert accepted == (instance in valid), (engine_name, instance)


def test_a_full_array_is_not_filled_with_items_its_contains_refuses(toy_engines):
    """maxItems 20 (past the algebra's positions), contains 7: after 19 other items the last must be 7
    (closing then would be refused)."""
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 20,
              "contains": {"const": 7}}
    for name, engine in toy_engines.items():
        compiled = engine.compile(S.json_schema(schema, strict=False, whitespace="none"))
        assert compiled.item_checks is not None, name
        matcher = _after(engine, compiled, "[" + "3," * 19)
        assert _allows(engine, matcher, "7") and not _allows(engine, matcher, "4"), name


@pytest.mark.parametrize("schema, pointer", [
    ({"anyOf": [{"type": "array", "uniqueItems": True}, {"type": "array", "maxItems": 3}]}, "#/anyOf/0/uniqueItems"),
    # a name nothing declares may or may not match the pattern
    ({"type": "object", "patternProperties": {"^t": {"type": "array", "uniqueItems": True}}},
     "#/patternProperties/^t/uniqueItems"),
    # in the second branch `t` is any value
    ({"type": "object", "anyOf": [{"properties": {"t": {"type": "array", "uniqueItems": True}}, "required": ["t"]},
                                  {"required": ["u"]}]}, "#/anyOf/0/properties/t/uniqueItems"),
], ids=["anyOf", "pattern-beside", "open-branch"])
def test_uniqueness_a_branch_decides_is_refused_by_name(toy_engines, schema, pointer):
    with pytest.raises(S.ConstraintError) as info:
        toy_engines["auto"].compile(S.json_schema(schema, strict=False))
    assert f"`uniqueItems` at {pointer}" in str(info.value) and "tracker" in str(info.value), str(info.value)


def test_a_token_no_json_could_take_is_refused_not_raised(toy_engines):
    engine = toy_engines["auto"]
    compiled = engine.compile(S.json_schema({"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
                                            whitespace="none"))
    matcher = _after(engine, compiled, "[1]")
    assert not matcher.accept_token(engine.tokenizer.encode("]")[0])  # closes nothing: refused, the state kept
    assert matcher.accept_token(engine.stop_token_ids[0]) and matcher.is_terminated()
