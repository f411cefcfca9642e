"""What a masked program looks like from outside: the names of the inputs and outputs the
mask-logits pass adds, and the empty-row policy.

    logit_mask, logit_mask_1, ...        one mask input per head (mask_input_name(head))
    tp_rank                              this rank's index, with tp_degree > 1
    logit_mask_empty, logit_mask_1_empty  a head's all-disallowed rows (empty_row="flag")

The mask-logits pass writes these; the process-logits pass extends the flag output
and refuses a vocab-sharded program by its ``tp_rank``; ``Transformed``, the checks
and the runtimes find the inputs and outputs by them.
"""
from __future__ import annotations

from neuron_constrain.core.errors import TransformError

MASK_INPUT = "logit_mask"
RANK_INPUT = "tp_rank"
EMPTY_SUFFIX = "_empty"
EMPTY_OUTPUT = MASK_INPUT + EMPTY_SUFFIX


def mask_input_name(head: int) -> str:
    """The mask input of head ``head``: ``logit_mask`` (the main head), ``logit_mask_1``, ..."""
    return MASK_INPUT if head == 0 else f"{MASK_INPUT}_{head}"


def is_mask_input(name: str) -> bool:
    """Whether ``name`` is a head's mask input (:func:`mask_input_name` of some head)."""
    head = name[len(MASK_INPUT) + 1:] if name.startswith(MASK_INPUT + "_") else None
    return name == MASK_INPUT or (head is not None and head.isdigit())


def empty_output_name(mask_name: str) -> str:
    """The empty-row flag output of the head masked by ``mask_name``."""
    return mask_name + EMPTY_SUFFIX


def is_empty_output(name: str) -> bool:
    return name.startswith(MASK_INPUT) and name.endswith(EMPTY_SUFFIX)


def check_empty_row(empty_row, vocab: int | None = None) -> None:
    """``empty_row`` is "flag" or a token id below ``vocab`` (the mask-logits and process-logits passes' option)."""
    if not (empty_row == "flag" or (isinstance(empty_row, int) and not isinstance(empty_row, bool) and empty_row >= 0)):
        raise TransformError(f"empty_row={empty_row!r}: use 'flag' or a token id >= 0 (e.g. the EOS id)")
    if vocab is not None and isinstance(empty_row, int) and empty_row >= vocab:
        raise TransformError(f"empty_row={empty_row} is not a token below vocab_size={vocab}")
