"""Tensor math the passes insert and the host runtimes share (plain aten ops only)."""
from .bitmask import (
    ALL_ALLOWED_WORD,
    all_allowed_bitmask,
    allowed_columns,
    apply_bitmask,
    apply_bool_mask,
    empty_rows,
    masked_argmax,
    pack_bool_mask,
    packed_width,
    unpack_bitmask,
)

__all__ = [
    "ALL_ALLOWED_WORD",
    "all_allowed_bitmask",
    "allowed_columns",
    "apply_bitmask",
    "apply_bool_mask",
    "empty_rows",
    "masked_argmax",
    "pack_bool_mask",
    "packed_width",
    "unpack_bitmask",
]
