"""Process-logits pass (``process_logits``): min_tokens, logit_bias, penalties, thinking_budget and min_p in the graph.

Before (after the mask-logits pass)             After (processors = all four)
    m = where(allowed, last, -inf)                 m = where(allowed, last, -inf)
    tok = argmax(m, -1)           # greedy         x = scatter_add(m, cat(stop_ids, bias_ids),            # min_tokens and
    t = div(m, 0.8)               # sampling                       cat(-inf if remaining > 0, bias))  # logit_bias, fused
    order = sort(t)                                s = gather(x, seen_ids)                                # penalties:
                                                   s2 = where(s > 0, s / rep, s * rep) - f * n - p * (n > 0)
                                                   x = scatter_add(x, seen_ids, s2 - s)
                                                   x = scatter_add(x, end, 1e9 if left <= 0)  # thinking_budget
                                                   empty = logit_mask_empty | isneginf(amax(x[:, :V]))
                                                   tok = argmax(x, -1)           # greedy: nothing more
                                                   t = div(x, 0.8)
                                                   y = where(t < amax(t) + log(min_p), -inf, t)
                                                   order = sort(y)               # sampling: min_p in front

Where: at the mask point of :func:`neuron_constrain.core.sites.plan_mask_points` (after the
mask-logits pass that point is the masked logits, so the order is mask, min_tokens,
logit_bias, penalties, thinking_budget: vLLM's order), then, on each sampling path only, right in front of the
sampling op: temperature (a per-row ``temperature`` input) and min_p.

Argmax-invariance is a compiler fact here: temperature (> 0) and min_p (it keeps the
top token) never change an argmax, so before a greedy ``argmax``/``max`` they are not
inserted at all; the report lists them under the site's ``pruned`` with the reason.
A graph with only greedy sites gets no ``min_p``/``temperature`` inputs.

Temperature. A sampling path that already scales its logits (a ``div``/``mul`` between
the processors and the sampling op, like ``SamplingStep``'s ``logits / 0.8``) keeps its
own temperature and gets no ``temperature`` input; min_p then runs on the scaled
logits, i.e. after temperature, as in vLLM. A path without one gets the per-row
``temperature`` input, applied before min_p. Bare logits outputs (no sampler in the
graph) get neither: the host samples and applies them itself.

All-disallowed rows. min_tokens (or a ``-inf`` bias) can empty a row the grammar left
one token in (EOS only). The mask-logits pass's ``empty_row`` policy holds on the final
allowed set: "flag" — the ``logit_mask_empty`` output becomes ``mask_empty | no
finite logit below V after the processors`` (added if the graph has none), so
``Transformed`` raises ``EmptyMaskRowError``; an int token id — such a row allows
exactly that token (logit 0) after the processors, so it emits e.g. EOS.

Inputs (``R`` = the logits' leading dims, symbolic when they are; neutral fill = off)
    min_tokens_remaining   int32[R]      tokens still required; 0
    min_tokens_stop_ids    int64[R, S]   stop ids (EOS included), -1 padded; -1
    logit_bias_ids         int64[R, K]   biased token ids, -1 padded; -1
    logit_bias_values      float32[R, K] their biases; 0
    penalty_token_ids      int64[R, L]   distinct tokens of prompt + output, -1 padded; -1
    penalty_token_counts   int32[R, L]   times each was generated (0: prompt only); 0
    penalty_repetition / penalty_frequency / penalty_presence  float32[R]; 1 / 0 / 0
    thinking_budget_left   int32[R]      thought tokens the row may still write; 0
    thinking_end_id        int64[R]      end-of-thought token forced (+1e9) once left <= 0; -1 (not in a thought)
    temperature            float32[R]    sampling paths without their own; 1
    min_p                  float32[R]    sampling paths; 0
    <name>_<key>           custom processors' inputs (``LogitsProcessor.inputs``)

Options
    processors        built-in names, entry points / "module:Qualname" of custom
                      ``LogitsProcessor`` classes; built-ins run in the order above,
                      custom ones after the built-ins of their kind.
    vocab_size        the tokenizer's vocabulary (default: the logits' width W).
    empty_row         "flag" or a token id: the mask-logits pass's policy (``transform()``
                      hands both passes the one option).
    max_stop_tokens   S; max_bias_tokens: K; max_penalty_tokens: L (default 1024).
                      Penalties are sparse: L seen ids per row, not a dense [R, V]
                      count tensor (12 x L bytes per row to ship instead of 5 x V).
    num_speculative_tokens  > 0 keeps only min_tokens and thinking_budget (others raise).

Requires ``unprocessed`` (no processor inputs yet) and ``full_vocabulary`` (no
``tp_rank``: the logits are not one rank's shard); ensures ``processors_reach_sites``
(every processor input it added feeds the logits some sampling site reads).

Reports each site with the processors inserted there and those pruned (and why), the
inputs added, ``logit_mask_empty`` if it added that output, and nodes inserted. A
second application raises.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch.export import ExportedProgram

from neuron_constrain.core.contract import PassContract, PassResult, declares
from neuron_constrain.core.errors import TransformError
from neuron_constrain.kernels import allow_token_in_empty_rows, no_token_rows
from neuron_constrain.core.mask_interface import EMPTY_OUTPUT, RANK_INPUT, check_empty_row
from neuron_constrain.core.processor_interface import (
    BUILTIN_INPUTS,
    BUILTIN_PROCESSORS,
    DEFAULT_WIDTHS,
    DOCS,
    KERNELS,
    PASS_NAME,
    WIDTH_OPTIONS,
    ProcessorError,
    builtin_inputs,
    fuse_adjacent,
    resolve_processors,
)
from neuron_constrain.core.program import ProgramEditor, refuse_if_present, user_input_names
from neuron_constrain.core.report import AddedInput, PassReport, symbolic_shape
from neuron_constrain.core.sites import SCALING_OPS, module_path, plan_logits, weight_names

GREEDY_KINDS = ("argmax", "max")
CONTRACT = PassContract(
    name=PASS_NAME, switch="processors",
    options=("processors", "vocab_size", "empty_row", "max_stop_tokens", "max_bias_tokens", "max_penalty_tokens",
             "num_speculative_tokens"),
    requires=("unprocessed", "full_vocabulary"), ensures=("processors_reach_sites",), after=("mask_logits",),
)


def processors_pass_adds(name: str, processors: Sequence) -> bool:
    """Whether this pass, given ``processors`` (a non-empty list as ``transform()`` takes
    it, unresolved), may add a user input called ``name``: a built-in processor's, or
    ``<name>_<key>`` of a custom one."""
    custom = [p if isinstance(p, str) else getattr(p, "name", "") for p in processors]
    return name in BUILTIN_INPUTS or any(name.startswith(f"{c}_") for c in custom)


def _own_scaling(stops: set, node: torch.fx.Node, width: int) -> list[torch.fx.Node]:
    """Temperature-like scalings (div/mul) on logit-width paths from ``stops`` to ``node``."""
    found, stack, seen = [], [node], set()
    while stack:
        current = stack.pop()
        if current in stops or current in seen or current.op != "call_function":
            continue
        seen.add(current)
        val = current.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dim() == 0 or val.shape[-1] != width:
            continue
        if current.target in SCALING_OPS:
            found.append(current)
        stack.extend(current.all_input_nodes)
    return found


@declares(CONTRACT)
def process_logits_pass(
    program: ExportedProgram,
    *,
    processors=BUILTIN_PROCESSORS,
    vocab_size: int | None = None,
    empty_row: str | int = "flag",
    max_stop_tokens: int = DEFAULT_WIDTHS["max_stop_tokens"],
    max_bias_tokens: int = DEFAULT_WIDTHS["max_bias_tokens"],
    max_penalty_tokens: int = DEFAULT_WIDTHS["max_penalty_tokens"],
    num_speculative_tokens: int = 0,
) -> PassResult:
    """Run logits processors in the graph after the mask, fed per row by ``ProcessorState``.

    See the module docstring for the graph before and after.

    Args:
        program: the exported (and masked) program, with one head.
        processors: built-in names or custom processors (:func:`resolve_processors`).
        vocab_size: the tokenizer's vocabulary (default: the logits' width).
        empty_row: as the mask pass's: the rule also holds after the processors.
        max_stop_tokens: fixed per-row width of min_tokens' stop ids.
        max_bias_tokens: fixed per-row width of logit_bias's ids.
        max_penalty_tokens: fixed per-row width of the distinct tokens penalties see.
        num_speculative_tokens: above 0, only processors that force or forbid tokens.

    Returns:
        The program and its report (the processors per site, those pruned before a greedy argmax).

    Raises:
        TransformError: an unknown or disallowed processor, a graph with several heads, a width
            below 1, a program already processed.
    """
    try:
        procs = resolve_processors(processors, num_speculative_tokens=num_speculative_tokens)
    except ProcessorError as exc:
        raise TransformError(str(exc)) from exc
    if not procs:
        raise TransformError("processors=[] inserts nothing; name at least one, or pass processors=None to skip the pass")
    refuse_if_present(program, BUILTIN_INPUTS, pass_name="logits-processors")
    if RANK_INPUT in user_input_names(program):
        raise TransformError(
            "the program's logits are one rank's vocab shard (it has a tp_rank input); the process-logits pass "
            "needs the full vocabulary: run it on an unsharded step, or transform with tp_degree=1"
        )
    for name, value in (("max_stop_tokens", max_stop_tokens), ("max_bias_tokens", max_bias_tokens),
                        ("max_penalty_tokens", max_penalty_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise TransformError(f"{name}={value!r}: use an int >= 1 (the fixed number of ids per row)")
    check_empty_row(empty_row)

    editor = ProgramEditor(program)
    ((plan, vocab),) = plan_logits(editor.graph, editor.user_output_nodes(), vocab_size, weights=weight_names(program),
                                   what="one set of processor inputs")
    width = plan.width
    check_empty_row(empty_row, vocab)

    # Decide everything before editing: which paths sample, which scale logits themselves.
    stage_one = [p for p in procs if p in ("min_tokens", "logit_bias", "penalties", "thinking_budget")]
    stage_one += [p for p in procs if not isinstance(p, str) and not p.argmax_invariant]
    invariant = [p for p in procs if p == "min_p" or (not isinstance(p, str) and p.argmax_invariant)]
    sampling_inputs: dict[torch.fx.Node, list] = {}  # a sampling site's logits -> its sites
    for site, kind in plan.sites:
        if kind not in GREEDY_KINDS:
            sampling_inputs.setdefault(site.args[0], []).append(site)
    own_scaling = {node: _own_scaling(set(plan.points), node, width) for node in sampling_inputs}
    paths = {node: list(invariant) for node in sampling_inputs}
    if "min_p" in invariant:
        for node, scalings in own_scaling.items():
            if not scalings:
                paths[node].insert(paths[node].index("min_p"), "temperature")

    # Inputs, all added before any code (so no inserted node takes an input's name).
    report = PassReport(name=PASS_NAME)
    first = plan.points[0].meta["val"]
    rows = tuple(first.shape[:-1])
    widths = {"max_stop_tokens": max_stop_tokens, "max_bias_tokens": max_bias_tokens,
              "max_penalty_tokens": max_penalty_tokens}
    sizes = {key: widths[option] for key, option in WIDTH_OPTIONS.items()}
    nodes: dict[str, torch.fx.Node] = {}

    def add_input(name, dtype, trailing, fill, doc):
        nodes[name] = editor.add_tensor_input(name, (*rows, *trailing), dtype, fill, device=first.device)
        report.inputs_added.append(AddedInput(name, dtype, (*symbolic_shape(rows), *trailing), fill, doc=doc))

    def add_inputs_of(proc):
        if isinstance(proc, str):
            # min_p and temperature share a host group but are added per path
            for name in [proc] if proc in ("min_p", "temperature") else builtin_inputs(proc):
                if name not in nodes:
                    _, dtype, shape, fill = BUILTIN_INPUTS[name]
                    add_input(name, dtype, tuple(sizes[d] for d in shape), fill, DOCS[name])
        else:
            for key, (dtype, shape, fill) in proc.inputs.items():
                add_input(proc.input_name(key), dtype, tuple(shape), fill, f"input {key!r} of processor {proc.name!r}")

    for proc in stage_one:
        add_inputs_of(proc)
    for proc in dict.fromkeys(p for path in paths.values() for p in path):
        add_inputs_of(proc)

    def splice(proc, x, near):
        if isinstance(proc, str):
            kernel, names, prefix = KERNELS[proc]
            return editor.splice(kernel, [x, *(nodes[n] for n in names)], near=near, prefix=prefix)
        keys = list(proc.inputs)
        return editor.splice(
            lambda logits, *values: proc.apply(logits, **dict(zip(keys, values))),
            [x, *(nodes[proc.input_name(k)] for k in keys)],
            near=near,
            prefix=proc.name,
        )

    def name_of(proc):
        return proc if isinstance(proc, str) else proc.name

    # Stage one, at each mask point: min_tokens, logit_bias, penalties (+ custom), then the empty-row policy.
    flag = editor.find_output(EMPTY_OUTPUT)  # the mask-logits pass's, when it ran with empty_row="flag"
    processed: dict[torch.fx.Node, torch.fx.Node] = {}  # mask point -> its value after stage one
    for point in plan.points:
        x = point
        for proc in fuse_adjacent(stage_one):
            x = splice(proc, x, point)
        if stage_one and isinstance(empty_row, int):
            x = editor.splice(lambda v: allow_token_in_empty_rows(v, empty_row, vocab), [x], near=point, prefix="processors_empty_row")
        elif stage_one:
            if flag is None:
                flag = editor.splice(lambda v: no_token_rows(v, vocab), [x], near=point, prefix=EMPTY_OUTPUT)
                editor.add_output(flag, EMPTY_OUTPUT)
                report.outputs_added.append(EMPTY_OUTPUT)
            else:
                extended = editor.splice(
                    lambda f, v: f.logical_or(no_token_rows(v, vocab)), [flag, x], near=point, prefix=EMPTY_OUTPUT
                )
                editor.replace_output(flag, extended)
                flag = extended
        if plan.sites:
            editor.replace_uses(point, x, keep_output=True)
        else:
            editor.replace_uses(point, x, users=[editor.output_node])
        processed[point] = x

    # Stage two, on sampling paths only: temperature (unless the path has its own), min_p (+ custom).
    for node, sites in sampling_inputs.items():
        start = processed.get(node, node)  # a site reading the mask point now reads stage one's output
        y = start
        for proc in paths[node]:
            y = splice(proc, y, sites[0])
        editor.replace_uses(start, y, users=sites)

    done = [name_of(p) for p in stage_one]
    for site, kind in plan.sites:
        entry = {"node": site.name, "kind": kind, "module": module_path(site), "width": width, "vocab_size": vocab}
        if kind in GREEDY_KINDS:
            pruned = (["temperature"] if "min_p" in invariant else []) + [name_of(p) for p in invariant]
            entry.update(processors=done, pruned=pruned)
            if pruned:
                report.notes.append(
                    f"{site.name} ({kind}): {', '.join(pruned)} not inserted: argmax-invariant "
                    "(temperature > 0 and min_p keep the top token, so a greedy pick cannot change)"
                )
        else:
            path = paths.get(_origin(site, sampling_inputs), [])
            entry.update(processors=done + [name_of(p) for p in path], pruned=[])
        report.sites.append(entry)
    for node, scalings in own_scaling.items():
        if scalings and "min_p" in invariant:
            report.notes.append(
                f"the sampling path into {', '.join(s.name for s in sampling_inputs[node])} scales its logits itself "
                f"({', '.join(s.name for s in scalings)}): no temperature input there; min_p runs on the scaled logits"
            )
    if not plan.sites:
        report.sites = [
            {"node": p.name, "kind": "logits_output", "module": module_path(p), "width": width, "vocab_size": vocab,
             "processors": done, "pruned": [name_of(p) for p in invariant]}
            for p in plan.points
        ]
        if invariant:
            report.notes.append(
                f"no sampler in the graph (bare logits output): {', '.join(name_of(p) for p in invariant)} "
                "not inserted; the host sampler applies them"
            )
    report.nodes_inserted = len(editor.inserted)
    return PassResult(editor.build(), report)


def _origin(site, sampling_inputs) -> torch.fx.Node | None:
    """The pre-rewrite logits node a sampling site read (its input is now our last node)."""
    return next((node for node, sites in sampling_inputs.items() if site in sites), None)
