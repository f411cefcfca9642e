"""``auto``'s race (``engines/race.py``, ``AutoEngine._race``): the first masks from llguidance, the rest from
xgrammar once its grammar is ready and takes the prefix; and one preparation per compile on every route.

xgrammar's grammar is handed over at a fill the test chooses (``ReadyAfter``: a future that turns ready on
its n-th poll, and the racing matcher polls once per fill), so every move here happens at a known token.
"""
from __future__ import annotations

import concurrent.futures
import functools
import json
import random

import jsonschema
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from neuron_constrain import structured as S
from neuron_constrain.structured import engines as E
from neuron_constrain.structured.engines.race import RacingMatcher
from neuron_constrain.structured.runtime.jump_forward import canonical_run
from neuron_constrain.structured.schema.prepare import STEPS
from neuron_constrain.testing import toy_tokenizer
from tests.conftest import examples

pytestmark = pytest.mark.torch_agnostic

VOCAB = toy_tokenizer()
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
SCHEMAS = [  # both engines exact on each (no narrowing): the race runs
    PERSON,
    {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "integer", "minimum": 0},
                                               "uniqueItems": True, "maxItems": 3}}, "required": ["tags"]},  # tracked
    {"anyOf": [{"type": "integer"}, {"type": "boolean"}]},
]


class ReadyAfter(concurrent.futures.Future):
    """xgrammar's grammar, ready from the ``polls``-th call of ``done()`` on (compiled then, on this thread)."""

    def __init__(self, compile, polls: int):
        super().__init__()
        self._compile, self._polls = compile, polls

    def done(self) -> bool:
        self._polls -= 1
        if self._polls <= 0 and not super().done():
            self.set_result(self._compile())
        return super().done()


@functools.lru_cache(maxsize=None)
def _auto() -> E.AutoEngine:
    return E.AutoEngine(VOCAB)  # one for the module (llguidance's tokenizer is built once)


def held_race(polls: int) -> E.AutoEngine:
    """auto on the toy vocabulary whose xgrammar grammars turn ready at the ``polls``-th poll: one by ``_race``
    itself, one by ``matcher``, then one per fill; its counters reset."""
    engine = _auto()
    engine.counts.clear()
    xgrammar = engine.xgrammar
    xgrammar.compile_later = lambda prepared, policy=None: ReadyAfter(
        lambda: xgrammar.compile(prepared, policy=policy), polls)
    return engine


def _mask(matcher) -> torch.Tensor:
    buffer = torch.zeros((1, -(-VOCAB.vocab_size // 32)), dtype=torch.int32)
    matcher.fill_next_token_bitmask(buffer, 0)
    return buffer[0].clone()


def test_first_masks_from_llguidance_then_xgrammar_and_the_move_is_recorded():
    """Before the move every row is llguidance's own, after it xgrammar's own (they differ in the text the grammar
    forces: llguidance allows its canonical token only); the matcher, the engine's counters and a later request
    say so."""
    moves_at = 4
    engine = held_race(polls=2 + moves_at + 1)  # ready at the fill after 4 accepted tokens
    constraint = S.json_schema(PERSON)
    compiled = engine.compile(constraint)
    assert compiled.engine == "llguidance" and compiled.engines == ("llguidance", "xgrammar")
    matcher = engine.matcher(compiled)
    assert type(matcher) is RacingMatcher
    alone = {name: E.make_engine(name, VOCAB) for name in ("llguidance", "xgrammar")}
    references = {name: e.matcher(e.compile(constraint)) for name, e in alone.items()}
    tokens = VOCAB.encode('{"name": "Ada", "age": 36}') + [VOCAB.eos_id]
    differed = {"llguidance": 0, "xgrammar": 0}
    for position, token in enumerate(tokens):
        row, own = _mask(matcher), {name: _mask(m) for name, m in references.items()}
        serving = "llguidance" if position < moves_at else "xgrammar"
        assert torch.equal(row, own[serving]), (position, serving)
        differed[serving] += not torch.equal(own["llguidance"], own["xgrammar"])
        assert matcher.accept_token(token) and all(m.accept_token(token) for m in references.values())
    assert differed["llguidance"] and differed["xgrammar"], "no row told the engines apart"
    assert matcher.is_terminated() and matcher.engines == ("llguidance", "xgrammar") and matcher.moved_at == moves_at
    assert engine.served(matcher) == (("llguidance", "xgrammar"), moves_at)
    assert engine.counts["races"] == 1 and engine.counts["moved"] == 1
    later = engine.matcher(compiled)  # the race is over: a new request starts on xgrammar
    assert type(later) is not RacingMatcher and engine.served(later) == (("xgrammar",), None)


def test_a_narrowed_grammar_never_takes_over_a_prefix_it_refuses():
    """xgrammar writes a bounded string past 64 characters without escapes (it would refuse ``"\\"``): auto serves
    it on llguidance without a race; and a racing matcher offered that narrowed grammar after ``"\\`` stays put."""
    schema = {"type": "string", "maxLength": 100}
    engine = E.AutoEngine(VOCAB)
    compiled = engine.compile(S.json_schema(schema))
    assert compiled.engine == "llguidance" and compiled.successor is None
    narrowed = engine.xgrammar.compile(S.json_schema(schema), policy="refuse")
    assert narrowed.narrowed == ("#",)
    for text, moves in (('"\\', False), ('"a', True)):
        ready = concurrent.futures.Future()
        matcher = RacingMatcher(engine.llguidance.matcher(compiled), "llguidance", ready, engine.xgrammar.matcher,
                                "xgrammar")
        for token in VOCAB.encode(text):
            _mask(matcher)
            assert matcher.accept_token(token)
        ready.set_result(narrowed)
        _mask(matcher)
        assert matcher.engines == (("llguidance", "xgrammar") if moves else ("llguidance",)) and not matcher.racing
        if not moves:  # still llguidance's: the escaped quote and the string end here
            for token in VOCAB.encode('""') + [VOCAB.eos_id]:
                assert matcher.accept_token(token)
            assert matcher.is_terminated()


def test_rollback_and_jump_forward_across_the_move():
    """Tokens accepted before the move roll back on the engine that took over; jump-forward's look-ahead leaves
    the state as it was and finds xgrammar's forced text after the move."""
    engine = held_race(polls=2 + 6 + 1)
    matcher = engine.matcher(engine.compile(S.json_schema(PERSON)))
    tokens = VOCAB.encode('{"name": "Ada", "age": 36}')
    for token in tokens[:6]:
        _mask(matcher)
        assert matcher.accept_token(token)
    assert matcher.engines == ("llguidance",)
    after = _mask(matcher)  # the move
    assert matcher.engines == ("llguidance", "xgrammar") and matcher.moved_at == 6
    matcher.rollback(4)
    for token in tokens[2:6]:
        _mask(matcher)
        assert matcher.accept_token(token)
    assert torch.equal(_mask(matcher), after)
    name = len(VOCAB.encode('{"name": "Ada"'))
    for token in tokens[6:name]:
        _mask(matcher)
        assert matcher.accept_token(token)
    before = _mask(matcher)
    run = canonical_run(engine, matcher, 8, torch.zeros_like(before).unsqueeze(0))
    assert torch.equal(_mask(matcher), before)  # look-ahead undone
    written = VOCAB.decode(tokens[:name]) + VOCAB.decode(run)  # xgrammar's forced text: the next key
    assert '"age":' in VOCAB.decode(run) and '{"name": "Ada", "age": 36}'.startswith(written.rstrip()), written
    for token in run:
        assert matcher.accept_token(token)
    with pytest.raises(ValueError, match="rollback"):
        matcher.rollback(len(tokens) + 99)


@settings(max_examples=examples(30), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(index=st.integers(0, len(SCHEMAS) - 1), polls=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_random_walks_across_the_move_end_valid(index, polls, seed):
    """A random walk under the masks, xgrammar's grammar ready at a drawn fill: every finished output is valid
    (``jsonschema``), and a walk that outlived the hand-over was moved (both engines exact: the prefix is taken)."""
    schema = SCHEMAS[index]
    engine = held_race(polls)
    matcher = engine.matcher(engine.compile(S.json_schema(schema)))
    rng, tokens = random.Random(seed), []
    for _ in range(60):
        row = _mask(matcher)
        bits = np.flatnonzero(np.unpackbits(row.numpy().view(np.uint8), bitorder="little")[: VOCAB.vocab_size]).tolist()
        assert bits, (schema, VOCAB.decode(tokens))
        if VOCAB.eos_id in bits and (len(tokens) > 20 or rng.random() < 0.3):
            token = VOCAB.eos_id
        else:
            token = rng.choice([t for t in bits if t != VOCAB.eos_id] or bits)
        assert matcher.accept_token(token)
        tokens.append(token)
        if matcher.is_terminated():
            break
    if matcher.is_terminated():
        jsonschema.validate(json.loads(VOCAB.decode(tokens[:-1])), schema)
    fill = polls - 2  # the fill at which xgrammar's grammar turns ready (0: before the matcher was made)
    if fill <= 0:
        assert engine.served(matcher) == (("xgrammar",), None)
    elif len(tokens) >= fill:  # one fill per token
        assert engine.served(matcher) == (("llguidance", "xgrammar"), fill - 1), (schema, VOCAB.decode(tokens))


def test_generate_records_the_engines_and_the_move():
    from neuron_constrain.decoding import export_decoder
    from neuron_constrain.testing import tiny_decoder

    decoder = export_decoder(tiny_decoder("llama", vocab_size=VOCAB.vocab_size), max_batch=2, max_len=64,
                             vocab_size=VOCAB.vocab_size)
    runtime = S.StructuredRuntime(VOCAB, max_rows=2, compile_isolation="thread")
    xgrammar = runtime.engine.xgrammar
    xgrammar.compile_later = lambda prepared, policy=None: ReadyAfter(
        lambda: xgrammar.compile(prepared, policy=policy), 2 + 3 + 1)
    with runtime:
        result = S.generate(decoder, ["A person:", "Pick:"], [S.json_schema(PERSON), S.json_schema({"maxLength": 80})],
                            40, tokenizer=VOCAB, runtime=runtime)
    person, short = result.outputs
    assert person.engines == ("llguidance", "xgrammar") and person.moved_at == 3, (person.engines, person.text)
    assert short.engines == ("llguidance",) and short.moved_at is None  # narrowed on xgrammar: no race
    for out, schema in zip(result.outputs, (PERSON, {"maxLength": 80})):
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), schema)


# --------------------------------------------------------------------------- one preparation per compile
ROUTES = {  # name -> (engine options, constraint, the engines whose view it reads)
    "auto to xgrammar": ({"race": False}, S.json_schema(PERSON), ("xgrammar",)),
    "auto racing": ({}, S.json_schema(PERSON), ("xgrammar", "llguidance")),
    "auto to llguidance": ({}, S.json_schema({"type": "object", "properties": {"x": {"type": "number", "multipleOf": 0.5}}}),
                           ("xgrammar", "llguidance")),
    "the narrowed fallback order": ({}, S.json_schema({"maxLength": 300}), ("xgrammar", "llguidance")),
    "allow": ({}, S.json_schema({"anyOf": [{"type": "array", "contains": {"type": "string"}, "minContains": 2},
                                           {"type": "array", "maxItems": 40}]}, unenforced="allow"),
              ("xgrammar", "llguidance")),
}


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_each_preparation_step_runs_once_per_compile(route):
    options, constraint, views = ROUTES[route]
    engine = E.AutoEngine(VOCAB, **options)
    before = STEPS.copy()
    compiled = engine.compile(constraint)
    ran = {step: STEPS[step] - before[step] for step in STEPS}
    assert {step: ran.get(step, 0) for step in ("limits", "satisfiable", "algebra")} == \
        {"limits": 1, "satisfiable": 1, "algebra": 1}, ran
    assert ran.get("engine_rewrites", 0) == ran.get("item_plan", 0) == len(views), (route, ran, compiled.engine)
    if compiled.successor is not None:
        compiled.successor.result()  # xgrammar's compile of the same prepared form: no step again
        assert {step: STEPS[step] - before[step] for step in STEPS} == ran
    if route == "allow":
        assert compiled.unenforced, "the allow route compiles with what it does not enforce listed"


# --------------------------------------------------------------------------- the public API through the move of rooms
PUBLIC = ['Accepted', 'BatchLayoutError', 'Constraint', 'ConstraintError', 'DisallowedTokenError', 'GenerateResult',
          'Generation', 'GrammarFailedError', 'GrammarFillError', 'NoAllowedTokenError', 'Reasoning',
          'RequestFailedError', 'StructuredOutputsDisabledError', 'StructuredRuntime', 'TOOL_FORMATS', 'Tokenizer',
          'TokenizerInfoError', 'TokenizerLike', 'ToolCall', 'VocabularyInfo', 'WHITESPACE', 'any_json', 'audit',
          'choice', 'ebnf', 'from_huggingface', 'from_mistral', 'generate', 'json_schema', 'mistral_data_file',
          'parse_tool_calls', 'regex', 'tool_constraint', 'transform_decoder', 'validate_output']  # 0.1.0's names


def test_the_documented_public_names_still_resolve():
    """``neuron_constrain.structured``'s names of 0.1.0 are all still there, each the object it documents (a
    function, not a submodule of the same name: ``structured.generate`` is the function)."""
    import inspect

    assert set(PUBLIC) <= set(S.__all__)
    for name in PUBLIC:
        assert not inspect.ismodule(getattr(S, name)), name
    assert S.generate.__module__ == "neuron_constrain.structured.runtime.generate"
    assert E.make_engine("auto", VOCAB).name == "auto" and callable(E.AutoEngine)
