"""``StructuredRuntime``: per-step packed masks for a batch of requests, in one buffer,
with grammars compiled off the critical path and failures kept to their request.

    runtime = StructuredRuntime(tokenizer, max_rows=64)      # tokenizer: .info (tokenizers.py)
    runtime.add("r1", json_schema(schema), timeout=30)       # returns at once: compiles in a thread pool
    runtime.ready(["r1", "r2"])                              # the requests a scheduler may put in a batch
    mask = runtime.step(batch)                               # rows in batch order (ready requests only)
    result = runtime.accept_rows(batch, tokens)              # result.finished, result.failed {id: error}
    runtime.error("r1")                                      # why a request failed, or None

The parts: ``compile_cache.py`` (grammars, threads), ``layout.py`` (rows), here the fill and accept.

Failures stay with their request: a constraint that does not parse or compile (``add`` never
raises for what a constraint says), a compilation past its limit, a fill that raises or hangs, a
mask row that allowed no token, a token its grammar refuses or one past the vocabulary each
fail that request alone, with one error naming it (``error()``; a :class:`RequestFailedError`,
returned once in ``accept_rows``' ``failed``); its rows then allow only stop tokens. The
caller's own mistakes (an unknown or repeated request, too many rows) raise
:class:`BatchLayoutError`; ``accept()`` of one request raises its :class:`DisallowedTokenError`
and leaves the request as it was, for callers that retry.

Compilation and fill run off the critical path, within each request's limits (the class's arguments).
"""
from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Hashable, Mapping, Sequence

import torch

from neuron_constrain.kernels import packed_width
from neuron_constrain.core.mask_interface import MASK_INPUT
from neuron_constrain.structured.runtime.accept import Acceptor
from neuron_constrain.structured.runtime.compile_cache import CompileCache
from neuron_constrain.structured.constraints import Constraint, engine_message
from neuron_constrain.structured.engines import ENGINE_CHOICES, make_engine
from neuron_constrain.structured.engines.base import fill_each
from neuron_constrain.structured.engines.xgrammar.fill_threads import FillTimeout
from neuron_constrain.structured.errors import (BatchLayoutError, GrammarFillError, RequestFailedError,
                                                StructuredOutputsDisabledError)
from neuron_constrain.structured.runtime.fill_budget import may_end, within_budget
from neuron_constrain.structured.runtime.jump_forward import MODES, canonical_run, exact_run
from neuron_constrain.structured.schema.limits import DEFAULT as DEFAULT_LIMITS, LimitError, Limits
from neuron_constrain.structured.runtime.layout import Layout, lay_out
from neuron_constrain.structured.runtime.mask_buffer import MaskBuffer
from neuron_constrain.structured.runtime.reasoning import Reasoning, ReasoningMatcher
from neuron_constrain.structured.runtime.requests import Requests
from neuron_constrain.structured.tokenizers import VocabularyInfo, with_info
from neuron_constrain.core.transform import Transformed


@dataclasses.dataclass
class Accepted:
    """What ``accept_rows`` did: every request of the batch is in exactly one of these or advanced.

    Attributes:
        finished: requests this token finished (a stop token accepted).
        failed: request id -> its :class:`RequestFailedError`, each failure returned once.
    """

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

    Reusable across ``generate`` calls (compiled grammars stay cached); ``close()`` stops its
    compile and fill threads. :meth:`for_model` matches one to a rewritten program.

    Args:
        tokenizer: the tokenizer protocol (``.info``) or a :class:`VocabularyInfo`; its ``vocab_size``
            (the graph's, so lm_head padding is never chosen) sets the mask width ``ceil(V/32)``.
        max_rows: the largest batch, draft rows included.
        enable_structured_outputs: ``False`` for a graph without a mask input (constrained refused).
        tokenizer_info: an info you built yourself, audited against ``tokenizer`` first.
        engine: ``"auto"`` (xgrammar where it enforces the whole constraint, else llguidance),
            ``"xgrammar"`` or ``"llguidance"``.
        fill_threads: threads of the engine's batch fill, without the GIL (default: 1 on a host of
            <= 2 cores, whose other core the model's step wants; else up to 8).
        compile_workers: threads compiling constraints, each once (then cached), and as many for large ones.
        compile_timeout: seconds a compilation may take from its start, not while it waits in the
            queue (``limits.compile_seconds``); a request's own ``timeout`` may be shorter.
        cache_size: compiled grammars kept.
        parallel_min_rows: from this many rows on, fills run on ``fill_threads`` threads.
        fill_timeout: seconds before a fill thread is abandoned (then a fresh buffer is used).
        jump_forward: ``"exact"`` or ``"canonical"``: the mode of :meth:`forced_runs`.
        limits: what one request may cost (:class:`~neuron_constrain.structured.schema.limits.Limits`),
            checked first; fills past ``fill_ms`` on 3 tokens in a row end a request (``budget_ended``) or fail it.
        compile_isolation: ``"process"`` (the default): xgrammar compiles in worker processes,
            killed past ``compile_seconds`` or ``compile_memory_mb`` (it cannot cancel).

    Raises:
        ValueError: a bad option (``max_rows=0``, ``fill_threads=0``, ``compile_timeout=-1``...).
        TokenizerInfoError: a ``tokenizer_info`` that fails the audit.
    """

    def __init__(
        self,
        tokenizer,
        *,
        max_rows: int,
        enable_structured_outputs: bool = True,
        tokenizer_info: VocabularyInfo | None = None,
        engine: str = "auto",
        fill_threads: int | None = None,
        compile_workers: int = 2,
        compile_timeout: float | None = None,
        cache_size: int = 512,
        parallel_min_rows: int = 16,
        fill_timeout: float = 120.0,
        jump_forward: str | None = None,
        limits: Limits | None = None,
        compile_isolation: str = "process",
    ):
        if not isinstance(max_rows, int) or isinstance(max_rows, bool) or max_rows <= 0:
            raise ValueError(f"max_rows must be positive (the largest batch, draft rows included), got {max_rows}")
        if jump_forward not in (None, *MODES):
            raise ValueError(f"jump_forward={jump_forward!r}: pass None, {' or '.join(map(repr, MODES))}")
        self.jump_forward = jump_forward
        if engine not in ENGINE_CHOICES:
            raise ValueError(f"unknown grammar engine {engine!r}; pick one of {', '.join(ENGINE_CHOICES)}")
        if fill_threads is None:  # 2 cores: leave the model's step a core of its own
            fill_threads = 1 if (os.cpu_count() or 1) <= 2 else min(8, os.cpu_count())
        self.fill_threads = _count("fill_threads", fill_threads, 1)
        if compile_isolation not in ("process", "thread"):
            raise ValueError(f"compile_isolation={compile_isolation!r}: pass 'process' (xgrammar compiles in worker "
                             "processes the runtime kills past its limits) or 'thread' (no memory cap, no kill)")
        self.limits = limits or DEFAULT_LIMITS
        if compile_timeout is not None:
            self.limits = dataclasses.replace(self.limits, compile_seconds=_seconds("compile_timeout", compile_timeout))
        self.compile_timeout = self.limits.compile_seconds
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
        self.engine = make_engine(engine, tokenizer, fill_threads=fill_threads, fill_timeout=self.fill_timeout,
                                  limits=self.limits,
                                  compile_processes=2 * compile_workers if compile_isolation == "process" else 0)
        self.requests = Requests(self.engine, compiled=CompileCache(self.engine, workers=compile_workers, size=cache_size),
                                 timeout=self.compile_timeout)
        self.acceptor = Acceptor(self.requests, self.engine, vocab_size=self.vocab_size,
                                 stop_token_ids=self.stop_token_ids, info=self.info)
        self.mask = MaskBuffer(max_rows=max_rows, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids)
        self._scratch = torch.zeros((1, self.width), dtype=torch.int32)  # jump-forward's lookahead fills
        # The last layout, reused while the batch and every request's state are unchanged (a decode loop's
        # usual case). ``requests.version`` moves on every join, leave, compilation end, finish and failure.
        self._plan: Layout | None = None
        self.last_step_seconds = 0.0  # whole step(): layout + fills + hand-off
        self.last_fill_seconds = 0.0  # the engine's fill / accept / rollback inside it
        self.last_accept_seconds = 0.0  # whole accept_rows()
        self.last_accept_engine_seconds = 0.0  # the engine's accept inside it
        self.budget_ended = 0  # requests ended with a stop token when their fill passed limits.fill_ms
        self._strikes, self._own_strikes = {}, {}  # tokens past fill_ms in a row (rows; reasoning rows)

    @property
    def buffer(self) -> torch.Tensor:
        """The mask buffer ``[max_rows, ceil(V/32)]`` (``mask_buffer.py``): one for the runtime's life,
        a fresh one only after a fill thread was abandoned."""
        return self.mask.buffer

    @property
    def compiled(self) -> CompileCache:
        """The one cache of compiled grammars (``compile_cache.py``)."""
        return self.requests.compiled

    @compiled.setter
    def compiled(self, cache: CompileCache) -> None:  # share one runtime's compiled grammars with another
        self.requests.compiled = cache

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

        ``tokenizer``: the tokenizer protocol or a bare :class:`VocabularyInfo`."""
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

    # -------------------------------------------------------------- requests join / leave (requests.py)
    def add(self, request_id: Hashable, constraint: Constraint | None = None, *, timeout: float | None = None,
            reasoning: Reasoning | None = None, prompt: Sequence[int] = ()) -> None:
        """Admit a request; returns at once. Its grammar compiles in the background (or
        comes from the cache) within ``timeout`` seconds of compiling (default
        ``compile_timeout``). A malformed constraint fails the request (``error()``).
        ``reasoning``: the request thinks first (``reasoning.py``: the grammar starts after its
        thought, a budget forces the end marker); ``prompt``: its prompt's tokens, which may open
        (and count toward) or close the thought."""
        thinks = reasoning is not None and not reasoning.grammar_in_thought
        if thinks and not self.enabled and (reasoning.budget is not None or reasoning.thought is not None):
            raise StructuredOutputsDisabledError(
                f"request {request_id!r} has a thinking budget or a thought grammar, which the mask enforces, but "
                "the model was transformed without a logit_mask input; transform it with "
                "enable_structured_outputs=True (transform_decoder) or logit_mask='packed'"
            )
        if constraint is not None and not self.enabled:
            raise StructuredOutputsDisabledError(
                f"request {request_id!r} asks for a {constraint.describe()} constraint, but structured outputs are "
                "disabled: the model was transformed without a logit_mask input, so its answer could not be "
                "constrained. Transform it with enable_structured_outputs=True (transform_decoder) or "
                "logit_mask='packed' (transform) and restart, or send the request without a constraint"
            )
        timeout = self.compile_timeout if timeout is None else _seconds("timeout", timeout)
        if not thinks:
            self.requests.add(request_id, constraint, timeout)
            return
        thinking, budget, prompt = reasoning.thinking(self.tokenizer, self.vocab_size), reasoning.budget, list(prompt)

        def matcher(answer, thought):
            return ReasoningMatcher(thinking, budget, prompt, answer=answer, thought=thought,
                                    stop_ids=self.stop_token_ids, width=self.width)

        self.requests.add(request_id, constraint, timeout, reasoning=matcher, thought=reasoning.thought)

    def remove(self, request_id: Hashable) -> None:
        self.requests.remove(request_id)

    def ready(self, request_ids: Sequence[Hashable] | None = None) -> list[Hashable]:
        """The requests of ``request_ids`` (default: all) that can be scheduled now, in order."""
        return self.requests.ready(request_ids)

    def wait(self, request_ids: Sequence[Hashable] | None = None, timeout: float | None = None) -> list[Hashable]:
        """Block until some of ``request_ids`` are ready or failed (or ``timeout``); returns the ready ones."""
        return self.requests.wait(request_ids, timeout)

    def error(self, request_id: Hashable) -> RequestFailedError | None:
        """Why the request failed, or ``None``."""
        return self.requests.error(request_id)

    def unenforced(self, request_id: Hashable) -> tuple:
        """The schema keywords this request's engine accepted but does not enforce
        (``json_schema(..., unenforced="allow")``; ``keywords.Unenforced``), once compiled."""
        self.requests.error(request_id)  # resolves a finished compilation
        return self.requests.get(request_id).unenforced

    def engines(self, request_id: Hashable) -> tuple[tuple[str, ...], int | None]:
        """The engines that decided its answer, in order, and its tokens before a move (``auto``'s race)."""
        answer = self.requests.answer(request_id)
        return self.engine.served(answer) if answer is not None else ((), None)

    def finished(self, request_id: Hashable) -> bool:
        """Whether the request took a stop token (or failed: see ``error``)."""
        return self.requests.get(request_id).finished

    # -------------------------------------------------------------- one decode step
    def step(self, batch: Sequence[Hashable], drafts: Mapping[Hashable, Sequence[int]] | None = None, *,
             forced: bool = False, rows_per_request: int | None = None):
        """The mask for one decode step: ``buffer[:rows]``, rows in batch order, or ``None`` if disabled.

        A request with ``k`` draft tokens owns ``1 + k`` consecutive rows: row ``i`` is
        its grammar after accepting the first ``i`` drafts. Past a draft the grammar
        forbids, rows repeat the row that forbade it (the verifier rejects that draft,
        so they are never used); past an accepted stop token rows allow only stop tokens.
        A finished or failed request's rows allow only stop tokens; unconstrained rows are ``-1``.
        ``forced``: the drafts are forced runs (:meth:`forced_runs`): row ``i`` allows exactly
        draft ``i``, so none can be rejected. ``rows_per_request``: every request owns that
        many rows (a verify step ``[B, k + 1]``); rows past its drafts are -1 padding.
        """
        clock = time.perf_counter
        start = clock()
        if not self.enabled:
            for request_id in batch:
                self.requests.get(request_id)
            self.last_step_seconds, self.last_fill_seconds = clock() - start, 0.0
            return None
        plan = self._plan
        if drafts or rows_per_request or plan is None or plan.version != self.requests.version or plan.key != tuple(batch):
            plan = self._lay_out(batch, drafts, rows_per_request)
        fill_seconds = 0.0
        matchers = plan.matchers
        if matchers:
            tick = clock()
            failures = self._fill(matchers, plan.fill_rows)
            fill_seconds = clock() - tick
            if failures:
                self._fill_failed(plan, failures)
        if plan.drafts:
            fill_seconds += self._fill_drafts(plan, forced)
        self.last_fill_seconds = fill_seconds
        self.last_step_seconds = clock() - start
        return self.mask.views[plan.rows]

    def _fill(self, matchers: list, rows: list[int]) -> list[tuple[int, BaseException]]:
        buffer, own = self.mask.buffer, ()
        if self.requests.reasoning and len(matchers) > 1:  # reasoning requests' matchers fill themselves
            own = [i for i, m in enumerate(matchers) if type(m) is ReasoningMatcher]
        if not own:
            return within_budget(self._fill_rows, matchers, buffer, rows, self.limits, self._strikes)
        rest = [i for i in range(len(matchers)) if type(matchers[i]) is not ReasoningMatcher]
        failures = [(own[k], e) for k, e in within_budget(fill_each, [matchers[i] for i in own], buffer,
                                                          [rows[i] for i in own], self.limits, self._own_strikes)]
        if rest:
            failures += [(rest[k], e) for k, e in self._fill([matchers[i] for i in rest], [rows[i] for i in rest])]
        return sorted(failures, key=lambda failure: failure[0])

    def _fill_rows(self, matchers: list, buffer: torch.Tensor, rows: list[int]) -> list[tuple[int, BaseException]]:
        if len(matchers) < self.parallel_min_rows:  # a few rows: on this thread
            return fill_each(matchers, buffer, rows)
        return self.engine.batch_fill(matchers, buffer, rows)  # fill_threads threads, GIL released

    def _fill_failed(self, plan: Layout, failures: list[tuple[int, BaseException]]) -> None:
        """Fail the requests whose fill raised or hung (a hung fill may still write: use a fresh buffer);
        a request past its fill budget where its grammar may end gets a stop-only row instead."""
        if any(isinstance(error, FillTimeout) for _, error in failures):
            self.mask.replace()
        for index, error in failures:
            row = plan.fill_rows[index]
            if isinstance(error, LimitError) and may_end(self.mask.buffer, row, self.stop_token_ids):
                self.mask.stop(row, row + 1)  # its answer is complete here: it ends with its stop token
                self.budget_ended += 1
                continue
            request_id = plan.key[plan.positions[index]]
            self.requests.fail(request_id, plan.requests[index], GrammarFillError(
                f"request {request_id!r}: {engine_message(error)}" if isinstance(error, (FillTimeout, LimitError)) else
                f"request {request_id!r}: its grammar fill failed ({engine_message(error)}); resubmit it", request_id,
            ))
            self.mask.stop(plan.fill_rows[index], plan.fill_rows[index] + 1)

    def _lay_out(self, batch: Sequence[Hashable], drafts, rows_per_request: int | None = None) -> Layout:
        """Lay ``batch`` out and write the rows that do not change while the layout holds
        (-1 rows, stop-only rows); kept as ``self._plan`` when there are no drafts."""
        self._plan = None
        self.requests.wait_for_batch(batch)  # scheduled while compiling: it ends ready or failed
        plan = lay_out(batch, self.requests.states, drafts, max_rows=self.max_rows, version=self.requests.version,
                       rows_per_request=rows_per_request)
        self.mask.write_fixed_rows(plan)
        if not drafts and not rows_per_request:
            self._plan = plan
        return plan

    def _fill_drafts(self, plan: Layout, forced: bool) -> float:
        start = time.perf_counter()
        fill = self.mask.fill_forced if forced else self.mask.fill_draft
        for position, row, state, draft in plan.drafts:
            request_id = plan.key[position]
            try:
                fill(request_id, state.matcher, row, draft)
            except BatchLayoutError:
                raise
            except Exception as error:  # noqa: BLE001 - that request's own failure
                self.requests.fail(request_id, state, GrammarFillError(
                    f"request {request_id!r}: its grammar fill failed ({engine_message(error)}); resubmit it",
                    request_id))
                self.mask.stop(row, row + 1 + len(draft))
        return time.perf_counter() - start

    # -------------------------------------------------------------- after sampling (accept.py)
    def accept(self, request_id: Hashable, tokens: Sequence[int]) -> bool:
        """Advance ``request_id`` by ``tokens`` (the sampled token, or accepted drafts + bonus).

        Returns whether the request has finished (a stop token). A token its grammar
        forbids raises :class:`DisallowedTokenError` and leaves the request as it was; a
        failed request raises its error.
        """
        return self.acceptor.one(request_id, tokens)

    def accept_rows(self, batch: Sequence[Hashable], tokens: torch.Tensor | Sequence[int], *,
                    empty: torch.Tensor | Sequence[bool] | None = None) -> Accepted:
        """One sampled token per request of ``batch`` (no drafts).

        ``empty``: the graph's ``logit_mask_empty`` flags (``Transformed.run``), one per row:
        a flagged row allowed no token, so its request fails. Returns :class:`Accepted`:
        after it every request of the batch has advanced by its token, finished, or failed
        with an error naming it and the token (a refused token, one past the vocabulary).
        """
        start = time.perf_counter()
        # only read; `type is list` first: isinstance through torch.Tensor's metaclass costs ~0.15 us
        values = tokens if type(tokens) is list or not isinstance(tokens, torch.Tensor) else tokens.tolist()
        if len(values) != len(batch):
            raise BatchLayoutError(f"{len(values)} tokens for a batch of {len(batch)} requests; pass one token per request")
        plan = self._plan
        if plan is None or plan.version != self.requests.version or plan.key != tuple(batch):
            plan = self._lay_out(batch, None)  # the layout step() would use; nothing is filled
        finished, self.last_accept_engine_seconds = self.acceptor.rows(plan, batch, values, empty)
        self.last_accept_seconds = time.perf_counter() - start
        return Accepted(finished, self.requests.unreported(batch))

    # -------------------------------------------------------------- jump-forward (jump_forward.py)
    def forced_runs(self, batch: Sequence[Hashable], limit: int | Mapping[Hashable, int], *,
                    mode: str | None = None) -> dict[Hashable, list[int]]:
        """The tokens each live constrained request's grammar forces next, in ``mode`` (default:
        this runtime's ``jump_forward``), at most ``limit`` (or ``limit[request]``) each; grammars
        are left where they are. Decode them as forced drafts: ``step(batch, runs, forced=True)``,
        then ``accept_runs``. The host time is counted per request (``forced_seconds``)."""
        mode = self.jump_forward if mode is None else mode
        if mode not in (None, *MODES):
            raise ValueError(f"jump_forward={mode!r}: pass None, {' or '.join(map(repr, MODES))}")
        if mode is None:
            return {}
        runs = {}
        for request_id in batch:
            state = self.requests.get(request_id)
            cap = limit if isinstance(limit, int) else limit.get(request_id, 0)
            if state.matcher is None or state.finished or state.job is not None or cap <= 0:
                continue
            start = time.perf_counter()
            try:
                run = self._forced_run(state.matcher, cap, mode)
            except Exception as error:  # noqa: BLE001 - that request's own failure
                self.requests.fail(request_id, state, GrammarFillError(
                    f"request {request_id!r}: finding its forced tokens failed ({engine_message(error)})", request_id))
                continue
            state.forced_seconds += time.perf_counter() - start
            if run:
                runs[request_id] = run
        return runs

    def _forced_run(self, matcher, cap: int, mode: str) -> list[int]:
        """A matcher's forced run: a reasoning request's through its own matcher (the budget's end
        tokens, then what the answer's grammar forces), canonical text only from its answer's grammar."""
        if mode == "exact":
            return exact_run(matcher, cap, self._scratch)
        if type(matcher) is ReasoningMatcher:
            if matcher.inner is None:
                return exact_run(matcher, cap, self._scratch)
            return canonical_run(self.engine, matcher.inner, cap, self._scratch)
        return canonical_run(self.engine, matcher, cap, self._scratch)

    def forced_seconds(self, request_id: Hashable) -> float:
        """Host seconds spent finding this request's forced runs."""
        return self.requests.get(request_id).forced_seconds

    def accept_runs(self, batch: Sequence[Hashable], runs: Sequence[Sequence[int]], *,
                    empty: Sequence[bool] | None = None) -> Accepted:
        """``accept_rows`` for a verify step: each request of ``batch`` takes its run of tokens
        (accepted drafts, then the token sampled after them). ``empty``: per request, whether a
        row it used allowed no token. A refused token fails that request alone."""
        return Accepted(self.acceptor.runs(batch, runs, empty), self.requests.unreported(batch))
