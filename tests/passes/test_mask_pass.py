"""The logit-mask pass on real HF decoder architectures and on synthetic decoders."""
from __future__ import annotations

import functools
import types

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import neuron_constrain as nc
from neuron_constrain.core.errors import EmptyMaskRowError, InputError, TransformError
from neuron_constrain.kernels import pack_bool_mask, packed_width
from neuron_constrain.passes import mask_logits_pass
from neuron_constrain.testing import (
    GreedyStep,
    SamplingStep,
    TopKMultinomialStep,
    exponential_noise,
    random_ids,
    tiny_decoder,
)

aten = torch.ops.aten
VOCAB, PADDED, BATCH, SEQ = 1000, 1024, 3, 6
BATCH_DIM = torch.export.Dim("batch")


def random_allowed(rows: int, vocab: int, seed: int, density: float = 0.02) -> torch.Tensor:
    """Random bool mask with at least one allowed token per row."""
    generator = torch.Generator().manual_seed(seed)
    allowed = torch.rand(rows, vocab, generator=generator) < density
    allowed[torch.arange(rows), torch.randint(0, vocab, (rows,), generator=generator)] = True
    return allowed


def step_case(arch: str, kind: str):
    model = tiny_decoder(arch, vocab_size=PADDED)
    ids = random_ids(BATCH, SEQ, VOCAB)
    if kind == "greedy":
        return GreedyStep(model), (ids,), ({0: BATCH_DIM},)
    if kind == "sampling":
        return SamplingStep(model, top_k=50, top_p=0.9), (ids, exponential_noise(BATCH, PADDED)), ({0: BATCH_DIM}, {0: BATCH_DIM})
    if kind == "topk":
        return TopKMultinomialStep(model, top_k=20), (ids,), ({0: BATCH_DIM},)
    raise AssertionError(kind)


class MaskedLogits(torch.nn.Module):
    """The untransformed model with its last-position logits masked by hand (padding
    columns too): run under the step's own sampler, the eager reference."""

    def __init__(self, model: torch.nn.Module, allowed: torch.Tensor):
        super().__init__()
        self.model, self.allowed = model, allowed

    def forward(self, input_ids, use_cache=False):
        logits = self.model(input_ids=input_ids, use_cache=use_cache).logits.clone()
        vocab = self.allowed.shape[-1]
        last = logits[:, -1]
        last[:, :vocab] = last[:, :vocab].masked_fill(~self.allowed, float("-inf"))
        last[:, vocab:] = float("-inf")
        return types.SimpleNamespace(logits=logits)


def eager_tokens(kind: str, model: torch.nn.Module, args: tuple, allowed: torch.Tensor) -> torch.Tensor:
    """What the step picks from the eager logits of the untransformed model, masked:
    the best allowed token (greedy), or the sampler's pick among allowed tokens."""
    reference = MaskedLogits(model, allowed)
    step = {"greedy": GreedyStep, "sampling": lambda m: SamplingStep(m, top_k=50, top_p=0.9)}[kind](reference)
    with torch.no_grad():
        return step(*args)


@functools.lru_cache(maxsize=None)
def transformed_step(arch: str, kind: str):
    step, args, dynamic = step_case(arch, kind)
    with torch.no_grad():
        plain = torch.export.export(step, args, dynamic_shapes=dynamic)
    assert all(str(n.target).startswith(("aten.", "<built-in")) for n in plain.graph.nodes if n.op == "call_function")
    return step, args, plain, nc.transform(plain, vocab_size=VOCAB)


CASES = [(arch, kind) for arch in ("llama", "mixtral", "gpt_oss") for kind in ("greedy", "sampling", "topk")]


@pytest.mark.parametrize("arch,kind", CASES)
def test_sampled_token_is_always_allowed(arch, kind):
    step, args, plain, t = transformed_step(arch, kind)
    expected_kind = {"greedy": "argmax", "sampling": "sort", "topk": "topk"}[kind]
    assert [s["kind"] for s in t.report["mask_logits"].sites] == [expected_kind]
    for seed in range(4):
        allowed = random_allowed(BATCH, VOCAB, seed, density=[0.001, 0.01, 0.3, 0.9][seed])
        torch.manual_seed(seed)
        tokens = t(*args, logit_mask=pack_bool_mask(allowed))
        assert tokens.shape == (BATCH,)
        assert bool(allowed[torch.arange(BATCH), tokens].all()), (tokens, allowed.sum(-1))
        if kind != "topk":  # deterministic: the best allowed token, or the race's winner among allowed ones
            expected = eager_tokens(kind, step.model, args, allowed)
            assert torch.equal(tokens, expected), (seed, tokens, expected)


@pytest.mark.parametrize("arch,kind", CASES)
def test_all_allowed_mask_changes_nothing(arch, kind):
    # With vocab_size = the logits' width nothing is padding, so all-allowed is a no-op.
    # (With vocab_size=1000 the 24 padding columns are masked: a real change, tested below.)
    step, args, plain, _ = transformed_step(arch, kind)
    t = nc.transform(plain)
    torch.manual_seed(7)
    expected = plain.module()(*args)
    torch.manual_seed(7)
    omitted = t(*args)
    torch.manual_seed(7)
    explicit = t(*args, logit_mask=torch.full((BATCH, packed_width(PADDED)), -1, dtype=torch.int32))
    assert torch.equal(expected, omitted) and torch.equal(expected, explicit)
    if kind == "greedy":  # the export itself is exact for greedy: compare with eager too
        assert torch.equal(step(*args), omitted)


@pytest.mark.parametrize("arch", ["llama", "gpt_oss"])
def test_padded_vocab_columns_are_never_chosen(arch):
    step, args, plain, t = transformed_step(arch, "greedy")
    # Pick inputs whose unconstrained greedy token would be a padding column: make the
    # padding columns win by allowing nothing real but one token with a tiny logit.
    model = step.model
    with torch.no_grad():
        logits = model(input_ids=args[0], use_cache=False).logits[:, -1]
    worst = logits[:, :VOCAB].argmin(-1)
    allowed = torch.zeros(BATCH, VOCAB, dtype=torch.bool)
    allowed[torch.arange(BATCH), worst] = True
    tokens = t(*args, logit_mask=pack_bool_mask(allowed))
    assert torch.equal(tokens, worst)
    assert int(tokens.max()) < VOCAB


@pytest.mark.parametrize("arch", ["llama", "mixtral", "gpt_oss"])
def test_bare_causal_lm_masks_its_logits_output(arch):
    model = tiny_decoder(arch, vocab_size=PADDED)
    ids = random_ids(2, SEQ, VOCAB)
    kwargs = {"input_ids": ids, "use_cache": False}
    with torch.no_grad():
        plain = torch.export.export(model, (), kwargs=kwargs)
    t = nc.transform(plain, logit_mask="bool", vocab_size=VOCAB)
    (site,) = t.report["mask_logits"].sites
    assert site["kind"] == "logits_output" and site["module"] == "lm_head"
    allowed = torch.rand(2, SEQ, VOCAB, generator=torch.Generator().manual_seed(0)) < 0.3
    allowed[..., 5] = True
    raw = plain.module()(**kwargs).logits
    masked = t(**kwargs, logit_mask=allowed).logits
    assert masked.shape == raw.shape == (2, SEQ, PADDED)
    real = masked[..., :VOCAB]
    assert torch.equal(real[allowed], raw[..., :VOCAB][allowed])
    assert bool((real[~allowed] == float("-inf")).all())
    assert bool((masked[..., VOCAB:] == float("-inf")).all())
    # host-side sampling from the masked logits can only see allowed tokens
    probs = masked.softmax(-1)
    assert float(probs[..., :VOCAB][~allowed].sum()) == 0.0
    unconstrained = t(**kwargs).logits
    assert torch.equal(unconstrained[..., :VOCAB], raw[..., :VOCAB])


def test_dynamic_batch_stays_dynamic():
    step, args, _, t = transformed_step("llama", "greedy")
    (mask_input,) = t.report["mask_logits"].inputs_added
    assert not isinstance(mask_input.shape[0], int), mask_input.shape
    for batch in (1, 2, 5):
        ids = random_ids(batch, SEQ, VOCAB, seed=batch)
        allowed = random_allowed(batch, VOCAB, batch)
        tokens = t(ids, logit_mask=pack_bool_mask(allowed))
        assert tokens.shape == (batch,) and bool(allowed[torch.arange(batch), tokens].all())
        assert torch.equal(tokens, eager_tokens("greedy", step.model, (ids,), allowed))


def test_inserted_nodes_carry_metadata_and_are_plain_aten():
    _, _, plain, t = transformed_step("mixtral", "sampling")
    before = {n.name for n in plain.graph.nodes}
    inserted = [n for n in t.program.graph.nodes if n.name not in before and n.op == "call_function"]
    assert len(inserted) == t.report["mask_logits"].nodes_inserted > 0
    for node in inserted:
        assert "val" in node.meta, node
        assert node.meta.get("nn_module_stack"), node
        assert node.meta.get("stack_trace"), node
        assert str(node.target).startswith("aten.") or node.target.__module__ == "_operator", node.target
    # op-count contract: one mask input, one where(allowed, logits, -inf), feeding the sort (top-p site)
    masks = [n for n in inserted if n.target == aten.where.self and n.args[2].target == aten.scalar_tensor.default
             and n.args[2].args[0] == float("-inf")]
    assert len(masks) == 1
    masked = masks[0]
    assert any(u.target == aten.div.Tensor for u in masked.users), "mask must come before temperature"
    assert [n.name for n in t.program.graph.nodes if n.op == "placeholder"][-1] == "logit_mask"


def test_save_load_round_trip_runs_without_the_library(tmp_path):
    import subprocess
    import sys

    cases = []
    for arch, kind in [("llama", "greedy"), ("gpt_oss", "sampling")]:
        _, args, _, t = transformed_step(arch, kind)
        path = tmp_path / f"{arch}_{kind}.pt2"
        t.save(path)
        loaded = torch.export.load(path)
        allowed = random_allowed(BATCH, VOCAB, 3)
        mask = pack_bool_mask(allowed)
        torch.manual_seed(0)
        ours = t(*args, logit_mask=mask)
        out, empty = loaded.module()(*args, logit_mask=mask)
        assert torch.equal(out, ours) and not bool(empty.any())
        torch.save({"args": args, "mask": mask, "expected": ours}, tmp_path / f"{arch}_{kind}.io.pt")
        cases.append(f"{arch}_{kind}")
    # A fresh interpreter that never imports neuron_constrain runs each program (one
    # interpreter for both: starting one, importing torch, is most of the cost).
    code = (
        "import sys, torch\n"
        f"for name in {cases!r}:\n"
        f"    p = torch.export.load(f'{tmp_path}/{{name}}.pt2'); io = torch.load(f'{tmp_path}/{{name}}.io.pt')\n"
        "    out, empty = p.module()(*io['args'], logit_mask=io['mask'])\n"
        "    assert torch.equal(out, io['expected']), (name, out, io['expected'])\n"
        "    print('ran', name)\n"
        "assert 'neuron_constrain' not in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert result.stdout.split("\n")[:-1] == [f"ran {name}" for name in cases], result.stdout


def test_transformed_exports_again():
    _, args, _, t = transformed_step("llama", "greedy")
    allowed = random_allowed(BATCH, VOCAB, 5)
    mask = pack_bool_mask(allowed)
    again = torch.export.export(t, args, kwargs={"logit_mask": mask})
    tokens = again.module()(*args, logit_mask=mask)
    assert torch.equal(tokens, t(*args, logit_mask=mask))
    compiled = torch.compile(t, backend="eager")
    assert torch.equal(compiled(*args, logit_mask=mask), tokens)


# ----------------------------------------------------------------------------- empty rows


def test_all_disallowed_row_raises_naming_the_row():
    _, args, _, t = transformed_step("llama", "greedy")
    allowed = random_allowed(BATCH, VOCAB, 1)
    allowed[1] = False
    with pytest.raises(EmptyMaskRowError, match=r"row\(s\) \[1\]") as info:
        t(*args, logit_mask=pack_bool_mask(allowed))
    assert info.value.rows == [1]
    # bits past vocab_size do not count as allowed
    mask = pack_bool_mask(allowed)
    mask[1, -1] = -1 << (VOCAB % 32)  # set only the bits at or past token 1000
    with pytest.raises(EmptyMaskRowError):
        t(*args, logit_mask=mask)


def test_fallback_token_policy_emits_that_token_in_graph():
    step, args, plain, _ = transformed_step("llama", "greedy")  # the passes copy: the shared export stays as it is
    eos = 2
    t = nc.transform(plain, vocab_size=VOCAB, empty_row=eos)
    assert t.report["mask_logits"].outputs_added == []
    allowed = random_allowed(BATCH, VOCAB, 4)
    allowed[0] = False
    tokens = t(*args, logit_mask=pack_bool_mask(allowed))
    assert int(tokens[0]) == eos
    assert bool(allowed[torch.arange(1, BATCH), tokens[1:]].all())
    fallback = allowed.clone()
    fallback[0, eos] = True  # what empty_row=eos means: the empty row allows exactly eos
    assert torch.equal(tokens, eager_tokens("greedy", step.model, args, fallback))
    # sampling path: the fallback keeps softmax finite
    step, args, plain, _ = transformed_step("llama", "sampling")
    t = nc.transform(plain, vocab_size=VOCAB, empty_row=eos)
    tokens = t(*args, logit_mask=pack_bool_mask(allowed))
    assert int(tokens[0]) == eos
    assert torch.equal(tokens, eager_tokens("sampling", step.model, args, fallback))


# ----------------------------------------------------------------------------- bad input


def test_bad_mask_inputs_name_the_problem_and_fix():
    _, args, _, t = transformed_step("llama", "greedy")
    width = packed_width(VOCAB)
    with pytest.raises(InputError, match=r"dtype torch.int64 but the graph takes torch.int32"):
        t(*args, logit_mask=torch.full((BATCH, width), -1, dtype=torch.int64))
    with pytest.raises(InputError, match=r"shape \(3, 31\) but these inputs need \(3, 32\)"):
        t(*args, logit_mask=torch.full((BATCH, width - 1), -1, dtype=torch.int32))
    with pytest.raises(InputError, match=r"shape \(2, 32\) but these inputs need \(3, 32\)"):
        t(*args, logit_mask=torch.full((2, width), -1, dtype=torch.int32))
    with pytest.raises(InputError, match=r"is on meta but the model's inputs are on cpu"):
        t(*args, logit_mask=torch.full((BATCH, width), -1, dtype=torch.int32, device="meta"))
    with pytest.raises(InputError, match="must be a tensor"):
        t(*args, logit_mask=[[-1] * width] * BATCH)


def test_bad_transform_options():
    _, _, plain, _ = transformed_step("llama", "greedy")  # the passes copy: the shared export stays as it is
    with pytest.raises(TransformError, match=r"vocab_size=2000 is larger than the logits' width 1024"):
        nc.transform(plain, vocab_size=2000)
    with pytest.raises(TransformError, match="is not a mask format"):
        nc.transform(plain, logit_mask="int8")
    with pytest.raises(TransformError, match=r"empty_row=5000 is not a token below vocab_size=1000"):
        nc.transform(plain, vocab_size=VOCAB, empty_row=5000)
    once = nc.transform(plain, vocab_size=VOCAB)
    with pytest.raises(TransformError, match="applied already"):
        nc.transform(once.program, vocab_size=VOCAB)
    with pytest.raises(TransformError, match="applied already"):
        mask_logits_pass(once.program)


def test_model_without_logits_is_refused():
    model = tiny_decoder("llama", vocab_size=PADDED).model  # LlamaModel: hidden states, no lm_head
    ids = random_ids(2, SEQ, VOCAB)
    with pytest.raises(TransformError, match="found no logits for one logit_mask"):
        nc.transform(model, (), example_kwargs={"input_ids": ids, "use_cache": False})


def test_logit_mask_none_skips_the_pass():
    step, args, dynamic = step_case("llama", "greedy")
    t = nc.transform(step, args, dynamic_shapes=dynamic, logit_mask=None)
    assert t.report.passes == {}
    assert "logit_mask" not in [n.name for n in t.program.graph.nodes]
    assert torch.equal(t(*args), step(*args))


# ----------------------------------------------------------------------------- properties


class SyntheticDecoder(torch.nn.Module):
    """Embedding -> 2 linear layers -> lm_head padded past the vocabulary."""

    def __init__(self, vocab: int, padded: int, kind: str):
        super().__init__()
        torch.manual_seed(vocab)
        self.embed = torch.nn.Embedding(vocab, 16)
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
        self.lm_head = torch.nn.Linear(16, padded)
        self.kind = kind

    def forward(self, ids, noise):
        logits = self.lm_head(self.body(self.embed(ids)))[:, -1]
        if self.kind == "greedy":
            return logits.argmax(-1)
        probs = (logits / 0.7).softmax(-1)
        return (probs / noise).argmax(-1)  # exponential race


@functools.lru_cache(maxsize=None)
def synthetic_program(vocab: int, pad: int, kind: str):
    """The decoder exported as ``nc.transform`` exports a module (under no_grad), once for both
    mask formats: the passes copy the program, so each format's rewrite starts from the same export."""
    module = SyntheticDecoder(vocab, vocab + pad, kind)
    ids = torch.zeros(2, 3, dtype=torch.long)
    noise = torch.ones(2, vocab + pad)
    with torch.no_grad():
        return torch.export.export(module, (ids, noise), dynamic_shapes=({0: BATCH_DIM}, {0: BATCH_DIM}))


@functools.lru_cache(maxsize=None)
def synthetic(vocab: int, pad: int, kind: str, fmt: str):
    return nc.transform(synthetic_program(vocab, pad, kind), logit_mask=fmt, vocab_size=vocab)


def synthetic_reference(vocab: int, pad: int, kind: str, ids, noise, allowed) -> torch.Tensor:
    """The untransformed decoder's eager logits, masked by hand, through its own sampler."""
    module = SyntheticDecoder(vocab, vocab + pad, kind)  # seeded by vocab: the same weights
    with torch.no_grad():
        logits = module.lm_head(module.body(module.embed(ids)))[:, -1]
    logits[:, :vocab] = logits[:, :vocab].masked_fill(~allowed, float("-inf"))
    logits[:, vocab:] = float("-inf")
    if kind == "greedy":
        return logits.argmax(-1)
    return ((logits / 0.7).softmax(-1) / noise).argmax(-1)


@given(
    vocab=st.integers(33, 300).filter(lambda v: v % 32 != 0),
    pad=st.sampled_from([0, 7, 40]),
    kind=st.sampled_from(["greedy", "race"]),
    batch=st.integers(1, 6),
    density=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
)
def test_property_token_allowed_and_formats_agree(vocab, pad, kind, batch, density, seed):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, 3), generator=generator)
    noise = torch.empty(batch, vocab + pad).exponential_(generator=generator)
    allowed = torch.rand(batch, vocab, generator=generator) < density
    allowed[torch.arange(batch), torch.randint(0, vocab, (batch,), generator=generator)] = True
    packed_tokens = synthetic(vocab, pad, kind, "packed")(ids, noise, logit_mask=pack_bool_mask(allowed))
    bool_tokens = synthetic(vocab, pad, kind, "bool")(ids, noise, logit_mask=allowed)
    assert bool(allowed[torch.arange(batch), packed_tokens].all())
    assert torch.equal(packed_tokens, bool_tokens)
    expected = synthetic_reference(vocab, pad, kind, ids, noise, allowed)
    assert torch.equal(packed_tokens, expected), (packed_tokens, expected)
