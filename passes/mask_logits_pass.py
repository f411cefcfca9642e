"""Logit-mask pass: a ``logit_mask`` input, applied to the logits right before sampling.

Before (greedy step)                      After (mask_format="packed", V=1000, logits 1024 wide)
    logits = linear(h, lm_head_w)             logit_mask: i32[B, 32]              # new user input
    last = select(logits, 1, -1)              logits = linear(h, lm_head_w)
    tok = argmax(last, -1)                    last = select(logits, 1, -1)
    return (tok,)                             bits = ne(bitwise_and(unsqueeze(logit_mask, -1), 1 << arange(32)), 0)
                                              allowed = pad(view(bits, [B, 1024])[:, :1000], 24, False)
                                              masked = masked_fill(last, ~allowed, -inf)
                                              tok = argmax(masked, -1)
                                              empty = all(eq(bitwise_and(logit_mask, valid_words), 0), -1)
                                              return (tok, empty)                 # empty_row="flag"

Where the mask goes is decided by :func:`neuron_constrain.sites.plan_mask_points`:
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

Reports the sites (node, kind, module), the mask points, the input (and output)
added and the number of nodes inserted. A second application raises.
"""
from __future__ import annotations

import torch
from torch.export import ExportedProgram

from neuron_constrain.errors import TransformError
from neuron_constrain.kernels import allowed_columns, empty_rows, packed_width
from neuron_constrain.program import ProgramEditor, user_input_names
from neuron_constrain.report import AddedInput, PassReport
from neuron_constrain.sites import module_path, plan_mask_points

MASK_INPUT = "logit_mask"
EMPTY_OUTPUT = "logit_mask_empty"
MASK_FORMATS = ("packed", "bool")


def _sympy_dims(shape) -> tuple:
    return tuple(d.node.expr if isinstance(d, torch.SymInt) else int(d) for d in shape)


def mask_logits_pass(
    program: ExportedProgram,
    *,
    mask_format: str = "packed",
    vocab_size: int | None = None,
    empty_row: str | int = "flag",
) -> tuple[ExportedProgram, PassReport]:
    if mask_format not in MASK_FORMATS:
        raise TransformError(f"logit_mask={mask_format!r} is not a mask format; use one of {MASK_FORMATS} or None")
    if MASK_INPUT in user_input_names(program):
        raise TransformError(
            f"the program already has a {MASK_INPUT!r} input: the logit-mask pass was applied already; "
            "transform the original model or program, not its rewrite"
        )
    if not (empty_row == "flag" or (isinstance(empty_row, int) and not isinstance(empty_row, bool) and empty_row >= 0)):
        raise TransformError(f"empty_row={empty_row!r}: use 'flag' or a token id >= 0 (e.g. the EOS id)")

    editor = ProgramEditor(program)
    plan = plan_mask_points(editor.graph, editor.user_output_nodes(), vocab_size)
    if plan is None and vocab_size is not None:  # logits found, but narrower than vocab_size?
        plan = plan_mask_points(editor.graph, editor.user_output_nodes(), None)
    if plan is None:
        raise TransformError(
            "found no logits to mask: the graph has no vocabulary projection (a matmul wider than its input"
            + (f" and at least vocab_size={vocab_size} wide" if vocab_size else "")
            + ") that feeds a sampling op or an output; export the model with its lm_head, "
            "or pass the vocab_size that the logits have"
        )
    width = plan.width
    vocab = width if vocab_size is None else vocab_size
    if vocab > width:
        raise TransformError(
            f"vocab_size={vocab} is larger than the logits' width {width} (node {plan.root.name!r}); "
            f"pass vocab_size<={width}"
        )
    if isinstance(empty_row, int) and empty_row >= vocab:
        raise TransformError(f"empty_row={empty_row} is not a token below vocab_size={vocab}")

    leading = {tuple(_sympy_dims(p.meta["val"].shape[:-1])) for p in plan.points}
    if len(leading) != 1:
        raise TransformError(
            f"the logits at {[p.name for p in plan.points]} have different leading shapes {sorted(map(str, leading))}; "
            "one logit_mask cannot cover them: export one logits output per program"
        )
    first = plan.points[0].meta["val"]
    mask_width = packed_width(vocab) if mask_format == "packed" else vocab
    mask_dtype = torch.int32 if mask_format == "packed" else torch.bool
    mask_val = editor.fake(
        lambda: torch.empty((*first.shape[:-1], mask_width), dtype=mask_dtype, device=first.device)
    )
    example_rows = tuple(int(d) if isinstance(d, int) else int(d.node.hint) for d in first.shape[:-1])
    fill = -1 if mask_format == "packed" else True
    mask = editor.add_input(MASK_INPUT, mask_val, torch.full((*example_rows, mask_width), fill, dtype=mask_dtype))

    report = PassReport(name="logit_mask")
    report.inputs_added.append(
        AddedInput(MASK_INPUT, mask_dtype, (*_sympy_dims(first.shape[:-1]), mask_width), fill,
                   doc=f"{mask_format} grammar mask over {vocab} tokens")
    )
    fallback = None if empty_row == "flag" else empty_row

    def apply_mask(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        allowed = allowed_columns(mask, width, vocab)
        if fallback is not None:
            token = torch.arange(width, device=logits.device) == fallback
            allowed = allowed.logical_or(empty_rows(mask, vocab).unsqueeze(-1).logical_and(token))
        return logits.masked_fill(allowed.logical_not(), float("-inf"))

    output = editor.output_node
    for point in plan.points:
        users = [u for u in point.users if u is not output] if plan.sites else [output]
        masked = editor.splice(apply_mask, [point, mask], near=point, prefix=MASK_INPUT)
        for user in users:
            user.replace_input_with(point, masked)
    if fallback is None:
        flag = editor.splice(lambda m: empty_rows(m, vocab), [mask], near=plan.points[0], prefix=EMPTY_OUTPUT)
        editor.add_output(flag)
        report.outputs_added.append(EMPTY_OUTPUT)

    report.sites = [
        {"node": node.name, "kind": kind, "module": module_path(node)} for node, kind in plan.sites
    ] or [{"node": p.name, "kind": "logits_output", "module": module_path(p)} for p in plan.points]
    report.nodes_inserted = len(editor.inserted)
    report.notes.append(
        f"logits {plan.root.name} [{width} wide, vocab_size {vocab}] masked at "
        + ", ".join(p.name for p in plan.points)
    )
    if plan.sites and any(o in plan.points for o in editor.user_output_nodes()):
        report.notes.append("the raw logits are also returned unmasked (for logprobs); the sampler sees masked logits")
    return editor.build(), report
