"""``CompileCache``: the runtime's one cache of compiled grammars, compiled on two thread pools.

    cache = CompileCache(engine, workers=2, size=512)
    job = cache.get(constraint)       # CompileJob: .future (-> engine.CompiledGrammar), .started (None while queued)
    job = cache.get_all([a, b])       # one job for several: .future -> (CompiledGrammar, CompiledGrammar), None for a None
    cache.put(compiled)               # a grammar compiled elsewhere (engine.compile), kept under its constraint
    cache.hits, cache.misses

Keyed by ``Constraint.key`` (kind, spec, options): a repeated schema is free, and
concurrent requests with one schema share one compilation. A failed compilation is not
kept: the next request with that constraint compiles it again. Past ``size`` entries the
least recently used finished one is forgotten. ``job.started`` is when a worker began
compiling (the request's time limit runs from then, not from when it was queued).
Constraints compile on ``lanes.py``'s two lanes (``workers`` threads each): a large
constraint waits behind large ones only.
"""
from __future__ import annotations

import collections
import concurrent.futures
import threading
import time

from neuron_constrain.structured.constraints import Constraint
from neuron_constrain.structured.runtime.lanes import Lanes


class CompileJob:
    """One compilation: its future and when a worker started it (``None`` while it waits in the queue)."""

    __slots__ = ("future", "started")

    def __init__(self):
        self.future: concurrent.futures.Future | None = None
        self.started: float | None = None


class JoinedJob(CompileJob):
    """Several compilations as one job (``CompileCache.get_all``): started when the first started."""

    __slots__ = ("parts",)

    def __init__(self, parts):
        super().__init__()
        self.parts = parts

    @property
    def started(self) -> float | None:
        starts = [j.started for j in self.parts if j.started is not None]
        return min(starts) if starts else None

    @started.setter
    def started(self, value) -> None:  # (CompileJob's __init__ sets it; the parts' times are what count)
        pass


class CompileCache:
    def __init__(self, engine, *, workers: int, size: int):
        self.engine = engine
        self.size = size
        self.hits = 0  # get() of a constraint compiled (or compiling) already
        self.misses = 0
        self._jobs: collections.OrderedDict[tuple, CompileJob] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._pool = Lanes(workers)

    def get(self, constraint: Constraint) -> CompileJob:
        key = constraint.key
        with self._lock:
            job = self._jobs.get(key)
            if job is not None and not (job.future.done() and job.future.exception() is not None):
                self.hits += 1
                self._jobs.move_to_end(key)
                return job
            job = CompileJob()
            job.future = self._pool.submit(len(key[1] or ""), self._compile, job, constraint)
            self.misses += 1
            self._jobs[key] = job
            if len(self._jobs) > self.size:  # forget the least recently used finished compilation
                oldest = next((k for k, j in self._jobs.items() if j.future.done()), None)
                if oldest is not None:
                    del self._jobs[oldest]
            return job

    def get_all(self, constraints) -> CompileJob:
        """One job for ``constraints`` (a ``None`` among them compiles nothing): its future gives their
        compiled grammars in order, or the first failure; it started when the first of them did."""
        jobs = [None if c is None else self.get(c) for c in constraints]
        joined = JoinedJob([j for j in jobs if j is not None])
        joined.future = concurrent.futures.Future()

        lock = threading.Lock()

        def settle(_):
            with lock:  # the last part's callback settles it, once
                if joined.future.done() or not all(j.future.done() for j in joined.parts):
                    return
                try:
                    result = tuple(None if j is None else j.future.result() for j in jobs)
                except Exception as error:  # noqa: BLE001 - a part's failure is the joined job's
                    joined.future.set_exception(error)
                else:
                    joined.future.set_result(result)

        for job in joined.parts:
            job.future.add_done_callback(settle)
        if not joined.parts:
            joined.future.set_result(tuple(None for _ in jobs))
        return joined

    def put(self, compiled) -> None:
        """Keep a grammar compiled elsewhere (a warm-up, a benchmark's own engine) under its constraint."""
        job = CompileJob()
        job.future, job.started = concurrent.futures.Future(), time.perf_counter()
        job.future.set_result(compiled)
        with self._lock:
            self._jobs[compiled.constraint.key] = job

    def _compile(self, job: CompileJob, constraint: Constraint):
        getattr(self.engine, "wait_ready", lambda: None)()  # worker start-up is not the compilation's time
        job.started = time.perf_counter()
        return self.engine.compile(constraint)

    def close(self) -> None:
        """Stop the workers (running compilations finish first; queued ones are cancelled)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
