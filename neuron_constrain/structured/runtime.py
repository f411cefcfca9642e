"""``StructuredRuntime``: per-step packed masks for a batch of requests, in one buffer,
with grammars compiled off the critical path.

    runtime = StructuredRuntime(tokenizer, max_rows=64)      # tokenizer: .info (tokenizers.py)
    runtime.add("r1", json_schema(schema), timeout=30)       # returns at once: compiles in a thread pool
    runtime.ready(["r1", "r2"])                              # the requests a scheduler may put in a batch
    runtime.error("r1")                                      # the ConstraintError of a failed request
    mask = runtime.step(batch)                               # rows in batch order (ready requests only)
    runtime.accept_rows(batch, tokens)                       # the requests these tokens finished

Layout reuse: ``step`` lays a batch out once (per-request readiness, -1 rows, stop-only
rows of finished requests) and reuses that layout, touching no request, while the
batch (same requests, same order) and every request's state are unchanged: the decode
loop's usual case (``generate`` and vLLM's persistent batch keep a request in its row).
A join, a leave, a finish or a compilation ending moves a version counter and the next
step lays the batch out again; so does a step of another batch or with drafts.

Compilation: a thread pool (``compile_workers``) compiles each constraint once; the
cache is keyed by the constraint (``Constraint.key``: kind, spec, options), so a
repeated schema is free (``cache_hits`` / ``cache_misses`` count it), and concurrent
requests with one schema share one compilation. A request whose grammar is not ready
is **not scheduled**: ``ready()`` leaves it out, and a scheduler (``generate``, a
server) puts only ready requests in a batch; no row is ever filled from a grammar that
is not there. A caller that schedules a compiling request anyway makes ``step()`` /
``accept()`` wait for it (up to its time limit): the synchronous behaviour, never a
wrong row. A compile error, or a compilation past the request's time limit, fails that
request alone (``error()``; ``step()`` raises :class:`GrammarFailedError` naming it);
the others run on. xgrammar cannot cancel a compilation: a timed-out one finishes in
its worker and fills the cache for later requests.

The engine seam: ``engine="xgrammar"`` (default) or ``"llguidance"`` (``engines.py``):
``engine.compile(constraint)``, ``engine.matcher(compiled)`` (``fill_next_token_bitmask``
/ ``accept_token`` / ``rollback`` / ``is_terminated``), ``engine.batch_fill``. Fill: one
constrained row calls its matcher directly; more
rows go to the engine's batch fill, which runs ``fill_threads`` threads without the GIL
from ``parallel_min_rows`` rows on (default: 1 thread on a host of <= 2 cores, whose
other core the model's step wants; else up to 8). Two threads filled batches 32 and 64
1.04-1.39x as fast as one on 2 idle cores (``benchmarks/bench_host.py``).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import operator
import os
import threading
import time
from typing import Hashable, Mapping, Sequence

import torch
import xgrammar as xgr

from neuron_constrain.kernels import pack_bool_mask, packed_width
from neuron_constrain.passes.mask_logits_pass import MASK_INPUT
from neuron_constrain.structured.constraints import Constraint, ConstraintError, engine_message
from neuron_constrain.structured.engines import make_engine
from neuron_constrain.structured.tokenizers import audit
from neuron_constrain.transform import Transformed


class StructuredOutputsDisabledError(ValueError):
    """A constrained request reached a model transformed without a logit mask."""


class DisallowedTokenError(ValueError):
    """A chosen token is not allowed by its request's grammar (or lies past the vocabulary)."""

    def __init__(self, message: str, request_id: Hashable, token: int):
        super().__init__(message)
        self.request_id = request_id
        self.token = token


class BatchLayoutError(ValueError):
    """A batch layout names an unknown or repeated request, or needs more rows than the buffer has."""


class GrammarFailedError(ConstraintError):
    """A request's grammar failed to compile, or did not compile within its time limit."""

    def __init__(self, message: str, request_id: Hashable):
        super().__init__(message)
        self.request_id = request_id


@dataclasses.dataclass(slots=True, eq=False)  # slots: fewer memory reads per row; eq=False: identity
class _Request:
    constraint: Constraint | None
    matcher: object | None = None  # the engine's matcher once the grammar is ready
    finished: bool = False
    future: concurrent.futures.Future | None = None  # compilation (None: ready or unconstrained)
    deadline: float = 0.0
    timeout: float = 0.0
    error: ConstraintError | None = None
    unenforced: tuple = ()  # keywords.Unenforced the engine accepted but does not enforce (opt-in)


_MATCHER, _FINISHED = operator.attrgetter("matcher"), operator.attrgetter("finished")
_NONES = itertools.repeat(None)


@dataclasses.dataclass(slots=True)
class _Layout:
    """One batch laid out in the buffer (``StructuredRuntime._layout``), reused by ``step``
    and ``accept_rows`` while ``version`` and ``key`` (the batch) are the runtime's."""

    version: int
    key: tuple
    rows: int  # mask rows, drafts included
    matchers: list  # live constrained rows: filled every step, accepted in one batch call
    fill_rows: list[int]  # their mask rows
    positions: list[int]  # their positions in the batch
    requests: list[_Request]
    others: list[int]  # positions of unconstrained and finished requests: accepted one by one
    draft_seconds: float  # the engine's time filling draft rows while laying the batch out
    every_row_live: bool = dataclasses.field(init=False)  # then the batch's tokens are the live tokens

    def __post_init__(self):
        self.every_row_live = len(self.positions) == len(self.key)


class _WithInfo:
    """A tokenizer seen with a user-built (audited) tokenizer info."""

    def __init__(self, tokenizer, info: xgr.TokenizerInfo):
        self._tokenizer, self.info = tokenizer, info

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


class _InfoOnly:
    """A bare ``xgrammar.TokenizerInfo`` seen through the tokenizer protocol (what the engine reads)."""

    def __init__(self, info: xgr.TokenizerInfo):
        self.info = info


class StructuredRuntime:
    """Per-step packed masks for a batch of requests, in one reusable buffer.

    ``tokenizer``: the tokenizer protocol (``tokenizers.py``: ``.info``), or a bare
    ``xgrammar.TokenizerInfo``. ``tokenizer_info``: an info you built yourself, audited
    against ``tokenizer`` (control tokens special, sizes agree) before it is used.
    Its ``vocab_size`` sets the mask width ``ceil(V/32)``; it is the ``vocab_size`` the
    graph was transformed with, so an lm_head padded past it never has its padding
    chosen. ``step`` returns ``None`` when structured outputs are disabled (the graph
    has no mask input). The runtime is reusable across ``generate`` calls (compiled
    grammars stay cached); ``close()`` stops its compile threads.
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
    ):
        if max_rows <= 0:
            raise ValueError(f"max_rows must be positive (the largest batch, draft rows included), got {max_rows}")
        if isinstance(tokenizer, xgr.TokenizerInfo):
            tokenizer = _InfoOnly(tokenizer)
        if tokenizer_info is not None:
            if not hasattr(tokenizer, "special_ids"):
                raise TypeError(
                    "tokenizer_info= is audited against the tokenizer's control tokens: pass a tokenizer from "
                    "from_huggingface / from_mistral, or pass the info alone as the tokenizer"
                )
            audit(tokenizer_info, tokenizer)
            tokenizer = _WithInfo(tokenizer, tokenizer_info)
        self.tokenizer = tokenizer
        tokenizer_info = tokenizer.info
        self.info = tokenizer_info
        self.vocab_size = tokenizer_info.vocab_size
        self.width = packed_width(self.vocab_size)
        self.max_rows = max_rows
        self.enabled = enable_structured_outputs
        self.stop_token_ids = frozenset(tokenizer_info.stop_token_ids)
        if not self.stop_token_ids:
            raise ValueError("the tokenizer info has no stop token; build it with stop_token_ids=[<eos id>]")
        if fill_threads is None:  # 2 cores: leave the model's step a core of its own
            fill_threads = 1 if (os.cpu_count() or 1) <= 2 else min(8, os.cpu_count())
        self.fill_threads = fill_threads
        # Fewer constrained rows than this are filled on this thread: waking a fill thread costs
        # ~25 us each way on a 2-core VM, about what batch 8's whole fill takes (bench_host.py).
        self.parallel_min_rows = parallel_min_rows if fill_threads > 1 else 2  # 1 thread: the engine's batch fill always
        self.engine = make_engine(engine, tokenizer, fill_threads=fill_threads)
        self.compile_timeout = compile_timeout
        self._pool = concurrent.futures.ThreadPoolExecutor(compile_workers, thread_name_prefix="grammar-compile")
        self._compiled: dict[tuple, concurrent.futures.Future] = {}  # Constraint.key -> compilation, oldest first
        self.cache_size = cache_size
        self._lock = threading.Lock()
        self.cache_hits = 0  # add() of a constraint compiled (or compiling) already
        self.cache_misses = 0
        # One buffer for the life of the runtime; pinned when a CUDA-like host allows it.
        self.buffer = torch.full((max_rows, self.width), -1, dtype=torch.int32)
        self._all_allowed = bytearray(b"\x01" * max_rows)  # row holds -1 everywhere
        self._views = [self.buffer[:rows] for rows in range(max_rows + 1)]  # handed out, never re-sliced
        self._words = self.buffer.numpy()  # same memory; numpy row writes cost less than torch indexing
        stop = torch.zeros(self.width * 32, dtype=torch.bool)
        stop[sorted(self.stop_token_ids)] = True
        self._stop_row = pack_bool_mask(stop[: self.vocab_size])
        self._stop_words = self._stop_row.numpy()
        self._requests: dict[Hashable, _Request] = {}
        # The last step's layout, reused while the batch and every request's state are unchanged
        # (a decode loop's usual case). ``_version`` moves on every join, leave, compilation end and finish.
        self._plan: _Layout | None = None
        self._version = 0
        self._decoded: list[bytes] | None = None
        self.last_step_seconds = 0.0  # whole step(): layout + fills + hand-off
        self.last_fill_seconds = 0.0  # the engine's fill_next_token_bitmask / accept / rollback inside it
        self.last_accept_seconds = 0.0  # whole accept_rows()
        self.last_accept_xgrammar_seconds = 0.0

    def close(self) -> None:
        """Stop the compile threads (running compilations finish first) and the fill threads."""
        self._pool.shutdown(wait=False, cancel_futures=True)
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
                raise ValueError(
                    f"the graph's logit_mask has {width} words per row but the tokenizer's {runtime.vocab_size} "
                    f"tokens need {runtime.width}; transform with vocab_size={runtime.vocab_size} (the tokenizer's "
                    "vocabulary, even when the lm_head is wider)"
                )
        return runtime

    # -------------------------------------------------------------- requests join / leave
    def add(self, request_id: Hashable, constraint: Constraint | None = None, *, timeout: float | None = None) -> None:
        """Admit a request; returns at once. Its grammar compiles in the background (or
        comes from the cache) within ``timeout`` seconds (default ``compile_timeout``)."""
        if request_id in self._requests:
            raise BatchLayoutError(f"request {request_id!r} is already in the runtime; remove it first or use a new id")
        if constraint is not None and not self.enabled:
            raise StructuredOutputsDisabledError(
                f"request {request_id!r} asks for a {constraint.describe()} constraint, but structured outputs are "
                "disabled: the model was transformed without a logit_mask input, so its answer could not be "
                "constrained. Transform it with enable_structured_outputs=True (transform_decoder) or "
                "logit_mask='packed' (transform) and restart, or send the request without a constraint"
            )
        request = _Request(constraint)
        if constraint is not None:
            if self.engine.name == "xgrammar":
                constraint.parse()  # a malformed regex/choice/EBNF fails here, at once
            key = constraint.key
            with self._lock:
                future = self._compiled.get(key)
                if future is None or (future.done() and future.exception() is not None):
                    future = self._pool.submit(self.engine.compile, constraint)
                    self.cache_misses += 1
                    if len(self._compiled) >= self.cache_size:  # forget the oldest finished compilation
                        oldest = next((k for k, f in self._compiled.items() if f.done()), None)
                        if oldest is not None:
                            del self._compiled[oldest]
                else:
                    self.cache_hits += 1
                    del self._compiled[key]  # re-inserted below: most recently used last
                self._compiled[key] = future
            request.timeout = self.compile_timeout if timeout is None else float(timeout)
            request.deadline = time.perf_counter() + request.timeout
            request.future = future
            self._resolve(request_id, request)
        self._requests[request_id] = request
        self._version += 1

    def _resolve(self, request_id: Hashable, request: _Request) -> bool:
        """Make the request's matcher if its compilation is done; False while it is pending or failed."""
        future = request.future
        if future is None:
            return request.error is None
        if future.done():
            request.future = None
            self._version += 1
            try:
                compiled = future.result()
                request.matcher = self.engine.matcher(compiled)
                request.unenforced = tuple(getattr(compiled, "unenforced", ()))
            except ConstraintError as error:
                request.error = GrammarFailedError(f"request {request_id!r}: {error}", request_id)
            except Exception as error:  # the engine's own failure, one clean line
                request.error = GrammarFailedError(
                    f"request {request_id!r}: its {request.constraint.describe()} constraint failed to compile "
                    f"({engine_message(error)}); fix it and resubmit", request_id,
                )
            return request.error is None
        if time.perf_counter() > request.deadline:
            request.future = None
            self._version += 1
            request.error = GrammarFailedError(
                f"request {request_id!r}: its {request.constraint.describe()} constraint did not compile within "
                f"{request.timeout:g} s; simplify the schema (fewer bounded strings/alternatives), resubmit with a "
                "longer timeout, or send it without a constraint", request_id,
            )
        return False

    def ready(self, request_ids: Sequence[Hashable] | None = None) -> list[Hashable]:
        """The requests of ``request_ids`` (default: all) that can be scheduled now, in order."""
        requests = self._requests
        ids = list(requests) if request_ids is None else request_ids
        out = []
        for request_id in ids:
            request = self._request(request_id)
            if request.future is None and request.error is None or self._resolve(request_id, request):
                out.append(request_id)
        return out

    def error(self, request_id: Hashable) -> ConstraintError | None:
        """Why the request failed (compile error or time limit), or ``None``."""
        request = self._request(request_id)
        if request.future is not None:
            self._resolve(request_id, request)
        return request.error

    def wait(self, request_ids: Sequence[Hashable] | None = None, timeout: float | None = None) -> list[Hashable]:
        """Block until some of ``request_ids`` are ready or failed (or ``timeout``); returns the ready ones."""
        ids = list(self._requests) if request_ids is None else list(request_ids)
        pending = [self._requests[r] for r in ids if self._requests[r].future is not None]
        if pending:
            limit = min(r.deadline for r in pending) - time.perf_counter()
            limit = max(0.0, limit if timeout is None else min(limit, timeout))
            concurrent.futures.wait([r.future for r in pending], timeout=limit + 1e-3,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        return self.ready(ids)

    def remove(self, request_id: Hashable) -> None:
        if self._requests.pop(request_id, None) is None:
            raise BatchLayoutError(f"request {request_id!r} is not in the runtime (never added, or removed already)")
        self._version += 1

    def unenforced(self, request_id: Hashable) -> tuple:
        """The schema keywords this request's engine accepted but does not enforce
        (``json_schema(..., unenforced="allow")``; ``keywords.Unenforced``), once compiled."""
        request = self._request(request_id)
        if request.future is not None:
            self._resolve(request_id, request)
        return request.unenforced

    def finished(self, request_id: Hashable) -> bool:
        return self._request(request_id).finished

    def _request(self, request_id: Hashable) -> _Request:
        request = self._requests.get(request_id)
        if request is None:
            raise BatchLayoutError(f"request {request_id!r} is not in the runtime; add() it before scheduling it")
        return request

    def _not_ready(self, request_id: Hashable, request: _Request) -> None:
        """A compiling request was scheduled: wait for it (up to its time limit), or raise its error."""
        while not self._resolve(request_id, request) and request.error is None:
            concurrent.futures.wait([request.future], timeout=max(0.0, request.deadline - time.perf_counter()) + 1e-3)
        if request.error is not None:
            raise request.error

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
        A finished request's rows allow only stop tokens; unconstrained rows are ``-1``.
        """
        clock = time.perf_counter
        start = clock()
        if not self.enabled:
            for request_id in batch:
                self._request(request_id)
            self.last_step_seconds, self.last_fill_seconds = clock() - start, 0.0
            return None
        plan, key = self._plan, tuple(batch)
        if drafts or plan is None or plan.version != self._version or plan.key != key:
            plan = self._layout(batch, key, drafts)
        fill_matchers, fill_rows = plan.matchers, plan.fill_rows
        fill_seconds = plan.draft_seconds
        if fill_matchers:
            tick = clock()
            if len(fill_matchers) == 1:  # the matcher directly
                fill_matchers[0].fill_next_token_bitmask(self.buffer, fill_rows[0])
            elif len(fill_matchers) < self.parallel_min_rows:  # a few rows: on this thread
                for matcher, fill_row in zip(fill_matchers, fill_rows):
                    matcher.fill_next_token_bitmask(self.buffer, fill_row)
            else:  # one call: the engine fills the rows on fill_threads threads, GIL released
                self.engine.batch_fill(fill_matchers, self.buffer, fill_rows)
            fill_seconds += clock() - tick
        view = self._views[plan.rows]
        self.last_fill_seconds = fill_seconds
        self.last_step_seconds = clock() - start
        return view

    def _layout(self, batch: Sequence[Hashable], key: tuple, drafts) -> _Layout:
        """Lay ``batch`` out in the buffer: write the rows that do not change while the
        layout holds (-1 rows, stop-only rows), fill draft rows, and return the layout
        ``step`` and ``accept_rows`` reuse (kept as ``self._plan`` when there are no drafts)."""
        if not drafts:
            return self._layout_one_row_each(batch, key)
        requests, buffer, all_allowed, words = self._requests, self.buffer, self._all_allowed, self._words
        self._plan, draft_seconds, row = None, 0.0, 0
        fill_matchers, fill_rows, positions, live_requests, others = [], [], [], [], []
        for position, request_id in enumerate(batch):
            request = requests.get(request_id)
            if request is None:
                self._request(request_id)  # raises, naming the request
            if request.matcher is None and request.constraint is not None:
                self._not_ready(request_id, request)  # waits for it, or raises its compile error
            draft = drafts.get(request_id) if drafts else None
            if draft:
                end = row + 1 + len(draft)
                if end > self.max_rows:
                    self._too_many_rows(batch, drafts)
                if request.matcher is None:
                    for r in range(row, end):
                        if not all_allowed[r]:
                            buffer[r].fill_(-1)
                            all_allowed[r] = 1
                else:
                    draft_seconds += self._fill(request_id, request, row, draft)
                    for r in range(row, end):
                        all_allowed[r] = 0
                row = end
                continue
            if row >= self.max_rows:
                self._too_many_rows(batch, drafts)
            matcher = request.matcher
            if matcher is None:
                if not all_allowed[row]:
                    words[row] = -1
                    all_allowed[row] = 1
                others.append(position)
            elif request.finished:
                words[row] = self._stop_words
                all_allowed[row] = 0
                others.append(position)
            else:
                fill_matchers.append(matcher)
                fill_rows.append(row)
                all_allowed[row] = 0
                positions.append(position)
                live_requests.append(request)
            row += 1
        self._check_distinct(batch)
        return _Layout(self._version, key, row, fill_matchers, fill_rows, positions, live_requests, others, draft_seconds)

    def _layout_one_row_each(self, batch: Sequence[Hashable], key: tuple) -> _Layout:
        """``_layout`` without drafts: request ``i`` owns row ``i``. One pass sorts the
        requests into live rows and the rest (the per-step cost when requests join and
        finish every few steps), then the few other rows are written."""
        self._plan = None
        if len(batch) > self.max_rows:
            self._too_many_rows(batch, None)
        get = self._requests.get
        live_requests = list(map(get, batch))
        # The usual batch: every row constrained, ready and running, sorted by map alone.
        # (Identity tests through operator.is_: `None in` would call each object's __eq__.)
        every_row_live = not any(map(operator.is_, live_requests, _NONES))
        if every_row_live:
            live_matchers = list(map(_MATCHER, live_requests))
            every_row_live = not any(map(operator.is_, live_matchers, _NONES)) and not any(map(_FINISHED, live_requests))
        if every_row_live:
            positions, others = list(range(len(batch))), []
        else:
            live_matchers, positions, live_requests, others = [], [], [], []
            for position, request_id in enumerate(batch):
                request = get(request_id)
                if request is None:
                    self._request(request_id)  # raises, naming the request
                matcher = request.matcher
                if matcher is None and request.constraint is not None:
                    self._not_ready(request_id, request)  # waits for it, or raises its compile error
                    matcher = request.matcher
                if matcher is None or request.finished:
                    others.append(position)
                else:
                    live_matchers.append(matcher)
                    positions.append(position)
                    live_requests.append(request)
        self._check_distinct(batch)
        all_allowed, words = self._all_allowed, self._words
        if not others:
            all_allowed[: len(batch)] = bytes(len(batch))
        else:
            for position in others:
                if self._requests[batch[position]].matcher is None:  # unconstrained: -1 (kept while it stays)
                    if not all_allowed[position]:
                        words[position] = -1
                        all_allowed[position] = 1
                else:  # finished: only stop tokens
                    words[position] = self._stop_words
                    all_allowed[position] = 0
            for position in positions:
                all_allowed[position] = 0
        plan = _Layout(self._version, key, len(batch), live_matchers, positions, positions, live_requests, others, 0.0)
        self._plan = plan
        return plan

    @staticmethod
    def _check_distinct(batch: Sequence[Hashable]) -> None:
        if len(set(batch)) != len(batch):
            raise BatchLayoutError(f"the batch {list(batch)} names a request twice; each request owns one slot")

    def _too_many_rows(self, batch, drafts) -> None:
        total = len(batch) + sum(len(drafts.get(r, ())) for r in batch) if drafts else len(batch)
        raise BatchLayoutError(
            f"this batch needs {total} mask rows ({len(batch)} requests + draft tokens) but the runtime "
            f"was built with max_rows={self.max_rows}; build it with max_rows>={total} (the compiled "
            "graph's largest batch, draft rows included)"
        )

    def _fill(self, request_id, request: _Request, row: int, draft: Sequence[int]) -> float:
        buffer, matcher = self.buffer, request.matcher
        end = row + 1 + len(draft)
        if request.finished:
            buffer[row:end] = self._stop_row
            return 0.0
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(buffer, row)
        advanced = 0
        for token in draft:
            if not 0 <= token < self.vocab_size:
                if advanced:
                    matcher.rollback(advanced)
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
        forbids raises :class:`DisallowedTokenError` and leaves the request as it was.
        """
        request = self._request(request_id)
        if request.matcher is None and request.constraint is not None:
            self._not_ready(request_id, request)  # waits for it, or raises its compile error
        matcher, advanced, was_finished = request.matcher, 0, request.finished
        for token in tokens:
            token = int(token)
            if not 0 <= token < self.vocab_size:
                self._undo(request, advanced)
                raise DisallowedTokenError(
                    f"request {request_id!r} got token {token}, past the tokenizer's {self.vocab_size} tokens "
                    "(a padded lm_head column): transform the model with "
                    f"vocab_size={self.vocab_size} so padded columns are never chosen",
                    request_id, token,
                )
            if request.finished:
                if token in self.stop_token_ids:
                    continue  # a finished request padding its slot with stop tokens
                self._undo(request, advanced)
                raise DisallowedTokenError(
                    f"request {request_id!r} already finished at a stop token but got token {token} "
                    f"({self._piece(token)!r}); remove() finished requests or keep their rows masked to stop tokens",
                    request_id, token,
                )
            if matcher is None:
                request.finished = token in self.stop_token_ids
                continue
            if not matcher.accept_token(token):
                self._undo(request, advanced)
                raise DisallowedTokenError(
                    f"request {request_id!r} ({request.constraint.describe()}) got token {token} "
                    f"({self._piece(token)!r}), which its grammar does not allow here: the mask fed to the "
                    "graph was not this request's current row (check the batch order and draft offsets), "
                    "or the graph ignored the mask",
                    request_id, token,
                )
            advanced += 1
            request.finished = matcher.is_terminated()
        if request.finished != was_finished:
            self._version += 1  # the batch layout changes: its rows now allow only stop tokens
        return request.finished

    def _undo(self, request: _Request, advanced: int) -> None:
        if advanced:
            request.matcher.rollback(advanced)
            request.finished = False
            self._version += 1

    def accept_rows(self, batch: Sequence[Hashable], tokens: torch.Tensor | Sequence[int]) -> list[Hashable]:
        """One sampled token per request of ``batch`` (no drafts); returns the requests this token finished.

        A token some request's grammar forbids raises :class:`DisallowedTokenError` for
        that request (left unchanged) after the other requests have taken theirs.
        """
        clock = time.perf_counter
        start = clock()
        values = tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens  # only read
        if len(values) != len(batch):
            raise BatchLayoutError(f"{len(values)} tokens for a batch of {len(batch)} requests; pass one token per request")
        plan, key = self._plan, tuple(batch)
        if plan is None or plan.version != self._version or plan.key != key:
            plan = self._layout(batch, key, None)  # the layout step() would use; nothing is filled
        positions, live_requests, live_matchers, others = plan.positions, plan.requests, plan.matchers, plan.others
        live_tokens = values if plan.every_row_live else [values[p] for p in positions]
        finished, xgrammar_seconds = [], 0.0
        if others:  # unconstrained and finished rows: one by one (cheap: no grammar)
            requests = self._requests
            for position in others:
                request_id = batch[position]
                was_finished = requests[request_id].finished  # (then it pads its row with stop tokens)
                if self.accept(request_id, (values[position],)) and not was_finished:
                    finished.append(request_id)
        if live_matchers:
            if not (min(live_tokens) >= 0 and max(live_tokens) < self.vocab_size):
                for position in positions:  # a token past the vocabulary: the request's own error
                    if not 0 <= values[position] < self.vocab_size:
                        self.accept(batch[position], (values[position],))  # raises, naming request and token
            tick = clock()
            accepted = self.engine.batch_accept(live_matchers, live_tokens)
            xgrammar_seconds = clock() - tick
            stops = self.stop_token_ids
            if not stops.isdisjoint(live_tokens):  # accepting a stop token is what terminates a matcher
                for index in [i for i, token in enumerate(live_tokens) if token in stops]:
                    if accepted[index]:
                        live_requests[index].finished = True
                        finished.append(batch[positions[index]])
                        self._version += 1
            if False in accepted:  # the other requests advanced; this one is unchanged
                index = accepted.index(False)
                self.last_accept_xgrammar_seconds = xgrammar_seconds
                self.accept(batch[positions[index]], [live_tokens[index]])  # raises, naming request and token
        self.last_accept_xgrammar_seconds = xgrammar_seconds
        self.last_accept_seconds = clock() - start
        return finished
