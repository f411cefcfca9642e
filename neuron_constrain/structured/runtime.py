"""``StructuredRuntime``: per-step packed masks for a batch of requests, in one buffer,
with grammars compiled off the critical path and failures kept to their request.

    runtime = StructuredRuntime(tokenizer, max_rows=64)      # tokenizer: .info (tokenizers.py)
    runtime.add("r1", json_schema(schema), timeout=30)       # returns at once: compiles in a thread pool
    runtime.ready(["r1", "r2"])                              # the requests a scheduler may put in a batch
    mask = runtime.step(batch)                               # rows in batch order (ready requests only)
    result = runtime.accept_rows(batch, tokens)              # result.finished, result.failed {id: error}
    runtime.error("r1")                                      # why a request failed, or None

The parts: ``compile_cache.py`` (the one cache of compiled grammars, and the thread pool),
``layout.py`` (which row each request owns: a pure function of the batch and the
request states, reused while neither changes), and here the fill and the accept.

Failures stay with their request. A constraint that does not parse or compile, one past
its compile time limit, a fill that raises or does not return, a mask row that allowed
no token, a token its grammar refuses or one past the vocabulary: each fails that request
alone, with one error naming it (``error()``; a :class:`RequestFailedError`), and
``accept_rows`` returns it once in ``failed``. A failed request is finished: its rows
allow only stop tokens and the tokens it gets are ignored; every other request in the
batch advances. ``add`` never raises for what a constraint says (both engines agree): a
malformed regex, choice or EBNF fails the request at once. Errors of the caller's own
making (an unknown or repeated request, too many rows, a draft token past the vocabulary)
raise :class:`BatchLayoutError`; ``accept()`` of one request raises its
:class:`DisallowedTokenError` and leaves the request as it was, for callers that retry.

Compilation: ``compile_workers`` threads compile each constraint once (a repeated schema
is free: ``cache_hits`` / ``cache_misses``). A request's time limit runs from when its
compilation starts, not while it waits in the queue (the error says how long it
waited). A request whose grammar is not ready is **not scheduled**: ``ready()`` leaves
it out; a caller that schedules a compiling request anyway makes ``step()`` wait for
it (up to its limit). xgrammar cannot cancel a compilation: a timed-out one finishes in
its worker and fills the cache for later requests.

Fill: one constrained row calls its matcher directly; more rows go to the engine's batch
fill, which runs ``fill_threads`` threads without the GIL from ``parallel_min_rows`` rows
on (default: 1 thread on a host of <= 2 cores, whose other core the model's step wants;
else up to 8). A fill thread past ``fill_timeout`` is abandoned and may still write its
row: the runtime then moves to a fresh buffer, so no model ever reads a row a straggler
writes. A fill on the calling thread cannot be bounded.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import os
import time
from typing import Hashable, Mapping, Sequence

import torch
import xgrammar as xgr

from neuron_constrain.kernels import pack_bool_mask, packed_width
from neuron_constrain.passes.mask_logits_pass import MASK_INPUT
from neuron_constrain.structured.compile_cache import CompileCache
from neuron_constrain.structured.constraints import Constraint, ConstraintError, engine_message
from neuron_constrain.structured.engines import ENGINE_CHOICES, make_engine
from neuron_constrain.structured.engines.base import fill_each
from neuron_constrain.structured.engines.fill_threads import FillTimeout
from neuron_constrain.structured.errors import (
    BatchLayoutError,
    DisallowedTokenError,
    GrammarFailedError,
    GrammarFillError,
    NoAllowedTokenError,
    RequestFailedError,
    StructuredOutputsDisabledError,
)
from neuron_constrain.structured.layout import Layout, RequestState, lay_out
from neuron_constrain.structured.tokenizers import with_info
from neuron_constrain.transform import Transformed


@dataclasses.dataclass
class Accepted:
    """What ``accept_rows`` did: every request of the batch is in exactly one of these or advanced."""

    finished: list  # requests this token finished (a stop token accepted)
    failed: dict  # request id -> its RequestFailedError, each failure returned once


def _count(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r}: pass an int >= {minimum}")
    return value


def _seconds(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={value!r}: pass a finite number of seconds > 0")
    return float(value)


class StructuredRuntime:
    """Per-step packed masks for a batch of requests, in one reusable buffer.

    ``tokenizer``: the tokenizer protocol (``tokenizers.py``: ``.info``), or a bare
    ``xgrammar.TokenizerInfo``. ``tokenizer_info``: an info you built yourself, audited
    against ``tokenizer`` (control tokens special, sizes agree) before it is used.
    Its ``vocab_size`` sets the mask width ``ceil(V/32)``; it is the ``vocab_size`` the
    graph was transformed with, so an lm_head padded past it never has its padding
    chosen. ``step`` returns ``None`` when structured outputs are disabled (the graph
    has no mask input). The runtime is reusable across ``generate`` calls (compiled
    grammars stay cached); ``close()`` stops its compile and fill threads.
    """

    def __init__(
        self,
        tokenizer,
        *,
        max_rows: int,
        enable_structured_outputs: bool = True,
        tokenizer_info: xgr.TokenizerInfo | None = None,
        engine: str = "xgrammar",
        fill_threads: int | None = None,
        compile_workers: int = 2,
        compile_timeout: float = 60.0,
        cache_size: int = 512,
        parallel_min_rows: int = 16,
        fill_timeout: float = 120.0,
    ):
        if not isinstance(max_rows, int) or isinstance(max_rows, bool) or max_rows <= 0:
            raise ValueError(f"max_rows must be positive (the largest batch, draft rows included), got {max_rows}")
        if engine not in ENGINE_CHOICES:
            raise ValueError(f"unknown grammar engine {engine!r}; pick one of {', '.join(ENGINE_CHOICES)}")
        if fill_threads is None:  # 2 cores: leave the model's step a core of its own
            fill_threads = 1 if (os.cpu_count() or 1) <= 2 else min(8, os.cpu_count())
        self.fill_threads = _count("fill_threads", fill_threads, 1)
        self.compile_timeout = _seconds("compile_timeout", compile_timeout)
        self.fill_timeout = _seconds("fill_timeout", fill_timeout)
        _count("compile_workers", compile_workers, 1)
        _count("cache_size", cache_size, 1)
        # Fewer constrained rows than this are filled on this thread: waking a fill thread costs
        # ~25 us each way on a 2-core VM, about what batch 8's whole fill takes (bench_host.py).
        _count("parallel_min_rows", parallel_min_rows, 2)
        self.parallel_min_rows = parallel_min_rows if fill_threads > 1 else 2  # 1 thread: the engine's batch fill always
        tokenizer = with_info(tokenizer, tokenizer_info)
        self.tokenizer = tokenizer
        self.info = tokenizer.info
        self.vocab_size = self.info.vocab_size
        self.width = packed_width(self.vocab_size)
        self.max_rows = max_rows
        self.enabled = enable_structured_outputs
        self.stop_token_ids = frozenset(self.info.stop_token_ids)
        if not self.stop_token_ids:
            raise ValueError("the tokenizer info has no stop token; build it with stop_token_ids=[<eos id>]")
        self.engine = make_engine(engine, tokenizer, fill_threads=fill_threads, fill_timeout=self.fill_timeout)
        self.compiled = CompileCache(self.engine, workers=compile_workers, size=cache_size)
        stop = torch.zeros(self.width * 32, dtype=torch.bool)
        stop[sorted(self.stop_token_ids)] = True
        self._stop_row = pack_bool_mask(stop[: self.vocab_size])
        self._stop_words = self._stop_row.numpy()
        self._all_allowed = bytearray(b"\x01" * max_rows)  # row holds -1 everywhere
        self._use_buffer(torch.full((max_rows, self.width), -1, dtype=torch.int32))
        self._requests: dict[Hashable, RequestState] = {}
        self._pending = 0  # requests still compiling
        self._unreported: set = set()  # failed requests an accept_rows() has not returned yet
        # The last layout, reused while the batch and every request's state are unchanged (a decode
        # loop's usual case). ``_version`` moves on every join, leave, compilation end, finish and failure.
        self._plan: Layout | None = None
        self._version = 0
        self._decoded: list[bytes] | None = None
        self.last_step_seconds = 0.0  # whole step(): layout + fills + hand-off
        self.last_fill_seconds = 0.0  # the engine's fill / accept / rollback inside it
        self.last_accept_seconds = 0.0  # whole accept_rows()
        self.last_accept_engine_seconds = 0.0  # the engine's accept inside it

    def _use_buffer(self, buffer: torch.Tensor) -> None:
        """One buffer for the life of the runtime (a fresh one only after a fill thread was abandoned)."""
        self.buffer = buffer
        self._views = [buffer[:rows] for rows in range(self.max_rows + 1)]  # handed out, never re-sliced
        self._words = buffer.numpy()  # same memory; numpy row writes cost less than torch indexing

    @property
    def cache_hits(self) -> int:
        return self.compiled.hits

    @property
    def cache_misses(self) -> int:
        return self.compiled.misses

    def close(self) -> None:
        """Stop the compile threads (running compilations finish first) and the fill threads."""
        self.compiled.close()
        self.engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @classmethod
    def for_model(cls, transformed: Transformed, tokenizer, *, max_rows: int, **kwargs):
        """A runtime matched to ``transformed``: enabled iff the graph takes a logit mask of our width.

        ``tokenizer``: the tokenizer protocol or a bare ``xgrammar.TokenizerInfo``."""
        added = {i.name: i for i in transformed.report.inputs_added}
        runtime = cls(tokenizer, max_rows=max_rows, enable_structured_outputs=MASK_INPUT in added, **kwargs)
        if runtime.enabled:
            info = added[MASK_INPUT]
            if info.dtype != torch.int32:
                runtime.close()
                raise ValueError(
                    f"the graph's logit_mask is {info.describe()} but the runtime ships packed int32 rows; "
                    "transform with logit_mask='packed'"
                )
            graph_vocab = getattr(info, "vocab_size", None)
            if graph_vocab is not None and graph_vocab != runtime.vocab_size:
                runtime.close()
                raise ValueError(
                    f"the graph was transformed with vocab_size={graph_vocab} but the tokenizer info has "
                    f"{runtime.vocab_size} tokens; transform with vocab_size={runtime.vocab_size} (the tokenizer's "
                    f"vocabulary), or build the tokenizer with vocab_size={graph_vocab} (from_huggingface / "
                    "from_mistral pad it with tokens that are never text)"
                )
            width = int(info.shape[-1])
            if width != runtime.width:
                runtime.close()
                raise ValueError(
                    f"the graph's logit_mask has {width} words per row but the tokenizer's {runtime.vocab_size} "
                    f"tokens need {runtime.width}; transform with vocab_size={runtime.vocab_size} (the tokenizer's "
                    "vocabulary, even when the lm_head is wider)"
                )
        return runtime

    # -------------------------------------------------------------- requests join / leave
    def add(self, request_id: Hashable, constraint: Constraint | None = None, *, timeout: float | None = None) -> None:
        """Admit a request; returns at once. Its grammar compiles in the background (or
        comes from the cache) within ``timeout`` seconds of compiling (default
        ``compile_timeout``). A malformed constraint fails the request (``error()``)."""
        if request_id in self._requests:
            raise BatchLayoutError(f"request {request_id!r} is already in the runtime; remove it first or use a new id")
        if constraint is not None and not self.enabled:
            raise StructuredOutputsDisabledError(
                f"request {request_id!r} asks for a {constraint.describe()} constraint, but structured outputs are "
                "disabled: the model was transformed without a logit_mask input, so its answer could not be "
                "constrained. Transform it with enable_structured_outputs=True (transform_decoder) or "
                "logit_mask='packed' (transform) and restart, or send the request without a constraint"
            )
        timeout = self.compile_timeout if timeout is None else _seconds("timeout", timeout)
        state = RequestState(constraint, added=time.perf_counter(), timeout=timeout)
        self._requests[request_id] = state
        self._version += 1
        if constraint is None:
            return
        try:  # xgrammar's parser finds a malformed regex/choice/EBNF in microseconds; llguidance's compile does
            if self.engine.name == "xgrammar":
                constraint.parse()
        except ConstraintError as error:
            self._fail(request_id, state, GrammarFailedError(f"request {request_id!r}: {error}", request_id))
            return
        state.job = self.compiled.get(constraint)
        self._pending += 1
        self._resolve(request_id, state)

    def _resolve(self, request_id: Hashable, state: RequestState) -> bool:
        """Make the request's matcher if its compilation is done; False while it is pending or failed."""
        job = state.job
        if job is None:
            return state.error is None
        if job.future.done():
            self._settle(state)
            try:
                compiled = job.future.result()
                state.matcher = self.engine.matcher(compiled)
                state.unenforced = tuple(compiled.unenforced)
            except ConstraintError as error:
                self._fail(request_id, state, GrammarFailedError(f"request {request_id!r}: {error}", request_id))
            except Exception as error:  # noqa: BLE001 - the engine's own failure, one clean line
                self._fail(request_id, state, GrammarFailedError(
                    f"request {request_id!r}: its {state.constraint.describe()} constraint failed to compile "
                    f"({engine_message(error)}); fix it and resubmit", request_id,
                ))
            return state.error is None
        deadline = self._deadline(state)
        if deadline is not None and time.perf_counter() > deadline:
            self._settle(state)
            queued = max(0.0, job.started - state.added)
            self._fail(request_id, state, GrammarFailedError(
                f"request {request_id!r}: its {state.constraint.describe()} constraint did not compile within "
                f"{state.timeout:g} s of its compilation starting (it waited {queued:.2f} s in the compile queue "
                "before that); simplify the schema (fewer bounded strings/alternatives), resubmit with a longer "
                "timeout, or send it without a constraint", request_id,
            ))
        return False

    @staticmethod
    def _deadline(state: RequestState) -> float | None:
        """When the request's compile time limit ends: ``None`` while its compilation is queued."""
        started = state.job.started
        return None if started is None else max(started, state.added) + state.timeout

    def _settle(self, state: RequestState) -> None:
        state.job = None
        self._pending -= 1
        self._version += 1

    def _fail(self, request_id: Hashable, state: RequestState, error: RequestFailedError) -> None:
        """Fail one request: its rows allow only stop tokens from now on; the error is kept once."""
        if state.error is not None:
            return
        if state.job is not None:
            self._settle(state)
        state.error, state.finished = error, True
        self._unreported.add(request_id)
        self._version += 1

    def ready(self, request_ids: Sequence[Hashable] | None = None) -> list[Hashable]:
        """The requests of ``request_ids`` (default: all) that can be scheduled now, in order."""
        requests = self._requests
        ids = list(requests) if request_ids is None else request_ids
        out = []
        for request_id in ids:
            state = self._request(request_id)
            if state.job is None and state.error is None or self._resolve(request_id, state):
                out.append(request_id)
        return out

    def error(self, request_id: Hashable) -> RequestFailedError | None:
        """Why the request failed, or ``None``."""
        state = self._request(request_id)
        if state.job is not None:
            self._resolve(request_id, state)
        return state.error

    def wait(self, request_ids: Sequence[Hashable] | None = None, timeout: float | None = None) -> list[Hashable]:
        """Block until some of ``request_ids`` are ready or failed (or ``timeout``); returns the ready ones."""
        ids = list(self._requests) if request_ids is None else list(request_ids)
        end = None if timeout is None else time.perf_counter() + timeout
        while True:
            pending = [self._requests[r] for r in ids if self._requests[r].job is not None]
            if not pending:
                break
            now = time.perf_counter()
            deadlines = [self._deadline(state) for state in pending]
            # a queued compilation has no deadline yet: look again soon (its limit starts when it does)
            limit = min([d - now for d in deadlines if d is not None] + ([0.05] if None in deadlines else []))
            if end is not None:
                limit = min(limit, end - now)
            concurrent.futures.wait([s.job.future for s in pending], timeout=max(0.0, limit) + 1e-3,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
            ready = self.ready(ids)
            if len([r for r in ids if self._requests[r].job is not None]) < len(pending):
                return ready
            if end is not None and time.perf_counter() >= end:
                return ready
        return self.ready(ids)

    def remove(self, request_id: Hashable) -> None:
        state = self._requests.pop(request_id, None)
        if state is None:
            raise BatchLayoutError(f"request {request_id!r} is not in the runtime (never added, or removed already)")
        if state.job is not None:
            self._pending -= 1
        self._unreported.discard(request_id)
        self._version += 1

    def unenforced(self, request_id: Hashable) -> tuple:
        """The schema keywords this request's engine accepted but does not enforce
        (``json_schema(..., unenforced="allow")``; ``keywords.Unenforced``), once compiled."""
        state = self._request(request_id)
        if state.job is not None:
            self._resolve(request_id, state)
        return state.unenforced

    def finished(self, request_id: Hashable) -> bool:
        """Whether the request took a stop token (or failed: see ``error``)."""
        return self._request(request_id).finished

    def _request(self, request_id: Hashable) -> RequestState:
        state = self._requests.get(request_id)
        if state is None:
            raise BatchLayoutError(f"request {request_id!r} is not in the runtime; add() it before scheduling it")
        return state

    def _wait_for(self, request_id: Hashable, state: RequestState) -> None:
        """A compiling request was scheduled: wait for it (up to its time limit); it ends ready or failed."""
        while not self._resolve(request_id, state) and state.error is None:
            deadline = self._deadline(state)
            limit = 0.05 if deadline is None else max(0.0, deadline - time.perf_counter())
            concurrent.futures.wait([state.job.future], timeout=limit + 1e-3)

    def _piece(self, token: int) -> bytes:
        if self._decoded is None:
            self._decoded = self.info.decoded_vocab
        return self._decoded[token]

    # -------------------------------------------------------------- one decode step
    def step(self, batch: Sequence[Hashable], drafts: Mapping[Hashable, Sequence[int]] | None = None):
        """The mask for one decode step: ``buffer[:rows]``, rows in batch order, or ``None`` if disabled.

        A request with ``k`` draft tokens owns ``1 + k`` consecutive rows: row ``i`` is
        its grammar after accepting the first ``i`` drafts. Past a draft the grammar
        forbids, rows repeat the row that forbade it (the verifier rejects that draft,
        so they are never used); past an accepted stop token rows allow only stop tokens.
        A finished or failed request's rows allow only stop tokens; unconstrained rows are ``-1``.
        """
        clock = time.perf_counter
        start = clock()
        if not self.enabled:
            for request_id in batch:
                self._request(request_id)
            self.last_step_seconds, self.last_fill_seconds = clock() - start, 0.0
            return None
        plan = self._plan
        if drafts or plan is None or plan.version != self._version or plan.key != tuple(batch):
            plan = self._lay_out(batch, drafts)
        fill_seconds = 0.0
        matchers = plan.matchers
        if matchers:
            tick = clock()
            failures = self._fill(matchers, plan.fill_rows)
            fill_seconds = clock() - tick
            if failures:
                self._fill_failed(plan, failures)
        if plan.drafts:
            fill_seconds += self._fill_drafts(plan)
        self.last_fill_seconds = fill_seconds
        self.last_step_seconds = clock() - start
        return self._views[plan.rows]

    def _fill(self, matchers: list, rows: list[int]) -> list[tuple[int, BaseException]]:
        if len(matchers) == 1:  # the matcher directly
            try:
                matchers[0].fill_next_token_bitmask(self.buffer, rows[0])
            except Exception as error:  # noqa: BLE001 - that request's own failure
                return [(0, error)]
            return []
        if len(matchers) < self.parallel_min_rows:  # a few rows: on this thread
            return fill_each(matchers, self.buffer, rows)
        return self.engine.batch_fill(matchers, self.buffer, rows)  # fill_threads threads, GIL released

    def _fill_failed(self, plan: Layout, failures: list[tuple[int, BaseException]]) -> None:
        """Fail the requests whose fill raised or hung; a hung fill may still write: use a fresh buffer."""
        if any(isinstance(error, FillTimeout) for _, error in failures):
            fresh = self.buffer.clone()
            self._use_buffer(fresh)
        for index, error in failures:
            request_id = plan.key[plan.positions[index]]
            self._fail(request_id, plan.requests[index], GrammarFillError(
                f"request {request_id!r}: {engine_message(error)}" if isinstance(error, FillTimeout) else
                f"request {request_id!r}: its grammar fill failed ({engine_message(error)}); resubmit it", request_id,
            ))
            self._stop_rows(plan.fill_rows[index], plan.fill_rows[index] + 1)

    def _stop_rows(self, first: int, end: int) -> None:
        self._words[first:end] = self._stop_words
        self._all_allowed[first:end] = bytes(end - first)

    def _lay_out(self, batch: Sequence[Hashable], drafts) -> Layout:
        """Lay ``batch`` out and write the rows that do not change while the layout holds
        (-1 rows, stop-only rows); kept as ``self._plan`` when there are no drafts."""
        self._plan = None
        if self._pending:  # scheduled while compiling: wait for it, it ends ready or failed
            for request_id in batch:
                state = self._requests.get(request_id)
                if state is not None and state.job is not None:
                    self._wait_for(request_id, state)
        plan = lay_out(batch, self._requests, drafts, max_rows=self.max_rows, version=self._version)
        all_allowed, words = self._all_allowed, self._words
        if not plan.free_rows and not plan.stop_rows:
            all_allowed[: plan.rows] = bytes(plan.rows)
        else:
            for row in plan.free_rows:  # unconstrained: -1 (kept while it stays)
                if not all_allowed[row]:
                    words[row] = -1
                    all_allowed[row] = 1
            for row in plan.stop_rows:
                words[row] = self._stop_words
                all_allowed[row] = 0
            for row in plan.fill_rows:
                all_allowed[row] = 0
            for _, first, _, draft in plan.drafts:
                all_allowed[first:first + 1 + len(draft)] = bytes(1 + len(draft))
        if not drafts:
            self._plan = plan
        return plan

    def _fill_drafts(self, plan: Layout) -> float:
        seconds = 0.0
        for position, row, state, draft in plan.drafts:
            request_id = plan.key[position]
            try:
                seconds += self._fill_draft(request_id, state, row, draft)
            except BatchLayoutError:
                raise
            except Exception as error:  # noqa: BLE001 - that request's own failure
                self._fail(request_id, state, GrammarFillError(
                    f"request {request_id!r}: its grammar fill failed ({engine_message(error)}); resubmit it",
                    request_id))
                self._stop_rows(row, row + 1 + len(draft))
        return seconds

    def _fill_draft(self, request_id, state: RequestState, row: int, draft: Sequence[int]) -> float:
        """Rows ``row .. row + len(draft)``: fill, accept a draft token, fill, ..., roll back."""
        buffer, matcher = self.buffer, state.matcher
        end = row + 1 + len(draft)
        start = time.perf_counter()
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
                    buffer[row] = self._stop_row
                    break
                matcher.fill_next_token_bitmask(buffer, row)
        finally:
            if advanced:
                matcher.rollback(advanced)
        seconds = time.perf_counter() - start
        if row + 1 < end:
            buffer[row + 1:end] = buffer[row]
        return seconds

    # -------------------------------------------------------------- after sampling
    def accept(self, request_id: Hashable, tokens: Sequence[int]) -> bool:
        """Advance ``request_id`` by ``tokens`` (the sampled token, or accepted drafts + bonus).

        Returns whether the request has finished (a stop token). A token its grammar
        forbids raises :class:`DisallowedTokenError` and leaves the request as it was; a
        failed request raises its error.
        """
        state = self._request(request_id)
        if state.job is not None:
            self._wait_for(request_id, state)
        if state.error is not None:
            raise state.error
        matcher, advanced, was_finished = state.matcher, 0, state.finished
        for token in tokens:
            token = int(token)
            refused = self._refusal(request_id, state, token)
            if refused is None and matcher is not None and not state.finished:
                if matcher.accept_token(token):
                    advanced += 1
                    state.finished = matcher.is_terminated()
                    continue
                refused = self._refused(request_id, state, token)
            if refused is not None:
                if advanced:
                    matcher.rollback(advanced)
                    state.finished = was_finished
                    self._version += 1
                raise refused
            if matcher is None and not state.finished:
                state.finished = token in self.stop_token_ids
        if state.finished != was_finished:
            self._version += 1  # the batch layout changes: its rows now allow only stop tokens
        return state.finished

    def _refusal(self, request_id, state: RequestState, token: int) -> DisallowedTokenError | None:
        """The error for a token no request may take here (past the vocabulary; after the stop), or None."""
        if not 0 <= token < self.vocab_size:
            return DisallowedTokenError(
                f"request {request_id!r} got token {token}, past the tokenizer's {self.vocab_size} tokens "
                "(a padded lm_head column): transform the model with "
                f"vocab_size={self.vocab_size} so padded columns are never chosen",
                request_id, token,
            )
        if state.finished and token not in self.stop_token_ids:
            return DisallowedTokenError(
                f"request {request_id!r} already finished at a stop token but got token {token} "
                f"({self._piece(token)!r}); remove() finished requests or keep their rows masked to stop tokens",
                request_id, token,
            )
        return None

    def _refused(self, request_id, state: RequestState, token: int) -> DisallowedTokenError:
        return DisallowedTokenError(
            f"request {request_id!r} ({state.constraint.describe()}) got token {token} "
            f"({self._piece(token)!r}), which its grammar does not allow here: the mask fed to the "
            "graph was not this request's current row (check the batch order and draft offsets), "
            "or the graph ignored the mask",
            request_id, token,
        )

    def accept_rows(self, batch: Sequence[Hashable], tokens: torch.Tensor | Sequence[int], *,
                    empty: torch.Tensor | Sequence[bool] | None = None) -> Accepted:
        """One sampled token per request of ``batch`` (no drafts).

        ``empty``: the graph's ``logit_mask_empty`` flags (``Transformed.run``), one per row:
        a flagged row allowed no token, so its request fails. Returns :class:`Accepted`:
        after it every request of the batch has advanced by its token, finished, or failed
        with an error naming it and the token (a refused token, one past the vocabulary).
        """
        clock = time.perf_counter
        start = clock()
        values = tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens  # only read
        if len(values) != len(batch):
            raise BatchLayoutError(f"{len(values)} tokens for a batch of {len(batch)} requests; pass one token per request")
        plan = self._plan
        if plan is None or plan.version != self._version or plan.key != tuple(batch):
            plan = self._lay_out(batch, None)  # the layout step() would use; nothing is filled
        positions, live, matchers = plan.positions, plan.requests, plan.matchers
        finished, engine_seconds = [], 0.0
        flagged = () if empty is None else [p for p, f in enumerate(empty.tolist() if isinstance(empty, torch.Tensor) else empty) if f]
        for position in flagged:
            request_id = batch[position]
            self._fail(request_id, self._requests[request_id], NoAllowedTokenError(
                f"request {request_id!r}: its mask row allowed no token at this step (its grammar reached a dead "
                "end, or min_tokens masked the only stop token it allowed), so its token "
                f"{values[position]} means nothing; the request ends here", request_id,
            ))
        for position in plan.others:  # unconstrained, finished and failed rows: one by one (no grammar)
            request_id = batch[position]
            state = self._requests[request_id]
            if state.error is None:
                token = values[position]
                refused = self._refusal(request_id, state, token)
                if refused is not None:
                    self._fail(request_id, state, refused)
                elif not state.finished and token in self.stop_token_ids:
                    state.finished = True
                    finished.append(request_id)
                    self._version += 1
        if matchers:
            live_tokens = values if plan.every_row_live else [values[p] for p in positions]
            vocab = self.vocab_size
            if flagged or not (min(live_tokens) >= 0 and max(live_tokens) < vocab):
                keep = [i for i, (p, t) in enumerate(zip(positions, live_tokens)) if live[i].error is None and 0 <= t < vocab]
                for i in set(range(len(positions))) - set(keep):
                    if live[i].error is None:  # a token past the vocabulary: the request's own failure
                        self._fail(batch[positions[i]], live[i], self._refusal(batch[positions[i]], live[i], live_tokens[i]))
                positions = [positions[i] for i in keep]
                live, matchers, live_tokens = [live[i] for i in keep], [matchers[i] for i in keep], [live_tokens[i] for i in keep]
            tick = clock()
            accepted = self.engine.batch_accept(matchers, live_tokens)
            engine_seconds = clock() - tick
            stops = self.stop_token_ids
            if not stops.isdisjoint(live_tokens):  # accepting a stop token is what terminates a matcher
                for index in [i for i, token in enumerate(live_tokens) if token in stops]:
                    if accepted[index]:
                        live[index].finished = True
                        finished.append(batch[positions[index]])
                        self._version += 1
            if False in accepted:  # the others advanced; these fail, naming request and token
                for index in [i for i, ok in enumerate(accepted) if not ok]:
                    request_id = batch[positions[index]]
                    self._fail(request_id, live[index], self._refused(request_id, live[index], live_tokens[index]))
        failed = {}
        if self._unreported:
            for request_id in batch:
                if request_id in self._unreported:
                    self._unreported.discard(request_id)
                    self._requests[request_id].reported = True
                    failed[request_id] = self._requests[request_id].error
        self.last_accept_engine_seconds = engine_seconds
        self.last_accept_seconds = clock() - start
        return Accepted(finished, failed)
