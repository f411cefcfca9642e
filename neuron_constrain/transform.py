"""``transform(model)``: export, run the passes, and wrap the result as a callable module."""
from __future__ import annotations

import time
from typing import Any, Sequence

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, TensorArgument
from torch.utils import _pytree as pytree

from neuron_constrain.errors import EmptyMaskRowError, InputError
from neuron_constrain.passes import mask_logits_pass
from neuron_constrain.passes.mask_logits_pass import EMPTY_OUTPUT
from neuron_constrain.report import AddedInput, TransformReport

__all__ = ["transform", "Transformed"]


def _tracing() -> bool:
    return torch.compiler.is_compiling() or torch.compiler.is_exporting()


class Transformed(torch.nn.Module):
    """A rewritten program you can call, export again, compile or save.

    Call it with the original arguments plus the inputs the passes added, as
    keywords (``logit_mask=``). An added input you leave out is fed its neutral
    value (an all-allowed mask), so constrained and unconstrained traffic run the
    same compiled graph.
    """

    def __init__(self, program: ExportedProgram, report: TransformReport):
        super().__init__()
        self.program = program
        self.report = report
        self._added: list[AddedInput] = report.inputs_added
        added = {i.name for i in self._added}
        self._user_specs = [
            s for s in program.graph_signature.input_specs
            if s.kind == InputKind.USER_INPUT and s.arg.name not in added
        ]
        placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
        # (leaf index, dim, symbol) for every symbolic size of a user input: plain
        # data, so forward() never touches fake tensors (dynamo traces it).
        self._symbolic_dims = []
        for leaf, spec in enumerate(self._user_specs):
            if not isinstance(spec.arg, TensorArgument):
                continue
            for dim, size in enumerate(placeholders[spec.arg.name].meta["val"].shape):
                if isinstance(size, torch.SymInt):
                    self._symbolic_dims.append((leaf, dim, size.node.expr))
        args_index, kwargs_index = pytree.tree_unflatten(
            list(range(program.call_spec.in_spec.num_leaves)), program.call_spec.in_spec
        )
        self._kwarg_order = [k for k in kwargs_index if k not in added]
        # Unlifting may rewrite placeholder metadata: read the symbolic sizes first.
        self.graph_module = program.module()
        self._flag_outputs = sum(EMPTY_OUTPUT in r.outputs_added for r in report.passes.values())

    # ------------------------------------------------------------------ feeding added inputs
    def _bindings(self, args: tuple, kwargs: dict) -> tuple[dict, torch.device]:
        ordered = {k: kwargs[k] for k in self._kwarg_order if k in kwargs}
        leaves = pytree.tree_leaves((args, ordered))
        bindings: dict = {}
        for leaf, dim, symbol in self._symbolic_dims:
            bindings.setdefault(symbol, leaves[leaf].shape[dim])
        device = next((x.device for x in leaves if isinstance(x, torch.Tensor)), torch.device("cpu"))
        return bindings, device

    def _feed(self, info: AddedInput, value, bindings: dict, device: torch.device) -> torch.Tensor:
        shape = info.shape_for(bindings)
        if value is None:
            return torch.full(shape, info.fill, dtype=info.dtype, device=device)
        if not isinstance(value, torch.Tensor):
            raise InputError(f"{info.name} must be a tensor ({info.describe()}), got {type(value).__name__}")
        if _tracing():
            return value
        if value.dtype != info.dtype:
            raise InputError(
                f"{info.name} has dtype {value.dtype} but the graph takes {info.dtype} ({info.doc}); "
                f"convert it with .to({info.dtype})"
            )
        if tuple(value.shape) != tuple(shape):
            raise InputError(
                f"{info.name} has shape {tuple(value.shape)} but these inputs need {tuple(shape)} ({info.doc}): "
                f"one row per logits row and {shape[-1]} columns"
            )
        if value.device != device:
            raise InputError(f"{info.name} is on {value.device} but the model's inputs are on {device}; move it with .to({str(device)!r})")
        return value

    def forward(self, *args, **kwargs):
        extras = {i.name: kwargs.pop(i.name, None) for i in self._added}
        bindings, device = self._bindings(args, kwargs)
        for info in self._added:
            kwargs[info.name] = self._feed(info, extras[info.name], bindings, device)
        out = self.graph_module(*args, **kwargs)
        if not self._flag_outputs:
            return out
        out, *flags = out
        for empty in flags:
            if _tracing():
                torch._assert_async(empty.any().logical_not(), "logit_mask allows no token in some row")
            elif bool(empty.any()):
                raise EmptyMaskRowError([tuple(r) if len(r) > 1 else r[0] for r in empty.nonzero().tolist()])
        return out

    def save(self, path) -> None:
        torch.export.save(self.program, path)


def transform(
    model: torch.nn.Module | ExportedProgram,
    example_inputs: Sequence[Any] = (),
    *,
    example_kwargs: dict | None = None,
    dynamic_shapes: Any = None,
    logit_mask: str | None = "packed",
    vocab_size: int | None = None,
    empty_row: str | int = "flag",
    strict: bool = False,
) -> Transformed:
    """Export ``model`` (unless it is already an ``ExportedProgram``) and rewrite it.

    ``logit_mask``: "packed" (xgrammar int32 bitmask), "bool", or None to skip the
    mask pass. ``vocab_size``: the tokenizer's vocabulary when the lm_head is
    padded past it. ``empty_row``: "flag" or a fallback token id (see the pass).
    """
    report = TransformReport()
    start = time.perf_counter()
    if isinstance(model, ExportedProgram):
        program = model
    else:
        # Decoding is inference: exporting under no_grad keeps a model's own no_grad
        # blocks (MoE routing) from becoming set_grad higher-order ops in the graph.
        with torch.no_grad():
            program = torch.export.export(
                model, tuple(example_inputs), kwargs=example_kwargs, dynamic_shapes=dynamic_shapes, strict=strict
            )
    report.export_seconds = time.perf_counter() - start
    start = time.perf_counter()
    if logit_mask is not None:
        program, report.passes["logit_mask"] = mask_logits_pass(
            program, mask_format=logit_mask, vocab_size=vocab_size, empty_row=empty_row
        )
    report.transform_seconds = time.perf_counter() - start
    return Transformed(program, report)
