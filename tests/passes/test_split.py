"""Split at the mask: body + head equal the unsplit step (outputs and KV cache) over a
multi-step decode on tiny Llama / Mixtral / GPT-OSS static-cache steps, greedy and
sampling; the cut itself (what crosses it, the head's size); save / load of both
halves in a process without this library; one XLA compilation each, with the logits
and the mask as HLO parameters of the head; and the programs the split refuses."""
from __future__ import annotations

import copy
import functools
import gc
import subprocess
import sys

import pytest
import torch

import neuron_constrain as nc
from neuron_constrain.core.errors import TransformError
from neuron_constrain.kernels import pack_bool_mask
from neuron_constrain.passes.split_at_mask_pass import split_at_mask_pass
from neuron_constrain.decoding.pipeline import split_step
from neuron_constrain.processors import BatchUpdate, ProcessorState, RequestParams
from neuron_constrain.testing import CachedGreedyStep, GreedyStep, CachedSamplingStep, cache_state, exponential_noise, tiny_decoder
from neuron_constrain.core.transform import Transformed
from conftest import require_torch_xla
from references import fresh

VOCAB, PADDED, BATCH, STEPS, EOS = 1000, 1024, 3, 5, 2
PROCESSORS = ["min_tokens", "logit_bias", "penalties", "min_p"]


@functools.lru_cache(maxsize=None)
def cached_step(arch: str, sampling: bool, strict: bool = False) -> Transformed:
    """A rewritten static-cache decode step (mask + all four processors). Llama is
    exported strict (HF's recipe: the cache as buffers); the MoE models non-strict
    (the cache lifted as constants, written in place): both forms are split here."""
    model = tiny_decoder(arch, vocab_size=PADDED)
    step = (CachedSamplingStep if sampling else CachedGreedyStep)(model, batch_size=BATCH, max_cache_len=16)
    return nc.transform(step, step.example_inputs(VOCAB), vocab_size=VOCAB, processors=PROCESSORS, strict=strict)


def processor_state(transformed: Transformed) -> ProcessorState:
    state = ProcessorState.for_model(transformed, BATCH, eos_token_id=EOS)
    state.update(BatchUpdate(BATCH, added=[
        (0, RequestParams(min_tokens=3, logit_bias={5: 4.0, 7: -2.0}), [1, 5, 9]),
        (1, RequestParams(repetition_penalty=1.3, frequency_penalty=0.2, min_p=0.1, temperature=0.7), [4, 4, 8]),
        (2, RequestParams(), [3]),
    ]))
    return state


def decode_inputs(step: int, sampling: bool, generator: torch.Generator) -> tuple[tuple, torch.Tensor]:
    allowed = torch.rand(BATCH, VOCAB, generator=generator) < 0.4
    allowed[:, EOS] = True
    extra = (exponential_noise(BATCH, PADDED, seed=step),) if sampling else ()
    return extra, pack_bool_mask(allowed)


CASES = [("llama", False, True), ("llama", True, False), ("mixtral", False, False), ("mixtral", True, False),
         ("gpt_oss", False, False), ("gpt_oss", True, False)]


@pytest.mark.parametrize("cut", ["logits", "hidden"])
@pytest.mark.parametrize("arch, sampling, strict", CASES, ids=[f"{a}-{'sampling' if s else 'greedy'}" for a, s, _ in CASES])
def test_split_equals_unsplit_over_a_decode(arch, sampling, strict, cut):
    unsplit = fresh(cached_step(arch, sampling, strict))
    split = split_step(fresh(unsplit), cut=cut)
    state = processor_state(unsplit)
    generator = torch.Generator().manual_seed(0)
    ids = unsplit.program.example_inputs[0][0]
    history = []
    with torch.no_grad():
        for step in range(STEPS):
            extra, mask = decode_inputs(step, sampling, generator)
            inputs = state.inputs()
            position = torch.tensor([step])
            expected = unsplit(ids, position, *extra, logit_mask=mask, **inputs)
            got = split(ids, position, *extra, logit_mask=mask, **inputs)
            assert torch.equal(got, expected), f"step {step}: split {got.tolist()} != unsplit {expected.tolist()}"
            allowed = torch.stack([(mask[r, t // 32] >> (t % 32)) & 1 for r, t in enumerate(got.tolist())])
            assert bool(allowed.all()), f"step {step}: a token the mask forbids: {got.tolist()}"
            state.append_tokens(got)
            history.append(got.tolist())
            ids = got[:, None]
    assert len({tuple(h) for h in history}) > 1, "the decode never changed its tokens: the cache is not being read"
    before, after = cache_state(unsplit.program), cache_state(split.body.program)
    assert before.keys() == after.keys() and len(before) >= 4
    for name in before:
        assert torch.equal(before[name], after[name]), f"KV cache {name} differs after {STEPS} steps"
    assert all(bool(t.abs().sum() > 0) for t in after.values()), "a KV-cache tensor was never written"


def test_the_cut_is_the_last_logits_and_the_head_is_small():
    transformed = cached_step("llama", True, False)
    split = split_step(transformed)
    report = split.report
    assert [(c["dtype"], c["shape"]) for c in report.cut] == [(torch.float32, (BATCH, PADDED))]
    added = [i.name for i in transformed.report.inputs_added]
    assert report.head_inputs == ["noise", *added]  # the sampler's noise is read by the head only
    assert report.head_state == []  # no weight crosses: the lm_head stays in the body
    # bytes in: logits + noise + mask + processor rows, at the exported sizes
    args, kwargs = transformed.program.example_inputs
    example = {"noise": args[2], **kwargs}
    expected = BATCH * PADDED * 4 + sum(example[n].numel() * example[n].element_size() for n in report.head_inputs)
    assert report.head_bytes_in == expected
    live = copy.deepcopy(transformed.program.graph)
    live.eliminate_dead_code()  # HF's graph has a few dead ops; the body drops them
    unsplit_ops = sum(n.op == "call_function" for n in live.nodes)
    assert 0 < report.head_ops and report.head_ops + report.body_ops >= unsplit_ops  # rebuilt ops count twice
    body_inputs = {n.name for n in split.body.program.graph.nodes if n.op == "placeholder"}
    assert not body_inputs & set(added), "the body takes an added input"
    head_targets = {str(n.target) for n in split.head.program.graph.nodes if n.op == "call_function"}
    assert {"aten.linear.default", "aten.embedding.default", "aten.index_copy_.default",
            "aten.scaled_dot_product_attention.default"}.isdisjoint(head_targets)
    assert "aten.sort.default" in head_targets and "aten.masked_fill.Scalar" in head_targets
    assert "cut" in report.summary() and "head" in report.summary()


def test_cut_hidden_moves_the_lm_head_into_the_head():
    transformed = cached_step("llama", True, False)
    split = split_step(transformed, cut="hidden")
    report = split.report
    model = tiny_decoder("llama", vocab_size=PADDED)
    hidden = model.config.hidden_size
    assert [(c["dtype"], c["shape"][-1]) for c in report.cut] == [(torch.float32, hidden)]  # [B, 1, H], not [B, V]
    (weight,) = report.head_state
    assert weight.endswith("lm_head.weight")
    assert report.head_bytes_in < split_step(transformed).report.head_bytes_in
    head_targets = {str(n.target) for n in split.head.program.graph.nodes if n.op == "call_function"}
    body_targets = {str(n.target) for n in split.body.program.graph.nodes if n.op == "call_function"}
    assert "aten.linear.default" in head_targets and "aten.embedding.default" not in head_targets
    assert "aten.index_copy_.default" in body_targets  # the KV-cache writes stay in the body
    with pytest.raises(TransformError, match="cut='middle'"):
        split_step(transformed, cut="middle")


SUBPROCESS = r"""
import sys, torch
body, head = torch.export.load(sys.argv[1]), torch.export.load(sys.argv[2])
unsplit = torch.export.load(sys.argv[3])
case = torch.load(sys.argv[4])
b, h, u = body.module(), head.module(), unsplit.module()
with torch.no_grad():
    for step, (args, kwargs) in enumerate(case):
        cut = b(*args)
        got = h(*cut, **kwargs)
        want = u(*args, **kwargs)
        assert all(torch.equal(x, y) for x, y in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want))), step
assert not any(m.startswith("neuron_constrain") for m in sys.modules), "the library was imported"
print("ok", len(case))
"""


def test_both_halves_save_load_and_run_without_the_library(tmp_path):
    transformed = fresh(cached_step("llama", False, True))
    unsplit_path = tmp_path / "step.pt2"
    torch.export.save(transformed.program, unsplit_path)  # before any step: the cache is zeros
    result = split_at_mask_pass(transformed.program, [i.name for i in transformed.report.inputs_added])
    body, head = result.program, result.programs["head"]
    torch.export.save(body, tmp_path / "body.pt2")
    torch.export.save(head, tmp_path / "head.pt2")
    generator = torch.Generator().manual_seed(1)
    ids = transformed.program.example_inputs[0][0]
    case = []
    for step in range(3):
        _, mask = decode_inputs(step, False, generator)
        neutral = dict(transformed.program.example_inputs[1])  # the processors' neutral rows
        case.append(((ids, torch.tensor([step])), {**neutral, "logit_mask": mask}))
        ids = torch.randint(0, VOCAB, (BATCH, 1), generator=generator)
    torch.save(case, tmp_path / "case.pt")
    result = subprocess.run(
        [sys.executable, "-c", SUBPROCESS, *(str(tmp_path / f) for f in ("body.pt2", "head.pt2", "step.pt2", "case.pt"))],
        capture_output=True, text=True, timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok 3"


# ----------------------------------------------------------------------------- XLA


@pytest.mark.parametrize("cut_at", ["logits", "hidden"])
def test_each_half_compiles_once_on_xla_and_the_head_takes_the_cut_and_mask(cut_at):
    torch_xla = require_torch_xla()
    import torch_xla.debug.metrics as met

    from neuron_constrain.decoding.xla import lower

    transformed = fresh(cached_step("llama", False, True))
    cpu = fresh(transformed)
    split = split_step(transformed, cut=cut_at)
    on_xla = split.to()  # materialises the moved state (one small graph): then count
    device = torch_xla.device()
    generator = torch.Generator().manual_seed(2)
    ids = transformed.program.example_inputs[0][0]
    gc.collect()  # an earlier test's lazy tensors: freed, or synced here, before counting
    torch_xla.sync()
    met.clear_all()
    counts = []
    with torch.no_grad():
        for step in range(4):
            _, mask = decode_inputs(step, False, generator)
            position = torch.tensor([step])
            cut = on_xla.body(ids.to(device), position.to(device))
            torch_xla.sync()
            counts.append(met.metric_data("CompileTime")[0])
            tokens = on_xla.head(*cut, logit_mask=mask.to(device)).cpu()
            counts.append(met.metric_data("CompileTime")[0])
            expected = cpu(ids, position, logit_mask=mask)
            assert torch.equal(tokens, expected), f"step {step}: XLA {tokens.tolist()} != CPU {expected.tolist()}"
            ids = expected[:, None]
    assert counts == [1] + [2] * 7, f"compilations after each body / head call: {counts}"
    # lowering traces lazily and leaves pending tensors behind: after the count
    params = {p.name: (p.dtype, p.shape) for p in lower(split.head).parameters if p.name}
    hidden = transformed.program.state_dict["cached.model.model.embed_tokens.weight"].shape[1]
    want = (BATCH, PADDED) if cut_at == "logits" else (BATCH, 1, hidden)  # the logits, or the last hidden rows
    assert params[split.report.cut[0]["name"]] == ("f32", want)
    assert params["logit_mask"] == ("s32", (BATCH, 32))
    body_params = {p.name for p in lower(split.body).parameters}
    assert "logit_mask" not in body_params and "input_ids" in body_params


# ----------------------------------------------------------------------------- refusals


class _Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("seen", torch.zeros(4))

    def forward(self, x, logit_mask):
        self.seen.add_(logit_mask.float().sum(0))  # a state write that reads the mask
        return (x + logit_mask).argmax(-1)


def test_split_refuses_what_it_cannot_cut():
    transformed = cached_step("llama", False, True)
    with pytest.raises(TransformError, match="has no user input 'logit_maks'"):
        split_at_mask_pass(transformed.program, ["logit_maks"])
    with pytest.raises(TransformError, match="needs the names"):
        split_at_mask_pass(transformed.program, [])
    with pytest.raises(TransformError, match="no logit-mask or processor inputs"):
        split_step(nc.transform(GreedyStep(tiny_decoder("llama", vocab_size=PADDED)), (torch.zeros(2, 4, dtype=torch.long),),
                                logit_mask=None))
    with torch.no_grad():
        toy = torch.export.export(_Toy(), (torch.zeros(2, 4), torch.ones(2, 4)), kwargs=None)
    with pytest.raises(TransformError, match="is positional"):
        split_at_mask_pass(toy, ["logit_mask"])
    with torch.no_grad():
        toy = torch.export.export(_Toy(), (torch.zeros(2, 4),), kwargs={"logit_mask": torch.ones(2, 4)})
    with pytest.raises(TransformError, match=r"writes in place to b_seen|write to 'seen'"):
        split_at_mask_pass(toy, ["logit_mask"])
    functional = toy.run_decompositions()
    with pytest.raises(TransformError, match="the write to 'seen' depends on"):
        split_at_mask_pass(functional, ["logit_mask"])
