"""xgrammar token bitmasks as plain aten math: unpack, apply, masked greedy pick.

Format (xgrammar's): an int32 tensor ``[..., ceil(V / 32)]``; token ``t`` is bit
``t % 32`` (LSB first) of word ``t // 32``; 1 = allowed. A word of ``-1`` allows
all 32 of its tokens. Bits at or past ``vocab_size`` in the last word are not
reliable and are always treated as disallowed, as are logits columns at or past
``vocab_size`` (a padded lm_head: Qwen3 151669 tokens vs 151936 logits).

Every function here is built from functional aten ops with static vocab widths and
no Python loop over rows, so ``torch.export`` keeps it as plain aten nodes,
inductor fuses it into one loop, and torch-xla lowers it with any batch contents
under one compilation. Bits are tested by AND with powers of two (bit 31 is the
int32 ``-2**31``), never by right shift: an int32 right shift of bit 31 is
arithmetic, and some backends lack shifts on data.

Widths are checked eagerly with messages that name both widths and the fix.
"""
from __future__ import annotations

import torch

ALL_ALLOWED_WORD = -1
BITS_PER_WORD = 32

__all__ = [
    "ALL_ALLOWED_WORD",
    "packed_width",
    "unpack_bitmask",
    "allowed_columns",
    "shard_columns",
    "allowed_shard_columns",
    "apply_bitmask",
    "masked_argmax",
    "empty_rows",
    "pack_bool_mask",
]


def packed_width(vocab_size: int) -> int:
    """Number of int32 words that hold ``vocab_size`` bits.

    Args:
        vocab_size: the vocabulary.

    Returns:
        ``ceil(vocab_size / 32)``.

    Raises:
        ValueError: ``vocab_size`` is not positive.
    """
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    return (vocab_size + BITS_PER_WORD - 1) // BITS_PER_WORD


def _bit_values(device: torch.device) -> torch.Tensor:
    """int32 ``[32]`` with ``1 << k``; entry 31 is ``-2**31`` (the sign bit)."""
    one = torch.ones((), dtype=torch.int32, device=device)
    return torch.bitwise_left_shift(one, torch.arange(BITS_PER_WORD, dtype=torch.int32, device=device))


def _check_packed(packed: torch.Tensor, vocab_size: int) -> None:
    if packed.dtype != torch.int32:
        raise TypeError(
            f"packed bitmask must be int32 (xgrammar's format), got {packed.dtype}; "
            "build it with xgrammar.allocate_token_bitmask or pack_bool_mask()"
        )
    want = packed_width(vocab_size)
    if packed.shape[-1] != want:
        raise ValueError(
            f"packed bitmask has {packed.shape[-1]} words per row but vocab_size={vocab_size} "
            f"needs ceil({vocab_size}/32) = {want}; pass a mask of width {want}, or the vocab_size "
            f"the mask was built for (between {32 * packed.shape[-1] - 31} and {32 * packed.shape[-1]})"
        )


def _check_mask(mask: torch.Tensor, vocab_size: int) -> None:
    """A packed int32 mask of ``ceil(V/32)`` words or a bool mask of ``V`` columns."""
    if mask.dtype != torch.bool:
        _check_packed(mask, vocab_size)
    elif mask.shape[-1] != vocab_size:
        raise ValueError(
            f"bool logit mask has {mask.shape[-1]} columns but vocab_size={vocab_size}; "
            f"pass vocab_size={mask.shape[-1]} or a mask of width {vocab_size}"
        )


def unpack_bitmask(packed: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 ``[..., ceil(V/32)]`` -> bool ``[..., V]`` (True = allowed).

    Args:
        packed: xgrammar's bitmask.
        vocab_size: ``V``.

    Returns:
        The bool mask.

    Raises:
        TypeError: ``packed`` is not int32.
        ValueError: its width is not ``ceil(V/32)``.
    """
    _check_packed(packed, vocab_size)
    bits = torch.bitwise_and(packed.unsqueeze(-1), _bit_values(packed.device)) != 0
    return bits.flatten(-2)[..., :vocab_size]


def _fit_width(allowed: torch.Tensor, width: int) -> torch.Tensor:
    """Pad a ``[..., V]`` allowed mask with False up to the logits ``width`` (>= V)."""
    vocab_size = allowed.shape[-1]
    if width < vocab_size:
        raise ValueError(
            f"logits have {width} columns but the mask covers vocab_size={vocab_size} tokens; "
            f"pass vocab_size<={width} (the tokenizer's vocabulary) or logits of width >= {vocab_size}"
        )
    if width == vocab_size:
        return allowed
    # cat, not F.pad: pad's decomposition guards on (and so specialises) symbolic batch sizes.
    padding = allowed.new_zeros((*allowed.shape[:-1], width - vocab_size))
    return torch.cat([allowed, padding], dim=-1)


def allowed_columns(mask: torch.Tensor, width: int, vocab_size: int | None = None) -> torch.Tensor:
    """A packed (int32) or bool mask -> bool ``[..., width]`` over the logits' columns.

    Args:
        mask: packed int32 ``[..., ceil(V/32)]`` or bool ``[..., V]``.
        width: the logits' width (>= V).
        vocab_size: ``V``; default ``width``. Columns at or past it are disallowed.

    Returns:
        bool ``[..., width]``.

    Raises:
        TypeError: a mask neither int32 nor bool.
        ValueError: a mask wider than the logits, or whose width does not fit ``vocab_size``.
    """
    vocab_size = width if vocab_size is None else vocab_size
    _check_mask(mask, vocab_size)
    return _fit_width(mask if mask.dtype == torch.bool else unpack_bitmask(mask, vocab_size), width)


def shard_columns(rank: torch.Tensor, shard_width: int) -> torch.Tensor:
    """int64 ``[shard_width]``: the global vocab columns ``rank * shard_width + arange(shard_width)``.

    Args:
        rank: an integer tensor of shape ``[]`` or ``[1]`` (a graph input, so one program serves
            every rank of a vocab-parallel lm_head).
        shard_width: columns per rank.

    Returns:
        int64 ``[shard_width]``.
    """
    start = rank.reshape(-1).to(torch.int64) * shard_width
    return start + torch.arange(shard_width, dtype=torch.int64, device=rank.device)


def allowed_shard_columns(
    mask: torch.Tensor, shard_width: int, vocab_size: int, rank: torch.Tensor
) -> torch.Tensor:
    """A full-vocab packed (int32) or bool mask -> bool ``[..., shard_width]`` for one vocab shard.

    Rank ``r`` of a vocab-parallel lm_head owns columns ``[r * shard_width, (r + 1) *
    shard_width)``; the mask is gathered at those global columns (the word ``c // 32``,
    ANDed with the bit ``c % 32``), so a shard may start mid-word. Columns at or past
    ``vocab_size`` (the padded last shard, a padded lm_head) are disallowed.

    Args:
        mask: the full mask, packed int32 or bool.
        shard_width: columns per rank.
        vocab_size: the full vocabulary.
        rank: this rank's index (``[]`` or ``[1]``).

    Returns:
        bool ``[..., shard_width]``.

    Raises:
        TypeError: a mask neither int32 nor bool.
        ValueError: a mask whose width does not fit ``vocab_size``.
    """
    _check_mask(mask, vocab_size)
    columns = shard_columns(rank, shard_width)
    real = columns < vocab_size
    safe = torch.where(real, columns, 0)  # padding columns read token 0, then are forced off
    if mask.dtype == torch.bool:
        return mask.index_select(-1, safe).logical_and(real)
    words = mask.index_select(-1, torch.div(safe, BITS_PER_WORD, rounding_mode="floor"))
    bits = _bit_values(mask.device).index_select(0, torch.remainder(safe, BITS_PER_WORD))
    return torch.bitwise_and(words, bits).ne(0).logical_and(real)


def apply_bitmask(
    logits: torch.Tensor,
    mask: torch.Tensor,
    vocab_size: int | None = None,
    *,
    rank: torch.Tensor | None = None,
    empty_token: int | None = None,
) -> torch.Tensor:
    """Return logits with ``-inf`` where ``mask`` (packed int32 or bool) disallows a token.

    Functional (the input is not written). ``vocab_size`` defaults to the logits'
    width; columns at or past it are disallowed. ``rank``: the logits are this
    rank's vocab shard of a vocab-parallel lm_head (``mask`` stays the full mask).
    ``empty_token``: a row whose mask allows nothing allows exactly this token.
    This is the kernel the mask-logits pass inserts.

    Args:
        logits: ``[..., width]``.
        mask: packed int32 ``[..., ceil(V/32)]`` or bool ``[..., V]``.
        vocab_size: ``V``; default the logits' width.
        rank: this rank's index (int ``[1]``) when the logits are a vocab shard.
        empty_token: the token a row allowing nothing allows instead.

    Returns:
        The masked logits (a new tensor).

    Raises:
        TypeError: a mask that is neither int32 nor bool.
        ValueError: a mask whose width does not fit ``vocab_size``.
    """
    width = logits.shape[-1]
    vocab_size = width if vocab_size is None else vocab_size
    if empty_token is not None:
        mask = _allow_in_empty_rows(mask, vocab_size, empty_token)
    if rank is None:
        allowed = allowed_columns(mask, width, vocab_size)
    else:
        allowed = allowed_shard_columns(mask, width, vocab_size, rank)
    # where(allowed, logits, -inf): one pass, no negated copy of the mask (masked_fill with
    # ~allowed costs two more passes over [rows, V] in eager mode).
    return torch.where(allowed, logits, float("-inf"))


def _allow_in_empty_rows(mask: torch.Tensor, vocab_size: int, token: int) -> torch.Tensor:
    """``mask`` with ``token`` allowed in the rows that allow nothing below ``vocab_size``.

    On a packed mask this sets one bit of one word per row (``[rows, ceil(V/32)]`` work,
    not ``[rows, V]``): word ``token // 32`` gains bit ``token % 32`` where the row is empty.
    """
    if not 0 <= token < vocab_size:
        raise ValueError(f"empty_token={token} is not a token below vocab_size={vocab_size}")
    empty = empty_rows(mask, vocab_size).unsqueeze(-1)
    if mask.dtype == torch.bool:
        columns = torch.arange(mask.shape[-1], device=mask.device)
        return mask.logical_or(empty.logical_and(columns == token))
    word_index = torch.arange(mask.shape[-1], dtype=torch.int32, device=mask.device)
    bit = _bit_values(mask.device)[token % BITS_PER_WORD]
    extra = torch.where(empty.logical_and(word_index == token // BITS_PER_WORD), bit, 0).to(torch.int32)
    return torch.bitwise_or(mask, extra)


def empty_rows(mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool ``[...]``: rows whose mask allows no token below ``vocab_size``.

    For a packed mask this reads the words, not the unpacked bits (32x less work):
    the last word is ANDed with the bits that lie below ``vocab_size``.

    Args:
        mask: packed int32 or bool.
        vocab_size: ``V``.

    Returns:
        bool ``[...]``.

    Raises:
        TypeError: a packed mask that is not int32.
        ValueError: a packed mask whose width does not fit ``vocab_size``.
    """
    if mask.dtype == torch.bool:
        return mask[..., :vocab_size].any(-1).logical_not()
    _check_packed(mask, vocab_size)
    width = mask.shape[-1]
    tail_bits = vocab_size - (width - 1) * BITS_PER_WORD  # 1..32 valid bits in the last word
    tail_word = -1 if tail_bits == BITS_PER_WORD else (1 << tail_bits) - 1
    word_index = torch.arange(width, dtype=torch.int32, device=mask.device)
    valid = torch.where(word_index == width - 1, tail_word, ALL_ALLOWED_WORD).to(torch.int32)
    return torch.bitwise_and(mask, valid).eq(0).all(-1)


def masked_argmax(
    logits: torch.Tensor, packed: torch.Tensor, vocab_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy pick among allowed tokens: ``(tokens int64 [...], empty bool [...])``.

    Under inductor the unpack, the select and the reduction fuse into one pass over
    the logits, so no bool mask is materialised. A row whose mask allows nothing
    gets ``empty=True`` (and a meaningless token): the caller decides, never token 0
    in silence.

    Args:
        logits: ``[..., width]``.
        packed: xgrammar's int32 bitmask ``[..., ceil(V/32)]``.
        vocab_size: ``V``; default the logits' width.

    Returns:
        ``(tokens, empty)``: the best allowed token per row, and whether the row allowed none.
    """
    vocab_size = logits.shape[-1] if vocab_size is None else vocab_size
    tokens = apply_bitmask(logits, packed, vocab_size).argmax(-1)
    return tokens, empty_rows(packed, vocab_size)


# ----------------------------------------------------------------------------- host helpers


def pack_bool_mask(mask: torch.Tensor) -> torch.Tensor:
    """bool ``[..., V]`` -> xgrammar int32 ``[..., ceil(V/32)]`` (bits past V are 0).

    Args:
        mask: True where a token is allowed.

    Returns:
        The packed bitmask, as ``xgrammar.allocate_token_bitmask`` lays it out.

    Raises:
        TypeError: ``mask`` is not bool.
    """
    if mask.dtype != torch.bool:
        raise TypeError(f"pack_bool_mask wants a bool mask, got {mask.dtype}")
    vocab_size = mask.shape[-1]
    width = packed_width(vocab_size)
    padded = torch.nn.functional.pad(mask, (0, width * BITS_PER_WORD - vocab_size), value=False)
    words = padded.reshape(*mask.shape[:-1], width, BITS_PER_WORD).to(torch.int64)
    # Sum of distinct powers of two in int64, then wrap to int32 (bit 31 -> sign bit).
    powers = torch.ones((), dtype=torch.int64, device=mask.device) << torch.arange(
        BITS_PER_WORD, dtype=torch.int64, device=mask.device
    )
    value = (words * powers).sum(-1)
    return torch.where(value >= 2**31, value - 2**32, value).to(torch.int32)
