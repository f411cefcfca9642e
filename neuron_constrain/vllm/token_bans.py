"""``allowed_token_ids`` and ``bad_words`` through the head's mask: what a request bans, row by row.

    bans = TokenBans.of(params, vocab_size)      # once per request; None when it bans nothing
    bans.apply(mask_row, output, drafts)         # AND into the row the grammar (or -1) wrote

vLLM applies both as logits processors after its raw logprobs (so the logprobs program keeps
the grammar's mask alone): ``allowed_token_ids`` keeps only its ids; a bad word's last token
is banned where the output so far (and, on a draft row, the drafts before it) ends with the
rest of the word — at once for a one-token word (``vllm/v1/sample/ops/bad_words.py``, over
the word's token ids with and without a leading space, ``SamplingParams.bad_words_token_ids``).
A mask row is packed int32, token ``t`` bit ``t % 32`` of word ``t // 32``.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from neuron_constrain.kernels import packed_width


def _words(ids: Sequence[int], width: int) -> np.ndarray:
    """The packed row allowing exactly ``ids``."""
    words = np.zeros(width, dtype=np.uint32)
    ids = np.asarray(list(ids), dtype=np.int64)
    np.bitwise_or.at(words, ids >> 5, (np.uint32(1) << (ids & 31).astype(np.uint32)))
    return words.view(np.int32)


class TokenBans:
    """One request's bans: ``allowed`` (packed: the ids it keeps), ``keep`` (packed: every id but
    its one-token bad words), ``words``: its longer bad words as (prefix, last token)."""

    __slots__ = ("allowed", "keep", "words")

    def __init__(self, allowed: np.ndarray | None, keep: np.ndarray | None, words: list[tuple[tuple, int]]):
        self.allowed, self.keep, self.words = allowed, keep, words

    @classmethod
    def of(cls, params, vocab_size: int) -> "TokenBans | None":
        width = packed_width(vocab_size)
        allowed = _words(params.allowed_token_ids, width) if params.allowed_token_ids else None
        single, words = [], []
        for word in (params.bad_words_token_ids or []) if params.bad_words else []:
            if len(word) == 1:
                single.append(word[0])
            elif word:
                words.append((tuple(word[:-1]), int(word[-1])))
        keep = ~_words(single, width) if single else None
        if allowed is None and keep is None and not words:
            return None
        return cls(allowed, keep, words)

    def apply(self, row: np.ndarray, output: Sequence[int], drafts: Sequence[int] = ()) -> None:
        """AND this request's bans into ``row`` (int32 words), for a row after ``output`` + ``drafts``."""
        if self.allowed is not None:
            row &= self.allowed
        if self.keep is not None:
            row &= self.keep
        if self.words:
            past = list(output or ()) + [int(t) for t in drafts]
            for prefix, last in self.words:
                if len(prefix) <= len(past) and tuple(past[len(past) - len(prefix):]) == prefix:
                    row.view(np.uint32)[last >> 5] &= np.uint32(~(1 << (last & 31)) & 0xFFFFFFFF)
