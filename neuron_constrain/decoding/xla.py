"""XLA lowering of rewritten programs: the path torch-neuronx takes to neuronx-cc.

    xla_step = to_xla(transformed)                 # a copy on the XLA device: Transformed (or ExportedProgram)
    lowering = lower(transformed)                  # HLO text of one call on its example inputs + parameter names
    hlo_parameters(lowering.text)                  # [HloParameter(0, "s32", (3, 32)), ...]
    neff = to_neff(transformed)                    # torch_neuronx.trace, where torch-neuronx is installed

How it works: exported graphs bake ``device='cpu'`` into some ops, so
``to_xla`` runs ``torch.export.passes.move_to_device_pass`` — on a copy of the
program (the pass edits the program it is given, and the caller's must keep
running on the host), then recompiles every GraphModule in it: the pass rewrites
node arguments but regenerates no code, and a grad-enabled export of a RoPE
decoder keeps ``device='cpu'`` in its ``wrap_with_set_grad_enabled`` submodule's
stale code (``Tensor device mismatch`` on XLA). Lowering calls the moved
program's module on XLA tensors (lazy: nothing runs) and asks torch-xla for the
HLO of the outputs. Inputs are copied from the host, so each is device data — an
HLO *parameter* (the mask included), never a constant folded into the graph: one
compiled graph serves every mask. Parameter names come from matching torch-xla's
device-data tensors (in parameter order) to the program's inputs and weights.

torch-xla is imported lazily (the latest lane has none); torch-neuronx too (not
installable here): a missing one raises :class:`MissingDependencyError` naming it.
"""
from __future__ import annotations

import copy
import dataclasses
import importlib
import re
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.utils import _pytree as pytree

from neuron_constrain.core.errors import Error

__all__ = [
    "HloLowering",
    "HloParameter",
    "MissingDependencyError",
    "example_inputs",
    "hlo_parameters",
    "lower",
    "to_neff",
    "to_xla",
    "xla_device",
]

INSTALL_HINTS = {
    "torch_xla": "torch-xla is not installed: lowering to HLO needs it (pip install torch-xla==2.9.0 "
                 "next to torch==2.9.0, or neuron-constrain[xla]; the main lane `make test` has it)",
    "torch_neuronx": "torch-neuronx is not installed: tracing to a NEFF needs it and neuronx-cc "
                     "(on a Neuron instance, from the AWS Neuron pip repository)",
}


class MissingDependencyError(Error, ImportError):
    """An optional package a function needs (torch-xla, torch-neuronx) is not installed."""


def _require(module: str):
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingDependencyError(INSTALL_HINTS[module]) from e


def xla_device() -> torch.device:
    """torch-xla's device.

    Returns:
        The device (``xla:0``).

    Raises:
        MissingDependencyError: torch-xla is not installed.
    """
    return _require("torch_xla").device()


def _program(program_or_transformed) -> ExportedProgram:
    return getattr(program_or_transformed, "program", program_or_transformed)


def _moved(program: ExportedProgram, device: torch.device | str) -> ExportedProgram:
    """A copy of ``program`` with its weights, example inputs and baked devices on
    ``device``, every GraphModule's code regenerated; ``program`` is unchanged.

    The copy shares no graph with ``program``; its host tensors are not copied
    (the pass replaces them in the copy's own dicts with moved ones).
    """
    import torch.export.passes  # not imported by `import torch` on 2.9

    tensors = [*program.state_dict.values(), *program.constants.values()]
    if program.example_inputs is not None:
        tensors += pytree.tree_leaves(program.example_inputs)
    shared = {id(t): t for t in tensors if isinstance(t, torch.Tensor)}
    moved = torch.export.passes.move_to_device_pass(copy.deepcopy(program, shared), device)
    for module in moved.graph_module.modules():  # nested ones too: higher-order ops' submodules
        if isinstance(module, torch.fx.GraphModule):
            module.recompile()
    return moved


def to_xla(program_or_transformed, device: torch.device | None = None):
    """A copy of the program (or ``Transformed``) on the XLA device: weights, example inputs and baked
    devices moved. The one given keeps running on the host and saves as it was.

    Args:
        program_or_transformed: an ``ExportedProgram`` or a ``Transformed``.
        device: any device (default torch-xla's).

    Returns:
        A copy of the same kind.

    Raises:
        MissingDependencyError: no ``device`` given and torch-xla is not installed.
    """
    device = device if device is not None else xla_device()
    program = _moved(_program(program_or_transformed), device)
    if isinstance(program_or_transformed, ExportedProgram):
        return program
    from neuron_constrain.core.transform import Transformed

    return Transformed(program, program_or_transformed.report)


def _hint(size) -> int:
    if isinstance(size, int):
        return size
    hint = size.node.hint
    if hint is None:
        raise ValueError(f"the program has no example inputs and its size {size} has no hint; pass the inputs")
    return int(hint)


def example_inputs(program_or_transformed) -> tuple[tuple, dict]:
    """Inputs to call a program with.

    Args:
        program_or_transformed: an ``ExportedProgram`` or a ``Transformed``.

    Returns:
        ``(args, kwargs)``: its saved example inputs, else zeros shaped like its placeholders (symbolic
        sizes at their hints).

    Raises:
        ValueError: no example inputs and a size without a hint.
    """
    program = _program(program_or_transformed)
    if program.example_inputs is not None:
        return program.example_inputs
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    leaves = []
    for spec in program.graph_signature.input_specs:
        if spec.kind != InputKind.USER_INPUT:
            continue
        val = placeholders[spec.arg.name].meta.get("val")
        if isinstance(val, torch.Tensor):
            leaves.append(torch.zeros([_hint(d) for d in val.shape], dtype=val.dtype))
        else:
            leaves.append(_hint(val) if isinstance(val, torch.SymInt) else val)
    return pytree.tree_unflatten(leaves, program.call_spec.in_spec)


@dataclasses.dataclass(frozen=True)
class HloParameter:
    """One parameter of the HLO entry computation: ``s32[3,32]`` is ("s32", (3, 32))."""

    index: int
    dtype: str
    shape: tuple[int, ...]
    name: str | None = None

    def __str__(self) -> str:
        return f"p{self.index} {self.dtype}[{','.join(map(str, self.shape))}]" + (f" {self.name}" if self.name else "")


@dataclasses.dataclass
class HloLowering:
    """What :func:`lower` returns.

    Attributes:
        text: the HLO text of the call.
        parameters: the entry computation's parameters, named where they are a user input, a weight
            or a buffer of the program.
    """

    text: str
    parameters: list[HloParameter]


_ENTRY = re.compile(r"^ENTRY\b.*?\{\s*$(?P<body>.*?)^\}", re.M | re.S)
_PARAMETER = re.compile(r"=\s*(?P<dtype>\w+)\[(?P<dims>[^\]]*)\](?:\{[^}]*\})?\s+parameter\((?P<index>\d+)\)")


def hlo_parameters(hlo_text: str, names: list[str | None] | None = None) -> list[HloParameter]:
    """The entry computation's parameters, by index: the canonical list tests compare (dtype and shape,
    independent of instruction numbering and of torch-xla's version).

    Args:
        hlo_text: HLO text (torch-xla's).
        names: a name per parameter, by index (ignored unless there is one per parameter).

    Returns:
        The parameters.

    Raises:
        ValueError: no ENTRY computation, or parameters not numbered ``0..n-1``.
    """
    entry = _ENTRY.search(hlo_text)
    if entry is None:
        raise ValueError("no ENTRY computation in this HLO text")
    found = {}
    for m in _PARAMETER.finditer(entry.group("body")):
        dims = tuple(int(d) for d in m.group("dims").split(",") if d.strip())
        found[int(m.group("index"))] = (m.group("dtype"), dims)
    if sorted(found) != list(range(len(found))):
        raise ValueError(f"the entry computation's parameters are not numbered 0..n-1: {sorted(found)}")
    names = names if names is not None and len(names) == len(found) else [None] * len(found)
    return [HloParameter(i, *found[i], name=names[i]) for i in range(len(found))]


def _to(value, device):
    return value.to(device) if isinstance(value, torch.Tensor) else value


def lower(program_or_transformed, args: tuple | None = None, kwargs: dict | None = None) -> HloLowering:
    """HLO of one call of the program on the XLA device (nothing is compiled or run, and the program given
    stays on the host: the copy :func:`to_xla` makes is lowered).

    Args:
        program_or_transformed: an ``ExportedProgram`` or a ``Transformed``.
        args: host tensors, every positional user input (default :func:`example_inputs`).
        kwargs: every keyword user input, the added ones too.

    Returns:
        The HLO text and its parameters (the mask one of them: one graph serves every mask).

    Raises:
        MissingDependencyError: torch-xla is not installed.
    """
    torch_xla = _require("torch_xla")
    device = torch_xla.device()
    if args is None and kwargs is None:
        args, kwargs = example_inputs(program_or_transformed)
    program = to_xla(_program(program_or_transformed), device)
    module = program.module()
    args = tuple(_to(a, device) for a in (args or ()))
    kwargs = {k: _to(v, device) for k, v in (kwargs or {}).items()}
    with torch.no_grad():
        outputs = [o for o in pytree.tree_leaves(module(*args, **kwargs)) if isinstance(o, torch.Tensor)]
    text = torch_xla._XLAC._get_xla_tensors_hlo(outputs)

    xla_id = torch_xla._XLAC._xla_get_tensor_id
    user_names = [s.arg.name for s in program.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    user_leaves = pytree.tree_leaves((args, kwargs))
    named = {xla_id(t): n for n, t in zip(user_names, user_leaves) if isinstance(t, torch.Tensor)}
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        named.setdefault(xla_id(t), name)
    ids, _ = torch_xla._XLAC._get_tensors_xla_device_data_node(outputs)
    return HloLowering(text, hlo_parameters(text, [named.get(i) for i in ids]))


class _Positional(torch.nn.Module):
    """The program's module called with every user input positionally (what tracers pass)."""

    def __init__(self, program: ExportedProgram):
        super().__init__()
        self.module = program.module()
        self.in_spec = program.call_spec.in_spec

    def forward(self, *leaves):
        args, kwargs = pytree.tree_unflatten(list(leaves), self.in_spec)
        return self.module(*args, **kwargs)


def to_neff(program_or_transformed, args: tuple | None = None, kwargs: dict | None = None, **trace_options) -> Any:
    """``torch_neuronx.trace`` of the rewritten program (a NEFF-backed module). Needs torch-neuronx and
    neuronx-cc.

    Args:
        program_or_transformed: an ``ExportedProgram`` or a ``Transformed``.
        args: example inputs to trace with (default :func:`example_inputs`).
        kwargs: keyword example inputs.
        **trace_options: keywords of ``torch_neuronx.trace``.

    Returns:
        The traced module: it takes every user input positionally, in the program's order (the added
        ``logit_mask`` last).

    Raises:
        MissingDependencyError: torch-neuronx is not installed.
    """
    torch_neuronx = _require("torch_neuronx")
    if args is None and kwargs is None:
        args, kwargs = example_inputs(program_or_transformed)
    program = _program(program_or_transformed)
    leaves = pytree.tree_leaves((tuple(args or ()), dict(kwargs or {})))
    return torch_neuronx.trace(_Positional(program), tuple(leaves), **trace_options)
