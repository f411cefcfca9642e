"""Tokens a grammar forces, found on the host, to be decoded as drafts the verify step cannot reject.

    run = exact_run(matcher, limit=7, scratch=buffer)     # while the mask allows exactly one token
    run = canonical_run(engine, matcher, limit=7, scratch=buffer)   # the forced text, tokenized canonically
    runs = forced_runs(requests, engine, batch, limit, mode, scratch)  # StructuredRuntime.forced_runs: per request

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

import time
from typing import Hashable, Mapping, Sequence

import numpy as np
import torch

from neuron_constrain.structured.constraints import engine_message
from neuron_constrain.structured.engines.item_tracker import ItemTrackingMatcher
from neuron_constrain.structured.errors import GrammarFillError
from neuron_constrain.structured.runtime.reasoning import ReasoningMatcher

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


def forced_run(engine, matcher, limit: int, mode: str, scratch: torch.Tensor) -> list[int]:
    """A matcher's forced run in ``mode``: a reasoning request's through its own matcher (the budget's end
    tokens, then what the answer's grammar forces), canonical text only from its answer's grammar."""
    if mode == "exact":
        return exact_run(matcher, limit, scratch)
    if type(matcher) is ReasoningMatcher:
        if matcher.inner is None:
            return exact_run(matcher, limit, scratch)
        return canonical_run(engine, matcher.inner, limit, scratch)
    return canonical_run(engine, matcher, limit, scratch)


def forced_runs(requests, engine, batch: Sequence[Hashable], limit: int | Mapping[Hashable, int], mode: str | None,
                scratch: torch.Tensor) -> dict[Hashable, list[int]]:
    """``StructuredRuntime.forced_runs``: each live constrained request's forced run in ``mode`` (None: no runs;
    another mode than ``MODES`` raises ValueError), at most ``limit`` (or ``limit[request]``) tokens, its host
    time added to its ``forced_seconds``; a grammar that raises fails its request (``requests.fail``). Requests
    without a run are left out."""
    if mode not in (None, *MODES):
        raise ValueError(f"jump_forward={mode!r}: pass None, {' or '.join(map(repr, MODES))}")
    if mode is None:
        return {}
    runs = {}
    for request_id in batch:
        state = requests.get(request_id)
        cap = limit if isinstance(limit, int) else limit.get(request_id, 0)
        if state.matcher is None or state.finished or state.job is not None or cap <= 0:
            continue
        start = time.perf_counter()
        try:
            run = forced_run(engine, state.matcher, cap, mode, scratch)
        except Exception as error:  # noqa: BLE001 - that request's own failure
            requests.fail(request_id, state, GrammarFillError(
                f"request {request_id!r}: finding its forced tokens failed ({engine_message(error)})", request_id))
            continue
        state.forced_seconds += time.perf_counter() - start
        if run:
            runs[request_id] = run
    return runs
