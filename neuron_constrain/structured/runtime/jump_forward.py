"""Tokens a grammar forces, found on the host, to be decoded as drafts the verify step cannot reject.

    run = exact_run(matcher, limit=7, scratch=buffer)     # while the mask allows exactly one token
    run = canonical_run(engine, matcher, limit=7, scratch=buffer)   # the forced text, tokenized canonically

Two modes (``StructuredRuntime(jump_forward=...)``):

* ``"exact"``: fill, and while the row allows exactly one token take it (accept, fill again),
  up to ``limit``; then roll the lookahead back. Decoding the run as drafts is
  token-identical to decoding step by step, greedy and sampled alike: a one-token mask
  leaves nothing to sample. A run may end with a stop token (the grammar must end
  there: the request finishes); it never passes one, and a row that allows a stop token
  beside others (the grammar *may* end) is not forced.
* ``"canonical"``: the engine's forced text (xgrammar's jump-forward string, llguidance's
  fast-forward tokens) tokenized canonically, without its last token, which may merge
  with what follows (``GrammarEngine.forced_tokens``), then the exact run from there.
  Longer runs (the text of a whole key is forced even where a tokenizer has several ways
  to spell it), always grammar-valid, but not always the tokens step-by-step decoding
  would pick.

The verify step's rows for a run allow exactly the run's tokens (``MaskBuffer.fill_forced``),
so every draft is accepted and the token sampled after the run is the step's new token.
"""
from __future__ import annotations

import numpy as np
import torch

from neuron_constrain.structured.engines.item_tracker import ItemTrackingMatcher

MODES = ("exact", "canonical")


def single_token(words: np.ndarray) -> int | None:
    """The one token a packed mask row allows, or ``None`` if it allows none or several."""
    nonzero = np.flatnonzero(words)
    if len(nonzero) != 1:
        return None
    word = int(words[nonzero[0]]) & 0xFFFFFFFF
    if word & (word - 1):
        return None
    return int(nonzero[0]) * 32 + word.bit_length() - 1


def exact_run(matcher, limit: int, scratch: torch.Tensor) -> list[int]:
    """The longest run (up to ``limit``) of positions whose mask allows exactly one token."""
    words, run = scratch.numpy()[0], []
    try:
        while len(run) < limit:
            matcher.fill_next_token_bitmask(scratch, 0)
            token = single_token(words)
            if token is None or not matcher.accept_token(token):
                break
            run.append(token)
            if matcher.is_terminated():  # the run ends the request
                break
    finally:
        if run:
            matcher.rollback(len(run))
    return run


def canonical_run(engine, matcher, limit: int, scratch: torch.Tensor) -> list[int]:
    """The engine's forced text, tokenized canonically, then the exact run from there (each
    position whose mask allows one token), up to ``limit`` tokens; the matcher's state is
    unchanged. The exact tail takes back what the held-back last token may not merge with."""
    if limit <= 0:
        return []
    run: list[int] = []
    try:
        grammar = matcher.grammar if type(matcher) is ItemTrackingMatcher else matcher  # the tracker refuses below
        for token in engine.forced_tokens(grammar)[:limit]:
            if not matcher.accept_token(token):
                break
            run.append(token)
        if len(run) < limit and not matcher.is_terminated():
            return run + exact_run(matcher, limit - len(run), scratch)
        return run
    finally:
        if run:
            matcher.rollback(len(run))
