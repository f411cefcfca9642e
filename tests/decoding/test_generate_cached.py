"""KV-cached ``generate()`` on the tiny decoders: token-identical to the full-recompute path
(each prompt alone, so no padding is attended), for every constraint kind, with prompts of
different lengths in one batch, more requests than cache rows (joins as rows free up), the
cache's end, and a prompt that does not fit; and the n-token step (speculative verify)
equal to n one-token steps."""
from __future__ import annotations

import pytest
import torch

from neuron_constrain import structured as S
from neuron_constrain.decoding import export_decoder
from neuron_constrain.testing import GreedyStep, tiny_decoder, toy_tokenizer, weather_tool

VOCAB = toy_tokenizer()
PADDED = 32 * -(-VOCAB.vocab_size // 32) + 32  # an lm_head wider than the tokenizer: padding must never win
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
REQUESTS = [  # (prompt, constraint): every kind, and free text
    ("Describe a user:", S.json_schema(SCHEMA)),
    ("Email:", S.regex(r"[a-z]{3,8}@[a-z]{3,6}\.(com|org)")),
    ("Pick one:", S.choice(["yes", "no", "maybe"])),
    ("free text", None),
    ("weather?", S.tool_constraint([weather_tool()], "required")),
    ("a", S.ebnf('root ::= "[" [0-9]+ ("," [0-9]+)* "]"')),
    ("json please", S.any_json()),
]
MAX_NEW = 24


def _recompute(model):
    return S.transform_decoder(GreedyStep(model), (torch.zeros(2, 8, dtype=torch.long),), vocab_size=VOCAB.vocab_size,
                               dynamic_shapes=({0: torch.export.Dim("batch"), 1: torch.export.Dim("seq")},))


@pytest.fixture(scope="module", params=["llama", "qwen3", "gpt_oss"])
def decoders(request):
    """(model, KV-cached decoder with 3 rows, full-recompute step) per architecture; GPT-OSS
    has sliding-window layers (window 16, shorter than these sequences) and attention sinks."""
    model = tiny_decoder(request.param, vocab_size=PADDED)
    decoder = export_decoder(model, max_batch=3, max_len=96, vocab_size=VOCAB.vocab_size, pad_id=VOCAB.eos_id)
    return request.param, model, decoder, _recompute(model)


def test_cached_generate_is_token_identical_to_recompute(decoders):
    arch, _, decoder, recompute = decoders
    prompts, constraints = zip(*REQUESTS)
    # one engine: auto's race may move a request at another token in each run (both answers valid, not identical)
    cached = S.generate(decoder, list(prompts), list(constraints), MAX_NEW, tokenizer=VOCAB, engine="xgrammar")  # 7 requests, 3 rows
    lengths = {len(VOCAB.encode(p)) for p in prompts}
    assert len(lengths) > 3, "the batch must mix prompt lengths"
    for (prompt, constraint), out in zip(REQUESTS, cached.outputs):
        alone = S.generate(recompute, [prompt], [constraint], MAX_NEW, tokenizer=VOCAB, engine="xgrammar").outputs[0]
        assert out.tokens == alone.tokens, f"{arch} {prompt!r}: cached {out.tokens} != recompute {alone.tokens}"
        assert out.finish_reason == alone.finish_reason
        assert all(t < VOCAB.vocab_size for t in out.tokens), "a padded lm_head column was chosen"
        if constraint is not None and out.finish_reason == "stop":
            assert S.validate_output(constraint, out.text) is None, (prompt, out.text)
    choice = cached.outputs[2]
    assert choice.finish_reason == "stop" and choice.text in ("yes", "no", "maybe")


def test_cache_end_and_prompts_that_do_not_fit(decoders):
    _, _, decoder, recompute = decoders
    fits = VOCAB.encode("x" * 90)  # 90 tokens: 6 slots left for the generated ones
    too_long = VOCAB.encode("y" * 97)
    result = S.generate(decoder, [fits, too_long, "ok"], [None, None, S.choice(["ok"])], 20, tokenizer=VOCAB)
    end, failed, short = result.outputs
    assert end.finish_reason == "length" and len(end.tokens) == 96 - 90 + 1  # the last token needs no slot
    assert end.tokens == S.generate(recompute, [fits], [None], len(end.tokens), tokenizer=VOCAB).outputs[0].tokens
    assert failed.finish_reason == "error" and "97 tokens" in failed.error and "max_len >= 98" in failed.error
    assert failed.tokens == []
    assert short.finish_reason == "stop" and short.text == "ok"


def test_cached_generate_without_mask_input():
    """A decoder exported without the logit-mask pass runs unconstrained requests and refuses constrained ones
    (an lm_head exactly the tokenizer's width: without the mask nothing keeps padding columns out)."""
    model = tiny_decoder("llama", vocab_size=VOCAB.vocab_size)
    plain = export_decoder(model, max_batch=2, max_len=48, vocab_size=VOCAB.vocab_size, logit_mask=None)
    masked = export_decoder(model, max_batch=2, max_len=48, vocab_size=VOCAB.vocab_size)
    a = S.generate(plain, ["hello", "x"], [None, None], 10, tokenizer=VOCAB)
    b = S.generate(masked, ["hello", "x"], [None, None], 10, tokenizer=VOCAB)
    assert [o.tokens for o in a.outputs] == [o.tokens for o in b.outputs]
    with pytest.raises(S.StructuredOutputsDisabledError):
        S.generate(plain, ["x"], [S.choice(["a"])], 4, tokenizer=VOCAB)


def test_verify_step_equals_one_token_steps():
    """The n-token step program (what speculative / jump-forward verification runs) predicts,
    at each of its positions, what n one-token steps predict, and leaves the same cache."""
    model = tiny_decoder("llama", vocab_size=PADDED)
    decoder = export_decoder(model, max_batch=2, max_len=64, vocab_size=VOCAB.vocab_size, new_tokens=(1, 4))
    prompts = [VOCAB.encode("Hello there"), VOCAB.encode("abc")]
    drafts = torch.tensor([[40, 41, 42, 43], [50, 51, 52, 53]])
    with torch.no_grad():
        decoder.run_prefill(prompts, [0, 1])
        start = [len(p) for p in prompts]
        one = []
        for t in range(4):
            one.append(decoder.run_step(drafts[:, t:t + 1], [s + t for s in start])[0])
        after_one = [c.clone() for c in decoder.cache]
        decoder.run_prefill(prompts, [0, 1])
        verified, _ = decoder.run_step(drafts, start)
    assert verified.shape == (2, 4)
    assert torch.equal(verified, torch.stack(one, 1))
    rows = [slice(0, s + 4) for s in start]
    for a, b in zip(after_one, decoder.cache):
        for row, used in enumerate(rows):
            torch.testing.assert_close(a[row, :, used], b[row, :, used])


def test_verify_step_masks_every_position():
    """A ``[B, n, W]`` mask on the verify step: each position takes its own row's best allowed token."""
    model = tiny_decoder("llama", vocab_size=PADDED)
    decoder = export_decoder(model, max_batch=2, max_len=32, vocab_size=VOCAB.vocab_size, new_tokens=3)
    from neuron_constrain.kernels import pack_bool_mask

    generator = torch.Generator().manual_seed(0)
    allowed = torch.rand(2, 3, VOCAB.vocab_size, generator=generator) < 0.05
    allowed[..., 7] = True
    drafts = torch.tensor([[40, 41, 42], [50, 51, 52]])
    with torch.no_grad():
        decoder.run_prefill([[1, 2, 3], [4, 5]], [0, 1])
        free, _ = decoder.run_step(drafts, [3, 2])
        decoder.run_prefill([[1, 2, 3], [4, 5]], [0, 1])
        masked, _ = decoder.run_step(drafts, [3, 2], logit_mask=pack_bool_mask(allowed.reshape(6, -1)).reshape(2, 3, -1))
        logits = _verify_logits(model, [[1, 2, 3], [4, 5]], drafts)
    best = logits[..., : VOCAB.vocab_size].masked_fill(~allowed, float("-inf")).argmax(-1)
    assert torch.equal(masked, best)
    assert not torch.equal(masked, free)


def _verify_logits(model, prompts, drafts):
    """The HF model's logits at the draft positions, each row alone (no padding)."""
    rows = []
    for prompt, row in zip(prompts, drafts.tolist()):
        ids = torch.tensor([prompt + row])
        rows.append(model(input_ids=ids).logits[0, len(prompt):len(prompt) + len(row)])  # after each draft
    return torch.stack(rows)


def test_cache_holds_no_autograd_history():
    """generate() without no_grad around it: the cache tensors stay plain (a write under grad
    would chain every step into one autograd graph: memory without bound)."""
    model = tiny_decoder("llama", vocab_size=PADDED)
    decoder = export_decoder(model, max_batch=2, max_len=32, vocab_size=VOCAB.vocab_size)
    assert torch.is_grad_enabled()
    S.generate(decoder, ["ab", "c"], [None, None], 6, tokenizer=VOCAB)
    assert not any(t.requires_grad or t.grad_fn is not None for t in decoder.cache)
