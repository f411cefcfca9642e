"""Reasoning in the library: ``generate(..., reasoning=Reasoning(...))`` on real tokenizers with
``<think>`` / ``</think>`` added (the tiny checkpoint's Mistral tokenizer, SmolLM2's), KV-cached
tiny decoders. A thought is free (or its own grammar's), a budget of N gives exactly N thought
tokens then the end marker, the answer's grammar starts after it; jump-forward and draft rows
cross the boundary; ``ReasoningMatcher``'s accept / rollback against a replay from scratch."""
from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import examples
from neuron_constrain import structured as S
from neuron_constrain.decoding import export_decoder
from neuron_constrain.kernels import unpack_bitmask
from neuron_constrain.structured.engines import make_engine
from neuron_constrain.structured.engines.base import encode_continuation
from neuron_constrain.structured.runtime.reasoning import Reasoning, ReasoningMatcher
from neuron_constrain.testing import tiny_decoder
from neuron_constrain.testing.tiny_checkpoint import add_think_tokens, tokenizer

THINK, END = 32002, 32003  # the tiny checkpoint's markers
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                         "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
REGEX = r"[a-z]{3,8}@[a-z]{2,5}\.com"


@functools.lru_cache(maxsize=None)
def tiny_think():
    """(Hugging Face tokenizer, library tokenizer, KV-cached decoder with 1/2/4/8-token steps)."""
    hf = tokenizer(reasoning=True)
    tok = S.from_huggingface(hf)
    model = tiny_decoder("llama", vocab_size=32 * -(-tok.vocab_size // 32) + 32)
    decoder = export_decoder(model, max_batch=4, max_len=160, vocab_size=tok.vocab_size, pad_id=tok.eos_id,
                             new_tokens=(1, 2, 4, 8))
    return hf, tok, decoder


def _prompts(hf, n: int) -> list[list[int]]:
    """Chat prompts that open the thought (the template ends in ``<think>``), different per request."""
    return [hf.apply_chat_template([{"role": "user", "content": f"Question {i}?"}], add_generation_prompt=True,
                                   tokenize=True, return_dict=False) for i in range(n)]


CONSTRAINTS = [S.json_schema(SCHEMA, whitespace="none"), S.regex(REGEX), S.choice(["yes", "no", "maybe"]), None]


@pytest.mark.parametrize("budget", [0, 3, 7])
def test_a_budget_of_n_gives_n_thought_tokens_the_end_marker_then_a_valid_answer(budget):
    hf, tok, decoder = tiny_think()
    prompts = _prompts(hf, 4)
    assert all(p[-1] == THINK for p in prompts)
    result = S.generate(decoder, prompts, CONSTRAINTS, 48, tokenizer=tok, reasoning=Reasoning(budget=budget))
    for constraint, out in zip(CONSTRAINTS, result.outputs):
        assert END not in out.tokens[:budget] and out.tokens[budget] == END, out.tokens  # the random model never ends it
        assert out.reasoning == tok.decode(out.tokens[:budget])
        body = out.tokens[budget + 1:-1] if out.finish_reason == "stop" else out.tokens[budget + 1:]
        assert out.text == tok.decode(body)
        if constraint is not None:
            assert out.finish_reason == "stop", (constraint.describe(), out.tokens)
            assert S.validate_output(constraint, out.text) is None, (constraint.describe(), out.text)
    # without reasoning the same requests are constrained from the first token: the JSON starts at once
    plain = S.generate(decoder, prompts[:1], CONSTRAINTS[:1], 48, tokenizer=tok).outputs[0]
    assert plain.reasoning is None and plain.text.startswith('{"name":')


def test_jump_forward_takes_the_forced_end_marker_and_stays_token_identical():
    """The spent budget's end marker is a one-token row: jump-forward decodes it (and what the answer's
    grammar forces after it) inside a verify step, with the same tokens as step by step."""
    hf, tok, decoder = tiny_think()
    prompts, reasoning = _prompts(hf, 3), Reasoning(budget=4)
    constraints = [S.choice(["maybe"]), S.json_schema(SCHEMA, whitespace="none"), S.regex(REGEX)]
    # one engine: auto's race may move a request at another token in each run (both valid, not identical)
    step = S.generate(decoder, prompts, constraints, 40, tokenizer=tok, reasoning=reasoning, engine="xgrammar")
    jumped = S.generate(decoder, prompts, constraints, 40, tokenizer=tok, reasoning=reasoning, jump_forward="exact",
                        engine="xgrammar")
    for a, b in zip(step.outputs, jumped.outputs):
        assert a.tokens == b.tokens and a.text == b.text and a.reasoning == b.reasoning
        assert b.forced_tokens >= 1 and b.forward_passes < a.forward_passes
    # the end marker (the budget's) and EOS after "maybe" are forced, each decoded in the pass of the token after it
    maybe = jumped.outputs[0]
    assert maybe.text == "maybe" and maybe.tokens[4] == END and maybe.forced_tokens == 2
    assert maybe.forward_passes == len(maybe.tokens) - maybe.forced_tokens


def test_a_thought_grammar_ends_the_thought_early_and_the_answer_is_constrained_from_there():
    hf, tok, decoder = tiny_think()
    thought = S.choice(["hmm", "let me see"])
    result = S.generate(decoder, _prompts(hf, 2), [S.json_schema(SCHEMA, whitespace="none"), S.choice(["no"])], 48,
                        tokenizer=tok, reasoning=Reasoning(budget=30, thought=thought))
    for out in result.outputs:
        assert out.reasoning in ("hmm", "let me see") and out.finish_reason == "stop"
        assert len(out.tokens[:out.tokens.index(END)]) < 30  # ended by its grammar, not the budget
    assert S.validate_output(S.json_schema(SCHEMA), result.outputs[0].text) is None and result.outputs[1].text == "no"


def test_a_prompt_that_closed_its_thought_and_grammar_in_thought():
    """A prompt ending after ``</think>`` has no thought left: the grammar holds from the first token;
    so does ``grammar_in_thought=True`` (vLLM's ``enable_in_reasoning``) on an opened thought."""
    hf, tok, decoder = tiny_think()
    opened = _prompts(hf, 1)[0]
    closed = opened + tok.encode("fine") + [END]
    for prompt, reasoning in ((closed, Reasoning(budget=2)), (opened, Reasoning(grammar_in_thought=True))):
        (out,) = S.generate(decoder, [prompt], [S.choice(["yes", "no"])], 8, tokenizer=tok, reasoning=reasoning).outputs
        assert out.reasoning is None and out.text in ("yes", "no") and END not in out.tokens
    with pytest.raises(ValueError, match="grammar_in_thought"):
        Reasoning(grammar_in_thought=True, budget=3)
    with pytest.raises(ValueError, match="budget"):
        Reasoning(budget=-1)


def test_draft_rows_across_the_end_of_the_thought():
    """Drafts that finish the thought and start the answer: each draft row is the request's matcher
    after the drafts before it (free, the forced end marker, the answer's grammar), and the step
    leaves the request where it was."""
    hf, tok, _ = tiny_think()
    with S.StructuredRuntime(tok, max_rows=8) as runtime:
        prompt = _prompts(hf, 1)[0]
        runtime.add("r", S.choice(["yes", "no"]), reasoning=Reasoning(budget=2), prompt=prompt)
        runtime.wait(["r"])
        yes = encode_continuation(tok.encode, "yes")  # as the answer's first tokens (no sentencepiece space)
        a, b = tok.encode("hello world")[:2]
        drafts = [a, b, END, *yes]
        rows = unpack_bitmask(runtime.step(["r"], {"r": drafts}).clone(), tok.vocab_size)
        assert rows[0].all() and rows[1].all()  # a free thought
        assert rows[2].nonzero().flatten().tolist() == [END]  # the budget spent: the end marker only
        assert rows[3, yes[0]] and not rows[3, a] and not rows[3, END]  # the answer's grammar
        assert rows[3 + len(yes)].nonzero().flatten().tolist() == [tok.eos_id]  # "yes" done: it may only stop
        again = unpack_bitmask(runtime.step(["r"]).clone(), tok.vocab_size)
        assert torch.equal(again[0], rows[0])  # rolled back: still at the start of its thought
        finished = runtime.accept("r", drafts + [tok.eos_id])
        assert finished


@settings(max_examples=examples(25), deadline=None)
@given(thought=st.lists(st.sampled_from(["think", "text", "eos", "end"]), max_size=5),
       ends=st.booleans(), answered=st.integers(0, 4), back=st.integers(0, 8), budget=st.sampled_from([None, 0, 2, 5]))
def test_property_rollback_equals_a_replay(thought, ends, answered, back, budget):
    """Accept what the matcher takes, roll back ``back`` tokens: every mask row after that equals the
    row of a fresh matcher that accepted only the tokens kept (the thought's state, the answer's grammar)."""
    hf, tok, _ = tiny_think()
    ids = {"think": THINK, "end": END, "eos": tok.eos_id, "text": tok.encode("hi")[0]}
    ids.update({c: encode_continuation(tok.encode, c)[0] for c in "yes"})
    engine = make_engine("xgrammar", tok)
    compiled = engine.compile(S.choice(["yes"]))
    prompt = _prompts(hf, 1)[0]

    def fresh():
        return ReasoningMatcher(Reasoning().thinking(tok), budget, prompt, answer=engine.matcher(compiled), thought=None,
                                stop_ids=tok.stop_token_ids, width=(tok.vocab_size + 31) // 32)

    def row(matcher):
        buffer = torch.zeros((1, (tok.vocab_size + 31) // 32), dtype=torch.int32)
        matcher.fill_next_token_bitmask(buffer, 0)
        return buffer.clone(), matcher.is_terminated()

    matcher, taken = fresh(), []
    for name in thought + ["end"] * ends + ["y", "e", "s", "eos"][:answered]:  # a thought, its end, an answer
        if matcher.accept_token(ids[name]):
            taken.append(ids[name])
    back = min(back, len(taken))
    matcher.rollback(back)
    replay = fresh()
    for token in taken[:len(taken) - back]:
        assert replay.accept_token(token)
    got, want = row(matcher), row(replay)
    assert torch.equal(got[0], want[0]) and got[1] == want[1]


def test_smollm2_tokenizer_with_think_tokens():
    """SmolLM2's tokenizer, ``<think>`` / ``</think>`` added the same way: the budget and the answer's grammar."""
    from transformers import AutoTokenizer

    from neuron_constrain.models import smollm2_dir

    hf = AutoTokenizer.from_pretrained(str(smollm2_dir()))
    think, end = add_think_tokens(hf)
    tok = S.from_huggingface(hf)
    model = tiny_decoder("llama", vocab_size=32 * -(-tok.vocab_size // 32))
    decoder = export_decoder(model, max_batch=2, max_len=96, vocab_size=tok.vocab_size, pad_id=tok.eos_id)
    prompts = [hf.encode(f"<|im_start|>user\nQ{i}<|im_end|>\n<|im_start|>assistant\n<think>") for i in range(2)]
    assert all(p[-1] == think for p in prompts)
    result = S.generate(decoder, prompts, [S.json_schema(SCHEMA, whitespace="none"), S.regex(REGEX)], 48,
                        tokenizer=tok, reasoning=Reasoning(budget=6))
    for constraint, out in zip((S.json_schema(SCHEMA), S.regex(REGEX)), result.outputs):
        assert out.tokens[6] == end and end not in out.tokens[:6]
        assert out.finish_reason == "stop" and S.validate_output(constraint, out.text) is None
