"""Mask-logits pass (``mask_logits``): a ``logit_mask`` input, applied to the logits right before sampling.

Before (greedy step)                      After (mask_format="packed", V=1000, logits 1024 wide)
    logits = linear(h, lm_head_w)             logit_mask: i32[B, 32]              # new user input
    last = select(logits, 1, -1)              logits = linear(h, lm_head_w)
    tok = argmax(last, -1)                    last = select(logits, 1, -1)
    return (tok,)                             bits = ne(bitwise_and(unsqueeze(logit_mask, -1), 1 << arange(32)), 0)
                                              allowed = cat(view(bits, [B, 1024])[:, :1000], zeros(B, 24))
                                              masked = where(allowed, last, -inf)
                                              tok = argmax(masked, -1)
                                              empty = all(eq(bitwise_and(logit_mask, valid_words), 0), -1)
                                              return (tok, empty)                 # empty_row="flag"

Where the mask goes is decided by :func:`neuron_constrain.core.sites.plan_mask_points`:
before temperature / top-k / top-p on sampling paths; on the logits output itself
when the graph has no sampler (a bare ``*ForCausalLM``), so host-side sampling sees
masked logits too. The mask's leading dims are those of the masked logits (batch,
or batch and tokens), symbolic when they are.

Options
    mask_format  "packed" (xgrammar int32 ``[rows, ceil(V/32)]``, unpacked in-graph)
                 or "bool" (``[rows, V]``).
    vocab_size   the tokenizer's vocabulary (default: the logits' width); columns at
                 or past it are always disallowed (padded lm_head).
    empty_row    what a row whose mask allows nothing does. "flag" (default): the
                 program gains a ``logit_mask_empty`` bool output per row, and
                 ``Transformed`` raises ``EmptyMaskRowError`` naming the rows; the
                 token of such a row is meaningless. An int token id (e.g. EOS):
                 such a row allows exactly that token, in-graph, with no extra output.
    tp_degree    ranks of a vocab-parallel lm_head (NxD's ColumnParallel, gathered
                 after sampling). With ``tp_degree > 1`` the graph's logits are this
                 rank's shard, ``shard = ceil(padded_vocab / tp_degree)`` columns (the
                 last shard may be padded); the mask input stays the FULL mask (every
                 rank gets the same one) and the program gains a ``tp_rank`` input,
                 int32 ``[1]`` (NxD's SPMDRank layout), fed per rank at call time, so
                 no rank is baked in and one program serves all ranks. In-graph::

                     cols = tp_rank * shard + arange(shard)      # global columns
                     words = index_select(logit_mask, -1, cols // 32)
                     bits = index_select(1 << arange(32), 0, cols % 32)
                     allowed = ne(bitwise_and(words, bits), 0) & (cols < V)

                 A shard may start mid-word; ``logit_mask_empty`` reads the full mask,
                 so every rank flags the same rows. ``Transformed`` refuses to run
                 without ``tp_rank`` (never a silent rank 0) and checks its range.

Requires ``unmasked`` (no mask input yet); ensures ``every_site_masked`` (every
sampling site reads logits that depend on a mask input of a width that fits: the
checks' :func:`~neuron_constrain.core.checks.check_program`).

Reports the sites (node, kind, module), the mask points, the input (and output)
added and the number of nodes inserted. A second application raises. The names of
what it adds are :mod:`neuron_constrain.core.mask_interface`'s.
"""
from __future__ import annotations

import torch
from torch.export import ExportedProgram

from neuron_constrain.core.contract import PassContract, PassResult, declares
from neuron_constrain.core.errors import TransformError
from neuron_constrain.kernels import apply_bitmask, empty_rows, packed_width
from neuron_constrain.core.mask_interface import (
    MASK_INPUT,
    RANK_INPUT,
    check_empty_row,
    empty_output_name,
    is_mask_input,
    mask_input_name,
)
from neuron_constrain.core.program import ProgramEditor, refuse_if_present
from neuron_constrain.core.report import AddedInput, PassReport, symbolic_shape
from neuron_constrain.core.sites import describe_head, module_path, plan_logits, weight_names

MASK_FORMATS = ("packed", "bool")
CONTRACT = PassContract(name="mask_logits", switch="mask_format",
                        options=("mask_format", "vocab_size", "empty_row", "tp_degree"),
                        requires=("unmasked",), ensures=("every_site_masked",), after=("tap_modules",))


def mask_pass_adds(name: str) -> bool:
    """Whether this pass may add a user input called ``name``: a head's mask, or ``tp_rank``."""
    return is_mask_input(name) or name == RANK_INPUT


@declares(CONTRACT)
def mask_logits_pass(
    program: ExportedProgram,
    *,
    mask_format: str = "packed",
    vocab_size: int | None = None,
    empty_row: str | int = "flag",
    tp_degree: int = 1,
) -> PassResult:
    """Add a ``logit_mask`` input per head and mask the logits right before sampling.

    See the module docstring for the graph before and after, and the options in detail.

    Args:
        program: the exported program.
        mask_format: ``"packed"`` (xgrammar's int32 bitmask) or ``"bool"``.
        vocab_size: the tokenizer's vocabulary (default: the logits' width), or one per head.
        empty_row: ``"flag"`` (a ``logit_mask_empty`` output) or the token an empty row allows.
        tp_degree: ranks of a vocab-parallel lm_head (adds ``tp_rank``).

    Returns:
        The masked program and its report (sites found, nodes inserted, inputs added).

    Raises:
        TransformError: an unknown format, a bad ``empty_row`` or ``tp_degree``, a program already
            masked, no sampling site, or a ``vocab_size`` wider than the logits.
    """
    if mask_format not in MASK_FORMATS:
        raise TransformError(f"logit_mask={mask_format!r} is not a mask format; use one of {MASK_FORMATS} or None")
    refuse_if_present(program, [MASK_INPUT], pass_name="logit-mask")
    check_empty_row(empty_row)
    if isinstance(tp_degree, bool) or not isinstance(tp_degree, int) or tp_degree < 1:
        raise TransformError(f"tp_degree={tp_degree!r}: use the number of vocab-parallel ranks, an int >= 1")

    editor = ProgramEditor(program)
    heads = plan_logits(
        editor.graph, editor.user_output_nodes(), vocab_size, weights=weight_names(program), what="one logit_mask",
        shards=tp_degree, several=True,
    )
    for _, vocab in heads:
        check_empty_row(empty_row, vocab)
    mask_dtype = torch.int32 if mask_format == "packed" else torch.bool
    fill = -1 if mask_format == "packed" else True
    fallback = None if empty_row == "flag" else empty_row
    report = PassReport(name=CONTRACT.name)

    # Inputs first (so no inserted node takes an input's name), then the code.
    masks = []
    for index, (plan, vocab) in enumerate(heads):
        name = mask_input_name(index)
        first = plan.points[0].meta["val"]
        mask_width = packed_width(vocab) if mask_format == "packed" else vocab
        masks.append(editor.add_tensor_input(name, (*first.shape[:-1], mask_width), mask_dtype, fill, device=first.device))
        head = "" if len(heads) == 1 else f" for {describe_head(index, plan)}"
        report.inputs_added.append(
            AddedInput(name, mask_dtype, (*symbolic_shape(first.shape[:-1]), mask_width), fill,
                       doc=f"{mask_format} grammar mask over {vocab} tokens{head}", vocab_size=vocab)
        )
    rank = None
    if tp_degree > 1:
        plan, _ = heads[0]
        rank = editor.add_tensor_input(RANK_INPUT, (1,), torch.int32, 0, device=plan.points[0].meta["val"].device)
        report.inputs_added.append(
            AddedInput(RANK_INPUT, torch.int32, (1,), None, bounds=(0, tp_degree),
                       doc=f"this rank's index among tp_degree={tp_degree} vocab shards of {plan.width} columns")
        )

    for index, ((plan, vocab), mask) in enumerate(zip(heads, masks)):
        name = mask_input_name(index)

        for point in plan.points:
            args = [point, mask] + ([rank] if rank is not None else [])
            masked = editor.splice(_mask_kernel(vocab, fallback), args, near=point, prefix=name)
            if plan.sites:  # the samplers read masked logits; a logits output stays raw (logprobs)
                editor.replace_uses(point, masked, keep_output=True)
            else:  # no sampler: the logits output itself is masked
                editor.replace_uses(point, masked, users=[editor.output_node])
        if fallback is None:
            flag_name = empty_output_name(name)
            flag = editor.splice(_empty_kernel(vocab), [mask], near=plan.points[0], prefix=flag_name)
            editor.add_output(flag, flag_name)
            report.outputs_added.append(flag_name)

        sites = [{"node": node.name, "kind": kind, "module": module_path(node)} for node, kind in plan.sites]
        sites = sites or [{"node": p.name, "kind": "logits_output", "module": module_path(p)} for p in plan.points]
        for site in sites:
            site.update(head=index, mask_input=name)
        report.sites += sites
        width = plan.width  # with tp_degree > 1: this rank's shard
        report.notes.append(
            (f"{describe_head(index, plan)}: " if len(heads) > 1 else "")
            + f"logits {plan.root.name} [{width} wide, vocab_size {vocab}] masked by {name} at "
            + ", ".join(p.name for p in plan.points)
        )
        if tp_degree > 1:
            report.notes.append(
                f"vocab-parallel: {tp_degree} shards of {width} columns, this rank's from the {RANK_INPUT} input; "
                f"{width * tp_degree - vocab} padding column(s) disallowed"
            )
        if plan.sites and any(o in plan.points for o in editor.user_output_nodes()):
            report.notes.append("the raw logits are also returned unmasked (for logprobs); the sampler sees masked logits")
    report.nodes_inserted = len(editor.inserted)
    return PassResult(editor.build(), report)


def _mask_kernel(vocab: int, fallback: int | None):
    def apply_mask(logits: torch.Tensor, mask: torch.Tensor, *rank: torch.Tensor) -> torch.Tensor:
        return apply_bitmask(logits, mask, vocab, rank=rank[0] if rank else None, empty_token=fallback)

    return apply_mask


def _empty_kernel(vocab: int):
    return lambda mask: empty_rows(mask, vocab)
