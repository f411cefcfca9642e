"""Tensor math the passes insert and the host runtimes share (plain aten ops only)."""
from .bitmask import (
    ALL_ALLOWED_WORD,
    allowed_columns,
    allowed_shard_columns,
    apply_bitmask,
    empty_rows,
    masked_argmax,
    pack_bool_mask,
    packed_width,
    shard_columns,
    unpack_bitmask,
)
from .processors import (
    allow_token_in_empty_rows,
    apply_logit_bias,
    apply_min_tokens_and_logit_bias,
    apply_min_p,
    apply_min_tokens,
    apply_penalties,
    apply_temperature,
    apply_thinking_budget,
    no_token_rows,
)

__all__ = [
    "ALL_ALLOWED_WORD",
    "allowed_columns",
    "allowed_shard_columns",
    "apply_bitmask",
    "empty_rows",
    "masked_argmax",
    "pack_bool_mask",
    "packed_width",
    "shard_columns",
    "unpack_bitmask",
    # logits processors
    "allow_token_in_empty_rows",
    "apply_logit_bias",
    "apply_min_tokens_and_logit_bias",
    "apply_min_p",
    "apply_min_tokens",
    "apply_penalties",
    "apply_temperature",
    "apply_thinking_budget",
    "no_token_rows",
]
