"""XLA lowering (main lane, torch-xla on the CPU): one compilation for every mask and
tap state, the mask as an HLO parameter, the ``hlo`` command, and torch-neuronx.

Compilations are counted with torch-xla's ``CompileTime`` metric. On the latest lane
(no torch-xla) these tests skip with the reason, except the ones that check what
happens without it.
"""
from __future__ import annotations

import copy
import functools
import importlib.util

import pytest
import torch

import neuron_constrain as nc
from neuron_constrain.testing import GreedyStep, random_ids, tiny_decoder
from neuron_constrain.decoding.xla import MissingDependencyError, example_inputs, hlo_parameters, lower, to_neff, to_xla
from test_backend import BATCH, PADDED, SEQ, TAPS, VOCAB, check_cases
from conftest import require_torch_xla
from cli_runner import run_cli

HAS_XLA = importlib.util.find_spec("torch_xla") is not None


@pytest.fixture
def xla():
    torch_xla = require_torch_xla()
    import torch_xla.debug.metrics as met

    return torch_xla, met


def compilations(met) -> int:
    data = met.metric_data("CompileTime")
    return 0 if data is None else data[0]


@functools.lru_cache(maxsize=None)
def exported_step(arch: str = "llama"):
    """(model, ids, program), exported once per arch and shared by the tests: read them, never edit them
    (``nc.transform`` and ``lower`` leave the program they are given as it was)."""
    model = tiny_decoder(arch, vocab_size=PADDED)
    ids = random_ids(BATCH, SEQ, VOCAB)
    with torch.no_grad():
        program = torch.export.export(GreedyStep(model), (ids,), dynamic_shapes=({0: torch.export.Dim("batch")},))
    return model, ids, program


# ----------------------------------------------------------------------------- zero recompiles


@pytest.mark.parametrize("arch", ["llama", "gpt_oss"])
def test_transformed_program_compiles_once_on_xla(xla, arch):
    torch_xla, met = xla
    model = tiny_decoder(arch, vocab_size=PADDED)
    ids = random_ids(BATCH, SEQ, VOCAB)
    transformed = nc.transform(GreedyStep(model), (ids,), dynamic_shapes=({0: torch.export.Dim("batch")},),
                               vocab_size=VOCAB, taps=TAPS)
    on_xla = to_xla(transformed)
    device = torch_xla.device()
    met.clear_all()
    with torch.no_grad():
        check_cases(model, ids, lambda ids, mask: on_xla(
            ids.to(device), **({} if mask is None else {"logit_mask": mask.to(device)})
        ))
    assert compilations(met) == 1, f"expected one XLA compilation for every mask and tap state, got {compilations(met)}"


@pytest.mark.parametrize("arch", ["llama", "gpt_oss"])
def test_openxla_backend_compiles_once(xla, arch):
    torch_xla, met = xla
    torch._dynamo.reset()
    device = torch_xla.device()
    model = tiny_decoder(arch, vocab_size=PADDED)
    ids = random_ids(BATCH, SEQ, VOCAB)
    on_device = copy.deepcopy(model).to(device)  # the eager reference runs `model` on the host
    compiled = nc.compile(GreedyStep(on_device), inner="openxla", vocab_size=VOCAB, taps=TAPS)
    met.clear_all()
    try:
        with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
            check_cases(model, ids, lambda ids, mask: compiled(
                ids.to(device), logit_mask=None if mask is None else mask.to(device)
            ))
    finally:
        torch._dynamo.reset()
    assert compiled.backend.graphs_compiled == 1
    assert compilations(met) == 1, f"expected one XLA compilation, got {compilations(met)}"


# ----------------------------------------------------------------------------- moving a program


def graph_code(program) -> dict[str, str]:
    return {name: m.code for name, m in program.graph_module.named_modules() if isinstance(m, torch.fx.GraphModule)}


def test_to_xla_moves_a_copy_and_regenerates_nested_code():
    # No torch-xla needed (the meta device stands in for XLA): runs on both lanes. A
    # grad-enabled export keeps device='cpu' in a wrap_with_set_grad_enabled submodule;
    # move_to_device_pass edits its nodes in place and regenerates no code.
    model = tiny_decoder("llama", vocab_size=256, hidden_size=32)
    ids = random_ids(2, 5, 250)
    program = torch.export.export(GreedyStep(model), (ids,))
    nested = [m for name, m in program.graph_module.named_modules() if name and isinstance(m, torch.fx.GraphModule)]
    assert nested and any("device(type='cpu')" in m.code for m in nested)
    t = nc.transform(program, vocab_size=250)
    code = graph_code(t.program)
    with torch.no_grad():
        expected = model(input_ids=ids, use_cache=False).logits[:, -1, :250].argmax(-1)
    meta = torch.device("meta")
    all_allowed = torch.full((2, 8), -1, dtype=torch.int32, device=meta)
    with torch.no_grad():
        tokens = to_xla(t, meta)(ids.to(meta))
        raw_tokens, empty = to_xla(t.program, meta).module()(ids.to(meta), logit_mask=all_allowed)
    for out in (tokens, raw_tokens):
        assert out.device == meta and out.shape == (2,)
    assert empty.device == meta
    # the caller's program is as it was: on the host, same code, runs, and a fresh module from it too
    assert {str(v.device) for v in t.program.state_dict.values()} == {"cpu"}
    assert graph_code(t.program) == code
    with torch.no_grad():
        assert torch.equal(t(ids), expected)
        assert torch.equal(nc.Transformed(t.program, t.report)(ids), expected)


# ----------------------------------------------------------------------------- HLO


HLO_SNIPPET = """HloModule IrToHlo.12, entry_computation_layout={(s32[3,32]{1,0}, f32[])->(s64[3]{0})}

%AddComputation.1 (x.2: f32[], y.3: f32[]) -> f32[] {
  %x.2 = f32[] parameter(0)
  %y.3 = f32[] parameter(1)
  ROOT %add.4 = f32[] add(f32[] %x.2, f32[] %y.3)
}

ENTRY %IrToHlo.12 (p0.1: s32[3,32], p1.5: f32[]) -> (s64[3]) {
  %p1.5 = f32[] parameter(1)
  %p0.1 = s32[3,32]{1,0} parameter(0)
  ROOT %tuple.11 = (s64[3]{0}) tuple(s64[3]{0} %p0.1)
}
"""


def test_hlo_parameters_reads_the_entry_computation_only():
    params = hlo_parameters(HLO_SNIPPET, ["logit_mask", None])
    assert [(p.index, p.dtype, p.shape, p.name) for p in params] == [(0, "s32", (3, 32), "logit_mask"), (1, "f32", (), None)]
    assert str(params[0]) == "p0 s32[3,32] logit_mask"
    with pytest.raises(ValueError, match="no ENTRY computation"):
        hlo_parameters("HloModule empty")


@pytest.mark.parametrize("mask_format, dtype, width", [("packed", "s32", (VOCAB + 31) // 32), ("bool", "pred", VOCAB)])
def test_lowered_hlo_takes_the_mask_as_a_parameter(xla, mask_format, dtype, width):
    _, met = xla
    _, ids, program = exported_step()
    transformed = nc.transform(program, logit_mask=mask_format, vocab_size=VOCAB)
    met.clear_all()
    plain, rewritten = lower(program), lower(transformed)
    assert compilations(met) == 0, "lowering must not compile"
    inputs = {p.name: (p.dtype, p.shape) for p in rewritten.parameters if p.name in ("input_ids", "logit_mask")}
    assert inputs == {"input_ids": ("s64", (BATCH, SEQ)), "logit_mask": (dtype, (BATCH, width))}
    # the mask is the only new tensor parameter (the inserted code adds a few scalars: -inf, 0)
    canonical = lambda ps: sorted((p.dtype, p.shape) for p in ps if p.shape)  # noqa: E731
    assert canonical(rewritten.parameters) == sorted(canonical(plain.parameters) + [(dtype, (BATCH, width))])
    assert "logit_mask" not in {p.name for p in plain.parameters}


def test_hlo_command_writes_the_rewritten_program(tmp_path, xla):
    _, _, program = exported_step()
    path = tmp_path / "llama.rewritten.pt2"
    torch.export.save(nc.transform(program, vocab_size=VOCAB).program, path)
    out = tmp_path / "llama.hlo.txt"
    # in-process cli.main; the installed console script's hlo runs in test_xla_plain_exports
    result = run_cli("hlo", path, "-o", out)
    assert result.returncode == 0, result.stderr
    assert f"s32[{BATCH},32] logit_mask" in result.stdout, result.stdout  # the inputs' parameters are listed
    params = hlo_parameters(out.read_text())
    assert ("s32", (BATCH, 32)) in [(p.dtype, p.shape) for p in params]
    to_stdout = run_cli("hlo", path)
    assert to_stdout.returncode == 0 and to_stdout.stdout == out.read_text()


@pytest.mark.skipif(HAS_XLA, reason="torch-xla is installed on this lane; its absence is checked on the latest lane")
def test_hlo_command_without_torch_xla_says_what_to_install(tmp_path):
    _, _, program = exported_step()
    path = tmp_path / "llama.pt2"
    torch.export.save(program, path)
    result = run_cli("hlo", path)  # in-process cli.main: torch-xla is absent from this interpreter too
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip() == (
        "neuron-constrain hlo: error: torch-xla is not installed: lowering to HLO needs it (pip install "
        "torch-xla==2.9.0 next to torch==2.9.0, or neuron-constrain[xla]; the main lane `make test` has it)"
    )
    with pytest.raises(MissingDependencyError, match="torch-xla is not installed"):
        lower(program)


def test_example_inputs_without_saved_ones_use_the_size_hints():
    _, ids, program = exported_step()
    transformed = nc.transform(program, vocab_size=VOCAB)
    args, kwargs = example_inputs(transformed)
    assert torch.equal(args[0], ids) and kwargs["logit_mask"].shape == (BATCH, 32)
    transformed.program._example_inputs = None  # as in programs saved without them
    (zeros,), kwargs = example_inputs(transformed)
    assert zeros.shape == ids.shape and zeros.dtype == ids.dtype
    assert kwargs["logit_mask"].shape == (BATCH, 32) and kwargs["logit_mask"].dtype == torch.int32


# ----------------------------------------------------------------------------- torch-neuronx


def test_neff_needs_torch_neuronx():
    if importlib.util.find_spec("torch_neuronx") is not None:
        pytest.skip("torch-neuronx is installed: test_neff_trace runs instead")
    _, _, program = exported_step()
    with pytest.raises(MissingDependencyError, match="torch-neuronx is not installed"):
        to_neff(nc.transform(program, vocab_size=VOCAB))


def test_neff_trace():
    pytest.importorskip("torch_neuronx", reason="torch-neuronx is not installable here (PyPI has a placeholder); runs on Neuron hosts")
    model, ids, program = exported_step()
    traced = to_neff(nc.transform(program, vocab_size=VOCAB))
    mask = torch.full((BATCH, 32), -1, dtype=torch.int32)
    tokens = traced(ids, mask)
    tokens = tokens[0] if isinstance(tokens, tuple) else tokens
    assert tokens.shape == (BATCH,)
