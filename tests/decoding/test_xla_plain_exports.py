"""Lowering the programs users actually save: plain, grad-enabled exports of Hugging
Face RoPE decoders (Llama, Qwen2, Mistral), exported the default way
(``torch.export.export(step, (ids,))``, no ``no_grad``, no dynamic shapes).

Such a program holds a ``wrap_with_set_grad_enabled`` submodule (the rotary
embedding's ``@torch.no_grad()``) with ``device='cpu'`` baked into its code;
``move_to_device_pass`` rewrites its nodes but recompiles no GraphModule, so
unless ``to_xla`` recompiles them the stale code fails on XLA with ``Tensor device
mismatch``. The pass also edits the program it is given: ``to_xla``/``lower`` must
leave the caller's program untouched (devices, CPU calls, save and reload).

Main lane only (torch-xla); the CLI runs in-process through ``cli.main`` except for
one real ``neuron-constrain`` subprocess.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import neuron_constrain as nc
from neuron_constrain import cli
from neuron_constrain.kernels import pack_bool_mask
from neuron_constrain.testing import GreedyStep, random_ids, tiny_decoder
from neuron_constrain.core.transform import strip_added_outputs
from neuron_constrain.decoding.xla import hlo_parameters, lower, to_xla
from conftest import require_torch_xla

torch_xla = require_torch_xla()

VOCAB, PADDED, BATCH, SEQ = 1000, 1024, 2, 6
WIDTH = (VOCAB + 31) // 32
ARCHS = ("llama", "qwen2", "mistral")
SCRIPT = Path(sys.executable).parent / "neuron-constrain"


class Plain:
    """One architecture's tiny model, its plain export and the transformed program."""

    def __init__(self, arch: str):
        self.arch = arch
        self.model = tiny_decoder(arch, vocab_size=PADDED)
        self.ids = random_ids(BATCH, SEQ, VOCAB)
        assert torch.is_grad_enabled()
        self.program = torch.export.export(GreedyStep(self.model), (self.ids,))  # the default way
        self.transformed = nc.transform(self.program, vocab_size=VOCAB)
        with torch.no_grad():
            self.logits = self.model(input_ids=self.ids, use_cache=False).logits[:, -1, :VOCAB]


@pytest.fixture(scope="module")
def plain():
    cache: dict[str, Plain] = {}

    def get(arch: str) -> Plain:
        if arch not in cache:
            cache[arch] = Plain(arch)
        return cache[arch]

    return get


def allowed_mask(seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    allowed = torch.rand(BATCH, VOCAB, generator=generator) < 0.1
    allowed[:, 7] = True
    return allowed


def devices(program: torch.export.ExportedProgram) -> set[str]:
    """Every device the program names: weights, constants, example inputs, baked node args."""
    tensors = [*program.state_dict.values(), *program.constants.values()]
    if program.example_inputs is not None:
        tensors += torch.utils._pytree.tree_leaves(program.example_inputs)
    found = {str(v.device) for v in tensors if isinstance(v, torch.Tensor)}
    for module in program.graph_module.modules():
        if isinstance(module, torch.fx.GraphModule):
            for node in module.graph.nodes:
                if "device" in node.kwargs:
                    found.add(str(node.kwargs["device"]))
                if node.target == torch.ops.aten.to.device:
                    found.add(str(node.args[1]))
    return found


def submodule_code(program: torch.export.ExportedProgram) -> dict[str, str]:
    return {name: m.code for name, m in program.graph_module.named_modules() if isinstance(m, torch.fx.GraphModule)}


@pytest.mark.parametrize("arch", ARCHS)
def test_plain_export_holds_the_grad_submodule_with_cpu_baked_in(plain, arch):
    # the premise of this file: if a transformers upgrade drops it, the tests below test nothing
    p = plain(arch)
    code = submodule_code(p.program)
    nested = {name: text for name, text in code.items() if name}
    assert nested, f"{arch}: expected a wrap_with_set_grad_enabled submodule in a grad-enabled export"
    assert any("device(type='cpu')" in text for text in nested.values()), nested
    assert any(n.target is torch.ops.higher_order.wrap_with_set_grad_enabled for n in p.program.graph.nodes)


@pytest.mark.parametrize("arch", ARCHS)
def test_rewrite_check_hlo_commands_on_a_plain_export(plain, arch, tmp_path, capsys):
    p = plain(arch)
    saved, rewritten, hlo = tmp_path / f"{arch}.pt2", tmp_path / f"{arch}.rewritten.pt2", tmp_path / f"{arch}.hlo.txt"
    torch.export.save(p.program, saved)
    assert cli.main(["rewrite", str(saved), "-o", str(rewritten), "--vocab-size", str(VOCAB)]) == 0, capsys.readouterr()
    assert cli.main(["check", str(rewritten), "--vocab-size", str(VOCAB)]) == 0, capsys.readouterr()
    capsys.readouterr()
    assert cli.main(["hlo", str(rewritten), "-o", str(hlo)]) == 0, capsys.readouterr()
    listed = capsys.readouterr().out
    assert f"s32[{BATCH},{WIDTH}] logit_mask" in listed, listed
    assert f"s64[{BATCH},{SEQ}] input_ids" in listed, listed
    params = [(p.dtype, p.shape) for p in hlo_parameters(hlo.read_text())]
    assert ("s32", (BATCH, WIDTH)) in params, params


def test_hlo_command_subprocess_on_a_plain_export(plain, tmp_path):
    # the installed entry point, once: exit 0 and the mask listed as a parameter
    p = plain("llama")
    path = tmp_path / "llama.rewritten.pt2"
    torch.export.save(p.transformed.program, path)
    env = {**os.environ, "PJRT_DEVICE": "CPU"}
    result = subprocess.run([str(SCRIPT), "hlo", str(path), "-o", str(tmp_path / "out.hlo")],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert f"s32[{BATCH},{WIDTH}] logit_mask" in result.stdout, result.stdout


@pytest.mark.parametrize("arch", ARCHS)
def test_lower_names_the_mask_parameter_and_leaves_the_program(plain, arch, tmp_path):
    p = plain(arch)
    program = p.transformed.program
    before_devices, before_code = devices(program), submodule_code(program)
    lowering = lower(p.transformed)
    named = {q.name: (q.dtype, q.shape) for q in lowering.parameters if q.name in ("input_ids", "logit_mask")}
    assert named == {"input_ids": ("s64", (BATCH, SEQ)), "logit_mask": ("s32", (BATCH, WIDTH))}
    assert p.transformed.program is program
    assert devices(program) == before_devices == {"cpu"}
    assert submodule_code(program) == before_code
    check_still_a_cpu_program(p, tmp_path)


@pytest.mark.parametrize("arch", ARCHS)
def test_to_xla_tokens_equal_eager_and_leave_the_program(plain, arch, tmp_path):
    p = plain(arch)
    program = p.transformed.program
    before_devices, before_code = devices(program), submodule_code(program)
    device = torch_xla.device()
    on_xla = to_xla(p.transformed)
    assert isinstance(on_xla, nc.Transformed) and on_xla.program is not program
    assert devices(on_xla.program) == {str(device)}
    for seed in range(3):
        allowed = allowed_mask(seed)
        with torch.no_grad():
            tokens = on_xla(p.ids.to(device), logit_mask=pack_bool_mask(allowed).to(device)).cpu()
        expected = p.logits.masked_fill(~allowed, float("-inf")).argmax(-1)
        assert torch.equal(tokens, expected), (arch, seed, tokens, expected)
    with torch.no_grad():
        unmasked = on_xla(p.ids.to(device)).cpu()
    assert torch.equal(unmasked, p.logits.argmax(-1))
    # the plain (untransformed) program moves too: the caller's ExportedProgram is returned untouched
    plain_on_xla = to_xla(p.program)
    with torch.no_grad():
        assert torch.equal(plain_on_xla.module()(p.ids.to(device)).cpu(), p.logits.argmax(-1))
    assert devices(p.program) == {"cpu"}
    assert devices(program) == before_devices == {"cpu"}
    assert submodule_code(program) == before_code
    check_still_a_cpu_program(p, tmp_path)


def check_still_a_cpu_program(p: Plain, tmp_path: Path) -> None:
    """The caller's program runs on host inputs, saves and reloads, and the reload runs too."""
    allowed = allowed_mask(11)
    expected = p.logits.masked_fill(~allowed, float("-inf")).argmax(-1)
    fresh = nc.Transformed(p.transformed.program, p.transformed.report)  # a new module from the program
    with torch.no_grad():
        assert torch.equal(fresh(p.ids, logit_mask=pack_bool_mask(allowed)), expected)
    path = tmp_path / f"{p.arch}.saved.pt2"
    p.transformed.save(path)
    loaded = torch.export.load(path)
    assert devices(loaded) == {"cpu"}
    with torch.no_grad():
        out = loaded.module()(p.ids, logit_mask=pack_bool_mask(allowed))  # (tokens, logit_mask_empty)
    assert torch.equal(strip_added_outputs(out, p.transformed.report), expected)
