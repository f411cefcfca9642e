"""Invariants of a rewritten program, as data: ``check_program`` returns the failures
(an empty list: every invariant holds). Used by ``neuron-constrain check`` and the tests.

- torch's verifier accepts the program;
- every sampling site (or logits output) reads logits that depend on the mask input,
  and the mask's dtype and width fit those logits;
- every tap's replacement reaches all readers of the tapped value.

``check_contract(program, contract, "requires" | "ensures")`` checks what a pass
declares (:class:`~neuron_constrain.core.contract.PassContract`) by the conditions of
``CONDITIONS``, each a function ``program -> failures``.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.fx
from torch.utils import _pytree as pytree

from neuron_constrain.core.canonical import keyword_inputs
from neuron_constrain.core.errors import TransformError
from neuron_constrain.core.contract import PassContract
from neuron_constrain.kernels import pack_bool_mask, packed_width
from neuron_constrain.core.mask_interface import MASK_INPUT, RANK_INPUT, is_mask_input
from neuron_constrain.core.processor_interface import BUILTIN_INPUTS
from neuron_constrain.core.program import OUTPUT_TAG, user_input_names, user_outputs, wheres_fed_by
from neuron_constrain.core.sites import SAMPLING_OPS, module_path, projections, sampling_kind, weight_names
from neuron_constrain.core.tap_interface import INPUT_PREFIX as TAP_PREFIX
from neuron_constrain.core.tap_interface import RANK_INPUT as TAP_RANK_INPUT
from neuron_constrain.core.tap_interface import is_tap_input

__all__ = ["CONDITIONS", "CheckError", "Site", "check_contract", "check_program", "check_taps", "depends_on", "find_sites",
           "mask_inputs"]


class CheckError(TransformError):
    """The program is not one ``check_program`` can verify (e.g. it has no logits)."""


@dataclasses.dataclass(eq=False)  # hashed by identity: one per site
class Site:
    """A place a token is chosen from logits (or a logits output, when nothing samples them).

    Attributes:
        node: the sampling op, or the output value.
        kind: ``"argmax"``, ``"topk"``, ... or ``"logits output"``.
        logits: the value it reads.
        root: the vocabulary projection that value is computed from.
    """

    node: torch.fx.Node  # the sampling op, or the output value
    kind: str  # "argmax", "topk", ... or "logits output"
    logits: torch.fx.Node  # the value it reads
    root: torch.fx.Node  # the vocabulary projection it reads from

    def describe(self) -> str:
        """The site in words, for messages.

        Returns:
            ``sampling site argmax (argmax) in model.lm_head``: its node, kind and module.
        """
        where = module_path(self.node) or "<root>"
        return f"sampling site {self.node.name} ({self.kind}) in {where}"


def find_sites(program) -> list[Site]:
    """Every sampling op along the vocab axis of a projection's logits, found by walking
    each op's input back, through values of its width, to a projection of that width
    (not by the passes' planner); a projection that nothing samples contributes the
    logits outputs it reaches. A projection multiplies the hidden state by a weight
    (:func:`neuron_constrain.core.sites.projections`): attention scores over a KV cache are
    as wide as the cache and feed a softmax, but no weight makes them, so that softmax
    is no site.

    Args:
        program: an exported program.

    Returns:
        The sites in graph order, then the logits outputs of the last projection when nothing samples it.
    """
    graph = program.graph
    found = projections(graph, weights=weight_names(program))  # graph order
    roots = set(found)
    sites, sampled = [], set()
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in SAMPLING_OPS or not node.args:
            continue
        value = node.args[0]
        val = value.meta.get("val") if isinstance(value, torch.fx.Node) else None
        kind = sampling_kind(node, val.shape[-1]) if isinstance(val, torch.Tensor) and val.dim() else None
        root = None if kind is None else _nearest_root(value, roots, val.shape[-1])
        if root is not None:
            sites.append(Site(node, kind, value, root))
            sampled.add(root)
    outputs = user_outputs(graph, program.graph_signature)
    tagged = {n for n in outputs if isinstance(n, torch.fx.Node) and OUTPUT_TAG in n.meta.get("custom", {})}
    for out in outputs:
        if not isinstance(out, torch.fx.Node) or out in tagged:
            continue
        val = out.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dim() == 0 or not val.is_floating_point():
            continue
        root = _nearest_root(out, roots, val.shape[-1])
        if root is not None and root not in sampled and root is found[-1]:
            sites.append(Site(out, "logits output", out, root))
    return sites


def _nearest_root(node, roots: set, width: int):
    """The closest projection of ``width`` columns that ``node`` is computed from through
    values ``width`` wide (the vocab axis kept last), or None."""
    seen, frontier = {node}, [node]
    while frontier:
        nxt = []
        for n in frontier:
            if n in roots:
                return n
            for p in n.all_input_nodes:
                if p not in seen and _last_dim(p) == width:
                    seen.add(p)
                    nxt.append(p)
        frontier = nxt
    return None


def _last_dim(node):
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)) and val:  # sort / topk / max.dim: the values' width
        val = val[0]
    return val.shape[-1] if isinstance(val, torch.Tensor) and val.dim() else None


def mask_inputs(program) -> dict[str, torch.fx.Node]:
    """The program's logit-mask inputs.

    Args:
        program: an exported program.

    Returns:
        Input name (``logit_mask``, ``logit_mask_1``, ...) -> its placeholder node.
    """
    names = set(user_input_names(program))
    return {
        n.name: n for n in program.graph.nodes
        if n.op == "placeholder" and n.name in names and is_mask_input(n.name)
    }


def check_program(program, vocab_size: int | None = None, *, numeric: bool = True) -> list[str]:
    """Invariants of a rewritten program; returns the failures (empty: all hold).

    Every sampling site (and the logits output of a graph without a sampler) must read
    logits that depend on a mask input, of a dtype and width that fit; with
    ``numeric`` the program also runs on its example inputs with a mask allowing one
    random token per row, and every site must see ``-inf`` (or probability 0) at every
    other column. A taps-only rewrite is checked for its taps alone.

    Args:
        program: a rewritten program.
        vocab_size: the main head's tokenizer vocabulary: its mask's width is checked exactly against it.
        numeric: also run the program on its example inputs (not for one rank's shard of the logits).

    Returns:
        The failures, one sentence each naming the site or input and the fix; empty when all hold.

    Raises:
        CheckError: the program has no logits, or none ``vocab_size`` wide (the check cannot judge it).
    """
    failures: list[str] = []
    try:
        program.validate()
    except Exception as e:  # the verifier's own message says what is wrong
        failures.append(f"torch's verifier rejects the program: {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}")

    failures += check_taps(program)
    user_inputs = set(user_input_names(program))
    masks = mask_inputs(program)
    if not masks and any(n.startswith(TAP_PREFIX) for n in user_inputs):
        return failures  # a taps-only rewrite: nothing to say about sampling
    sites = find_sites(program)
    if not sites:
        raise CheckError(
            "the program has no logits (no vocabulary projection feeding a sampler or an output); "
            "check verifies decoders rewritten by `neuron-constrain rewrite`"
        )
    if not masks:
        return failures + [
            f"{site.describe()} is not masked: the program has no {MASK_INPUT!r} input; "
            "rewrite it with `neuron-constrain rewrite`"
            for site in sites
        ]
    sharded = RANK_INPUT in user_inputs  # one rank's shard of the logits, the full mask
    widest = max(site.root.meta["val"].shape[-1] for site in sites)
    if vocab_size is not None and not sharded and vocab_size > widest:
        raise CheckError(
            f"the program has no logits {vocab_size} wide (--vocab-size): its widest sampled projection has "
            f"{widest} columns; pass the tokenizer's vocabulary size, at most the logits' width"
        )
    fed_by: dict[str, list[Site]] = {name: [] for name in masks}
    for site in sites:
        feeding = [name for name, mask in masks.items() if depends_on(site.logits, mask)]
        if not feeding:
            failures.append(
                f"{site.describe()} reads {site.logits.name}, which does not depend on {' or '.join(masks)}: "
                "an unconstrained token can be sampled there; rewrite the original program again"
            )
        for name in feeding:
            fed_by[name].append(site)
    keywords = keyword_inputs(program)
    for name, mask in masks.items():
        width = max((s.root.meta["val"].shape[-1] for s in fed_by[name]), default=None)
        if width is not None:
            failures += _check_mask_width(name, mask, width, vocab_size if name == MASK_INPUT else None, sharded)
        if name not in keywords:
            failures.append(f"{name} is not a keyword input of the program; callers pass it as {name}=")
    if numeric and not failures and not sharded:
        failures += _check_numerically(program, masks, fed_by)
    return failures


def _check_mask_width(name: str, mask, width: int, vocab_size: int | None, sharded: bool) -> list[str]:
    val = mask.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() < 1:
        return [f"{name} carries no tensor metadata (meta['val']); re-export and rewrite the program"]
    columns = val.shape[-1]
    if val.dtype == torch.int32:
        vocab = vocab_size if vocab_size is not None else width
        want = packed_width(vocab)
        ok = columns == want if vocab_size is not None else 0 < columns and (sharded or columns <= want)
        if not ok:
            return [
                f"{name} is packed int32 with {columns} columns but the logits are {width} wide"
                + (f" and vocab_size is {vocab_size}" if vocab_size is not None else "")
                + f": a packed mask needs ceil(V/32) = {want} columns"
            ]
    elif val.dtype == torch.bool:
        want = vocab_size if vocab_size is not None else width
        ok = columns == want if vocab_size is not None else 0 < columns and (sharded or columns <= width)
        if not ok:
            return [
                f"{name} is bool with {columns} columns but needs {want} (one per token"
                + ("" if vocab_size is not None else f", at most the logits' width {width}") + ")"
            ]
    else:
        return [f"{name} has dtype {val.dtype}; the pass makes int32 (packed) or bool masks"]
    return []


def _check_numerically(program, masks: dict, fed_by: dict[str, list[Site]]) -> list[str]:
    """Run on the example inputs, each mask allowing one random token per row; every
    site (``fed_by``: mask name -> the sites reading it) must see only that token
    (others ``-inf``, or probability 0)."""
    if program.example_inputs is None:
        return []
    args, kwargs = program.example_inputs
    kwargs = dict(kwargs)
    generator = torch.Generator().manual_seed(0)
    for name, mask in masks.items():
        val = mask.meta["val"]
        if any(not isinstance(d, int) for d in val.shape):
            example = kwargs.get(name)
            if example is None:
                return []
            shape = tuple(example.shape)
        else:
            shape = tuple(val.shape)
        columns = shape[-1] * 32 if val.dtype == torch.int32 else shape[-1]
        widths = [s.root.meta["val"].shape[-1] for s in fed_by[name]] or [columns]
        safe = 32 * (shape[-1] - 1) + 1 if val.dtype == torch.int32 else columns  # below any vocab of this width
        tokens = torch.randint(0, min(safe, *widths), shape[:-1], generator=generator)
        bits = torch.nn.functional.one_hot(tokens, columns).bool()
        kwargs[name] = pack_bool_mask(bits) if val.dtype == torch.int32 else bits
    first_mask = {}  # each site, with the first mask (in input order) it reads
    for name, read in fed_by.items():
        for site in read:
            first_mask.setdefault(site, name)
    seen: dict[str, torch.Tensor] = {}
    wanted = {s.logits.name for s in first_mask}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n):
            result = super().run_node(n)
            if n.name in wanted and isinstance(result, torch.Tensor):
                seen[n.name] = result.detach()
            return result

    try:
        module = program.module()
        flat = pytree.tree_leaves((args, {k: kwargs[k] for k in _kwarg_order(program, kwargs)}))
        with torch.no_grad():
            Recorder(module).run(*flat)
    except Exception as e:  # the program does not run on its own example inputs: say so, do not guess
        return [f"the program does not run on its example inputs with one-token masks ({type(e).__name__}: "
                f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}); re-export it"]
    failures = []
    for site, name in first_mask.items():
        value = seen.get(site.logits.name)
        if value is None:
            continue
        rows = value.reshape(-1, value.shape[-1]).float()
        # Sampling paths sort and gather, so count per row instead of reading column t:
        # one allowed token leaves exactly one value that is not -inf (probability 0).
        nonneg = bool((rows >= 0).all())
        alive = (rows != 0.0) if nonneg else (rows != float("-inf"))
        leaked = int((alive.sum(-1) > 1).sum())
        if leaked:
            failures.append(
                f"{site.describe()} sees more than one candidate token in {leaked} of {rows.shape[0]} row(s) when "
                f"{name} allows exactly one per row: the mask does not reach it; rewrite the original program again"
            )
    return failures


def _kwarg_order(program, kwargs: dict) -> list[str]:
    in_spec = program.call_spec.in_spec
    _, spec_kwargs = pytree.tree_unflatten(list(range(in_spec.num_leaves)), in_spec)
    return [k for k in spec_kwargs if k in kwargs]


# ops that read only a tensor's sizes: reading the computed value's size (sequence_parallel's
# slice of the replacement) does not bypass the tap
_SIZE_ONLY = {torch.ops.aten.sym_size.int, torch.ops.aten.sym_numel.default, torch.ops.aten.sym_stride.int,
              torch.ops.aten.sym_storage_offset.default}


def check_taps(program) -> list[str]:
    """Every tap input pair feeds a ``where(enabled, replacement, computed)`` that all
    readers of the computed value go through (capture outputs and size reads excepted).

    Args:
        program: an exported program (one without taps has no failures).

    Returns:
        The failures, one sentence each; empty when every tap holds.
    """
    user_inputs = user_input_names(program)
    nodes = {n.name: n for n in program.graph.nodes}
    failures = []
    for name in user_inputs:
        if not name.startswith(TAP_PREFIX) or name.endswith("_enabled") or name == TAP_RANK_INPUT:
            continue
        enabled = nodes.get(name + "_enabled")
        if enabled is None:
            failures.append(f"tap input {name} has no {name}_enabled flag: rows cannot be switched; rewrite again")
            continue
        val = enabled.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dtype != torch.bool:
            failures.append(f"{name}_enabled must be a bool tensor over the tapped value's rows")
        wheres = [
            n for n in wheres_fed_by(enabled)
            if depends_on(n.args[0], enabled) and depends_on(n.args[1], nodes[name])
        ]
        if not wheres:
            failures.append(f"tap {name}: no where({name}_enabled, {name}, computed) node; the replacement is never used")
            continue
        computed = wheres[0].args[2]
        bypass = [u.name for u in computed.users
                  if u is not wheres[0] and u.op != "output" and u.target not in _SIZE_ONLY]  # a size is no value
        if bypass:
            failures.append(
                f"tap {name}: {', '.join(bypass)} read{'s' if len(bypass) == 1 else ''} {computed.name} directly, "
                "bypassing the tap: a replacement would not reach them; rewrite the original program again"
            )
    return failures


def depends_on(node, source) -> bool:
    """Whether a graph value is computed from another.

    Args:
        node: the value (an fx node).
        source: the node it may depend on.

    Returns:
        True where ``source`` is ``node`` or among its inputs, transitively.
    """
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n is source:
            return True
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return False


# ----------------------------------------------------------------------------- pass contracts

_REWRITTEN = "the pass was applied already; transform the original model or program, not its rewrite"

def _untapped(program) -> list[str]:
    tapped = [n for n in user_input_names(program) if is_tap_input(n)]
    return [f"the program already has tap inputs {tapped}: {_REWRITTEN}"] if tapped else []


def _taps_reach_readers(program) -> list[str]:
    if not any(is_tap_input(n) for n in user_input_names(program)):
        return ["the program has no tap inputs"]
    return check_taps(program)


def _unmasked(program) -> list[str]:
    masks = sorted(mask_inputs(program))
    return [f"the program already has mask inputs {masks}: {_REWRITTEN}"] if masks else []


def _every_site_masked(program) -> list[str]:
    if not mask_inputs(program):
        return [f"the program has no {MASK_INPUT!r} input"]
    return check_program(program, numeric=False)


def _unprocessed(program) -> list[str]:
    present = [n for n in user_input_names(program) if n in BUILTIN_INPUTS]
    return [f"the program already has processor inputs {present}: {_REWRITTEN}"] if present else []


def _full_vocabulary(program) -> list[str]:
    if RANK_INPUT in user_input_names(program):
        return [f"the program's logits are one rank's vocab shard (it has a {RANK_INPUT!r} input); the pass needs the "
                "full vocabulary: run it on an unsharded step, or transform with tp_degree=1"]
    return []


def _processors_reach_sites(program) -> list[str]:
    inputs = {n.name: n for n in program.graph.nodes if n.op == "placeholder" and n.name in BUILTIN_INPUTS}
    if not inputs:
        return ["the program has no processor inputs"]
    sites = find_sites(program)
    return [f"processor input {name} feeds no sampling site's logits" for name, node in inputs.items()
            if not any(depends_on(site.logits, node) for site in sites)]


def _has_head_inputs(program) -> list[str]:
    names = user_input_names(program)
    if any(is_mask_input(n) or n in BUILTIN_INPUTS for n in names):
        return []
    return ["the program has no mask or processor input to cut at"]


CONDITIONS = {
    "untapped": _untapped,
    "taps_reach_readers": _taps_reach_readers,
    "unmasked": _unmasked,
    "every_site_masked": _every_site_masked,
    "unprocessed": _unprocessed,
    "full_vocabulary": _full_vocabulary,
    "processors_reach_sites": _processors_reach_sites,
    "has_head_inputs": _has_head_inputs,
}


def check_contract(program, contract: PassContract, stage: str) -> list[str]:
    """Check the conditions a pass's contract declares for one stage.

    Args:
        program: the program the pass gets (``"requires"``) or returns (``"ensures"``).
        contract: the pass's contract; its conditions name functions of :data:`CONDITIONS`.
        stage: ``"requires"`` or ``"ensures"``.

    Returns:
        The failures, each prefixed with the pass, the stage and the condition; empty when all hold.

    Raises:
        ValueError: another stage.
        CheckError: a condition that cannot judge the program (``every_site_masked`` on a program
            without logits).
    """
    if stage not in ("requires", "ensures"):
        raise ValueError(f"stage={stage!r}: use 'requires' or 'ensures'")
    failures = []
    for condition in getattr(contract, stage):
        failures += [f"{contract.name} {stage} {condition}: {f}" for f in CONDITIONS[condition](program)]
    return failures
