"""Where the logits are and where they are sampled: graph analysis shared by passes and checks.

Definitions, on an aten graph:

* **logits root** — the vocabulary projection: the last matmul-like node whose
  output is wider than its input (``out_features > in_features``, as every lm_head
  is) and, when ``vocab_size`` is known, at least that wide.
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

aten = torch.ops.aten

__all__ = ["MaskPlan", "find_logits_root", "plan_mask_points", "normalize_module_path", "module_path"]

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


def find_logits_root(graph: torch.fx.Graph, vocab_size: int | None = None) -> torch.fx.Node | None:
    root = None
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in MATMUL_OPS:
            continue
        out_w, in_w = _width(node), _width(node.args[0] if node.target != aten.addmm.default else node.args[1])
        if out_w is None or in_w is None or out_w <= in_w:
            continue
        if vocab_size is not None and out_w < vocab_size:
            continue
        root = node
    return root


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


def plan_mask_points(graph: torch.fx.Graph, outputs: list, vocab_size: int | None = None) -> MaskPlan | None:
    """Find the logits and where to mask them; ``None`` if the graph has no logits."""
    root = find_logits_root(graph, vocab_size)
    if root is None:
        return None
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


def plan_logits(graph: torch.fx.Graph, outputs: list, vocab_size: int | None, *, what: str, shards: int = 1):
    """:func:`plan_mask_points` for a pass that needs one set of per-row inputs.

    Returns ``(plan, vocab)``: ``vocab`` is the full vocabulary (``vocab_size``, or
    the logits' width times ``shards``). With ``shards > 1`` the logits are one
    rank's vocab shard. Raises ``TransformError`` naming the problem and the fix:
    no logits, a vocabulary that does not fit them, or logits of several row shapes.
    ``what`` says what the inputs are for ("one logit_mask").
    """
    from neuron_constrain.errors import TransformError
    from neuron_constrain.report import symbolic_shape

    min_width = None if vocab_size is None else -(-vocab_size // shards)
    plan = plan_mask_points(graph, outputs, min_width)
    if plan is None and vocab_size is not None:  # logits found, but narrower than vocab_size?
        plan = plan_mask_points(graph, outputs, None)
    if plan is None:
        raise TransformError(
            f"found no logits for {what}: the graph has no vocabulary projection (a matmul wider than its input"
            + (f" and at least vocab_size={vocab_size} wide" if vocab_size else "")
            + ") that feeds a sampling op or an output; export the model with its lm_head, "
            "or pass the vocab_size that the logits have"
        )
    width = plan.width  # with shards > 1: this rank's shard
    vocab = width * shards if vocab_size is None else vocab_size
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
        raise TransformError(f"vocab_size={vocab} is larger than the logits' width {width} {where}; pass vocab_size<={width}")
    leading = {symbolic_shape(p.meta["val"].shape[:-1]) for p in plan.points}
    if len(leading) != 1:
        raise TransformError(
            f"the logits at {[p.name for p in plan.points]} have different leading shapes {sorted(map(str, leading))}; "
            f"{what} cannot cover them: export one logits output per program"
        )
    return plan, vocab


# ----------------------------------------------------------------------------- module paths

_MODULES_ITEM = re.compile(r"\._modules\[(['\"])(.*?)\1\]")
_ITEM = re.compile(r"\[(['\"]?)(.*?)\1\]")


def normalize_module_path(path: str) -> str:
    """One dotted spelling for every tracer's module path.

    ``L['self'].layers[0].mlp``, ``L['self']._modules['layers']._modules['0'].mlp``,
    ``L['self'].layers.0.mlp`` and ``layers.0.mlp`` all become ``layers.0.mlp``.
    """
    for prefix in ("L['self']", 'L["self"]', "L__self__"):
        if path.startswith(prefix):
            path = path[len(prefix):]
            break
    path = _MODULES_ITEM.sub(lambda m: "." + m.group(2), path)
    path = _ITEM.sub(lambda m: "." + m.group(2), path)
    return path.strip(".")


def module_path(node: torch.fx.Node) -> str:
    """Normalised path of the innermost module a node was traced in ('' for the root)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path, _ = list(stack.values())[-1]
    return normalize_module_path(path)
