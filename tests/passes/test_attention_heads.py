"""Attention is never a head: where attention is not one fused SDPA op, ``q @ k^T`` over
the KV cache is a matmul wider than its input that feeds a softmax (or NxD's manual
softmax, a ``max``), yet no weight makes it. A head multiplies the hidden state by a
weight. The graphs accelerators compile transform, mask every real head, pass
``check_program`` and pick the best allowed token, as eager does:

- HF's ExecuTorch static-cache decode step (strict export) after ``run_decompositions()``,
  with several attention layers;
- NxD-style token generation, one program per bucket: explicit KV cache inputs and
  outputs, ``position_ids``, ``[B, 3]`` sampling params, topk -> cumsum top-p -> sample;
- an eager-attention (matmul + softmax) decoder with a draft head: both heads, no more.
"""
from __future__ import annotations

import copy

import pytest
import torch

import neuron_constrain as nc
from neuron_constrain.core.checks import check_program, find_sites
from neuron_constrain.kernels import pack_bool_mask
from neuron_constrain.core.sites import SAMPLING_OPS as SAMPLING_KINDS
from neuron_constrain.core.sites import module_path, plan_heads, projections, weight_names
from neuron_constrain.testing import (
    CachedGreedyStep,
    DraftHeadStep,
    TokenGenerationStep,
    random_ids,
    sample_top_k_top_p,
    tiny_decoder,
)

VOCAB, BATCH, LAYERS = 512, 2, 3
bmm, matmul = torch.ops.aten.bmm.default, torch.ops.aten.matmul.default


def random_allowed(rows: int, width: int, seed: int, density: float = 0.3) -> torch.Tensor:
    allowed = torch.rand(rows, width, generator=torch.Generator().manual_seed(seed)) < density
    allowed[:, seed % width] = True  # never an empty row
    return allowed


def best_allowed(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    return logits.masked_fill(~allowed, float("-inf")).argmax(-1)


# ----------------------------------------------------------------------------- decomposed static-cache decode


@pytest.fixture(scope="module")
def decomposed():
    """(eager step with its own cache, decomposed program) of a 3-layer static-cache decode step."""
    model = tiny_decoder("llama", vocab_size=VOCAB, layers=LAYERS, seed=4)
    step = CachedGreedyStep(model, batch_size=BATCH, max_cache_len=32)
    eager = copy.deepcopy(step)  # the program keeps the module's cache tensors: the reference gets its own
    with torch.no_grad():
        program = torch.export.export(step, step.example_inputs(VOCAB), strict=True).run_decompositions()
    return eager, program


def test_decomposed_attention_layers_are_never_heads(decomposed):
    _, program = decomposed
    graph = program.graph
    weights = weight_names(program)
    # The attention scores q @ k^T are as wide as the cache: every layer has one widening bmm.
    scores = [n for n in projections(graph) if n.target == bmm]
    assert [module_path(n) for n in scores] == [f"cached.model.model.layers.{i}.self_attn" for i in range(LAYERS)]
    found = projections(graph, weights=weights)
    assert not set(scores) & set(found), "an attention product counted as a projection"
    heads = plan_heads(graph, [], VOCAB, weights=weights)
    assert [module_path(h.root) for h in heads] == ["cached.model.lm_head"]
    assert [kind for _, kind in heads[0].sites] == ["argmax"]
    # check finds the sites on its own: the argmax, never an attention softmax.
    sites = find_sites(program)
    assert [(s.kind, module_path(s.root)) for s in sites] == [("argmax", "cached.model.lm_head")]
    (failure,) = check_program(program, VOCAB)  # the untransformed program: that one site, unmasked
    assert "sampling site argmax (argmax)" in failure and "not masked" in failure


def test_decomposed_static_cache_decode_transforms_masks_and_matches_eager(decomposed):
    eager, program = decomposed
    t = nc.transform(program, vocab_size=VOCAB)
    report = t.report["mask_logits"]
    assert [i.name for i in report.inputs_added] == ["logit_mask"]
    assert [(s["kind"], s["head"]) for s in report.sites] == [("argmax", 0)]
    run = fresh(t)
    assert check_program(t.program, VOCAB) == []
    ids = random_ids(BATCH, 1, VOCAB, seed=5)
    for position in range(4):
        allowed = random_allowed(BATCH, VOCAB, seed=position)
        with torch.no_grad():
            want = best_allowed(eager.logits(ids, torch.tensor([position])), allowed)
            got = run(ids, torch.tensor([position]), logit_mask=pack_bool_mask(allowed))
        assert torch.equal(got, want), (position, got, want)
        ids = got[:, None]


def fresh(t: nc.Transformed) -> nc.Transformed:
    """The rewritten step with its own copy of the weights and KV cache."""
    return nc.Transformed(copy.deepcopy(t.program), t.report)


# ----------------------------------------------------------------------------- NxD-style token generation


@pytest.fixture(scope="module")
def token_gen_model():
    return tiny_decoder("llama", vocab_size=VOCAB, layers=2, seed=6)


@pytest.mark.parametrize("bucket", [16, 32])
def test_token_generation_bucket_transforms_masks_and_matches_eager(token_gen_model, bucket):
    step = TokenGenerationStep(token_gen_model, batch_size=BATCH, bucket=bucket, global_top_k=8)
    with torch.no_grad():
        program = torch.export.export(step, step.example_inputs(VOCAB))
    t = nc.transform(program, vocab_size=VOCAB - 12)  # the lm_head padded past the tokenizer
    report = t.report["mask_logits"]
    assert [i.name for i in report.inputs_added] == ["logit_mask"]
    assert [(s["kind"], s["head"]) for s in report.sites] == [("topk", 0)]
    run = fresh(t)
    assert check_program(t.program, VOCAB - 12) == []
    # What was there to mistake for heads: per layer, the prior-cache scores (q @ K^T, bucket
    # wide, read by the manual softmax's max) and the active ones; the sampler's topk.
    attention = [n for n in projections(program.graph) if n.target in (bmm, matmul)]
    assert len(attention) >= 2 and not set(attention) & set(projections(program.graph, weights=weight_names(program)))
    assert {"max", "topk"} <= {SAMPLING_KINDS.get(n.target) for n in program.graph.nodes}

    generator = torch.Generator().manual_seed(bucket)
    ids = random_ids(BATCH, 1, VOCAB - 12, seed=bucket)
    params = torch.tensor([[8, 0.95, 0.7], [3, 0.5, 1.3]])
    # Rows at different positions: row 1 has two tokens in its cache already.
    prefix = random_ids(BATCH, 2, VOCAB - 12, seed=bucket + 1)
    cache = step.empty_cache()
    with torch.no_grad():
        for j in range(2):
            _, cache = step.logits(prefix[:, j:j + 1], torch.tensor([[j], [j]]), cache)
    eager_cache, start, history = cache, torch.tensor([[0], [2]]), [[], prefix[1].tolist()]
    for offset in range(5):
        position = start + offset
        allowed = random_allowed(BATCH, VOCAB - 12, seed=offset)
        uniform = torch.rand(BATCH, 1, generator=generator)
        with torch.no_grad():
            logits, eager_cache = step.logits(ids, position, eager_cache)
            masked = torch.cat([logits[:, : VOCAB - 12].masked_fill(~allowed, float("-inf")),
                                torch.full((BATCH, 12), float("-inf"))], -1)
            want = sample_top_k_top_p(masked, params, uniform, global_top_k=8)
            token, *cache = run(ids, position, params, uniform, tuple(cache), logit_mask=pack_bool_mask(allowed))
        assert torch.equal(token, want) and bool(allowed.gather(1, token[:, None]).all()), (offset, token, want)
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(cache, eager_cache))
        # The step is the model: its logits are the model's own over each row's tokens.
        for row in range(BATCH):
            history[row].append(int(ids[row]))
            with torch.no_grad():
                reference = token_gen_model(input_ids=torch.tensor([history[row]]), use_cache=False).logits[0, -1]
            assert torch.allclose(logits[row], reference, atol=1e-5), (offset, row)
        ids = token[:, None]


# ----------------------------------------------------------------------------- what a weight is


class DequantizedHead(torch.nn.Module):
    """An int8 lm_head dequantized in the graph (int8 buffer * per-row scale), then argmax."""

    def __init__(self, hidden: int = 16, vocab: int = 200):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.register_buffer("weight_q", torch.randint(-127, 128, (vocab, hidden), generator=generator, dtype=torch.int8))
        self.scale = torch.nn.Parameter(torch.rand(vocab, 1, generator=generator) / 64, requires_grad=False)

    def forward(self, ids):
        hidden = self.embed(ids)[:, -1]
        return (hidden @ (self.weight_q.float() * self.scale).t()).argmax(-1)


class InputWeightHead(DequantizedHead):
    """The same matmul with its matrix passed in: a product of two activations."""

    def forward(self, ids, matrix):
        return (self.embed(ids)[:, -1] @ matrix).argmax(-1)


def test_a_dequantized_weight_makes_a_head_and_an_input_matrix_does_not():
    model = DequantizedHead()
    ids = random_ids(3, 4, 200)
    t = nc.transform(model, (ids,))
    assert [(s["kind"], s["head"]) for s in t.report["mask_logits"].sites] == [("argmax", 0)]
    assert check_program(t.program) == []
    allowed = random_allowed(3, 200, seed=1)
    with torch.no_grad():
        logits = model.embed(ids)[:, -1] @ (model.weight_q.float() * model.scale).t()
    assert torch.equal(t(ids, logit_mask=pack_bool_mask(allowed)), best_allowed(logits, allowed))
    # The same product with its matrix passed in multiplies two activations: no head, and the error says why.
    with pytest.raises(nc.TransformError, match=r"found no logits.*multiply two activations.*export it as a parameter"):
        nc.transform(InputWeightHead(), (ids, torch.randn(16, 200)))


# ----------------------------------------------------------------------------- heads beside eager attention


def test_a_draft_head_beside_eager_attention_is_the_only_second_head():
    model = tiny_decoder("llama", vocab_size=VOCAB, attn_implementation="eager")
    step = DraftHeadStep(model)
    ids = random_ids(2, 24, VOCAB)  # 24 positions > head_dim 16: the scores are wider than q
    with torch.no_grad():
        program = torch.export.export(step, (ids,))
    attention = [n for n in projections(program.graph) if n.target in (bmm, matmul)]
    assert len(attention) == 2, "expected one widening attention product (q @ k^T) per layer"
    t = nc.transform(program, vocab_size=VOCAB)
    report = t.report["mask_logits"]
    assert [i.name for i in report.inputs_added] == ["logit_mask", "logit_mask_1"]
    assert [(s["kind"], s["head"]) for s in report.sites] == [("argmax", 0), ("argmax", 1)]
    assert check_program(t.program, VOCAB) == []
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=False, output_hidden_states=True)
        main_logits, draft_logits = out.logits[:, -1], step.draft(out.hidden_states[-1][:, -1])
    main_allowed, draft_allowed = random_allowed(2, VOCAB, 2), random_allowed(2, VOCAB, 3)
    token, draft = t(ids, logit_mask=pack_bool_mask(main_allowed), logit_mask_1=pack_bool_mask(draft_allowed))
    assert torch.equal(token, best_allowed(main_logits, main_allowed))
    assert torch.equal(draft, best_allowed(draft_logits, draft_allowed))
