"""``MaskBuffer``: the runtime's one int32 mask buffer, and the rows it writes itself.

    mask = MaskBuffer(max_rows=64, vocab_size=V, stop_token_ids=[eos])
    mask.write_fixed_rows(layout)     # -1 rows (unconstrained) and stop-only rows, once per layout
    mask.stop(first, end)             # rows that may only stop (a failed request's)
    mask.fill_draft(matcher, row, draft)   # fill, accept a draft token, fill, ..., roll back
    mask.fill_forced(matcher, row, run)    # a forced run's rows: one token each, then the grammar after it
    mask.views[rows]                  # buffer[:rows]: what the graph reads, handed out, never re-sliced
    mask_mismatch(info, vocab_size)   # why a graph's logit_mask input cannot take these rows, or None
    mask.replace()                    # a fresh buffer (an abandoned fill thread may still write the old one)

``[max_rows, ceil(V/32)]``, token ``t`` is bit ``t % 32`` of word ``t // 32``. A -1 row is
rewritten only when a grammar row used it since (``all_allowed`` remembers which rows
hold -1), so a steady batch of unconstrained requests costs no writes.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from neuron_constrain.kernels import pack_bool_mask, packed_width
from neuron_constrain.structured.errors import BatchLayoutError
from neuron_constrain.structured.runtime.layout import Layout


class MaskBuffer:
    def __init__(self, *, max_rows: int, vocab_size: int, stop_token_ids: Sequence[int]):
        self.max_rows, self.vocab_size = max_rows, vocab_size
        self.width = packed_width(vocab_size)
        stop = torch.zeros(self.width * 32, dtype=torch.bool)
        stop[sorted(stop_token_ids)] = True
        self.stop_row = pack_bool_mask(stop[:vocab_size])
        self._stop_words = self.stop_row.numpy()
        self.all_allowed = bytearray(b"\x01" * max_rows)  # row holds -1 everywhere
        self._use(torch.full((max_rows, self.width), -1, dtype=torch.int32))

    def _use(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer
        self.views = [buffer[:rows] for rows in range(self.max_rows + 1)]  # handed out, never re-sliced
        self.words = buffer.numpy()  # same memory; numpy row writes cost less than torch indexing

    def replace(self) -> None:
        """Move to a fresh buffer holding the same rows: the old one may still be written by an
        abandoned fill thread, and no model may read it again."""
        self._use(self.buffer.clone())

    def stop(self, first: int, end: int) -> None:
        """Rows ``first .. end - 1`` allow only stop tokens."""
        self.words[first:end] = self._stop_words
        self.all_allowed[first:end] = bytes(end - first)

    def write_fixed_rows(self, layout: Layout) -> None:
        """The rows that do not change while ``layout`` holds: -1 rows and stop-only rows."""
        all_allowed, words = self.all_allowed, self.words
        if not layout.free_rows and not layout.stop_rows:
            all_allowed[: layout.rows] = bytes(layout.rows)
            return
        for row in layout.free_rows:  # unconstrained: -1 (kept while it stays)
            if not all_allowed[row]:
                words[row] = -1
                all_allowed[row] = 1
        for row in layout.stop_rows:
            words[row] = self._stop_words
            all_allowed[row] = 0
        for row in layout.fill_rows:
            all_allowed[row] = 0
        for _, first, _, draft in layout.drafts:
            all_allowed[first:first + 1 + len(draft)] = bytes(1 + len(draft))

    def fill_forced(self, request_id, matcher, row: int, run: Sequence[int]) -> None:
        """Rows ``row .. row + len(run)`` of a forced run (jump-forward): row ``i < len(run)`` allows
        exactly ``run[i]``, the last row is the grammar after the whole run (stop-only if the run
        ended it). The matcher is rolled back to where it was."""
        words = self.words.view(np.uint32)
        advanced = 0
        try:
            for token in run:
                if not (0 <= token < self.vocab_size and matcher.accept_token(token)):
                    raise BatchLayoutError(
                        f"forced token {token} of request {request_id!r} is not one its grammar takes here; "
                        "pass the runs StructuredRuntime.jump_forward() found, unchanged"
                    )
                words[row] = 0
                words[row, token >> 5] = np.uint32(1 << (token & 31))
                advanced += 1
                row += 1
            if matcher.is_terminated():
                self.buffer[row] = self.stop_row
            else:
                matcher.fill_next_token_bitmask(self.buffer, row)
        finally:
            if advanced:
                matcher.rollback(advanced)

    def fill_draft(self, request_id, matcher, row: int, draft: Sequence[int]) -> None:
        """Rows ``row .. row + len(draft)``: row ``i`` is the grammar after the first ``i`` drafts.
        Past a draft the grammar forbids, rows repeat the row that forbade it; past an accepted
        stop token they allow only stop tokens. The matcher is rolled back to where it was."""
        buffer, end = self.buffer, row + 1 + len(draft)
        matcher.fill_next_token_bitmask(buffer, row)
        advanced = 0
        try:
            for token in draft:
                if not 0 <= token < self.vocab_size:
                    raise BatchLayoutError(
                        f"draft token {token} of request {request_id!r} is outside the tokenizer's "
                        f"{self.vocab_size} tokens; the drafter must propose tokens < {self.vocab_size}"
                    )
                if not matcher.accept_token(token):
                    break
                advanced += 1
                row += 1
                if matcher.is_terminated():
                    buffer[row] = self.stop_row
                    break
                matcher.fill_next_token_bitmask(buffer, row)
        finally:
            if advanced:
                matcher.rollback(advanced)
        if row + 1 < end:
            buffer[row + 1:end] = buffer[row]


def mask_mismatch(info, vocab_size: int) -> str | None:
    """Why a graph's ``logit_mask`` input (its ``AddedInput``) cannot take this buffer's rows, or None:
    not packed int32, made for another vocabulary size, or of another width (``StructuredRuntime.for_model``)."""
    if info.dtype != torch.int32:
        return (f"the graph's logit_mask is {info.describe()} but the runtime ships packed int32 rows; "
                "transform with logit_mask='packed'")
    graph_vocab = getattr(info, "vocab_size", None)
    if graph_vocab is not None and graph_vocab != vocab_size:
        return (f"the graph was transformed with vocab_size={graph_vocab} but the tokenizer info has "
                f"{vocab_size} tokens; transform with vocab_size={vocab_size} (the tokenizer's "
                f"vocabulary), or build the tokenizer with vocab_size={graph_vocab} (from_huggingface / "
                "from_mistral pad it with tokens that are never text)")
    width = int(info.shape[-1])
    if width != packed_width(vocab_size):
        return (f"the graph's logit_mask has {width} words per row but the tokenizer's {vocab_size} "
                f"tokens need {packed_width(vocab_size)}; transform with vocab_size={vocab_size} (the tokenizer's "
                "vocabulary, even when the lm_head is wider)")
    return None
