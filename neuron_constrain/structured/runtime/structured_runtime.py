"""``StructuredRuntime``: per-step packed masks for a batch of requests, in one buffer,
with grammars compiled off the critical path and failures kept to their request.

    runtime = StructuredRuntime(tokenizer, max_rows=64)      # tokenizer: .info (tokenizers.py)
    runtime.add("r1", json_schema(schema), timeout=30)       # returns at once: compiles in a thread pool
    runtime.ready(["r1", "r2"])                              # the requests a scheduler may put in a batch
    mask = runtime.step(batch)                               # rows in batch order (ready requests only)
    result = runtime.accept_rows(batch, tokens)              # result.finished, result.failed {id: error}
    runtime.error("r1")                                      # why a request failed, or None

The parts: ``requests.py``, ``compile_cache.py`` (grammars, threads), ``layout.py`` (rows), ``fill.py``
(the step's fills) and ``accept.py``; here they meet.

Failures stay with their request: a constraint that does not parse or compile, a compilation past
its limit, a fill that raises or hangs, a row that allowed no token, a refused token each fail that
request alone, with one error naming it (``error()``; returned once in ``accept_rows``' ``failed``);
its rows then allow only stop tokens. The caller's own mistakes (an unknown or repeated request, too
many rows) raise :class:`BatchLayoutError`.
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
from neuron_constrain.structured.runtime.accept import Accepted, Acceptor
from neuron_constrain.structured.runtime.compile_cache import CompileCache
from neuron_constrain.structured.constraints import Constraint
from neuron_constrain.structured.engines import ENGINE_CHOICES, make_engine
from neuron_constrain.structured.errors import BatchLayoutError, RequestFailedError, StructuredOutputsDisabledError
from neuron_constrain.structured.runtime.fill import Fills
from neuron_constrain.structured.runtime.jump_forward import MODES, forced_runs
from neuron_constrain.structured.schema.limits import DEFAULT as DEFAULT_LIMITS, Limits
from neuron_constrain.structured.runtime.layout import Layout, lay_out
from neuron_constrain.structured.runtime.mask_buffer import MaskBuffer, mask_mismatch
from neuron_constrain.structured.runtime.reasoning import Reasoning, matcher_for
from neuron_constrain.structured.runtime.requests import Requests
from neuron_constrain.structured.tokenizers import VocabularyInfo, with_info
from neuron_constrain.core.transform import Transformed


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

    def __init__(self, tokenizer, *, max_rows: int, enable_structured_outputs: bool = True,
                 tokenizer_info: VocabularyInfo | None = None, engine: str = "auto", fill_threads: int | None = None,
                 compile_workers: int = 2, compile_timeout: float | None = None, cache_size: int = 512,
                 parallel_min_rows: int = 16, fill_timeout: float = 120.0, jump_forward: str | None = None,
                 limits: Limits | None = None, compile_isolation: str = "process"):
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
        _count("parallel_min_rows", parallel_min_rows, 2)  # fewer constrained rows fill on this thread (fill.py)
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
        self.fills = Fills(self.engine, self.requests, self.mask, self.limits, self.stop_token_ids,
                           parallel_min_rows if fill_threads > 1 else 2)  # 1 thread: the engine's batch fill always
        self._scratch = torch.zeros((1, self.width), dtype=torch.int32)  # jump-forward's lookahead fills
        # The last layout, reused while the batch and every request's state are unchanged (a decode loop's
        # usual case). ``requests.version`` moves on every join, leave, compilation end, finish and failure.
        self._plan: Layout | None = None
        self.last_step_seconds = 0.0  # whole step(): layout + fills + hand-off
        self.last_fill_seconds = 0.0  # the engine's fill / accept / rollback inside it
        self.last_accept_seconds = 0.0  # whole accept_rows()
        self.last_accept_engine_seconds = 0.0  # the engine's accept inside it

    @property
    def buffer(self) -> torch.Tensor:
        """The mask buffer ``[max_rows, ceil(V/32)]``: one for the runtime's life, a new one after a fill hung."""
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
        """Constraints found compiled in the cache."""
        return self.compiled.hits

    @property
    def cache_misses(self) -> int:
        """Constraints the cache had to compile."""
        return self.compiled.misses

    @property
    def budget_ended(self) -> int:
        """Requests ended with a stop token when their fill passed ``limits.fill_ms`` (``fill.py``)."""
        return self.fills.budget_ended

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
        """A runtime matched to ``transformed``: enabled iff the graph takes a logit mask.

        Args:
            transformed: the rewritten program the masks are for.
            tokenizer: the tokenizer protocol or a bare :class:`VocabularyInfo`.
            max_rows: the largest batch, draft rows included.
            **kwargs: the other arguments of :class:`StructuredRuntime`.

        Returns:
            The runtime; structured outputs disabled where the graph has no ``logit_mask`` input.

        Raises:
            ValueError: the graph's mask is not packed int32, or was made for another vocabulary size or
                width than the tokenizer's (the runtime is closed first); or a bad option.
        """
        added = {i.name: i for i in transformed.report.inputs_added}
        runtime = cls(tokenizer, max_rows=max_rows, enable_structured_outputs=MASK_INPUT in added, **kwargs)
        problem = mask_mismatch(added[MASK_INPUT], runtime.vocab_size) if runtime.enabled else None
        if problem is not None:
            runtime.close()
            raise ValueError(problem)
        return runtime

    # -------------------------------------------------------------- requests join / leave (requests.py)
    def add(self, request_id: Hashable, constraint: Constraint | None = None, *, timeout: float | None = None,
            reasoning: Reasoning | None = None, prompt: Sequence[int] = ()) -> None:
        """Admit a request; returns at once. Its grammar compiles in the background (or comes from the
        cache). A malformed constraint, or one past the limits, fails the request (``error()``), never raises.

        Args:
            request_id: the request's id, new to the runtime.
            constraint: what its answer must match; None: unconstrained.
            timeout: seconds its compilation may take once started (default ``compile_timeout``).
            reasoning: the request thinks first (``reasoning.py``: the grammar starts after its thought, a
                budget forces the end marker).
            prompt: its prompt's tokens, which may open (and count toward) or close the thought.

        Raises:
            BatchLayoutError: the id is already in the runtime.
            StructuredOutputsDisabledError: a constraint, a thinking budget or a thought grammar on a runtime
                whose graph has no mask input.
            ValueError: a ``timeout`` that is not a positive number of seconds, or reasoning markers the
                tokenizer cannot encode into its vocabulary.
        """
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
        matcher = matcher_for(reasoning, self.tokenizer, self.vocab_size, prompt, self.stop_token_ids, self.width)
        self.requests.add(request_id, constraint, timeout, reasoning=matcher, thought=reasoning.thought)

    def remove(self, request_id: Hashable) -> None:
        """Forget a request: finished, failed or cancelled.

        Args:
            request_id: a request of the runtime.

        Raises:
            BatchLayoutError: the request is not in the runtime (never added, or removed already).
        """
        self.requests.remove(request_id)

    def ready(self, request_ids: Sequence[Hashable] | None = None) -> list[Hashable]:
        """The requests that can be scheduled now: compiled (or unconstrained) and not failed.

        Args:
            request_ids: the requests to look at (default: all the runtime's).

        Returns:
            The ready ones, in order.

        Raises:
            BatchLayoutError: a request not in the runtime.
        """
        return self.requests.ready(request_ids)

    def wait(self, request_ids: Sequence[Hashable] | None = None, timeout: float | None = None) -> list[Hashable]:
        """Block until some of the requests still compiling are ready or failed, or ``timeout`` passed.

        Args:
            request_ids: the requests to wait for (default: all the runtime's).
            timeout: seconds to wait at most (default: until one is done).

        Returns:
            The ready ones among ``request_ids``, in order.

        Raises:
            KeyError: a request not in the runtime.
        """
        return self.requests.wait(request_ids, timeout)

    def error(self, request_id: Hashable) -> RequestFailedError | None:
        """Why the request failed (its compilation resolved first, if it has finished).

        Args:
            request_id: a request of the runtime.

        Returns:
            Its error, or None while it has not failed.

        Raises:
            BatchLayoutError: the request is not in the runtime.
        """
        return self.requests.error(request_id)

    def unenforced(self, request_id: Hashable) -> tuple:
        """The schema keywords its engine accepted but does not enforce (``json_schema(..., unenforced="allow")``).

        Args:
            request_id: a request of the runtime.

        Returns:
            Its ``keywords.Unenforced`` entries; empty before its compilation ends.

        Raises:
            BatchLayoutError: the request is not in the runtime.
        """
        self.requests.error(request_id)  # resolves a finished compilation
        return self.requests.get(request_id).unenforced

    def engines(self, request_id: Hashable) -> tuple[tuple[str, ...], int | None]:
        """The engines that decided a request's answer.

        Args:
            request_id: a request of the runtime.

        Returns:
            ``(engine names in order, the tokens it took before moving to the second, or None)``; ``((), None)``
            for a request without a grammar.

        Raises:
            BatchLayoutError: the request is not in the runtime.
        """
        answer = self.requests.answer(request_id)
        return self.engine.served(answer) if answer is not None else ((), None)

    def finished(self, request_id: Hashable) -> bool:
        """Whether the request took a stop token (or failed: see ``error``).

        Args:
            request_id: a request of the runtime.

        Returns:
            True once it finished or failed.

        Raises:
            BatchLayoutError: the request is not in the runtime.
        """
        return self.requests.get(request_id).finished

    # -------------------------------------------------------------- one decode step
    def step(self, batch: Sequence[Hashable], drafts: Mapping[Hashable, Sequence[int]] | None = None, *,
             forced: bool = False, rows_per_request: int | None = None):
        """The mask for one decode step, rows in batch order (a request still compiling is waited for): a
        finished or failed request's rows allow only stop tokens, unconstrained rows are ``-1``.

        Args:
            batch: the requests of the step, each once.
            drafts: request -> its ``k`` draft tokens: it owns ``1 + k`` rows, row ``i`` its grammar after the
                first ``i`` drafts (past a draft it forbids, the row that forbade it; past a stop, stop tokens).
            forced: the drafts are forced runs (:meth:`forced_runs`): row ``i`` allows exactly draft ``i``.
            rows_per_request: every request owns that many rows (a verify step ``[B, k + 1]``), -1 padded.

        Returns:
            ``buffer[:rows]`` (a view, valid until the next step), or None where structured outputs are off.

        Raises:
            BatchLayoutError: a request not in the runtime or named twice, more rows than ``max_rows``, a
                draft token past the vocabulary or a forced token its grammar does not take.
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
        self.last_fill_seconds = self.fills.run(plan, forced)
        self.last_step_seconds = clock() - start
        return self.mask.views[plan.rows]

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

    # -------------------------------------------------------------- after sampling (accept.py)
    def accept(self, request_id: Hashable, tokens: Sequence[int]) -> bool:
        """Advance one request by its tokens (a request still compiling is waited for).

        Args:
            request_id: a request of the runtime.
            tokens: the sampled token, or the accepted drafts and the bonus token.

        Returns:
            Whether the request has finished (a stop token).

        Raises:
            BatchLayoutError: the request is not in the runtime.
            DisallowedTokenError: a token its grammar forbids, past the vocabulary or after its stop; the
                request is left as it was.
            RequestFailedError: the request had failed (its own error).
        """
        return self.acceptor.one(request_id, tokens)

    def accept_rows(self, batch: Sequence[Hashable], tokens: torch.Tensor | Sequence[int], *,
                    empty: torch.Tensor | Sequence[bool] | None = None) -> Accepted:
        """One sampled token per request of ``batch`` (no drafts). A refused token, one past the
        vocabulary or a flagged row fails that request alone, with an error naming it and the token.

        Args:
            batch: the step's requests, in the order of its rows.
            tokens: one token per request.
            empty: the graph's ``logit_mask_empty`` flags (``Transformed.run``), one per row: a flagged row
                allowed no token.

        Returns:
            The requests it finished and those that failed; every other request advanced by its token.

        Raises:
            BatchLayoutError: not one token per request, or a request not in the runtime or named twice.
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
        """The tokens each live constrained request's grammar forces next (grammars left where they are), to decode
        as forced drafts: ``step(batch, runs, forced=True)``, then ``accept_runs``. A grammar that raises fails its
        request; the host time is counted per request (``forced_seconds``).

        Args:
            batch: the requests to look at.
            limit: the most tokens a run may have, or request -> its limit (a request absent: none).
            mode: ``"exact"`` or ``"canonical"`` (default: this runtime's ``jump_forward``).

        Returns:
            Request -> its forced tokens, for the requests with any; empty where the mode is None.

        Raises:
            ValueError: an unknown mode.
            BatchLayoutError: a request not in the runtime.
        """
        return forced_runs(self.requests, self.engine, batch, limit, self.jump_forward if mode is None else mode,
                           self._scratch)

    def forced_seconds(self, request_id: Hashable) -> float:
        """Host seconds spent finding a request's forced runs.

        Args:
            request_id: a request of the runtime.

        Returns:
            The seconds, summed over its runs.

        Raises:
            BatchLayoutError: the request is not in the runtime.
        """
        return self.requests.get(request_id).forced_seconds

    def accept_runs(self, batch: Sequence[Hashable], runs: Sequence[Sequence[int]], *,
                    empty: Sequence[bool] | None = None) -> Accepted:
        """``accept_rows`` for a verify step: each request of ``batch`` takes its run of tokens. A refused
        token, or a row that allowed no token, fails that request alone.

        Args:
            batch: the step's requests.
            runs: per request, its accepted drafts, then the token sampled after them.
            empty: per request, whether a row it used allowed no token.

        Returns:
            The requests it finished and those that failed; every other request advanced by its run.

        Raises:
            BatchLayoutError: a request not in the runtime.
        """
        return Accepted(self.acceptor.runs(batch, runs, empty), self.requests.unreported(batch))
