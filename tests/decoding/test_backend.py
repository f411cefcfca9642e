"""The ``torch.compile`` backend: passes on dynamo's graph, then inductor (or any inner backend).

Zero recompiles: one compiled graph serves all-allowed, random and mixed masks and
taps switched on and off (``error_on_recompile`` and the backend's own graph
count), and tokens equal an eager reference: the untransformed model, its logits
masked by hand and tapped outputs replaced by forward hooks. The openxla
inner backend is tested in ``test_xla.py`` (main lane only).
"""
from __future__ import annotations

import pytest
import torch

import neuron_constrain as nc
from neuron_constrain.decoding.dynamo_backend import BACKEND_NAME, default_backend
from neuron_constrain.core.errors import EmptyMaskRowError, InputError, TransformError
from neuron_constrain.kernels import pack_bool_mask, packed_width
from neuron_constrain.replacement import active_context
from neuron_constrain.testing import GreedyStep, random_ids, tiny_decoder

VOCAB, PADDED, BATCH, SEQ = 1000, 1024, 3, 6


@pytest.fixture(autouse=True)
def fresh_dynamo():
    # Every test compiles GreedyStep.forward for a new model: without a reset the
    # second one would count as a recompile of the first.
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def random_allowed(seed: int, density: float = 0.05) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    allowed = torch.rand(BATCH, VOCAB, generator=generator) < density
    allowed[torch.arange(BATCH), torch.randint(0, VOCAB, (BATCH,), generator=generator)] = True
    return allowed


TAPS = ["model.layers.*.mlp"]  # every decoder layer's MLP output, replaceable per token row


def tap_context(layer: int, rows: slice | None = None, seed: int = 0) -> dict:
    """A replacement for one layer's MLP output (all token rows, or ``rows`` of the batch)."""
    generator = torch.Generator().manual_seed(seed)
    values = 10 * torch.randn(BATCH, SEQ, 64, generator=generator)
    enabled = torch.zeros(BATCH, SEQ, dtype=torch.bool)
    enabled[rows if rows is not None else slice(None)] = True
    return {layer: (values, enabled)}


def mask_cases() -> list[tuple[str, torch.Tensor | None, dict]]:
    """(name, allowed, taps): (a) all allowed (omitted, explicit), (b) random masks,
    (c) a mixed constrained/unconstrained batch, (d) taps on and off with masks."""
    mixed = random_allowed(3)
    mixed[1] = True  # row 1 unconstrained, rows 0 and 2 constrained
    return [
        ("omitted", None, {}),
        ("all_allowed", torch.ones(BATCH, VOCAB, dtype=torch.bool), {}),
        ("random_1", random_allowed(1), {}),
        ("random_2", random_allowed(2, density=0.005), {}),
        ("mixed", mixed, {}),
        ("tap_layer0_all_rows", random_allowed(4), tap_context(0, seed=1)),
        ("tap_layer1_row1_mixed", mixed, tap_context(1, slice(1, 2), seed=2)),
        ("tap_layer0_omitted_mask", None, tap_context(0, seed=3)),
        ("taps_off_again", None, {}),
    ]


def as_context(taps: dict) -> dict:
    """The replacement context (tap name -> (values [rows, features], enabled [rows]))."""
    return {
        f"model.model.layers.{layer}.mlp": (values.reshape(-1, values.shape[-1]), enabled.reshape(-1))
        for layer, (values, enabled) in taps.items()
    }


def reference_tokens(model, ids: torch.Tensor, allowed: torch.Tensor | None, taps: dict | None = None) -> torch.Tensor:
    """The untransformed model, masked by hand (padded columns and disallowed tokens to
    -inf), with tapped MLP outputs replaced by forward hooks."""
    handles = []
    for layer, (values, enabled) in (taps or {}).items():
        def hook(module, args, out, values=values, enabled=enabled):
            first = out[0] if isinstance(out, tuple) else out
            new = torch.where(enabled.unsqueeze(-1), values.to(first.dtype), first)
            return (new, *out[1:]) if isinstance(out, tuple) else new

        handles.append(model.model.layers[layer].mlp.register_forward_hook(hook))
    try:
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits[:, -1].clone()
    finally:
        for handle in handles:
            handle.remove()
    logits[:, VOCAB:] = float("-inf")
    if allowed is not None:
        logits[:, :VOCAB] = logits[:, :VOCAB].masked_fill(~allowed, float("-inf"))
    return logits.argmax(-1)


def as_packed(allowed: torch.Tensor | None) -> torch.Tensor | None:
    return None if allowed is None else pack_bool_mask(allowed)


def check_cases(model, ids, call) -> None:
    """Run every case through ``call(ids, packed_mask_or_None)`` and compare with eager."""
    changed = False
    for name, allowed, taps in mask_cases():
        want = reference_tokens(model, ids, allowed, taps)
        changed |= bool(taps) and not torch.equal(want, reference_tokens(model, ids, allowed))
        with active_context(as_context(taps) if taps else None):
            got = call(ids, as_packed(allowed))
        assert torch.equal(got.cpu(), want), f"{name}: {got.tolist()} != {want.tolist()}"
    assert changed, "no tap case changed a token: the tap cases test nothing"


# ----------------------------------------------------------------------------- zero recompiles


@pytest.mark.parametrize("arch", ["llama", "gpt_oss"])
def test_inductor_one_graph_for_every_mask_and_tap(arch):
    model = tiny_decoder(arch, vocab_size=PADDED)
    ids = random_ids(BATCH, SEQ, VOCAB)
    compiled = nc.compile(GreedyStep(model), inner="inductor", vocab_size=VOCAB, taps=TAPS)
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        check_cases(model, ids, lambda ids, mask: compiled(ids, logit_mask=mask))
    assert compiled.backend.graphs_compiled == 1, "dynamo handed the backend more than one graph"
    (report,) = compiled.backend.reports
    assert [i.name for i in report.inputs_added] == [
        "tap_model_model_layers_0_mlp", "tap_model_model_layers_0_mlp_enabled",
        "tap_model_model_layers_1_mlp", "tap_model_model_layers_1_mlp_enabled", "logit_mask",
    ]
    assert report["mask_logits"].sites[0]["kind"] == "argmax"


def test_bool_mask_and_eager_inner():
    model = tiny_decoder("llama", vocab_size=PADDED)
    ids = random_ids(BATCH, SEQ, VOCAB)
    compiled = nc.compile(GreedyStep(model), inner="eager", logit_mask="bool", vocab_size=VOCAB)
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        for name, allowed, _ in mask_cases()[:5]:
            assert torch.equal(compiled(ids, logit_mask=allowed), reference_tokens(model, ids, allowed)), name


def test_backend_by_hand_with_feed():
    model = tiny_decoder("llama", vocab_size=PADDED)
    ids = random_ids(BATCH, SEQ, VOCAB)
    be = nc.backend(inner="eager", vocab_size=VOCAB)
    compiled = torch.compile(GreedyStep(model), backend=be, dynamic=False)
    allowed = random_allowed(5)
    with torch.no_grad():
        with be.feed(logit_mask=pack_bool_mask(allowed)):
            assert torch.equal(compiled(ids), reference_tokens(model, ids, allowed))
        assert torch.equal(compiled(ids), reference_tokens(model, ids, None)), "outside feed(): all allowed"


def test_registered_with_dynamo():
    assert BACKEND_NAME in torch._dynamo.list_backends()
    assert torch._dynamo.lookup_backend(BACKEND_NAME) is default_backend


# ----------------------------------------------------------------------------- graph breaks


class BrokenStep(torch.nn.Module):
    """Greedy step with a graph break between the decoder body and the lm_head."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        hidden = self.model.model(input_ids=input_ids, use_cache=False).last_hidden_state
        torch._dynamo.graph_break()
        return self.model.lm_head(hidden[:, -1]).argmax(-1)


def test_graph_break_masks_the_graph_holding_the_logits():
    model = tiny_decoder("llama", vocab_size=PADDED)
    ids = random_ids(BATCH, SEQ, VOCAB)
    compiled = nc.compile(BrokenStep(model), inner="eager", vocab_size=VOCAB)
    allowed = random_allowed(6)
    with torch.no_grad():
        assert torch.equal(compiled(ids, logit_mask=pack_bool_mask(allowed)), reference_tokens(model, ids, allowed))
    assert compiled.backend.graphs_compiled == 2 and len(compiled.backend.reports) == 1


def test_mask_that_no_graph_takes_raises():
    model = tiny_decoder("llama", vocab_size=PADDED)
    body = nc.compile(model.model, inner="eager", vocab_size=VOCAB)  # hidden states only: no logits
    mask = torch.full((BATCH, packed_width(VOCAB)), -1, dtype=torch.int32)
    with torch.no_grad(), pytest.raises(InputError, match="logit_mask was fed but no compiled graph takes it"):
        body(random_ids(BATCH, SEQ, VOCAB), use_cache=False, logit_mask=mask)


# ----------------------------------------------------------------------------- errors


def test_bad_masks_and_empty_rows():
    model = tiny_decoder("llama", vocab_size=PADDED)
    ids = random_ids(BATCH, SEQ, VOCAB)
    compiled = nc.compile(GreedyStep(model), inner="eager", vocab_size=VOCAB)
    good = torch.full((BATCH, packed_width(VOCAB)), -1, dtype=torch.int32)
    with torch.no_grad():
        compiled(ids)
        with pytest.raises(InputError, match=r"logit_mask has dtype torch.int64 .* convert it with \.to\(torch.int32\)"):
            compiled(ids, logit_mask=good.long())
        with pytest.raises(InputError, match=r"logit_mask has shape \(2, 32\) but these inputs need \(3, 32\)"):
            compiled(ids, logit_mask=good[:2])
        empty = good.clone()
        empty[2] = 0
        with pytest.raises(EmptyMaskRowError, match=r"row\(s\) \[2\]"):
            compiled(ids, logit_mask=empty)
        with pytest.raises(RuntimeError, match="already active"):
            with compiled.backend.feed(logit_mask=good), compiled.backend.feed(logit_mask=good):
                pass


def test_dynamic_shapes_are_refused_with_the_fix():
    model = tiny_decoder("llama", vocab_size=PADDED)
    be = nc.backend(inner="eager", vocab_size=VOCAB)
    compiled = torch.compile(GreedyStep(model), backend=be, dynamic=True)
    # torch.compile by hand: dynamo wraps the backend's error; the cause is ours, with the fix
    wrapped = torch._dynamo.exc.BackendCompilerFailed
    with torch.no_grad(), pytest.raises(wrapped, match="compile with dynamic=False") as info:
        compiled(random_ids(BATCH, SEQ, VOCAB))
    assert isinstance(info.value.inner_exception, TransformError)
    assert "graph with symbolic sizes" in str(info.value.inner_exception)
    # nc.compile unwraps it: the library's own error, nothing of dynamo's around it
    torch._dynamo.reset()
    ours = nc.compile(GreedyStep(model), inner="eager", vocab_size=VOCAB, dynamic=True)
    with torch.no_grad(), pytest.raises(TransformError, match=r"symbolic sizes .*; compile with dynamic=False \(nc.compile does\)"):
        ours(random_ids(BATCH, SEQ, VOCAB))


def test_inner_cannot_be_this_backend():
    with pytest.raises(ValueError, match="run the passes twice"):
        nc.backend(inner=BACKEND_NAME)._inner()
    with pytest.raises(TransformError, match="logit_mask='nope' is not a mask format"):
        model = tiny_decoder("llama", vocab_size=PADDED)
        with torch.no_grad():
            nc.compile(GreedyStep(model), inner="eager", logit_mask="nope")(random_ids(BATCH, SEQ, VOCAB))


def test_fake_example_inputs_get_fake_added_inputs():
    """Some dynamo versions hand the backend fake tensors: the added inputs must be fake too."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    model = tiny_decoder("llama", vocab_size=PADDED)
    ids = random_ids(BATCH, SEQ, VOCAB)
    captured = {}

    def grab(gm, example_inputs):
        captured.update(gm=gm, example_inputs=example_inputs)
        return gm.forward

    def inner(gm, example_inputs):
        captured["fake"] = [isinstance(x, FakeTensor) for x in example_inputs]
        return gm.forward

    with torch.no_grad():
        torch.compile(GreedyStep(model), backend=grab, dynamic=False)(ids)
        be = nc.backend(inner=inner, vocab_size=VOCAB)
        fake_mode = FakeTensorMode()
        run = be(captured["gm"], [fake_mode.from_tensor(x) for x in captured["example_inputs"]])
        assert all(captured["fake"]) and len(captured["fake"]) == len(captured["example_inputs"]) + 1
        allowed = random_allowed(7)
        with be.feed(logit_mask=pack_bool_mask(allowed)):
            (tokens,) = run(*captured["example_inputs"])
    assert torch.equal(tokens, reference_tokens(model, ids, allowed))
