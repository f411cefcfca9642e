"""A per-token budget for mask fills: a request whose grammar takes too long to fill ends, alone.

    failure = over_budget(seconds, limits)                     # the LimitError("fill_ms") of one slow fill
    failures = slow_rows(matchers, buffer, rows, limits, skip)  # [(index, LimitError)]: each row timed once
    failures = within_budget(fill, matchers, buffer, rows, limits)  # fill's failures, then slow_rows if it was slow
    may_end(buffer, row, stop_token_ids)                       # whether the row allows a stop token

A fill cannot be stopped once started (xgrammar's runs in C++ on the calling thread), but
how long it took can be known: an ambiguous grammar's fill grows with the text it has read
(an ``s ::= s s | "a"`` grammar on a 32,000-token vocabulary: 0.1 ms at the first token,
100 ms by the hundredth, 600 ms by the two-hundredth), so the step in which it first passes
the budget is the last one it slows. The runtime times each step's fill by the clock; when
the step passed the budget it fills each row once more timed in the CPU time of its thread
(``slow_rows``: a preempted thread on a busy host is not a slow grammar), to find whose it was.
Such a request ends at once: where its grammar may end (``may_end``) its row allows only
stop tokens, so its answer is complete and valid, cut where the budget ran out (as
``max_tokens`` cuts one); elsewhere it fails with the ``LimitError``.
"""
from __future__ import annotations

import time
from typing import Sequence

from neuron_constrain.structured.limits import LimitError, Limits


def within_budget(fill, matchers: Sequence, buffer, rows: Sequence[int], limits: Limits) -> list:
    """``fill(matchers, buffer, rows)``'s failures ``(index, error)``; where the whole fill took longer
    than the budget by the clock, with the rows past it (``slow_rows``, each other row timed once)."""
    start = time.perf_counter()
    failures = fill(matchers, buffer, rows)
    if time.perf_counter() - start > limits.fill_ms / 1e3:
        failures += slow_rows(matchers, buffer, rows, limits, {index for index, _ in failures})
    return failures


def over_budget(seconds: float, limits: Limits) -> LimitError:
    return LimitError("fill_ms", f"{seconds * 1e3:.0f} ms for one token", limits.fill_ms,
                      detail="its grammar's mask fill (an ambiguous grammar's work grows with its text)")


def slow_rows(matchers: Sequence, buffer, rows: Sequence[int], limits: Limits, skip: set = frozenset()) -> list:
    """Fill each row of ``matchers`` not in ``skip`` again (the same content), timed in this thread's
    CPU time; the rows past ``limits.fill_ms`` as ``(index, LimitError)``."""
    budget, clock, slow = limits.fill_ms / 1e3, time.thread_time, []
    for index, (matcher, row) in enumerate(zip(matchers, rows)):
        if index in skip:
            continue
        start = clock()
        try:
            matcher.fill_next_token_bitmask(buffer, row)
        except Exception as error:  # noqa: BLE001 - that request's own failure
            slow.append((index, error))
            continue
        seconds = clock() - start
        if seconds > budget:
            slow.append((index, over_budget(seconds, limits)))
    return slow


def may_end(buffer, row: int, stop_token_ids) -> bool:
    """Whether mask row ``row`` of ``buffer`` (packed int32) allows one of ``stop_token_ids``."""
    words = buffer[row]
    return any((int(words[token >> 5]) >> (token & 31)) & 1 for token in stop_token_ids)
