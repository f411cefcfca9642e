"""``Requests``: the runtime's requests, their compilations and their failures.

    requests = Requests(engine, compiled=CompileCache(engine, workers=2, size=512), timeout=60)
    requests.add("r1", json_schema(schema))     # returns at once; compiles on the cache's pool
    requests.ready(["r1"])                      # compiled (or unconstrained) and not failed
    requests.fail("r1", error)                  # once: its rows allow only stop tokens from now on
    requests.unreported(batch)                  # {id: error} for failures not yet returned, once each
    requests.version                            # moves on every join, leave, compilation end, finish, failure

A request's compile time limit runs from when its compilation starts (``CompileJob.started``),
not while it waits in the queue; the error says how long it waited. A failed request is
finished; its one error names it and is never replaced.
"""
from __future__ import annotations

import concurrent.futures
import time
from typing import Hashable, Sequence

from neuron_constrain.structured.runtime.compile_cache import CompileCache
from neuron_constrain.structured.constraints import Constraint, ConstraintError, engine_message
from neuron_constrain.structured.errors import BatchLayoutError, GrammarFailedError, RequestFailedError
from neuron_constrain.structured.runtime.layout import RequestState
from neuron_constrain.structured.schema.limits import check as check_limits


class Requests:
    def __init__(self, engine, *, compiled: CompileCache, timeout: float):
        self.engine = engine
        self.compiled = compiled
        self.timeout = timeout  # the default compile time limit
        self.states: dict[Hashable, RequestState] = {}
        self.pending = 0  # requests still compiling
        self.reasoning = 0  # requests that think first (their matchers are not an engine's: no batch calls)
        self.version = 0
        self._unreported: set = set()  # failed requests not yet returned by unreported()

    def get(self, request_id: Hashable) -> RequestState:
        state = self.states.get(request_id)
        if state is None:
            raise BatchLayoutError(f"request {request_id!r} is not in the runtime; add() it before scheduling it")
        return state

    def add(self, request_id: Hashable, constraint: Constraint | None, timeout: float, *,
            reasoning=None, thought: Constraint | None = None) -> None:
        """``reasoning``: ``(answer matcher, thought matcher) -> the request's matcher`` for a request that
        thinks first (``reasoning.py``), its thought constrained by ``thought`` (or free)."""
        if request_id in self.states:
            raise BatchLayoutError(f"request {request_id!r} is already in the runtime; remove it first or use a new id")
        state = RequestState(constraint, added=time.perf_counter(), timeout=timeout, reasoning=reasoning)
        self.states[request_id] = state
        self.version += 1
        self.reasoning += reasoning is not None
        if reasoning is not None and constraint is None and thought is None:
            state.matcher = reasoning(None, None)  # nothing to compile: a free thought, an unconstrained answer
            return
        if constraint is None and thought is None:
            return
        try:  # the limits first: nothing else reads a constraint past them (its cache key would recurse on depth)
            for each in (constraint, thought):
                if each is not None:
                    check_limits(each, self.engine.limits)
                    # an engine whose parser needs no vocabulary finds a malformed grammar now; the others' compile does
                    self.engine.parse(each)
        except ConstraintError as error:
            self.fail(request_id, state, GrammarFailedError(f"request {request_id!r}: {error}", request_id))
            return
        state.job = self.compiled.get(constraint) if reasoning is None else self.compiled.get_all([constraint, thought])
        self.pending += 1
        self.resolve(request_id, state)

    def remove(self, request_id: Hashable) -> None:
        state = self.states.pop(request_id, None)
        if state is None:
            raise BatchLayoutError(f"request {request_id!r} is not in the runtime (never added, or removed already)")
        if state.job is not None:
            self.pending -= 1
        self.reasoning -= state.reasoning is not None
        self._unreported.discard(request_id)
        self.version += 1

    def answer(self, request_id: Hashable):
        """The engine's matcher of the request's answer, its compilation resolved first (None: pending, failed
        or unconstrained)."""
        self.error(request_id)
        return self.get(request_id).answer

    def resolve(self, request_id: Hashable, state: RequestState) -> bool:
        """Make the request's matcher if its compilation is done; False while it is pending or failed."""
        job = state.job
        if job is None:
            return state.error is None
        if job.future.done():
            self._settle(state)
            try:
                compiled = job.future.result()
                if state.reasoning is None:
                    state.matcher = state.answer = self.engine.matcher(compiled)
                else:  # the answer's and the thought's grammars (either may be None), behind the request's matcher
                    state.answer, thought = (None if c is None else self.engine.matcher(c) for c in compiled)
                    state.matcher = state.reasoning(state.answer, thought)
                    compiled = compiled[0]
                state.unenforced = tuple(compiled.unenforced) if compiled is not None else ()
            except ConstraintError as error:
                self.fail(request_id, state, GrammarFailedError(f"request {request_id!r}: {error}", request_id))
            except Exception as error:  # noqa: BLE001 - the engine's own failure, one clean line
                self.fail(request_id, state, GrammarFailedError(
                    f"request {request_id!r}: its {state.describe()} constraint failed to compile "
                    f"({engine_message(error)}); fix it and resubmit", request_id,
                ))
            return state.error is None
        deadline = self.deadline(state)
        if deadline is not None and time.perf_counter() > deadline:
            self._settle(state)
            queued = max(0.0, job.started - state.added)
            self.fail(request_id, state, GrammarFailedError(
                f"request {request_id!r}: its {state.describe()} constraint did not compile within "
                f"{state.timeout:g} s of its compilation starting (its time limit: compile_seconds, or the request's "
                f"timeout; it waited {queued:.2f} s in the compile queue before that); simplify the schema (fewer "
                "bounded strings/alternatives), resubmit with a longer timeout, or send it without a constraint",
                request_id,
            ))
        return False

    @staticmethod
    def deadline(state: RequestState) -> float | None:
        """When the request's compile time limit ends: ``None`` while its compilation is queued."""
        started = state.job.started
        return None if started is None else max(started, state.added) + state.timeout

    def _settle(self, state: RequestState) -> None:
        state.job = None
        self.pending -= 1
        self.version += 1

    def fail(self, request_id: Hashable, state: RequestState, error: RequestFailedError) -> None:
        """Fail one request: its rows allow only stop tokens from now on; the error is kept once."""
        if state.error is not None:
            return
        if state.job is not None:
            self._settle(state)
        state.error, state.finished = error, True
        self._unreported.add(request_id)
        self.version += 1

    def unreported(self, batch: Sequence[Hashable]) -> dict:
        """The failures of ``batch``'s requests not returned before: each failure is returned once."""
        failed = {}
        if self._unreported:
            for request_id in batch:
                if request_id in self._unreported:
                    self._unreported.discard(request_id)
                    state = self.states[request_id]
                    state.reported = True
                    failed[request_id] = state.error
        return failed

    def ready(self, request_ids: Sequence[Hashable] | None = None) -> list[Hashable]:
        """The requests of ``request_ids`` (default: all) that can be scheduled now, in order."""
        ids = list(self.states) if request_ids is None else request_ids
        out = []
        for request_id in ids:
            state = self.get(request_id)
            if state.job is None and state.error is None or self.resolve(request_id, state):
                out.append(request_id)
        return out

    def error(self, request_id: Hashable) -> RequestFailedError | None:
        state = self.get(request_id)
        if state.job is not None:
            self.resolve(request_id, state)
        return state.error

    def wait(self, request_ids: Sequence[Hashable] | None = None, timeout: float | None = None) -> list[Hashable]:
        """Block until some of ``request_ids`` are ready or failed (or ``timeout``); returns the ready ones."""
        ids = list(self.states) if request_ids is None else list(request_ids)
        end = None if timeout is None else time.perf_counter() + timeout
        while True:
            pending = [self.states[r] for r in ids if self.states[r].job is not None]
            if not pending:
                return self.ready(ids)
            now = time.perf_counter()
            deadlines = [self.deadline(state) for state in pending]
            # a queued compilation has no deadline yet: look again soon (its limit starts when it does)
            limit = min([d - now for d in deadlines if d is not None] + ([0.05] if None in deadlines else []))
            if end is not None:
                limit = min(limit, end - now)
            concurrent.futures.wait([s.job.future for s in pending], timeout=max(0.0, limit) + 1e-3,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
            ready = self.ready(ids)
            if sum(self.states[r].job is not None for r in ids) < len(pending):
                return ready
            if end is not None and time.perf_counter() >= end:
                return ready

    def wait_for(self, request_id: Hashable, state: RequestState) -> None:
        """A compiling request was scheduled: wait for it (up to its time limit); it ends ready or failed."""
        while not self.resolve(request_id, state) and state.error is None:
            deadline = self.deadline(state)
            limit = 0.05 if deadline is None else max(0.0, deadline - time.perf_counter())
            concurrent.futures.wait([state.job.future], timeout=limit + 1e-3)

    def wait_for_batch(self, batch: Sequence[Hashable]) -> None:
        """Before a batch is laid out: every request of it still compiling ends ready or failed."""
        if self.pending:
            for request_id in batch:
                state = self.states.get(request_id)
                if state is not None and state.job is not None:
                    self.wait_for(request_id, state)
