"""Jump-forward on the host: forced runs found by the runtime, laid out as rows that allow
exactly their token, accepted as runs. (Decoding them through a verify program:
tests/decoding/test_jump_forward.py.)"""
from __future__ import annotations


import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from neuron_constrain import structured as S
from neuron_constrain.kernels import unpack_bitmask
from neuron_constrain.structured import engines as E
from neuron_constrain.structured.runtime.jump_forward import single_token
from neuron_constrain.testing import toy_tokenizer

# what this file checks is host-side, the same on every torch: the main lane runs it (see the torch_agnostic marker)
pytestmark = pytest.mark.torch_agnostic

VOCAB = toy_tokenizer()
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}}, "required": ["name", "age", "ok"]}
CONSTRAINTS = [S.json_schema(SCHEMA), S.choice(["x"]), S.regex(r"ab[0-9]c"), S.json_schema({"enum": ["alpha", "beta"]}),
               S.ebnf('root ::= "(" [0-9] ")"')]


def _allowed(row: torch.Tensor) -> list[int]:
    return unpack_bitmask(row, VOCAB.vocab_size).nonzero().flatten().tolist()


@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=5), st.integers(0, 4 * 32 - 1))
def test_property_single_token_finds_exactly_one_bit(extra, token):
    words = torch.zeros(4, dtype=torch.int32).numpy()
    assert single_token(words) is None
    words.view("uint32")[token >> 5] = 1 << (token & 31)
    assert single_token(words) == token
    for value in extra:
        other = words.copy()
        other.view("uint32")[(token >> 5) ^ 1] |= value
        assert single_token(other) == (token if value == 0 else None)


@pytest.mark.parametrize("engine", E.ENGINES)
@pytest.mark.parametrize("constraint", CONSTRAINTS, ids=lambda c: c.describe()[:20])
def test_exact_runs_are_what_step_by_step_would_be_forced_to(engine, constraint):
    """Each exact run is a prefix of the only continuation: every position's mask allows
    exactly that token, and the position after the run allows more than one (or the run ended
    the grammar); the grammar is left where it was."""
    runtime = S.StructuredRuntime(VOCAB, max_rows=8, engine=engine, jump_forward="exact")
    probe = E.make_engine(engine, VOCAB)
    compiled = probe.compile(constraint)
    try:
        runtime.add("r", constraint)
        runtime.wait(["r"])
        before = runtime.step(["r"]).clone()
        history: list[int] = []
        for _ in range(80):
            run = runtime.forced_runs(["r"], 16).get("r", [])
            assert torch.equal(runtime.step(["r"]), before) or history, "forced_runs moved the grammar"
            fresh = probe.matcher(compiled)
            for token in history:
                assert fresh.accept_token(token)
            one = torch.zeros((1, probe.width), dtype=torch.int32)
            for token in run:
                fresh.fill_next_token_bitmask(one, 0)
                assert _allowed(one[0]) == [token]
                assert fresh.accept_token(token)
            if run and run[-1] == VOCAB.eos_id:  # the run ends the grammar: taking it finishes the request
                assert fresh.is_terminated() and runtime.accept("r", run)
                break
            fresh.fill_next_token_bitmask(one, 0)
            allowed = _allowed(one[0])
            assert len(allowed) > 1 or (not run and len(allowed) == 1 and len(run) == 16), (run, allowed)
            # the model's choice: the first allowed token, or the stop token when it may stop
            choice = VOCAB.eos_id if VOCAB.eos_id in allowed else allowed[len(history) % len(allowed)]
            finished = runtime.accept("r", run + [choice])
            history += run + [choice]
            if finished:
                break
        assert runtime.finished("r"), VOCAB.decode(history)
    finally:
        runtime.close()
        probe.close()


def test_a_single_character_choice_is_forced_to_its_end_and_finishes():
    runtime = S.StructuredRuntime(VOCAB, max_rows=4, jump_forward="exact")
    runtime.add("x", S.choice(["x"]))
    runtime.wait(["x"])
    runs = runtime.forced_runs(["x"], 7)
    assert runs == {"x": [VOCAB.encode("x")[0], VOCAB.eos_id]}  # the stop token ends the run, nothing after
    mask = runtime.step(["x"], runs, forced=True, rows_per_request=4)
    assert [_allowed(row) for row in mask] == [[VOCAB.encode("x")[0]], [VOCAB.eos_id], [VOCAB.eos_id],
                                               list(range(VOCAB.vocab_size))]  # run, after it (stop only), padding
    result = runtime.accept_runs(["x"], [runs["x"]])
    assert result.finished == ["x"] and not result.failed


@pytest.mark.parametrize("engine", E.ENGINES)
def test_forced_rows_allow_only_their_token_then_the_grammar_and_pad_the_bucket(engine):
    runtime = S.StructuredRuntime(VOCAB, max_rows=12, engine=engine, jump_forward="canonical")
    try:
        for request_id, constraint in (("a", S.json_schema(SCHEMA)), ("free", None), ("b", S.regex(r"ab[0-9]c"))):
            runtime.add(request_id, constraint)
        runtime.wait(["a", "b"])
        batch = ["a", "free", "b"]
        runs = runtime.forced_runs(batch, 3)
        assert "free" not in runs and runs, runs  # an unconstrained request is never forced
        assert all(len(run) <= 3 and VOCAB.eos_id not in run for run in runs.values())
        mask = runtime.step(batch, runs, forced=True, rows_per_request=4)
        assert mask.shape == (12, runtime.width)
        for position, request_id in enumerate(batch):
            rows = mask[4 * position: 4 * position + 4]
            run = runs.get(request_id, [])
            if request_id == "free":
                assert bool((rows == -1).all())
                continue
            for i, token in enumerate(run):
                assert _allowed(rows[i]) == [token]
            after = _allowed(rows[len(run)])
            assert after and len(after) < VOCAB.vocab_size  # the grammar's own row after the run
            assert all(bool((rows[i] == -1).all()) for i in range(len(run) + 1, 4))  # padding
        tokens = [runs.get(r, []) + [_allowed(mask[4 * p + len(runs.get(r, []))])[0]] for p, r in enumerate(batch)]
        result = runtime.accept_runs(batch, tokens)
        assert not result.failed, result.failed
        for request_id, constraint in (("a", S.json_schema(SCHEMA)), ("b", S.regex(r"ab[0-9]c"))):
            fresh = runtime.engine.matcher(runtime.engine.compile(constraint))  # replay: the same state
            assert all(fresh.accept_token(t) for t in tokens[batch.index(request_id)])
            want = torch.zeros((1, runtime.width), dtype=torch.int32)
            fresh.fill_next_token_bitmask(want, 0)
            assert torch.equal(runtime.step([request_id])[0], want[0])
    finally:
        runtime.close()


def test_canonical_runs_tokenize_the_forced_text_and_keep_the_last_token_back():
    """llguidance and xgrammar give the same canonical run for forced JSON keys (tokenized after
    an anchor; the last token, which may merge with what the model writes next, held back, then
    the exact run from there), never shorter than the exact run from the same state."""
    runs = {}
    for engine in E.ENGINES:
        for mode in ("exact", "canonical"):
            runtime = S.StructuredRuntime(VOCAB, max_rows=2, engine=engine, jump_forward=mode)
            runtime.add("a", S.json_schema(SCHEMA))
            runtime.wait(["a"])
            runs[engine, mode] = runtime.forced_runs(["a"], 16).get("a", [])
            assert runtime.forced_seconds("a") > 0
            runtime.close()
        assert len(runs[engine, "canonical"]) >= len(runs[engine, "exact"]), (engine, runs)
    runs = {engine: runs[engine, "canonical"] for engine in E.ENGINES}
    text = VOCAB.decode(runs["xgrammar"])
    assert '{"name": "'.startswith(text) and text, text
    assert runs["xgrammar"] == runs["llguidance"], {k: VOCAB.decode(v) for k, v in runs.items()}


def test_bad_forced_runs_and_buckets_are_refused():
    runtime = S.StructuredRuntime(VOCAB, max_rows=8, jump_forward="exact")
    runtime.add("a", S.regex("ab"))
    runtime.wait(["a"])
    with pytest.raises(S.BatchLayoutError, match="forced token"):
        runtime.step(["a"], {"a": [VOCAB.encode("z")[0]]}, forced=True, rows_per_request=2)
    with pytest.raises(S.BatchLayoutError, match="at most 1 drafts"):
        runtime.step(["a"], {"a": [1, 2]}, forced=True, rows_per_request=2)
    with pytest.raises(ValueError, match="jump_forward='fast'"):
        S.StructuredRuntime(VOCAB, max_rows=1, jump_forward="fast")
    assert S.StructuredRuntime(VOCAB, max_rows=1).forced_runs(["a"], 4) == {}  # off: nothing forced (unknown ids unread)
