"""Where the logits are and where they are sampled: graph analysis shared by passes and checks.

Definitions, on an aten graph of an ``ExportedProgram``:

* **weight** — a value fixed for the program: computed only from parameters,
  constants and buffers the program never writes (through views, transposes, casts,
  dequantization ...). User inputs, and state the program writes (a KV cache), are
  not weights, nor is anything computed from them. :func:`weight_names` reads them
  off the program's signature (plus user inputs fed an ``nn.Parameter``: the
  ``torch.compile`` backend's graphs take the model's parameters as inputs).
* **projection** — a matmul-like node ``x @ W`` whose output is wider than its input
  (``out_features > in_features``, as every lm_head is), where ``x`` depends on the
  program's inputs (the hidden state) and ``W`` is a weight. A product of two
  activations is never a projection: ``q @ k^T`` over a KV cache (decomposed
  attention, explicit cache inputs) is as wide as the cache and feeds a softmax, and
  it is not logits.
* **logits root** — the last projection, at least ``vocab_size`` wide when that is known.
* **head** — a projection whose logit space feeds a sampling site, with those sites.
  The main head is the first in graph order (at least ``vocab_size`` wide); the
  others (Medusa / MTP / EAGLE draft heads) are numbered 1, 2, ... in graph order.
  Without any sampler the one head is the logits root. Each head gets its own mask
  (``logit_mask``, ``logit_mask_1``, ...): a draft head predicts another position, so
  its grammar row is another row.
* **logit space** — the root and every node reached from it through ops that keep
  the vocab axis last and are not sampling ops (views, slices, casts, temperature
  division, soft-capping, bias adds ...).
* **sampling site** — a sampling/probability op reading a logit-space node along the
  vocab axis: ``argmax``/``max.dim`` (greedy), ``topk``, ``sort``/``argsort``
  (top-p), ``softmax``/``log_softmax`` (then ``multinomial`` or an exponential
  race).
* **mask point** — where the mask goes: the latest logit-space node that every path
  from the root to every site passes through (a dominator), moved back over
  temperature scaling (``div``/``mul`` by something that is not logits) so the
  mask lands before temperature, top-k and top-p, but after soft-capping (which
  would turn ``-inf`` into a finite value). With no site at all, each logits
  output of the graph is a mask point (the bare ``*ForCausalLM`` case).
"""
from __future__ import annotations

import dataclasses
import re

import torch
import torch.fx
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils import _pytree as pytree

from neuron_constrain.core.errors import TransformError
from neuron_constrain.core.report import symbolic_shape

aten = torch.ops.aten

__all__ = ["MaskPlan", "find_logits_root", "projections", "plan_heads", "plan_mask_points", "plan_logits",
           "weight_names", "normalize_module_path", "module_path"]

MATMUL_OPS = {
    aten.linear.default,
    aten.mm.default,
    aten.addmm.default,
    aten.matmul.default,
    aten.bmm.default,
}

# Sampling and probability ops, by the kind of site they make.
SAMPLING_OPS = {
    aten.argmax.default: "argmax",
    aten.max.dim: "max",
    aten.topk.default: "topk",
    aten.sort.default: "sort",
    aten.sort.stable: "sort",
    aten.argsort.default: "argsort",
    aten.argsort.stable: "argsort",
    aten.softmax.int: "softmax",
    aten._softmax.default: "softmax",
    aten.log_softmax.int: "log_softmax",
    aten._log_softmax.default: "log_softmax",
    aten.multinomial.default: "multinomial",  # draws along the last axis; no dim argument
}

# Ops that mix the vocab axis without being a sampler: logit space ends there too.
VOCAB_MIXING_OPS = {aten.cumsum.default, aten.sum.dim_IntList, aten.amax.default, aten.logsumexp.default}

SCALING_OPS = {aten.div.Tensor, aten.div.Scalar, aten.mul.Tensor, aten.mul.Scalar}


def _val(node) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _width(node) -> int | None:
    val = _val(node)
    if val is None or val.dim() == 0:
        return None
    width = val.shape[-1]
    return width if isinstance(width, int) else None


def _dim_argument(node: torch.fx.Node):
    """The op's ``dim`` argument as called (schema default if omitted); -1 if it has none."""
    for index, arg in enumerate(node.target._schema.arguments):
        if arg.name == "dim":
            if not arg.kwarg_only and index < len(node.args):
                return node.args[index]
            return node.kwargs.get("dim", arg.default_value if arg.has_default_value() else None)
    return -1


def sampling_kind(node: torch.fx.Node, width: int) -> str | None:
    """The site's kind if ``node`` samples along the last (vocab) axis of its input."""
    if node.op != "call_function" or node.target not in SAMPLING_OPS or _width(node.args[0]) != width:
        return None
    rank = _val(node.args[0]).dim()
    # argmax with dim=None reduces the flattened tensor: not a per-row pick.
    return SAMPLING_OPS[node.target] if _dim_argument(node) in (-1, rank - 1) else None


def weight_names(program) -> frozenset[str]:
    """The placeholders of ``program`` that hold weights: its parameters, constants and
    the buffers it never writes (a static KV cache is written: not a weight), and the
    user inputs fed an ``nn.Parameter`` (a dynamo graph re-exported by the
    ``torch.compile`` backend takes the model's parameters as inputs)."""
    signature = program.graph_signature
    written = {s.target for s in signature.output_specs
               if s.kind in (OutputKind.BUFFER_MUTATION, OutputKind.PARAMETER_MUTATION)}
    kinds = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)
    names = {s.arg.name for s in signature.input_specs if s.kind in kinds and s.target not in written}
    if program.example_inputs is not None:
        users = [s.arg.name for s in signature.input_specs if s.kind == InputKind.USER_INPUT]
        args, kwargs = program.example_inputs
        leaves = pytree.tree_leaves((args, kwargs))
        if len(leaves) == len(users):
            names |= {name for name, leaf in zip(users, leaves) if isinstance(leaf, torch.nn.Parameter)}
    return frozenset(names)


def _operands(node: torch.fx.Node):
    """``(x, W)`` of a matmul-like node: the input it projects and the matrix it projects by."""
    if node.target == aten.addmm.default:
        return node.args[1], node.args[2]
    return node.args[0], node.args[1]


def _varying(graph: torch.fx.Graph, weights) -> set[torch.fx.Node]:
    """Nodes whose value is not fixed for the program: placeholders that are not
    weights, and everything computed from one."""
    varying = set()
    for node in graph.nodes:
        if node.op == "placeholder":
            if node.name not in weights:
                varying.add(node)
        elif any(p in varying for p in node.all_input_nodes):
            varying.add(node)
    return varying


def projections(graph: torch.fx.Graph, min_width: int | None = None, *, weights=None) -> list[torch.fx.Node]:
    """Projections (module docstring) at least ``min_width`` wide, in graph order.

    ``weights``: the names of the weight placeholders (:func:`weight_names`). Without
    them, every matmul-like node wider than its input: a superset, attention products
    included, for callers that only need candidates.
    """
    varying = None if weights is None else _varying(graph, weights)
    found = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in MATMUL_OPS:
            continue
        x, w = _operands(node)
        out_w, in_w = _width(node), _width(x)
        if out_w is None or in_w is None or out_w <= in_w:
            continue
        if min_width is not None and out_w < min_width:
            continue
        if varying is not None and (x not in varying or not isinstance(w, torch.fx.Node) or w in varying):
            continue  # not the hidden state by a weight: a product of activations, or of weights alone
        found.append(node)
    return found


def find_logits_root(graph: torch.fx.Graph, vocab_size: int | None = None, *, weights=None) -> torch.fx.Node | None:
    found = projections(graph, vocab_size, weights=weights)
    return found[-1] if found else None


@dataclasses.dataclass
class MaskPlan:
    root: torch.fx.Node
    width: int
    points: list[torch.fx.Node]          # nodes whose value gets masked
    sites: list[tuple[torch.fx.Node, str]]  # (sampling node, kind); empty: bare logits outputs


def _logit_space(root: torch.fx.Node, width: int) -> list[torch.fx.Node]:
    """Root plus nodes reached through non-sampling ops that keep ``width`` last, graph order."""
    seen = {root}
    frontier = [root]
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user in seen or user.op != "call_function":
                continue
            if user.target in SAMPLING_OPS or user.target in VOCAB_MIXING_OPS or _width(user) != width:
                continue
            if not _val(user).is_floating_point():
                continue
            seen.add(user)
            frontier.append(user)
    return [n for n in root.graph.nodes if n in seen]


def _plan_root(root: torch.fx.Node, outputs: list) -> MaskPlan | None:
    """The sites of ``root`` and where to mask them; ``None`` if its logits reach no site or output."""
    width = _width(root)
    space = _logit_space(root, width)
    members = set(space)
    sites = []
    for node in space:
        for user in node.users:
            kind = sampling_kind(user, width)
            if kind is not None:
                sites.append((user, kind))
    if not sites:
        points = [o for o in dict.fromkeys(outputs) if o in members]
        return MaskPlan(root, width, points, []) if points else None

    # Dominators of each logit-space node, restricted to logit space, from the root.
    dominators: dict[torch.fx.Node, set] = {}
    for node in space:
        preds = [p for p in node.all_input_nodes if p in members]
        common = set.intersection(*(dominators[p] for p in preds)) if preds and node is not root else set()
        dominators[node] = common | {node}
    common = set.intersection(*(dominators[s.args[0]] for s, _ in sites))
    order = {n: i for i, n in enumerate(space)}
    point = max(common, key=order.__getitem__)
    while point is not root and point.target in SCALING_OPS:
        logit_args = [a for a in point.all_input_nodes if a in members]
        if len(logit_args) != 1:
            break
        point = logit_args[0]
    return MaskPlan(root, width, [point], sites)


def plan_heads(graph: torch.fx.Graph, outputs: list, vocab_size: int | None = None, *, weights) -> list[MaskPlan]:
    """Every head, the main one first (see the module docstring); ``weights``: :func:`weight_names`.

    Heads are the projections whose logits are sampled; the main head is the first of
    them in graph order that is at least ``vocab_size`` wide (the model's lm_head runs
    before any draft head reads its hidden state), the others follow in graph order.
    With no sampler anywhere, the one head is the last projection (``vocab_size``
    wide or more) and its logits outputs are what gets masked.
    """
    roots = projections(graph, weights=weights)
    sampled = [plan for root in roots if (plan := _plan_root(root, [])) is not None and plan.sites]
    if not sampled:
        root = find_logits_root(graph, vocab_size, weights=weights)
        plan = None if root is None else _plan_root(root, outputs)
        return [] if plan is None else [plan]
    wide = [p for p in sampled if vocab_size is None or p.width >= vocab_size]
    if not wide:
        return []
    main = wide[0]
    return [main] + [p for p in sampled if p is not main]


def plan_mask_points(graph: torch.fx.Graph, outputs: list, vocab_size: int | None = None, *, weights) -> MaskPlan | None:
    """The main head's plan (``None`` if the graph has no logits)."""
    heads = plan_heads(graph, outputs, vocab_size, weights=weights)
    return heads[0] if heads else None


def describe_head(index: int, plan: MaskPlan) -> str:
    return f"head {index} ({plan.root.name} in {module_path(plan.root) or '<root>'}, {plan.width} wide)"


def plan_logits(graph: torch.fx.Graph, outputs: list, vocab_size, *, weights, what: str, shards: int = 1,
                several: bool = False):
    """:func:`plan_heads` for a pass that adds per-row inputs; returns ``[(plan, vocab), ...]``.

    ``vocab`` is each head's full vocabulary: ``vocab_size`` (an int for every head,
    or one per head, the main head first), or the head's width times ``shards``.
    With ``shards > 1`` the logits are one rank's vocab shard. ``several``: the pass
    handles several heads; otherwise a second head raises. Raises ``TransformError``
    naming the problem and the fix: no logits, a vocabulary that does not fit them,
    logits of several row shapes. ``what`` says what the inputs are for ("one logit_mask").
    """
    per_head = None
    if vocab_size is not None and not isinstance(vocab_size, int):
        per_head = [int(v) for v in vocab_size]
        vocab_size = per_head[0] if per_head else None
    min_width = None if vocab_size is None else -(-vocab_size // shards)
    heads = plan_heads(graph, outputs, min_width, weights=weights)
    if not heads and vocab_size is not None:  # logits found, but narrower than vocab_size?
        heads = plan_heads(graph, outputs, None, weights=weights)
    if not heads:
        unweighted = [n.name for n in projections(graph) if n not in projections(graph, weights=weights)]
        raise TransformError(
            f"found no logits for {what}: the graph has no vocabulary projection (a matmul of the hidden state by a "
            "weight, wider than its input" + (f" and at least vocab_size={vocab_size} wide" if vocab_size else "")
            + ") that feeds a sampling op or an output; export the model with its lm_head, "
            "or pass the vocab_size that the logits have"
            + (f". The matmuls {unweighted[:4]} are wider than their input but multiply two activations (attention "
               "over a KV cache) or read a graph input as their matrix: if the lm_head weight is an input, "
               "export it as a parameter or buffer" if unweighted else "")
        )
    names = "; ".join(describe_head(i, h) for i, h in enumerate(heads))
    if len(heads) > 1 and not several:
        raise TransformError(
            f"the graph has {len(heads)} logits heads, each sampled ({names}); {what} covers one head: "
            "export one head per program, or run only the mask-logits pass, which masks every head"
        )
    if len(heads) > 1 and shards > 1:
        raise TransformError(f"tp_degree={shards} with {len(heads)} heads ({names}): vocab-parallel masking takes one head")
    if per_head is not None and len(per_head) != len(heads):
        raise TransformError(
            f"vocab_size gives {len(per_head)} sizes but the graph has {len(heads)} head(s) ({names}); "
            "pass one vocab_size per head, the main head first"
        )
    planned = []
    for index, plan in enumerate(heads):
        width = plan.width  # with shards > 1: this rank's shard
        vocab = per_head[index] if per_head else vocab_size
        vocab = width * shards if vocab is None else vocab
        where = f"(node {plan.root.name!r})"
        if shards > 1 and vocab > width * shards:
            raise TransformError(
                f"vocab_size={vocab} does not fit in tp_degree={shards} shards of {width} columns {where}: "
                f"{width * shards} columns in all; pass the tp_degree the lm_head was sharded with, "
                f"or vocab_size<={width * shards}"
            )
        if shards > 1 and vocab <= width * (shards - 1):
            raise TransformError(
                f"vocab_size={vocab} fits in {shards - 1} shards of {width} columns {where}: the last of "
                f"tp_degree={shards} ranks would hold no token; export the rank's sharded lm_head (not the full one), "
                "or pass the tp_degree it was sharded with"
            )
        if shards == 1 and vocab > width:
            if index > 0 and per_head is None:
                raise TransformError(
                    f"{describe_head(index, plan)} is narrower than vocab_size={vocab}: pass one vocab_size per "
                    f"head, e.g. vocab_size=[{vocab}, {width}] (the main head first)"
                )
            raise TransformError(f"vocab_size={vocab} is larger than the logits' width {width} {where}; pass vocab_size<={width}")
        leading = {symbolic_shape(p.meta["val"].shape[:-1]) for p in plan.points}
        if len(leading) != 1:
            raise TransformError(
                f"the logits at {[p.name for p in plan.points]} have different leading shapes {sorted(map(str, leading))}; "
                f"{what} cannot cover them: export one logits output per program"
            )
        planned.append((plan, vocab))
    return planned


# ----------------------------------------------------------------------------- module paths

_MODULES_ITEM = re.compile(r"\._modules\[(['\"])(.*?)\1\]")
_ITEM = re.compile(r"\[(['\"]?)(.*?)\1\]")
# A ModuleList sliced from its start keeps its indices (HF's ``self.layers[:num_hidden_layers]``).
_LEADING_SLICE = re.compile(r"\.slice\((?:None|0), [^,()]*, (?:None|1)\)(?=\.|$)")


def normalize_module_path(path: str) -> str:
    """One dotted spelling for every tracer's module path.

    ``L['self'].layers[0].mlp``, ``L['self']._modules['layers']._modules['0'].mlp``,
    ``L['self'].layers.0.mlp``, ``layers.0.mlp`` and strict export's (torch 2.9)
    ``layers.slice(None, 2, None).0.mlp`` all become ``layers.0.mlp``.
    """
    for prefix in ("L['self']", 'L["self"]', "L__self__"):
        if path.startswith(prefix):
            path = path[len(prefix):]
            break
    path = _MODULES_ITEM.sub(lambda m: "." + m.group(2), path)
    path = _ITEM.sub(lambda m: "." + m.group(2), path)
    return _LEADING_SLICE.sub("", path).strip(".")


def module_path(node: torch.fx.Node) -> str:
    """Normalised path of the innermost module a node was traced in ('' for the root)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path, _ = list(stack.values())[-1]
    return normalize_module_path(path)
