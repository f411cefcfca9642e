"""``localize``: the device model is a tiny random-weight reference with one module's
numerics perturbed; the report must name exactly that module, from one tapped
program, in 2n + 1 forward passes for n tapped modules."""
from __future__ import annotations

import contextlib
import copy
import functools
import json

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.utils import _pytree as pytree

import neuron_constrain as nc
from neuron_constrain.core.errors import InputError
from neuron_constrain.replacement import localize, logit_validation, reference_captures
from neuron_constrain.replacement.localization import LOGITS, default_taps
from neuron_constrain.testing import LogitsStep, tiny_decoder
from conftest import examples, require_torch_xla

VOCAB, LAYERS, NEW = 256, 3, 4
PROMPTS = [[3, 14, 15, 92, 65], [27, 18, 28], [100, 101, 102, 103, 104, 105, 106]]  # lengths differ: padded slots
ATOL = 1e-5
ARCHS = ("llama", "mixtral", "gpt_oss")
ROUTER = {"mixtral": "mlp.gate", "gpt_oss": "mlp.router"}
FEW = settings(max_examples=examples(4), deadline=None)
DIMS = ({0: torch.export.Dim("batch", min=1), 1: torch.export.Dim("seq", min=1, max=64)},)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models on shared cores: one intra-op thread is ~6x faster than two contending."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def layer(i: int) -> str:
    return f"model.model.layers.{i}"


def router(arch: str, i: int) -> str:
    return f"{layer(i)}.{ROUTER[arch]}"


# ----------------------------------------------------------------------------- models and perturbations

class _OffsetMixtralRouter(torch.nn.Module):
    """Mixtral's router with a ``logit_offset`` buffer added to its logits (zeros: exact)."""

    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        router_logits = F.linear(hidden_states, self.weight) + self.logit_offset
        router_probs = torch.nn.functional.softmax(router_logits.float(), dim=-1)
        router_top_value, router_indices = torch.topk(router_probs, self.top_k, dim=-1)
        router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
        return router_logits, router_top_value, router_indices


def with_router_offsets(model):
    """Mixtral has no router bias to offset in place: give each router a zero offset buffer."""
    for i in range(LAYERS):
        gate = model.model.layers[i].mlp.gate
        gate.__class__ = type("OffsetRouter", (_OffsetMixtralRouter, type(gate)), {})
        gate.register_buffer("logit_offset", torch.zeros(gate.num_experts))
    return model


def run_in_bf16(model, i: int):
    """Layer ``i`` computes in bfloat16 (weights and activations); its output is cast back."""
    block = model.model.layers[i]
    base = type(block)

    def cast(dtype):
        return lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    class Bf16Layer(base):
        def forward(self, *args, **kwargs):
            args, kwargs = pytree.tree_map(cast(torch.bfloat16), (args, kwargs))
            return pytree.tree_map(cast(torch.float32), super().forward(*args, **kwargs))

    block.__class__ = Bf16Layer
    block.to(torch.bfloat16)
    return model


@functools.lru_cache(maxsize=None)
def reference(arch: str):
    return LogitsStep(tiny_decoder(arch, vocab_size=VOCAB, layers=LAYERS, seed=0))


@functools.lru_cache(maxsize=None)
def captures(arch: str):
    ref = reference(arch)
    return reference_captures(ref, PROMPTS, default_taps(ref), NEW)


@functools.lru_cache(maxsize=None)
def device(arch: str):
    """The reference's twin, transformed once with capture taps on every layer and router.
    Tests perturb its weights in place (the program's state is the graph module's)."""
    twin = copy.deepcopy(reference(arch))
    if arch == "mixtral":
        with_router_offsets(twin.model)
    taps = [nc.Tap(p, capture=True) for p in default_taps(twin)]
    return nc.transform(twin, (torch.zeros(2, 4, dtype=torch.long),), dynamic_shapes=DIMS, logit_mask=None, taps=taps)


@contextlib.contextmanager
def perturbed(t, key: str, change):
    weight = t.program.state_dict[key]
    saved = weight.clone()
    with torch.no_grad():
        weight.copy_(change(weight))
    try:
        yield
    finally:
        with torch.no_grad():
            weight.copy_(saved)


def mlp_weight(arch: str, i: int) -> str:
    return f"{layer(i)}.mlp.down_proj.weight" if arch == "llama" else f"{layer(i)}.mlp.experts.down_proj"


def router_offset(arch: str, i: int) -> str:
    return f"{router(arch, i)}.bias" if arch == "gpt_oss" else f"{router(arch, i)}.logit_offset"


OFFSET = torch.tensor([0.3, -0.3, 0.15, -0.15])


def assert_names_only(report, culprit: str):
    assert report.culprit == culprit, report.summary()
    assert report.ranking(1)[0].module == culprit
    others = [r for r in report.rows if r.module != culprit]
    assert len(others) == len(report.rows) - 1
    assert all(r.local_error <= ATOL for r in others), report.summary()
    row = report.culprit_row
    assert row.local_error > 100 * max(r.local_error for r in others)  # clearly apart from the noise
    assert row.alone.restored(ATOL), report.summary()  # replacing it alone restores the logits
    assert not report.baseline.restored(ATOL)          # and it did change them


# ----------------------------------------------------------------------------- must show: the culprit

@pytest.mark.parametrize("arch", ARCHS)
def test_nothing_perturbed_names_none(arch):
    report = localize(device(arch), captures(arch), PROMPTS, atol=ATOL)
    assert report.culprit is None, report.summary()
    assert len(report.rows) == LAYERS * (1 if arch == "llama" else 2)
    assert all(r.local_error <= ATOL and r.alone.restored(ATOL) for r in report.rows)
    assert report.baseline.restored(ATOL) and report.baseline.topk_agreement == 1.0
    assert "nothing diverges" in report.summary()


@FEW
@given(arch=st.sampled_from(ARCHS), i=st.integers(0, LAYERS - 1))
@example(arch="llama", i=0)
@example(arch="mixtral", i=LAYERS - 1)
@example(arch="gpt_oss", i=0)
@example(arch="gpt_oss", i=LAYERS - 1)
def test_mlp_weight_scaled_by_1_01_is_found(arch, i):
    t = device(arch)
    with perturbed(t, mlp_weight(arch, i), lambda w: w * 1.01):
        report = localize(t, captures(arch), PROMPTS, atol=ATOL)
    assert_names_only(report, layer(i))
    # upstream of the culprit the propagated error is the culprit's; from it on, none
    for k, row in enumerate(report.rows):
        assert row.propagated.restored(ATOL) == (k >= report.rows.index(report.culprit_row))


@FEW
@given(arch=st.sampled_from(("mixtral", "gpt_oss")), i=st.integers(0, LAYERS - 1))
@example(arch="mixtral", i=0)
@example(arch="gpt_oss", i=LAYERS - 1)
def test_router_logits_offset_is_found(arch, i):
    t = device(arch)
    with perturbed(t, router_offset(arch, i), lambda w: w + OFFSET):
        report = localize(t, captures(arch), PROMPTS, atol=ATOL)
    assert_names_only(report, router(arch, i))
    assert report.culprit_row.local_error == pytest.approx(0.3, rel=1e-3)  # the offset itself


@settings(max_examples=examples(2), deadline=None)
@given(arch=st.sampled_from(ARCHS), i=st.integers(0, LAYERS - 1))
@example(arch="llama", i=LAYERS - 1)
@example(arch="gpt_oss", i=0)
def test_layer_run_in_bf16_is_found(arch, i):
    """Exported per example (the perturbation is structural); taps on the layers only,
    since in an MoE layer run in bf16 its router is the first module to diverge."""
    ref = reference(arch)
    dev = LogitsStep(run_in_bf16(copy.deepcopy(ref.model), i))
    report = localize(dev, ref, PROMPTS, taps=["model.layers.*"], max_new_tokens=NEW, atol=ATOL)
    assert [r.module for r in report.rows] == [layer(k) for k in range(LAYERS)]
    assert_names_only(report, layer(i))
    assert report.reference_passes == len(PROMPTS) * (1 + NEW)


def test_bf16_moe_layer_with_router_taps_names_its_router_first():
    ref = reference("mixtral")
    dev = LogitsStep(run_in_bf16(copy.deepcopy(ref.model), 1))
    report = localize(dev, ref, PROMPTS, max_new_tokens=NEW, atol=ATOL)
    assert report.culprit == router("mixtral", 1)
    assert {r.module for r in report.ranking(2)} == {router("mixtral", 1), layer(1)}
    assert all(r.local_error > ATOL for r in report.ranking(2))
    assert all(r.local_error <= ATOL for r in report.rows if r.module not in (router("mixtral", 1), layer(1)))


# ----------------------------------------------------------------------------- one program, linear cost

def test_one_program_no_reexport_and_no_recompile(monkeypatch):
    exports = []
    real_export = torch.export.export
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: exports.append(1) or real_export(*a, **k))
    t = device("gpt_oss")
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    eager = t.graph_module
    t.graph_module = torch.compile(eager, backend=counting_backend)  # the program compiled, host feeding eager
    try:
        no_recompile = torch._dynamo.config.patch(error_on_recompile=True)
        with no_recompile, perturbed(t, mlp_weight("gpt_oss", 1), lambda w: w * 1.01):
            report = localize(t, captures("gpt_oss"), PROMPTS, atol=ATOL)
    finally:
        t.graph_module = eager
    assert exports == []  # a Transformed is never exported again
    assert len(graphs) == 1  # 13 passes, every tap switched on and off: one compiled graph
    assert report.culprit == layer(1) and report.forward_passes == 2 * 6 + 1
    # a plain module is exported exactly once, for every measurement
    ref = reference("llama")
    report = localize(copy.deepcopy(ref), ref, PROMPTS, max_new_tokens=NEW, atol=ATOL)
    assert len(exports) == 1 and report.forward_passes == 2 * LAYERS + 1 and report.culprit is None


def test_forward_passes_are_linear_in_the_tapped_modules_not_the_positions():
    t = device("gpt_oss")
    order = [r.module for r in localize(t, captures("gpt_oss"), PROMPTS, atol=ATOL).rows]
    calls = []
    hook = t.graph_module.register_forward_hook(lambda *a: calls.append(1))
    try:
        cost = {}
        for n in range(1, len(order) + 1):
            calls.clear()
            report = localize(t, captures("gpt_oss"), PROMPTS, taps=order[:n], atol=ATOL)
            assert [r.module for r in report.rows] == order[:n]
            assert report.forward_passes == len(calls)  # counted, not computed
            cost[n] = report.forward_passes
        calls.clear()
        one_prompt = localize(t, [captures("gpt_oss")[0]], PROMPTS[:1], taps=order[:2], atol=ATOL)
    finally:
        hook.remove()
    assert cost == {n: 2 * n + 1 for n in cost}
    # three prompts x 5 steps, or one: the same passes (positions are batched)
    assert one_prompt.forward_passes == len(calls) == cost[2]
    assert one_prompt.positions < localize(t, captures("gpt_oss"), PROMPTS, taps=order[:2]).positions


def test_static_program_shapes_are_padded_up_to():
    ref = reference("llama")
    static = nc.transform(copy.deepcopy(ref), (torch.zeros(4, 16, dtype=torch.long),), logit_mask=None,
                          taps=[nc.Tap("model.layers.*", capture=True)])
    with perturbed(static, mlp_weight("llama", 0), lambda w: w * 1.01):
        report = localize(static, captures("llama"), PROMPTS, atol=ATOL)
    assert_names_only(report, layer(0))
    assert report.positions == 4 * 16  # the program's bucket: one padding row, padded positions
    with pytest.raises(InputError, match=r"static shape \(4, 16\).*need \(5, 11\).*dynamic"):
        localize(static, captures("llama") + captures("llama")[:2], PROMPTS + PROMPTS[:2], atol=ATOL)


def test_graph_order_puts_each_router_before_its_layer():
    report = localize(device("gpt_oss"), captures("gpt_oss"), PROMPTS, atol=ATOL)
    assert [r.module for r in report.rows] == [m for i in range(LAYERS) for m in (router("gpt_oss", i), layer(i))]


def test_compiles_once_on_xla():
    require_torch_xla()
    import torch_xla
    import torch_xla.debug.metrics as metrics

    from neuron_constrain.decoding.xla import to_xla

    on_xla = to_xla(device("llama"))
    with perturbed(on_xla, mlp_weight("llama", 2), lambda w: w * 1.01):
        torch_xla.sync()
        before = (metrics.metric_data("CompileTime") or (0,))[0]
        report = localize(on_xla, captures("llama"), PROMPTS, atol=ATOL)
    assert report.culprit == layer(2), report.summary()
    assert metrics.metric_data("CompileTime")[0] - before == 1  # 7 passes, one XLA graph


# ----------------------------------------------------------------------------- teacher forcing

def test_teacher_forcing_matches_logit_validation():
    """The batched, teacher-forced passes see what logit_validation's step loop sees."""
    t = device("llama")
    with perturbed(t, mlp_weight("llama", 1), lambda w: w * 4.0):
        report = localize(t, captures("llama"), PROMPTS, atol=ATOL)
        validation = logit_validation(t, reference("llama"), PROMPTS, max_new_tokens=NEW + 1)
    assert validation.divergences  # the perturbation flips tokens, so retries happen
    firsts = [(validation.first_divergence(p), p) for p in range(len(PROMPTS))]
    first = min(f for f in firsts if f[0] is not None)
    assert report.baseline.first_divergence == (first[1], first[0])
    assert report.baseline.max_abs_error == pytest.approx(validation.max_abs_error, rel=1e-4)
    assert report.steps == NEW + 1 and report.culprit == layer(1)
    assert report.culprit_row.alone.restored(ATOL)


def test_nonfinite_logits_on_one_side_are_a_divergence():
    from neuron_constrain.replacement.localization import _max_error

    inf = float("inf")
    assert _max_error(torch.tensor([1.0, -inf]), torch.tensor([1.0, -inf])) == 0.0
    assert _max_error(torch.tensor([1.0, 2.0]), torch.tensor([1.0, -inf])) == inf
    assert _max_error(torch.tensor([float("nan"), 2.0]), torch.tensor([1.0, 2.0])) == inf
    assert _max_error(torch.tensor([1.5, 2.0]), torch.tensor([1.0, 2.0])) == 0.5


# ----------------------------------------------------------------------------- the report

def test_summary_json_and_plot(tmp_path):
    t = device("gpt_oss")
    with perturbed(t, router_offset("gpt_oss", 2), lambda w: w + OFFSET):
        report = localize(t, captures("gpt_oss"), PROMPTS, atol=ATOL)
    text = report.summary()
    assert f"culprit: {router('gpt_oss', 2)}" in text and "13 forward passes for 6 tapped modules" in text
    assert text.count("<- culprit") == 1
    data = json.loads(report.to_json())
    assert data["culprit"] == router("gpt_oss", 2) and data["forward_passes"] == 13
    assert [r["module"] for r in data["rows"]] == [r.module for r in report.rows]
    assert data["ranking"] == [router("gpt_oss", 2)]
    path = report.plot(tmp_path / "errors.png")
    assert path == str(tmp_path / "errors.png") and (tmp_path / "errors.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_is_skipped_with_a_note(tmp_path, monkeypatch, capsys):
    import sys

    report = localize(device("llama"), captures("llama"), PROMPTS, taps=[layer(0)], atol=ATOL)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert report.plot(tmp_path / "x.png") is None and not (tmp_path / "x.png").exists()
    assert capsys.readouterr().err.strip() == (
        "plot skipped: matplotlib is not installed (pip install 'neuron-constrain[plot]')"
    )


# ----------------------------------------------------------------------------- errors

def test_errors_name_the_problem_and_the_fix():
    ref = reference("llama")
    untapped = nc.transform(copy.deepcopy(ref), (torch.zeros(1, 4, dtype=torch.long),), logit_mask=None)
    with pytest.raises(InputError, match="has no taps.*capture=True"):
        localize(untapped, captures("llama"), PROMPTS)
    no_capture = nc.transform(copy.deepcopy(ref), (torch.zeros(1, 4, dtype=torch.long),), logit_mask=None,
                              taps=["model.layers.*"])
    with pytest.raises(InputError, match="do not return their computed values.*capture=True"):
        localize(no_capture, captures("llama"), PROMPTS)
    without_logits = [{k: v for k, v in c.items() if k != LOGITS} for c in captures("llama")]
    with pytest.raises(InputError, match="no 'logits' entry.*reference_captures"):
        localize(device("llama"), without_logits, PROMPTS)
    only_layer0 = [{k: v for k, v in c.items() if k in (LOGITS, layer(0))} for c in captures("llama")]
    with pytest.raises(InputError, match="no values for taps.*layers.1"):
        localize(device("llama"), only_layer0, PROMPTS)
    with pytest.raises(InputError, match="2 captures but 3 prompts"):
        localize(device("llama"), captures("llama")[:2], PROMPTS)
    with pytest.raises(InputError, match=r"\[batch, seq, vocab\] logits"):
        localize(LastLogits(copy.deepcopy(ref)), ref, PROMPTS, taps=[layer(0)], max_new_tokens=1)


class LastLogits(torch.nn.Module):
    def __init__(self, step):
        super().__init__()
        self.model = step.model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).logits[:, -1]


# ----------------------------------------------------------------------------- the command line

def test_cli_localize_on_saved_program_and_captures(tmp_path, capsys):
    from neuron_constrain.cli import main
    from neuron_constrain.replacement.files import save_captures

    t = device("gpt_oss")
    with perturbed(t, router_offset("gpt_oss", 1), lambda w: w + OFFSET):
        t.save(tmp_path / "tapped.pt2")  # the perturbed weights go into the file
    save_captures(tmp_path / "captures.safetensors", captures("gpt_oss"), PROMPTS)
    args = ["localize", str(tmp_path / "tapped.pt2"), "--captures", str(tmp_path / "captures.safetensors")]
    assert main(args + ["--json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png")]) == 1  # a culprit
    out = capsys.readouterr().out
    assert f"culprit: {router('gpt_oss', 1)}" in out and "13 forward passes for 6 tapped modules" in out
    assert json.loads((tmp_path / "r.json").read_text())["culprit"] == router("gpt_oss", 1)
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"
    t.save(tmp_path / "clean.pt2")
    assert main(["localize", str(tmp_path / "clean.pt2")] + args[2:]) == 0
    assert "nothing diverges" in capsys.readouterr().out


def test_cli_localize_taps_an_untapped_program_and_reports_bad_input(tmp_path, capsys):
    from neuron_constrain.cli import main
    from neuron_constrain.replacement.files import save_captures

    twin = copy.deepcopy(reference("llama"))
    twin.model.model.layers[2].mlp.down_proj.weight.data *= 1.01
    with torch.no_grad():
        plain = torch.export.export(twin, (torch.zeros(2, 4, dtype=torch.long),), dynamic_shapes=DIMS)
    torch.export.save(plain, tmp_path / "plain.pt2")
    save_captures(tmp_path / "captures.safetensors", captures("llama"), PROMPTS)
    capture_args = ["--captures", str(tmp_path / "captures.safetensors")]
    assert main(["localize", str(tmp_path / "plain.pt2")] + capture_args) == 1
    assert f"culprit: {layer(2)}" in capsys.readouterr().out
    assert main(["localize", str(tmp_path / "plain.pt2"), "--captures", str(tmp_path / "plain.pt2")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("neuron-constrain localize: error:") and "\n" not in err
    assert main(["localize", str(tmp_path / "plain.pt2")] + capture_args + ["--json", str(tmp_path / "no/r.json")]) == 2
    assert "does not exist" in capsys.readouterr().err
