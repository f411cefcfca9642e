"""Split-at-mask pass (``split_at_mask``): cut a rewritten step into a BODY and a HEAD program.

With on-device sampling the grammar mask is an input of the compiled step, so the
host must finish the mask fill before the forward may start. Cut the step where the
added inputs enter, and the forward (body) can run while the host fills the mask;
only the small head waits for it.

Before (one program)                         After
    step(ids, pos, logit_mask, **procs)          body(ids, pos) -> (select,)          # writes the KV cache
      h = layers(embed(ids), kv_cache)             h = layers(embed(ids), kv_cache)
      logits = linear(h, lm_head_w)                logits = linear(h, lm_head_w)
      last = select(logits, 1, -1)                 last = select(logits, 1, -1)
      m = where(unpack(mask), last, -inf)          return (last,)
      x = processors(m, **procs)               head(select, *, logit_mask, **procs) -> step's outputs
      tok = argmax(x, -1)                          m = where(unpack(logit_mask), select, -inf)
      empty = all(logit_mask == 0, -1)             x = processors(m, **procs)
      return (tok, empty)                          return (argmax(x, -1), all(logit_mask == 0, -1))

The cut. The head is exactly the nodes that depend (transitively) on the head inputs
(``logit_mask``, ``tp_rank``, the processors' inputs); everything else is the body.
That is the smallest head there is: the body keeps all work that can start before the
fill ends (embeddings, layers, KV-cache writes, lm_head and the last-position
select), and the values crossing the cut are the tensors the head reads (the last
logits ``[B, V]``: the mask point's input). Three kinds of value are not shipped but
rebuilt in the head: parameters, buffers and lifted constants the head reads (copied
into the head's own state), input-free code (``arange``, ``full``, code on constants
only), and symbolic sizes (``sym_size`` of a head input with the same size). Body user
inputs the head reads (a sampler's ``noise``) become head keyword inputs. The head
returns the unsplit program's user outputs with the same pytree (``(tok, empty)``),
body values among them passed through, so ``head(*body(ids, pos), logit_mask=m)`` is
the step; the body returns only the cut values (and its buffer mutations).

``cut="hidden"`` moves the lm_head into the head: the head is seeded with the widest
projection (the lm_head matmul) that feeds the mask, so the values crossing the cut
are its input, the last hidden rows ``[B, H]`` (H / V of the bytes), and the head
holds the lm_head weight. The body then ends at the final norm. Use it where shipping
the logits costs more than the lm_head's share of the overlap window: on torch-xla's
CPU client a body returning ``[B, V]`` logits ran 2x slower than the whole unsplit
step (``benchmarks/bench_overlap.py``), while the layers alone still hide a fill of a
millisecond. The default, ``cut="logits"``, keeps the lm_head in the body.

Refused, with the reason: a KV-cache (buffer or input) write that depends on a head
input, an in-place op in the head on a body value, a head input that is positional,
a non-tensor value other than a size crossing the cut, and a program where no output
depends on the head inputs.

Requires ``has_head_inputs`` (a mask or processor input, which the passes add as
keywords) and runs after the passes that add them. It returns two programs, so no
condition on one program states what it ensures; ``tests/passes/test_split.py`` checks
``head(*body(...))`` against the step.

Returns ``PassResult(body, SplitReport, {"head": head})``. Both are plain ``ExportedProgram``s of the
original aten ops (they save, load and run without this library); the report lists
the cut values, the head's ops and the bytes it takes per call (cut values plus
head inputs, at the exported sizes).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch
import torch.fx
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind, TensorArgument
from torch.utils import _pytree as pytree

from neuron_constrain.core.contract import PassContract, PassResult, declares
from neuron_constrain.core.errors import TransformError
from neuron_constrain.core.program import ProgramEditor, user_input_names
from neuron_constrain.core.report import PassReport
from neuron_constrain.core.sites import projections

__all__ = ["CONTRACT", "SplitReport", "split_at_mask_pass"]

_STATE_KINDS = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)
CUTS = ("logits", "hidden")
CONTRACT = PassContract(name="split_at_mask", options=("head_inputs", "cut"), requires=("has_head_inputs",),
                        after=("tap_modules", "mask_logits", "process_logits"))


@dataclasses.dataclass(kw_only=True)
class SplitReport(PassReport):
    """What the split cut: values crossing it, and the head's size (besides a pass report's fields).

    Attributes:
        cut: ``{"name", "dtype", "shape"}`` per value crossing the cut: the body's outputs, the
            head's positional inputs.
        head_inputs: the head's keyword inputs: body inputs it reads, then the added ones.
        head_ops: operator nodes in the head.
        body_ops: operator nodes in the body.
        head_bytes_in: bytes the head takes in per call, at the exported sizes.
        head_state: parameters, buffers and constants the head holds a copy of.
        rebuilt: input-free code and sizes recomputed in the head instead of shipped.
    """

    cut: list[dict]  # {"name", "dtype", "shape"}: body outputs = head's positional inputs
    head_inputs: list[str]  # keyword inputs of the head: body inputs it reads, then the added ones
    head_ops: int  # call_function nodes in the head
    body_ops: int
    head_bytes_in: int  # per call, at the exported sizes: cut values + head keyword inputs
    head_state: list[str]  # parameters / buffers / constants the head holds a copy of
    rebuilt: list[str]  # input-free code and sizes recomputed in the head instead of shipped

    def summary(self) -> str:
        """The split as text.

        Returns:
            The body's and head's sizes, then the cut values, the head's inputs, its state and the notes,
            one a line.
        """
        lines = [f"split: body {self.body_ops} ops | head {self.head_ops} ops, {self.head_bytes_in} bytes in per call"]
        lines += [f"  cut    {c['name']}: {c['dtype']}{list(c['shape'])}" for c in self.cut]
        lines += [f"  input  {name}" for name in self.head_inputs]
        lines += [f"  state  {name}" for name in self.head_state]
        lines += [f"  note   {n}" for n in self.notes]
        return "\n".join(lines)


def _mutated_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes an in-place / out= op writes to (its schema's mutable arguments)."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None or not schema.is_mutable:
        return []
    written = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        written += [v for v in pytree.tree_leaves(value) if isinstance(v, torch.fx.Node)]
    return written


def _hint(size) -> int:
    return int(size.node.hint) if isinstance(size, torch.SymInt) else int(size)


def _example(val: torch.Tensor) -> torch.Tensor:
    return torch.zeros([_hint(d) for d in val.shape], dtype=val.dtype)


def _nbytes(val) -> int:
    if not isinstance(val, torch.Tensor):
        return 0
    count = 1
    for d in val.shape:
        count *= _hint(d)
    return count * val.element_size()


def _example_leaves(program: ExportedProgram) -> dict[str, Any]:
    """User input name -> its example value (empty when the program saved none)."""
    if program.example_inputs is None:
        return {}
    args, kwargs = program.example_inputs
    spec = program.call_spec.in_spec
    # the kwargs in the order the program's in_spec lists them
    _, kwarg_index = pytree.tree_unflatten(list(range(spec.num_leaves)), spec)
    ordered = {k: kwargs[k] for k in kwarg_index if k in kwargs}
    leaves = pytree.tree_leaves((tuple(args), ordered))
    return dict(zip(user_input_names(program), leaves))


def _classify(graph: torch.fx.Graph, head_set: set, spec_of: dict, seeds: set) -> tuple[set, set]:
    """(head nodes: the head inputs, ``seeds`` and all that depends on them; stateful
    nodes: depending on a user input or a buffer, so they must run in the body)."""
    tainted: set[torch.fx.Node] = set()
    stateful: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if node.op == "output":
            continue
        if node.op == "placeholder":
            if node in head_set:
                tainted.add(node)
            elif spec_of[node.name].kind in (InputKind.USER_INPUT, InputKind.BUFFER):
                stateful.add(node)
            continue
        inputs = node.all_input_nodes
        if node in seeds or any(i in tainted for i in inputs):
            tainted.add(node)
        elif any(i in stateful for i in inputs) or _mutated_args(node):
            stateful.add(node)
    return tainted, stateful


def _lm_heads(graph: torch.fx.Graph, head: set) -> set[torch.fx.Node]:
    """The lm_head matmuls: walking back from the head's nodes, the first projections
    met (the widest of them, should a path bypass the lm_head)."""
    candidates = set(projections(graph))
    found, seen = set(), set(head)
    frontier = list(head)
    while frontier:
        for node in frontier.pop().all_input_nodes:
            if node in seen:
                continue
            seen.add(node)
            if node in candidates:
                found.add(node)
            elif node.op != "placeholder":
                frontier.append(node)
    if not found:
        raise TransformError("split_at_mask: cut='hidden' found no lm_head projection feeding the mask; "
                             "use cut='logits'")
    widest = max(node.meta["val"].shape[-1] for node in found)
    return {node for node in found if node.meta["val"].shape[-1] == widest}


def _copy_nodes(graph: torch.fx.Graph, nodes, env: dict) -> None:
    for node in nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])


@declares(CONTRACT)
def split_at_mask_pass(
    program: ExportedProgram, head_inputs: Sequence[str], *, cut: str = "logits"
) -> PassResult:
    """Cut a rewritten step into a body and a head at the mask.

    The head is exactly the nodes that depend on ``head_inputs``; the body everything else.
    See the module docstring.

    Args:
        program: a rewritten step (the mask pass has run).
        head_inputs: the inputs the head takes (``logit_mask``, ``tp_rank``, processor inputs).
        cut: ``"logits"`` (the last logits cross the cut) or ``"hidden"`` (the last hidden rows
            cross it and the head holds the lm_head).

    Returns:
        ``PassResult(body, report, {"head": head})``: ``head(*body(...), **head_inputs)`` returns
        exactly the unsplit step's outputs.

    Raises:
        TransformError: an unknown cut, head inputs the program does not take, or a KV-cache
            write that depends on the mask.
    """
    if cut not in CUTS:
        raise TransformError(f"split_at_mask: cut={cut!r}; use one of {CUTS} (after the lm_head, or before it)")
    head_inputs = list(dict.fromkeys(head_inputs))
    user_inputs = user_input_names(program)
    if not head_inputs:
        raise TransformError("split_at_mask needs the names of the inputs the head takes (e.g. ['logit_mask'])")
    missing = [n for n in head_inputs if n not in user_inputs]
    if missing:
        raise TransformError(
            f"split_at_mask: the program has no user input {missing[0]!r} (its inputs: {user_inputs}); "
            "run the mask-logits pass first, or name inputs the program has"
        )
    sig = program.graph_signature
    graph = program.graph
    spec_of = {s.arg.name: s for s in sig.input_specs if isinstance(s.arg, TensorArgument)}
    if any(s.kind not in (*_STATE_KINDS, InputKind.USER_INPUT) for s in sig.input_specs):
        kinds = sorted({s.kind.name for s in sig.input_specs})
        raise TransformError(f"split_at_mask: the program has inputs of kinds {kinds}; only parameters, buffers, "
                             "constants and user inputs can be split")
    in_spec = program.call_spec.in_spec
    args_index, kwargs_index = pytree.tree_unflatten(list(range(in_spec.num_leaves)), in_spec)
    positional = [user_inputs[i] for i in pytree.tree_leaves(args_index)]
    for name in head_inputs:
        if name in positional:
            raise TransformError(f"split_at_mask: head input {name!r} is positional; the head's inputs must be "
                                 "keyword inputs (as the passes add them)")

    # ---------------------------------------------------------------- classify nodes
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    by_name = {n.name: n for n in placeholders}
    head_set = {by_name[n] for n in head_inputs}
    tainted, stateful = _classify(graph, head_set, spec_of, seeds=set())
    if cut == "hidden":
        tainted, stateful = _classify(graph, head_set, spec_of, seeds=_lm_heads(graph, tainted))
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    outs = list(output.args[0])
    for value, spec in zip(outs, sig.output_specs):
        if spec.kind != OutputKind.USER_OUTPUT and value in tainted:
            raise TransformError(
                f"split_at_mask: the write to {spec.target or spec.arg.name!r} depends on "
                f"{sorted(head_inputs)}; the body must not need the head inputs (cut earlier, or do not split)"
            )
    user_outs = [(v, s) for v, s in zip(outs, sig.output_specs) if s.kind == OutputKind.USER_OUTPUT]
    if not any(v in tainted for v, _ in user_outs):
        raise TransformError(f"split_at_mask: no output of the program depends on {head_inputs}; nothing to split off")
    for node in tainted:
        for written in _mutated_args(node):
            if written not in tainted:
                raise TransformError(
                    f"split_at_mask: {node.name} ({node.target}) writes in place to {written.name}, a body value, "
                    "from the head; functionalize the program (run_decompositions) or keep the write before the mask"
                )

    # ---------------------------------------------------------------- what the head needs from the body
    head_nodes = [n for n in graph.nodes if n in tainted and n.op != "placeholder"]
    cut: list[torch.fx.Node] = []  # shipped: body outputs -> head positional inputs
    passthrough: list[torch.fx.Node] = []  # body user inputs the head reads -> head keyword inputs
    state: list[torch.fx.Node] = []  # params / buffers / constants copied into the head
    rebuilt: set[torch.fx.Node] = set()  # input-free code recomputed in the head
    sizes: list[torch.fx.Node] = []  # symbolic sizes recomputed from a head input

    def need(node: torch.fx.Node) -> None:
        if node in tainted or node in rebuilt or node in cut or node in passthrough or node in state or node in sizes:
            return
        if node.op == "placeholder":
            kind = spec_of[node.name].kind
            if kind == InputKind.USER_INPUT:
                passthrough.append(node)
                return
            if kind == InputKind.BUFFER and any(
                s.kind == OutputKind.BUFFER_MUTATION and s.target == spec_of[node.name].target for s in sig.output_specs
            ) or any(node in _mutated_args(u) for u in node.users):
                raise TransformError(f"split_at_mask: the head reads the buffer {spec_of[node.name].target!r}, which "
                                     "the body writes; the head cannot hold a copy of it")
            state.append(node)
            return
        val = node.meta.get("val")
        if isinstance(val, torch.SymInt):
            sizes.append(node)
            return
        if node not in stateful:  # input-free: cheaper to recompute than to ship
            rebuilt.add(node)
            for i in node.all_input_nodes:
                need(i)
            return
        if not isinstance(val, torch.Tensor):
            raise TransformError(f"split_at_mask: the head needs {node.name} ({type(val).__name__}), a non-tensor value "
                                 "computed in the body; only tensors and sizes can cross the cut")
        cut.append(node)

    for node in head_nodes:
        for i in node.all_input_nodes:
            need(i)
    for value, _ in user_outs:
        if isinstance(value, torch.fx.Node):
            need(value)
    cut.sort(key=list(graph.nodes).index)
    passthrough.sort(key=placeholders.index)
    state.sort(key=placeholders.index)

    examples = _example_leaves(program)
    kw_names = [n for n in user_inputs if by_name[n] in passthrough or n in head_inputs]
    head = _build_head(program, cut, kw_names, state, rebuilt, sizes, head_nodes, user_outs, examples)
    body = _build_body(program, head_inputs, cut, args_index, kwargs_index)
    report = SplitReport(
        name=CONTRACT.name,
        cut=[{"name": n.name, "dtype": n.meta["val"].dtype, "shape": tuple(n.meta["val"].shape)} for n in cut],
        head_inputs=kw_names,
        head_ops=sum(n.op == "call_function" for n in head.graph.nodes),
        body_ops=sum(n.op == "call_function" for n in body.graph.nodes),
        head_bytes_in=sum(_nbytes(n.meta["val"]) for n in cut) + sum(_nbytes(by_name[n].meta["val"]) for n in kw_names),
        head_state=[spec_of[n.name].target for n in state],
        rebuilt=sorted(n.name for n in rebuilt) + [n.name for n in sizes],
    )
    if passthrough:
        report.notes.append("body inputs the head reads too: " + ", ".join(n.name for n in passthrough))
    return PassResult(body, report, {"head": head})


def _build_head(program, cut, kw_names, state, rebuilt, sizes, head_nodes, user_outs, examples) -> ExportedProgram:
    by_name = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in state:  # state placeholders first, in the program's order (the verifier's rule)
        env[node] = graph.placeholder(node.name)
        env[node].meta.update(node.meta)
    user_phs = []
    for node in cut:
        ph = graph.placeholder(node.name)
        ph.meta["val"] = node.meta["val"]
        env[node] = ph
        user_phs.append(ph)
    for name in kw_names:
        node = by_name[name]
        ph = graph.placeholder(name)
        ph.meta.update(node.meta)
        env[node] = ph
        user_phs.append(ph)
    for node in sizes:  # a size of the body: the same size of a head input
        expr = node.meta["val"].node.expr
        found = next(((ph, d) for ph in user_phs for d, s in enumerate(ph.meta["val"].shape)
                      if isinstance(s, torch.SymInt) and s.node.expr == expr), None)
        if found is None:
            raise TransformError(f"split_at_mask: the head needs the size {expr} ({node.name}), which no head input has")
        env[node] = graph.call_function(torch.ops.aten.sym_size.int, found)
        env[node].meta["val"] = node.meta["val"]
    order = [n for n in program.graph.nodes if n in rebuilt or n in set(head_nodes)]
    _copy_nodes(graph, order, env)
    out_values = [env[v] if isinstance(v, torch.fx.Node) else v for v, _ in user_outs]
    graph.output(tuple(out_values))
    in_spec = pytree.tree_flatten((tuple(range(len(cut))), {k: 0 for k in kw_names}))[1]
    example_args = tuple(_example(n.meta["val"]) for n in cut)
    example_kwargs = {k: examples[k] if k in examples else _example(by_name[k].meta["val"]) for k in kw_names}
    return ProgramEditor.subprogram(
        program, graph, state=[n.name for n in state], user_inputs=[ph.name for ph in user_phs],
        outputs=[v.name if isinstance(v, torch.fx.Node) else s.arg for v, (_, s) in zip(out_values, user_outs)],
        in_spec=in_spec, out_spec=program.call_spec.out_spec, arg_names=[n.name for n in cut] + kw_names,
        example_inputs=(example_args, example_kwargs),
    )


def _build_body(program, head_inputs, cut, args_index, kwargs_index) -> ExportedProgram:
    sig = program.graph_signature
    old_output = next(n for n in reversed(program.graph.nodes) if n.op == "output")
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    head_names = set(head_inputs)
    for node in program.graph.nodes:
        if node.op == "placeholder" and node.name in head_names:
            continue
        if node.op == "output":
            break
        if node.op != "placeholder" and any(i not in env for i in node.all_input_nodes):
            continue  # a head node (it reads a head input, directly or not)
        env[node] = graph.node_copy(node, lambda n: env[n])
    mutations = [(v, s) for v, s in zip(old_output.args[0], sig.output_specs) if s.kind != OutputKind.USER_OUTPUT]
    graph.output(tuple([env[v] for v, _ in mutations] + [env[n] for n in cut]))
    graph.eliminate_dead_code()  # input-free code only the head used (rebuilt there)
    kwargs = {k: v for k, v in kwargs_index.items() if k not in head_names}
    old_root = program.module_call_graph[0].signature
    arg_names = None if old_root is None or old_root.forward_arg_names is None else [
        n for n in old_root.forward_arg_names if n not in head_names
    ]
    example_inputs = None
    if program.example_inputs is not None:
        args, old_kwargs = program.example_inputs
        example_inputs = (tuple(args), {k: v for k, v in old_kwargs.items() if k not in head_names})
    return ProgramEditor.subprogram(
        program, graph,
        state=[s.arg.name for s in sig.input_specs if s.kind != InputKind.USER_INPUT],
        user_inputs=[s.arg.name for s in sig.input_specs if s.kind == InputKind.USER_INPUT and s.arg.name not in head_names],
        outputs=[env[n].name for n in cut], mutations=[s for _, s in mutations],
        in_spec=pytree.tree_flatten((args_index, kwargs))[1], out_spec=pytree.tree_flatten(tuple(range(len(cut))))[1],
        arg_names=arg_names, example_inputs=example_inputs, keep_module_calls=True,
    )
