"""``transform(model)``: export, run the passes, and wrap the result as a callable module."""
from __future__ import annotations

import time
from typing import Any, Sequence

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, TensorArgument
from torch.utils import _pytree as pytree

from neuron_constrain.core.tap_context import record_captures, tap_input
from neuron_constrain.core.errors import EmptyMaskRowError, InputError, TransformError
from neuron_constrain.passes import mask_logits_pass, process_logits_pass, tap_modules_pass
from neuron_constrain.core.mask_interface import is_empty_output
from neuron_constrain.core.pass_manager import PassManager
from neuron_constrain.core.processor_interface import DEFAULT_WIDTHS
from neuron_constrain.core.report import AddedInput, TransformReport, unsizable
from neuron_constrain.core.tap_interface import CAPTURE_PREFIX, Tap, as_taps, match_modules

__all__ = ["PASSES", "transform", "Transformed"]

# The passes transform() runs, through the pass manager: their contracts order them, each
# gets the options it declares (one value of an option two passes share) and is left out
# when its switch is None.
PASSES = (tap_modules_pass, mask_logits_pass, process_logits_pass)


def _tracing() -> bool:
    return torch.compiler.is_compiling() or torch.compiler.is_exporting()


class Transformed(torch.nn.Module):
    """A rewritten program you can call, export again, compile or save.

    Call it with the original arguments plus the inputs the passes added, as
    keywords (``logit_mask=``). An added input you leave out is fed its neutral
    value (an all-allowed mask), so constrained and unconstrained traffic run the
    same compiled graph. Calling it returns the original program's outputs and raises
    :class:`EmptyMaskRowError` when a mask row allows no token (``empty_row="flag"``).

    Args:
        program: the rewritten ``ExportedProgram``.
        report: what the passes found and added (:class:`TransformReport`).

    Raises:
        InputError: on a call, an input the program does not take, or a mask of the wrong
            dtype, shape or width.
        EmptyMaskRowError: on a call, a mask row allows no token (the rows are named).
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
        self._num_args = len(args_index)
        self._known_kwargs = frozenset(self._kwarg_order) | added
        root = program.module_call_graph[0].signature if program.module_call_graph else None
        names = list(getattr(root, "forward_arg_names", None) or [])
        self._arg_names = names[: self._num_args] if len(names) >= self._num_args else [f"arg{i}" for i in range(self._num_args)]
        bound = {symbol for _, _, symbol in self._symbolic_dims}
        for info in self._added:
            problem = unsizable(info.shape, bound)
            if problem:
                raise TransformError(
                    f"{info.name} would have the shape {info.describe()}, but {problem}: the runtime could not "
                    "size it from the call's inputs. Export that dimension static, or let the logits keep the "
                    "input's own size (e.g. slice with logits[:, -1] rather than a strided or computed range)"
                )
        # Unlifting may rewrite placeholder metadata: read the symbolic sizes first.
        self.graph_module = program.module()

    # ------------------------------------------------------------------ feeding added inputs
    def _bindings(self, args: tuple, kwargs: dict) -> tuple[dict, torch.device]:
        ordered = {k: kwargs[k] for k in self._kwarg_order if k in kwargs}
        leaves = pytree.tree_leaves((args, ordered))
        bindings: dict = {}
        for leaf, dim, symbol in self._symbolic_dims:
            bindings.setdefault(symbol, leaves[leaf].shape[dim])
        device = next((x.device for x in leaves if isinstance(x, torch.Tensor)), torch.device("cpu"))
        return bindings, device

    @staticmethod  # also feeds the graphs of the torch.compile backend (decoding/dynamo_backend.py)
    def _feed(info: AddedInput, value, bindings: dict, device: torch.device) -> torch.Tensor:
        shape = info.shape_for(bindings)
        if value is None and info.tap is not None:
            tap, role = info.tap
            fed = tap_input(tap, shape, info.dtype, device, role)
            if fed is not None:
                return fed
        if value is None:
            if info.fill is None:
                raise InputError(f"{info.name} is required ({info.describe()}: {info.doc}); pass {info.name}=")
            # Made on the host and moved: on XLA a fill op would be a different graph
            # from a fed tensor (a recompile); a transfer is the same graph.
            return torch.full(shape, info.fill, dtype=info.dtype).to(device)
        if not isinstance(value, torch.Tensor):
            raise InputError(f"{info.name} must be a tensor ({info.describe()}), got {type(value).__name__}")
        if _tracing():
            return value
        if value.dtype != info.dtype:
            if info.vocab_size is not None and value.dtype == torch.bool:
                fix = "pack it with neuron_constrain.kernels.pack_bool_mask(mask) (bool [rows, V] -> int32 [rows, ceil(V/32)])"
            elif info.vocab_size is not None and value.dtype == torch.int32:
                fix = f"unpack it with neuron_constrain.kernels.unpack_bitmask(mask, {info.vocab_size})"
            else:
                fix = f"convert it with .to({info.dtype})"
            raise InputError(f"{info.name} has dtype {value.dtype} but the graph takes {info.dtype} ({info.doc}); {fix}")
        if tuple(value.shape) != tuple(shape):
            columns = f"{shape[-1]} columns" if len(shape) > 1 else ""
            if info.vocab_size is not None and info.dtype == torch.int32:
                columns = f"ceil({info.vocab_size}/32) = {shape[-1]} int32 words"
            elif info.vocab_size is not None:
                columns = f"{info.vocab_size} columns, one per token"
            raise InputError(
                f"{info.name} has shape {tuple(value.shape)} but these inputs need {tuple(shape)} ({info.doc})"
                + (f": one row per logits row and {columns}" if columns else "")
            )
        if value.device != device:
            raise InputError(f"{info.name} is on {value.device} but the model's inputs are on {device}; move it with .to({str(device)!r})")
        if info.bounds is not None and value.device.type == "cpu":  # on a device, reading it back would sync
            low, high = info.bounds
            if bool(((value < low) | (value >= high)).any()):
                raise InputError(f"{info.name}={value.tolist()} is outside [{low}, {high}) ({info.doc})")
        # the graph was traced on contiguous inputs (its views assume their strides): a
        # transposed or sliced mask is copied, never a "view size is not compatible" error
        return value.contiguous()

    def _arrange(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Positional inputs passed by name move to their place; anything else unknown raises."""
        if len(args) == self._num_args and self._known_kwargs.issuperset(kwargs):
            return args, kwargs
        if len(args) < self._num_args:
            missing = self._arg_names[len(args):]
            if all(n in kwargs for n in missing):
                kwargs = dict(kwargs)
                args = tuple(args) + tuple(kwargs.pop(n) for n in missing)
        unknown = sorted(set(kwargs) - self._known_kwargs)
        if len(args) != self._num_args or unknown:
            takes = ", ".join(self._arg_names) or "nothing"
            keywords = ", ".join([*self._kwarg_order, *(i.name for i in self._added)])
            raise InputError(
                f"this program takes {self._num_args} positional input(s) ({takes}) and the keywords ({keywords}); "
                f"got {len(args)} positional" + (f" and unknown keyword(s) {unknown}" if unknown else "")
                + ": call it as it was exported, e.g. t(" + ", ".join(self._arg_names) + ", logit_mask=...)"
            )
        return args, kwargs

    @torch.compiler.disable
    def _with_added_inputs(self, args: tuple, kwargs: dict) -> dict:
        # Host code outside any compiled region: whether a tap is on or a mask was
        # given, the compiled graph sees the same tensors-only call (no recompile).
        kwargs = dict(kwargs)
        extras = {i.name: kwargs.pop(i.name, None) for i in self._added}
        bindings, device = self._bindings(args, kwargs)
        for info in self._added:
            kwargs[info.name] = self._feed(info, extras[info.name], bindings, device)
        return kwargs

    def forward(self, *args, **kwargs):
        """Run the program (what calling the model does).

        Args:
            *args: the original program's inputs.
            **kwargs: its keyword inputs and the added ones (``logit_mask=``, processor inputs...); an added
                input left out is fed its neutral value.

        Returns:
            The original program's outputs (the added outputs, such as the empty-row flags, taken off).

        Raises:
            InputError: an input the program does not take, or a mask of the wrong dtype, shape or width.
            EmptyMaskRowError: a mask row allows no token (``empty_row="flag"``); :meth:`run` returns the
                flags instead.
        """
        if not _tracing():
            args, kwargs = self._arrange(args, kwargs)
        kwargs = self._with_added_inputs(args, kwargs)
        return strip_added_outputs(self.graph_module(*args, **kwargs), self.report)

    def run(self, *args, **kwargs) -> tuple[Any, dict[str, torch.Tensor]]:
        """Call the program and return the empty-row flags instead of raising.

        A runtime fails only the flagged requests
        (``StructuredRuntime.accept_rows(batch, tokens, empty=...)``).

        Args:
            *args: the original program's inputs.
            **kwargs: its keyword inputs and the added ones (``logit_mask=``, processor inputs...).

        Returns:
            ``(outputs, empty_rows)``: the program's own outputs, and each mask input's name
            (``"logit_mask"``, ``"logit_mask_1"``...) mapped to its bool flag per row, unread, on the
            outputs' device (read it when you read the tokens: on torch-xla that is one transfer,
            not a sync of its own).

        Raises:
            InputError: an input the program does not take, or a mask that does not fit.
        """
        args, kwargs = self._arrange(args, kwargs)
        kwargs = self._with_added_inputs(args, kwargs)
        empty_rows: dict[str, torch.Tensor] = {}
        out = strip_added_outputs(self.graph_module(*args, **kwargs), self.report, empty_rows=empty_rows)
        return out, empty_rows

    def save(self, path) -> None:
        """Save the rewritten program as a ``.pt2`` that loads and runs without this library.

        Args:
            path: the file to write (``torch.export.save``).
        """
        torch.export.save(self.program, path)


def _on_host(value: torch.Tensor) -> torch.Tensor:
    """A flag to read on the host. On XLA, materialise every pending output in one
    graph first: reading the flag alone would compile a second graph for it."""
    if value.device.type != "xla":
        return value
    import torch_xla

    torch_xla.sync()
    return value.cpu()


def strip_added_outputs(out, report: TransformReport, *, empty_rows: dict | None = None):
    """The program's own outputs; acts on what the passes added.

    Each pass that adds outputs wraps the outputs so far as ``(outputs, *added)``:
    unwrap in reverse order. ``logit_mask_empty`` rows raise
    :class:`EmptyMaskRowError`, or with ``empty_rows`` given go into it unread (mask
    input name -> flags); ``capture_*`` values go to
    :func:`neuron_constrain.replacement.recording_captures`.
    """
    captures = {}
    for passed in reversed(list(report.passes.values())):
        if not passed.outputs_added:
            continue
        out, *added = out
        for name, value in zip(passed.outputs_added, added):
            if is_empty_output(name):
                mask = name[: -len("_empty")]
                if empty_rows is not None:
                    empty_rows[mask] = value
                elif _tracing():
                    torch._assert_async(value.any().logical_not(), f"{mask} allows no token in some row")
                elif value.device.type == "meta":
                    continue  # shapes only: there is no flag to read
                elif bool((flag := _on_host(value)).any()):
                    rows = [tuple(r) if len(r) > 1 else r[0] for r in flag.nonzero().tolist()]
                    raise EmptyMaskRowError(rows, mask)
            elif name.startswith(CAPTURE_PREFIX):
                captures[name[len(CAPTURE_PREFIX):]] = value
            else:
                raise TransformError(f"the program returns {name!r}, which no pass of this library adds")
    if captures and not _tracing():
        record_captures(captures)
    return out


def transform(
    model: torch.nn.Module | ExportedProgram,
    example_inputs: Sequence[Any] = (),
    *,
    example_kwargs: dict | None = None,
    dynamic_shapes: Any = None,
    logit_mask: str | None = "packed",
    vocab_size: int | None = None,
    empty_row: str | int = "flag",
    tp_degree: int = 1,
    taps: Sequence[str | Tap] = (),
    sequence_parallel: int = 1,
    processors: Sequence | None = None,
    max_stop_tokens: int = DEFAULT_WIDTHS["max_stop_tokens"],
    max_bias_tokens: int = DEFAULT_WIDTHS["max_bias_tokens"],
    max_penalty_tokens: int = DEFAULT_WIDTHS["max_penalty_tokens"],
    num_speculative_tokens: int = 0,
    strict: bool = False,
    check_contracts: bool = True,
) -> Transformed:
    """Export ``model`` (unless it is already an ``ExportedProgram``) and rewrite it.

    Runs the passes of ``transform.PASSES`` (taps, then the mask, then the processors) through
    the pass manager, each only where its option asks for it.

    Args:
        model: a module ``torch.export`` can trace (a decode step returning tokens or logits),
            or a program already exported.
        example_inputs: positional example inputs for the export.
        example_kwargs: keyword example inputs for the export.
        dynamic_shapes: as ``torch.export.export`` takes them (e.g. a batch ``Dim``).
        logit_mask: ``"packed"`` (xgrammar's int32 bitmask, ``[rows, ceil(V/32)]``), ``"bool"``
            (``[rows, V]``), or ``None`` to leave the mask pass out.
        vocab_size: the tokenizer's vocabulary when the lm_head is padded past it (columns at or
            past it are never allowed); with several heads, one size per head, the main head first.
        empty_row: ``"flag"`` (a row that allows no token is reported: ``EmptyMaskRowError``, or
            the flags of :meth:`Transformed.run`) or a token id such a row allows instead.
        tp_degree: ranks of a vocab-parallel lm_head; ``model`` is then one rank's step (its
            logits that rank's shard) and the program gains a required ``tp_rank`` input (int32
            ``[1]``); ``vocab_size`` stays the full vocabulary.
        taps: module path patterns (``"model.layers.*.mlp.router"``) or :class:`Tap` objects whose
            outputs reference tensors can replace at run time.
        sequence_parallel: ranks the tapped values' token dim is split over (adds a ``tap_rank``
            input).
        processors: logits processors run in the graph after the mask: built-in
            ``"min_tokens"``, ``"logit_bias"``, ``"penalties"``, ``"thinking_budget"``,
            ``"min_p"``, or custom ones (see :class:`neuron_constrain.processors.ProcessorState`).
        max_stop_tokens: fixed per-row width of the stop ids min_tokens masks.
        max_bias_tokens: fixed per-row width of logit_bias's ids.
        max_penalty_tokens: fixed per-row width of the distinct tokens penalties see.
        num_speculative_tokens: draft tokens per request; above 0 only ``"min_tokens"`` and
            ``"thinking_budget"`` are allowed.
        strict: ``torch.export``'s strict mode.
        check_contracts: check each pass's ``requires`` / ``ensures`` around it; off saves their
            graph walks.

    Returns:
        The rewritten program, callable with the original inputs plus the added ones as keywords;
        its ``report`` says what each pass found and added.

    Raises:
        TransformError: a bad option (``taps="x"`` instead of a list, a ``vocab_size`` wider than
            the logits, an unknown processor, ...).
        PassError: a pass failed or broke its contract; names the pass and the passes before it,
            with the pass's own error as its cause.
    """
    for option, value in (("taps", taps), ("processors", processors)):
        if isinstance(value, str):
            raise TransformError(f"{option}={value!r} is a string; pass a list: {option}=[{value!r}]")
    _check_vocab_size(vocab_size)
    taps = as_taps(taps)
    start = time.perf_counter()
    if isinstance(model, ExportedProgram):
        program = model
    else:
        # Decoding is inference: exporting under no_grad keeps a model's own no_grad
        # blocks (MoE routing) from becoming set_grad higher-order ops in the graph.
        # Tapped modules keep their call signature, so a value the parent discards
        # (GPT-OSS router logits) is still recorded as the module's output.
        names = [name for name, _ in model.named_modules()]
        tapped = tuple(dict.fromkeys(p for tap in taps for p in match_modules(tap.module_pattern, names)))
        with torch.no_grad():
            program = torch.export.export(
                model, tuple(example_inputs), kwargs=example_kwargs, dynamic_shapes=dynamic_shapes, strict=strict,
                preserve_module_call_signature=tapped,
            )
    export_seconds = time.perf_counter() - start
    options = {
        "taps": taps or None, "sequence_parallel": sequence_parallel,
        "mask_format": logit_mask, "vocab_size": vocab_size, "empty_row": empty_row, "tp_degree": tp_degree,
        "processors": processors, "max_stop_tokens": max_stop_tokens, "max_bias_tokens": max_bias_tokens,
        "max_penalty_tokens": max_penalty_tokens, "num_speculative_tokens": num_speculative_tokens,
    }
    result = PassManager(PASSES, check=check_contracts).run(program, **options)
    result.report.export_seconds = export_seconds
    return Transformed(result.program, result.report)


def _check_vocab_size(vocab_size) -> None:
    """None, a positive int, or a sequence of them (one per head)."""
    if vocab_size is None:
        return
    sizes = [vocab_size] if isinstance(vocab_size, (int, float, str)) else list(vocab_size)
    for size in sizes:
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise TransformError(
                f"vocab_size={vocab_size!r}: use the tokenizer's vocabulary size, a positive int "
                "(or one per head, the main head first)"
            )
