"""A per-token budget for mask fills: a request whose grammar keeps taking too long to fill ends, alone.

    failures = within_budget(fill, matchers, buffer, rows, limits, strikes)  # fill's failures, and the
                                                                              # rows past the budget again
    failures = slow_rows(matchers, buffer, rows, limits, skip)  # [(index, LimitError)]: each row timed by CPU
    seconds = cpu_seconds(lambda: matcher.fill_next_token_bitmask(buffer, row))  # one fill's own cost
    failure = over_budget(seconds, limits)                     # the LimitError("fill_ms") of one slow fill
    may_end(buffer, row, stop_token_ids)                       # whether the row allows a stop token

A fill cannot be stopped once started (xgrammar's runs in C++ on the calling thread), but
how long it took can be known: an ambiguous grammar's fill grows with the text it has read
(an ``s ::= s s | "a"`` grammar on a 32,000-token vocabulary: 0.1 ms at the first token,
100 ms by the hundredth, 600 ms by the two-hundredth), so once it passes the budget it stays
past it, token after token. An ordinary grammar's fill is not always small either: xgrammar
checks every token at some states (the first character of a length-bounded string: 20-56 ms
measured on 32,000- and 131,072-token vocabularies), but such a spike is one token, two at most.
So a request ends when its fill passes the budget on ``STRIKES`` of its tokens in a row.

The runtime times each step's fill by the clock; when the step passed the budget it fills each
row again timed in the CPU time of its thread (``slow_rows``: a preempted thread on a busy host
is not a slow grammar), to find whose it was; a row's cost is the least of two such fills
(``cpu_seconds``: on a shared host one fill's CPU time can still jump, another process evicting
its caches). Such a request ends at once: where its grammar may end (``may_end``) its row
allows only stop tokens, so its answer is complete and valid, cut where the budget ran out (as
``max_tokens`` cuts one); elsewhere it fails with the ``LimitError``.
"""
from __future__ import annotations

import time
from typing import Sequence

from neuron_constrain.structured.schema.limits import LimitError, Limits


STRIKES = 3  # a request ends when its fill passes the budget on this many of its tokens in a row


def within_budget(fill, matchers: Sequence, buffer, rows: Sequence[int], limits: Limits,
                  strikes: dict | None = None) -> list:
    """``fill(matchers, buffer, rows)``'s failures ``(index, error)``; where the whole fill took longer
    than the budget by the clock, with the rows past it (``slow_rows``) the ``STRIKES``-th token in a
    row. ``strikes`` (the caller's, kept between steps) counts each matcher's tokens past the budget in
    a row; None: the first token past it fails."""
    start = time.perf_counter()
    failures = fill(matchers, buffer, rows)
    slow = []
    if time.perf_counter() - start > limits.fill_ms / 1e3:
        slow = slow_rows(matchers, buffer, rows, limits, {index for index, _ in failures})
    if strikes is None:
        return failures + slow
    counted = {}
    for index, error in slow:
        if not isinstance(error, LimitError):
            failures.append((index, error))
            continue
        matcher = matchers[index]
        before = strikes.get(id(matcher))
        count = before[1] + 1 if before is not None and before[0] is matcher else 1
        counted[id(matcher)] = (matcher, count)
        if count >= STRIKES:
            failures.append((index, error))
    strikes.clear()  # a matcher not past the budget this step starts again from none
    strikes.update(counted)
    return sorted(failures, key=lambda failure: failure[0])


def over_budget(seconds: float, limits: Limits) -> LimitError:
    return LimitError("fill_ms", f"{seconds * 1e3:.0f} ms for one token", limits.fill_ms,
                      detail="its grammar's mask fill (an ambiguous grammar's work grows with its text)")


def cpu_seconds(fill) -> float:
    """The CPU time of this thread that ``fill()`` (a fill of one row, repeatable) takes: the least of two
    runs, so that one run slowed by a neighbour on the host does not count as the grammar's cost."""
    costs = []
    for _ in range(2):
        start = time.thread_time()
        fill()
        costs.append(time.thread_time() - start)
    return min(costs)


def slow_rows(matchers: Sequence, buffer, rows: Sequence[int], limits: Limits, skip: set = frozenset()) -> list:
    """Fill each row of ``matchers`` not in ``skip`` again (the same content), timed in this thread's
    CPU time (``cpu_seconds``); the rows past ``limits.fill_ms`` as ``(index, LimitError)``."""
    budget, slow = limits.fill_ms / 1e3, []
    for index, (matcher, row) in enumerate(zip(matchers, rows)):
        if index in skip:
            continue
        try:
            seconds = cpu_seconds(lambda: matcher.fill_next_token_bitmask(buffer, row))
        except Exception as error:  # noqa: BLE001 - that request's own failure
            slow.append((index, error))
            continue
        if seconds > budget:
            slow.append((index, over_budget(seconds, limits)))
    return slow


def may_end(buffer, row: int, stop_token_ids) -> bool:
    """Whether mask row ``row`` of ``buffer`` (packed int32) allows one of ``stop_token_ids``."""
    words = buffer[row]
    return any((int(words[token >> 5]) >> (token & 31)) & 1 for token in stop_token_ids)
