"""Canonical graph text: one normalised, version-independent rendering of an
``ExportedProgram``, and its parser (the structural diff is in ``graph_diff``).

    text = canonical_text(program)          # what `neuron-constrain show` prints
    graph = parse_canonical(text)           # back to records (a golden file, `diff`)

The text::

    # neuron-constrain canonical graph v1
    symbols
      s0: [0, int_oo]
    inputs
      p_lm_head_weight: f32[1024, 64] = parameter lm_head.weight
      input_ids: i64[s0, 6] = user_input
      logit_mask: i32[s0, 32] = user_input keyword
    outputs
      argmax_0: i64[s0] = user_output
    nodes
      @ model.lm_head
      linear_0: f32[s0, 6, 1024] = aten.linear.default(mul_12, p_lm_head_weight)

What is normalised: call nodes are renamed ``{op}_{k}`` (k counts each op in graph
order; torch names multi-output nodes differently across versions, ``topk_default``
vs ``topk``); symbolic sizes become ``s0, s1 ...`` (``u0 ...`` unbacked) in order of
first appearance; module paths use :func:`normalize_module_path`; dtypes are short
(``f32``). Left out: weights, strides, devices of values, stack traces, memory
addresses, file paths. Placeholders keep torch's names (derived from the parameter
path or the argument name, the same on every torch version).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any

import sympy
import torch
import torch.fx
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils import _pytree as pytree

from neuron_constrain.core.program import user_input_names
from neuron_constrain.core.sites import module_path

__all__ = ["HEADER", "CanonicalGraph", "canonical_text", "is_canonical_text", "parse_canonical"]

HEADER = "# neuron-constrain canonical graph v1"

_DTYPES = {
    torch.float32: "f32", torch.float64: "f64", torch.float16: "f16", torch.bfloat16: "bf16",
    torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8",
    torch.bool: "b8", torch.complex64: "c64", torch.complex128: "c128",
}


def _dtype(dtype: torch.dtype) -> str:
    return _DTYPES.get(dtype, str(dtype).replace("torch.", ""))


def _op_name(node: torch.fx.Node) -> tuple[str, str]:
    """(spelling of the op, short name used for node names)."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return str(target), target._schema.name.split("::")[-1]
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"hop.{target.name()}", target.name()
    if isinstance(target, str):  # call_method / get_attr / call_module
        return f"{node.op}.{target}", node.op
    name = getattr(target, "__name__", str(target))
    return name, name


class _Renderer:
    def __init__(self, program: ExportedProgram):
        self.program = program
        self.symbols: dict[sympy.Symbol, sympy.Symbol] = {}
        self.names: dict[torch.fx.Node, str] = {}

    # ------------------------------------------------------------------ sizes and types
    def _symbol(self, sym: sympy.Symbol) -> sympy.Symbol:
        if sym not in self.symbols:
            prefix = re.match(r"[a-zA-Z_]*", sym.name).group(0) or "s"
            k = sum(1 for s in self.symbols.values() if s.name.rstrip("0123456789") == prefix)
            self.symbols[sym] = sympy.Symbol(f"{prefix}{k}", **sym.assumptions0)
        return self.symbols[sym]

    def expr(self, expr) -> str:
        if isinstance(expr, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            expr = expr.node.expr
        if not isinstance(expr, sympy.Basic):
            return str(expr)
        if isinstance(expr, sympy.Integer):
            return str(int(expr))
        for sym in sorted(expr.free_symbols, key=lambda s: s.name):
            self._symbol(sym)
        return str(expr.xreplace(self.symbols))

    def value(self, val: Any) -> str:
        if isinstance(val, torch.Tensor):
            return f"{_dtype(val.dtype)}[{', '.join(self.expr(d) for d in val.shape)}]"
        if isinstance(val, (tuple, list)):
            return "(" + ", ".join(self.value(v) for v in val) + ")"
        if isinstance(val, torch.SymInt):
            return f"sym_int({self.expr(val)})"
        if isinstance(val, torch.SymFloat):
            return f"sym_float({self.expr(val)})"
        if isinstance(val, torch.SymBool):
            return f"sym_bool({self.expr(val)})"
        if val is None:
            return "none"
        return type(val).__name__

    # ------------------------------------------------------------------ arguments
    def arg(self, a: Any) -> str:
        if isinstance(a, torch.fx.Node):
            return self.names[a]
        if isinstance(a, (list, tuple)):
            inner = ", ".join(self.arg(x) for x in a)
            return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
        if isinstance(a, dict):
            return "{" + ", ".join(f"{k}: {self.arg(a[k])}" for k in sorted(a, key=str)) + "}"
        if isinstance(a, torch.dtype):
            return _dtype(a)
        if isinstance(a, torch.device):
            return f"device({a.type})"
        if isinstance(a, (torch.layout, torch.memory_format)):
            return str(a).replace("torch.", "")
        if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return self.expr(a)
        if isinstance(a, float):
            return repr(a)
        if isinstance(a, str):
            return repr(a)
        return str(a)

    # ------------------------------------------------------------------ whole program
    def render(self) -> str:
        program = self.program
        graph = program.graph
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        for n in placeholders:
            self.names[n] = n.name
        counts: dict[str, int] = {}
        for n in graph.nodes:
            if n.op in ("placeholder", "output"):
                continue
            _, short = _op_name(n)
            k = counts.get(short, 0)
            counts[short] = k + 1
            self.names[n] = f"{short}_{k}"

        keywords = keyword_inputs(program)
        input_lines = []
        for spec, node in zip(program.graph_signature.input_specs, placeholders):
            kind = spec.kind.name.lower()
            extra = ""
            if spec.kind == InputKind.USER_INPUT and spec.arg.name in keywords:
                extra = " keyword"
            elif spec.target is not None:
                extra = f" {spec.target}"
                if spec.kind == InputKind.BUFFER and spec.persistent is False:
                    extra += " non_persistent"
            input_lines.append(f"  {self.names[node]}: {self.value(node.meta.get('val'))} = {kind}{extra}")

        node_lines = []
        current = None
        for n in graph.nodes:
            if n.op in ("placeholder", "output"):
                continue
            path = module_path(n)
            # torch's marker for "no module stack recorded" (sym_size nodes): the root.
            path = "<root>" if not path or path == "_empty_nn_module_stack_from_metadata_hook" else path
            if path != current:
                node_lines.append(f"  @ {path}")
                current = path
            op, _ = _op_name(n)
            args = [self.arg(a) for a in n.args] + [f"{k}={self.arg(v)}" for k, v in sorted(n.kwargs.items())]
            node_lines.append(f"  {self.names[n]}: {self.value(n.meta.get('val'))} = {op}({', '.join(args)})")

        output = next(n for n in reversed(graph.nodes) if n.op == "output")
        output_lines = []
        for spec, value in zip(program.graph_signature.output_specs, output.args[0]):
            kind = spec.kind.name.lower()
            extra = f" {spec.target}" if spec.kind != OutputKind.USER_OUTPUT and spec.target else ""
            if isinstance(value, torch.fx.Node):
                output_lines.append(f"  {self.names[value]}: {self.value(value.meta.get('val'))} = {kind}{extra}")
            else:
                output_lines.append(f"  {self.arg(value)}: constant = {kind}{extra}")

        symbol_lines = []
        constraints = {self.symbols[s]: r for s, r in program.range_constraints.items() if s in self.symbols}
        for new in sorted(constraints, key=lambda s: (s.name.rstrip("0123456789"), int(re.sub(r"\D", "", s.name) or 0))):
            r = constraints[new]
            symbol_lines.append(f"  {new.name}: [{r.lower}, {r.upper}]")

        return "\n".join(
            [HEADER, "symbols", *symbol_lines, "inputs", *input_lines, "outputs", *output_lines, "nodes", *node_lines]
        ) + "\n"


def keyword_inputs(program: ExportedProgram) -> set[str]:
    """Names of the user inputs the program takes as keyword arguments."""
    in_spec = program.call_spec.in_spec
    if in_spec is None:
        return set()
    user = user_input_names(program)
    _, kwargs = pytree.tree_unflatten(list(range(in_spec.num_leaves)), in_spec)
    keyword_leaves = set(pytree.tree_leaves(kwargs))
    return {name for i, name in enumerate(user) if i in keyword_leaves}


def canonical_text(program: ExportedProgram) -> str:
    """The canonical text of a program (see the module docstring): what ``neuron-constrain show`` prints.

    Args:
        program: the exported program.

    Returns:
        The text, one record a line under its header.
    """
    return _Renderer(program).render()


# ----------------------------------------------------------------------------- parsing

@dataclasses.dataclass
class Record:
    """One line of the canonical text: an input, output or node."""

    name: str
    type: str
    body: str          # kind (inputs/outputs) or op(args) (nodes)
    module: str = ""   # nodes only

    @property
    def op(self) -> str:
        return self.body.split("(", 1)[0]

    def line(self) -> str:
        return f"{self.name}: {self.type} = {self.body}"


@dataclasses.dataclass
class CanonicalGraph:
    """A canonical text read back (:func:`parse_canonical`): its records by section.

    Attributes:
        symbols: the ``symbols`` lines (``s0: [0, int_oo]``).
        inputs: the inputs' records.
        outputs: the outputs' records.
        nodes: the call nodes' records, each with its module.
        text: the text it was read from.
    """

    symbols: list[str]
    inputs: list[Record]
    outputs: list[Record]
    nodes: list[Record]
    text: str


_RECORD = re.compile(r"^  (\S+): (.*?) = (.*)$")
_SECTIONS = ("symbols", "inputs", "outputs", "nodes")


def is_canonical_text(head: bytes) -> bool:
    """Whether a file's first bytes are a canonical text's header (``neuron-constrain diff`` takes either).

    Args:
        head: the file's first bytes.

    Returns:
        True where they start with the header line.
    """
    return head.startswith(HEADER.encode())


def parse_canonical(text: str) -> CanonicalGraph:
    """Read a canonical text back into its records (a golden file, what ``diff`` compares).

    Args:
        text: a text :func:`canonical_text` wrote.

    Returns:
        Its symbols, inputs, outputs and nodes.

    Raises:
        ValueError: the header is missing, or a line is malformed (the first bad line is named).
    """
    lines = text.splitlines()
    if not lines or lines[0] != HEADER:
        raise ValueError(f"not a canonical graph text: the first line must be {HEADER!r}")
    graph = CanonicalGraph([], [], [], [], text)
    section = None
    module = "<root>"
    for number, line in enumerate(lines[1:], start=2):
        if line in _SECTIONS:
            section = line
            continue
        if section is None or not line.startswith("  "):
            raise ValueError(f"line {number} of the canonical text is malformed: {line!r}")
        if section == "symbols":
            graph.symbols.append(line.strip())
            continue
        if section == "nodes" and line.startswith("  @ "):
            module = line[4:]
            continue
        match = _RECORD.match(line)
        if match is None:
            raise ValueError(f"line {number} of the canonical text is malformed: {line!r}")
        record = Record(*match.groups(), module=module if section == "nodes" else "")
        getattr(graph, section).append(record)
    return graph
