"""``RowFillers``: long-lived threads that fill mask rows beside the calling thread.

    fillers = RowFillers(threads=2, timeout=120)
    failures = fillers.fill(matchers, buffer, rows)    # [(index, error)]: raised, or past the timeout
    fillers.stragglers                                 # fills abandoned past the timeout (may still write)

xgrammar's matcher releases the GIL while it fills a row, so rows taken one at a time
from one shared iterator (``next`` on it is atomic under the GIL) fill in parallel, and a
costly row (milliseconds inside a long string) is balanced by the cheap ones whichever
thread takes it. Measured on 2 cores at batches 32 and 64 of real schemas
(``bench_host.py``): 1.04-1.39x one thread, where xgrammar's own
``BatchGrammarMatcher(max_threads=2)`` was 0.63-0.80x; rows cost 1.1-1.8x more each when
both cores fill, and waking a thread costs ~25 us each way on that VM.

Failures stay with their row. A fill that raises is reported as ``(index, error)`` and
the thread goes on with the next row. A worker still filling when the wait ends is
abandoned: its row is reported as a ``TimeoutError``, a fresh thread takes its place, and
``stragglers`` counts it. The abandoned fill may still write its row later, into the
buffer of that call: the caller must not hand that buffer to a model again
(``StructuredRuntime`` swaps in a fresh one). A fill on the calling thread cannot be
bounded; only the workers' rows are.
"""
from __future__ import annotations

import threading
from typing import Sequence

import torch

from neuron_constrain.core.errors import Error


class FillTimeout(Error, TimeoutError):
    """A grammar fill did not return within the fill threads' time limit."""


class _Round:
    """One ``fill`` call: its claims, its buffer and what failed (shared by the threads of that call)."""

    __slots__ = ("claims", "buffer", "failures")

    def __init__(self, claims, buffer):
        self.claims, self.buffer, self.failures = claims, buffer, []

    def drain(self, worker: "_Worker | None") -> None:
        buffer, failures = self.buffer, self.failures
        for index, matcher, row in self.claims:
            if worker is not None:
                worker.current = index
            try:
                matcher.fill_next_token_bitmask(buffer, row)
            except Exception as error:  # noqa: BLE001 - reported with its row, the others go on
                failures.append((index, error))
        if worker is not None:
            worker.current = None


class _Worker:
    """One fill thread: waits for a round, drains it, says it is done."""

    def __init__(self, fillers: "RowFillers"):
        self.start, self.done = threading.Lock(), threading.Lock()
        self.start.acquire()
        self.done.acquire()
        self.current: int | None = None  # the claim being filled (for a timeout's report)
        self.abandoned = False
        self._fillers = fillers
        threading.Thread(target=self._run, daemon=True, name="grammar-fill").start()

    def _run(self) -> None:
        while True:
            self.start.acquire()
            if self.abandoned or self._fillers.closed:
                return
            self._fillers.round.drain(self)
            if self.abandoned:  # the caller gave up on this thread: leave without a word
                return
            self.done.release()


class RowFillers:
    """``threads - 1`` long-lived workers filling rows beside the calling thread (bounded waits)."""

    def __init__(self, threads: int, timeout: float = 120.0):
        if threads < 2:
            raise ValueError(f"RowFillers needs at least 2 threads (the caller and a worker), got {threads}")
        self.timeout = timeout
        self.closed = False
        self.stragglers = 0  # workers abandoned past the timeout
        self.round = _Round(iter(()), None)
        self._workers = [_Worker(self) for _ in range(threads - 1)]

    def fill(self, matchers: Sequence, buffer: torch.Tensor, rows: Sequence[int]) -> list[tuple[int, BaseException]]:
        """Fill ``rows[i]`` from ``matchers[i]``; returns the failures as ``(i, error)``."""
        if self.closed:
            raise RuntimeError("the engine's fill threads were closed; make a new runtime")
        self.round = this = _Round(iter(list(zip(range(len(matchers)), matchers, rows))), buffer)
        for worker in self._workers:
            worker.start.release()
        this.drain(None)
        for slot, worker in enumerate(self._workers):
            if worker.done.acquire(timeout=self.timeout):
                continue
            worker.abandoned = True  # it may still write its row of this call's buffer
            self.stragglers += 1
            self._workers[slot] = _Worker(self)
            if worker.current is not None:
                this.failures.append((worker.current, FillTimeout(
                    f"its grammar fill did not return within {self.timeout:g} s (a fill thread was abandoned)")))
        return sorted(this.failures, key=lambda failure: failure[0])

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            for worker in self._workers:
                worker.start.release()
