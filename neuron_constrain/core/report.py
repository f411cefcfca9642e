"""What a pass did, as data: the CLI prints it, tests and ``Transformed`` read it."""
from __future__ import annotations

import dataclasses
from typing import Any

import sympy
import torch

__all__ = ["FORMER_NAMES", "AddedInput", "PassReport", "TransformReport", "evaluate_dim", "symbolic_shape", "unsizable"]


def symbolic_shape(shape) -> tuple:
    """A fake tensor's shape as ints and sympy expressions (what :class:`AddedInput` stores).

    Args:
        shape: the shape, ints and ``SymInt`` sizes.

    Returns:
        Each size as an int, or as the sympy expression of its ``SymInt``.
    """
    return tuple(d.node.expr if isinstance(d, torch.SymInt) else int(d) for d in shape)


def _ops():
    from torch.utils._sympy.functions import FloorDiv, Mod, PythonMod

    return {
        sympy.Add: lambda parts: sum(parts[1:], parts[0]),
        sympy.Mul: lambda parts: _product(parts),
        FloorDiv: lambda parts: parts[0] // parts[1],
        Mod: lambda parts: parts[0] % parts[1],
        PythonMod: lambda parts: parts[0] % parts[1],
        sympy.Min: lambda parts: _fold(torch.sym_min, parts),
        sympy.Max: lambda parts: _fold(torch.sym_max, parts),
    }


def _product(parts):
    result = parts[0]
    for p in parts[1:]:
        result = result * p
    return result


def _fold(fn, parts):
    result = parts[0]
    for p in parts[1:]:
        result = fn(result, p)
    return result


def evaluate_dim(dim: int | sympy.Expr, bindings: dict) -> Any:
    """A program dimension (int or sympy expression over input sizes) for concrete inputs. Sums, products,
    floor division, modulo, min and max are understood.

    Args:
        dim: an int or a sympy expression over the program's symbols.
        bindings: symbol -> its int (or its SymInt while being traced again).

    Returns:
        The size.

    Raises:
        ValueError: a symbol ``bindings`` does not hold (no input has that size), or an expression of
            another kind.
    """
    if isinstance(dim, int):
        return dim
    if isinstance(dim, sympy.Integer):
        return int(dim)
    if isinstance(dim, sympy.Symbol):
        if dim not in bindings:
            raise ValueError(f"cannot size a new input: dimension {dim} is not the size of any input")
        return bindings[dim]
    op = _ops().get(type(dim))
    if op is None:
        raise ValueError(f"cannot size a new input from the expression {dim}")
    return op([evaluate_dim(a, bindings) for a in dim.args])


def unsizable(shape, symbols: set) -> str | None:
    """Why :func:`evaluate_dim` could not size ``shape`` from ``symbols``.

    Args:
        shape: ints and sympy expressions (an :class:`AddedInput`'s).
        symbols: the symbols whose sizes the caller's inputs give.

    Returns:
        The reason in words, or None where every size can be computed.
    """
    for dim in shape:
        if isinstance(dim, int) or isinstance(dim, sympy.Integer):
            continue
        free = getattr(dim, "free_symbols", set())
        if free - symbols:
            return f"its size {dim} involves {sorted(map(str, free - symbols))}, which no input of the call has"
        try:
            evaluate_dim(dim, {symbol: 7 for symbol in free})
        except ValueError:
            return f"its size {dim} is an expression the runtime cannot evaluate"
    return None


@dataclasses.dataclass
class AddedInput:
    """A graph input a pass added, and how to feed it when the caller does not.

    ``shape`` holds ints and sympy expressions over the program's input sizes;
    ``fill`` is the value of the tensor fed when the caller passes nothing (an
    all-allowed mask is ``-1`` packed or ``True`` bool: one graph for constrained
    and unconstrained traffic); ``None`` when there is no neutral value and the
    caller must feed it (``tp_rank``). ``bounds``: ``(low, high)``, the values a
    fed tensor must lie in (``low <= v < high``), checked on the host for CPU tensors.
    """

    name: str
    dtype: torch.dtype
    shape: tuple
    fill: Any
    doc: str = ""
    bounds: tuple[int, int] | None = None
    tap: tuple[str, str] | None = None  # (tap name, "values" | "enabled"): fed from the replacement context
    vocab_size: int | None = None  # a logit mask's vocabulary (for messages about its width and format)

    def shape_for(self, bindings: dict) -> tuple:
        """The input's concrete shape for one call.

        Args:
            bindings: symbol -> its size in this call (:func:`evaluate_dim`).

        Returns:
            The sizes.

        Raises:
            ValueError: a size :func:`evaluate_dim` cannot compute from ``bindings``.
        """
        return tuple(evaluate_dim(d, bindings) for d in self.shape)

    def describe(self) -> str:
        """The input in one line.

        Returns:
            Its name, dtype and shape: ``logit_mask: int32[s0, 32]``.
        """
        dims = ", ".join(str(d) for d in self.shape)
        return f"{self.name}: {str(self.dtype).replace('torch.', '')}[{dims}]"


@dataclasses.dataclass
class PassReport:
    """What one pass found and added (``transformed.report["mask_logits"]``).

    Attributes:
        name: the pass's name, the key of its report.
        sites: per sampling site it acted on: the node, its kind, its module, its head.
        nodes_inserted: graph nodes the pass added.
        inputs_added: the inputs it added (name, dtype, shape, neutral fill, meaning).
        outputs_added: the outputs it added (``logit_mask_empty``, ``capture_*``).
        notes: what it decided, in words (printed by ``summary()``).
    """

    name: str
    sites: list[dict] = dataclasses.field(default_factory=list)
    nodes_inserted: int = 0
    inputs_added: list[AddedInput] = dataclasses.field(default_factory=list)
    outputs_added: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)

    def summary(self) -> str:
        """The report as text (what ``neuron-constrain rewrite`` prints).

        Returns:
            A line of counts, then its sites, inputs, outputs and notes, one a line.
        """
        lines = [f"{self.name}: {len(self.sites)} site(s), {self.nodes_inserted} node(s) inserted"]
        lines += [f"  site {s['node']} ({s['kind']}) in {s['module'] or '<root>'}" for s in self.sites]
        lines += [f"  input  {i.describe()}" for i in self.inputs_added]
        lines += [f"  output {o}" for o in self.outputs_added]
        lines += [f"  note   {n}" for n in self.notes]
        return "\n".join(lines)


# The passes' names before each had one name (file = function = report key): the CLI's
# --passes and report[...] still take them.
FORMER_NAMES = {"taps": "tap_modules", "logit_mask": "mask_logits", "logits_processors": "process_logits"}


@dataclasses.dataclass
class TransformReport:
    """What ``transform()`` did: ``report["mask_logits"]`` is a pass's :class:`PassReport`.

    Attributes:
        passes: each pass's report under its name, in the order they ran.
        export_seconds: the ``torch.export`` time.
        transform_seconds: the passes' time.
    """

    passes: dict[str, PassReport] = dataclasses.field(default_factory=dict)
    export_seconds: float = 0.0
    transform_seconds: float = 0.0

    def __getitem__(self, name: str) -> PassReport:
        return self.passes[FORMER_NAMES.get(name, name)]

    @property
    def inputs_added(self) -> list[AddedInput]:
        """Every pass's added inputs, in the order the passes ran."""
        return [i for r in self.passes.values() for i in r.inputs_added]

    def summary(self) -> str:
        """The whole transform as text.

        Returns:
            The export and pass times, then each pass's :meth:`PassReport.summary`.
        """
        head = f"export {self.export_seconds:.2f}s, passes {self.transform_seconds:.2f}s"
        return "\n".join([head] + [r.summary() for r in self.passes.values()])
