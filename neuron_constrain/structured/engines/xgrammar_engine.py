"""xgrammar behind the engine contract: its own ``GrammarMatcher`` is the matcher.

    engine = XGrammarEngine(tokenizer, fill_threads=1)
    compiled = engine.compile(json_schema(schema))     # Constraint.compile on one GrammarCompiler
    engine.batch_fill(matchers, buffer, rows)          # one BatchGrammarMatcher call (1 thread),
                                                       # or RowFillers (fill_threads > 1)

xgrammar's matcher already keeps the contract: it refuses an out-of-range row or a
buffer of the wrong dtype/width, its mask and ``accept_token`` agree, and it releases
the GIL while it fills.
"""
from __future__ import annotations

import weakref
from typing import Sequence

import torch
import xgrammar as xgr

from neuron_constrain.structured.engines.base import Compiled, GrammarEngine, check_rows, fill_each
from neuron_constrain.structured.engines.fill_threads import RowFillers
from neuron_constrain.structured.tokenizers import encode_continuation

_ACCEPT = xgr.GrammarMatcher.accept_token


class XGrammarEngine(GrammarEngine):
    """xgrammar: the compiled grammar of ``Constraint.compile``; its matcher is xgrammar's own."""

    name = "xgrammar"

    def __init__(self, tokenizer, *, fill_threads: int = 1, fill_timeout: float = 120.0):
        super().__init__(tokenizer, fill_threads=fill_threads, fill_timeout=fill_timeout)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1)
        self.fillers = RowFillers(fill_threads, fill_timeout) if fill_threads > 1 else None
        # One thread: one call for all rows, so the GIL is released once, not once per row, while a
        # pipelined step traces the body on another thread (as fast as per-row calls when alone).
        self._batch = xgr.BatchGrammarMatcher(max_threads=1)
        if self.fillers is not None:  # the threads hold the fillers, not the engine: stop them with it
            weakref.finalize(self, self.fillers.close)

    def close(self) -> None:
        if self.fillers is not None:
            self.fillers.close()

    def compile(self, constraint) -> Compiled:
        unenforced = self.keyword_policy(constraint)
        return Compiled(self.name, constraint, constraint.compile(self.compiler), unenforced)

    def matcher(self, compiled: Compiled) -> xgr.GrammarMatcher:
        return xgr.GrammarMatcher(compiled.grammar)

    def batch_fill(self, matchers: Sequence, buffer: torch.Tensor, rows: Sequence[int]) -> list[tuple[int, BaseException]]:
        check_rows(buffer, rows, self.width)
        if len(matchers) == 1:  # the batch API costs ~65 us more for one row
            return fill_each(matchers, buffer, rows)
        if self.fillers is not None:  # xgrammar's BatchGrammarMatcher(max_threads=2) filled slower than one thread
            return self.fillers.fill(matchers, buffer, rows)
        try:
            self._batch.batch_fill_next_token_bitmask(list(matchers), buffer, list(rows))
        except Exception:  # noqa: BLE001 - which row failed: find it row by row (the others are refilled)
            return fill_each(matchers, buffer, rows)
        return []

    def forced_tokens(self, matcher) -> list[int]:
        text = matcher.find_jump_forward_string()
        if not text:
            return []
        encode = getattr(self.tokenizer, "encode", None)
        if encode is None:
            raise ValueError("jump_forward='canonical' tokenizes the forced text: pass the tokenizer itself "
                             "(from_huggingface / from_mistral), not a bare TokenizerInfo")
        tokens = encode_continuation(encode, text)[:-1]  # the last may merge with what the model writes next
        taken = 0
        for token in tokens:
            if not matcher.accept_token(token):
                break
            taken += 1
        if taken:
            matcher.rollback(taken)
        return tokens[:taken]

    def batch_accept(self, matchers: Sequence, tokens: Sequence[int]) -> list[bool]:
        # Row by row: xgrammar's batch_accept_token took 1.3x as long at batch 32.
        return list(map(_ACCEPT, matchers, tokens))
