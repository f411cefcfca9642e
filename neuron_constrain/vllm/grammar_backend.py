"""vLLM's structured-output backend, built on the library's grammar engines (engine-core process).

vLLM 0.32 holds ONE grammar backend per engine (``StructuredOutputManager.grammar_init``,
vllm/v1/structured_output/__init__.py: "We do NOT support different backends on a
per-request basis"), chosen from the first structured request. So the plugin cannot
pick vLLM's ``xgrammar`` or ``guidance`` backend per request; instead its scheduler
(``scheduler.py``) installs this backend before any request, and every request's grammar
is the library's:

    constraint = policy.from_vllm(kind, spec)     # the request as a library Constraint
    compiled = AutoEngine.compile(constraint)     # xgrammar where it enforces all of it, else llguidance,
                                                  # else ConstraintError (the frontend refused it with a 400 first)

vLLM's manager then fills its bitmask rows, accepts, validates drafts and rolls back
through the grammar objects returned here, exactly as with its own backends. An
xgrammar grammar is vLLM's own ``XgrammarGrammar`` around the library's compiled grammar
(the same matcher options vLLM uses); an llguidance grammar is the library's
``LLGuidanceMatcher`` behind vLLM's grammar interface. The token table is vLLM's own
(``xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size)``, as vLLM's xgrammar
backend builds it), so a grammar both compile alike gives the same masks as stock vLLM.

What one request may cost is bounded here too, by the server's limits (``policy.server_limits``):
xgrammar compiles in worker processes killed past ``compile_seconds`` or ``compile_memory_mb``
(the request fails alone; the frontend's verdict refused most such constraints with a 400
already), and every mask fill is timed: a request whose fill takes longer than ``fill_ms`` for one
token (an ambiguous grammar's work grows with its text) ends there, so the batch's other rows
keep their step time. Where its grammar may end, its row keeps only the stop tokens it allows:
the model ends the answer, complete and valid (``nc_budget_ended``); elsewhere the grammar is
marked failed (``nc_failure``) and the plugin's scheduler ends the request with an error after
that step.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time

import torch
import xgrammar as xgr

from neuron_constrain.structured.runtime.fill_budget import STRIKES
from neuron_constrain.structured.schema.limits import LimitError
from neuron_constrain.vllm import check_vllm_version
from neuron_constrain.vllm import policy

check_vllm_version()

from vllm.tokenizers import TokenizerLike  # noqa: E402,F401
from vllm.utils.mistral import is_mistral_tokenizer  # noqa: E402
from vllm.v1.structured_output.backend_types import (  # noqa: E402
    StructuredOutputBackend,
    StructuredOutputGrammar,
    StructuredOutputOptions,
)
from vllm.v1.structured_output.backend_xgrammar import XgrammarGrammar  # noqa: E402

log = logging.getLogger("vllm.neuron_constrain")

_CACHE = 256  # compiled grammars kept (per constraint key)
COMPILE_PROCESSES = 4  # xgrammar worker processes (the scheduler's two lanes of two threads)


class _Budget:
    """A per-token budget on a grammar's fill (``nc_budget`` seconds; ``nc_stops``: a mask row of the
    stop tokens): past it, the row keeps only its stop tokens (``nc_budget_ended``), or, where the
    grammar may not end, the grammar is marked failed (``nc_failure``).

    A fill is timed by the clock until one takes a quarter of the budget; from then on (``nc_slow``) the
    grammar's work for each token, its accept and the next fill, is timed in its thread's CPU time as it
    runs (a preempted thread on a busy host is not a slow grammar; an ambiguous grammar's accepts grow as
    its fills do: they were two thirds of its cost once its fills were timed alone), and
    ``fill_budget.STRIKES`` tokens past the budget in a row end the request (one spike of an ordinary
    grammar, the first character of a bounded string, does not). No fill is run twice: timing a slow
    grammar's fills again (as this did, the least of two more fills) tripled what it cost the batch."""

    nc_failure: str | None = None
    nc_budget_ended: bool = False
    nc_slow: bool = False  # one fill took a quarter of the budget by the clock: its work is timed in CPU time from now on
    nc_costly: bool = False  # and one token's work took a quarter of the budget in CPU time (not the host's load)
    nc_strikes: int = 0  # tokens past the budget in a row (fill_budget.STRIKES of them end the request)
    nc_accepting: float = 0.0  # CPU seconds of the accepts since the last fill (a slow grammar's)
    nc_budget: float = float("inf")
    nc_stops: torch.Tensor | None = None

    def _timed_fill(self, fill, bitmask: torch.Tensor, idx: int) -> None:
        if not self.nc_slow:
            start = time.perf_counter()
            fill(bitmask, idx)
            self.nc_slow = time.perf_counter() - start > self.nc_budget / 4
            return
        start = time.thread_time()
        fill(bitmask, idx)
        seconds = time.thread_time() - start + self.nc_accepting
        self.nc_accepting = 0.0
        self.nc_costly = self.nc_costly or seconds > self.nc_budget / 4
        if seconds <= self.nc_budget or self.nc_failure is not None:
            self.nc_strikes = 0
            return
        self.nc_strikes += 1
        if self.nc_strikes < STRIKES:  # a spike of an ordinary grammar, not yet a grammar that stays slow
            return
        ends = bitmask[idx] & self.nc_stops
        if bool(ends.any()):  # its answer may end here: it does, with one of the stop tokens it allows
            bitmask[idx].copy_(ends)
            self.nc_budget_ended = True
        else:
            self.nc_failure = policy.over_budget_message(seconds, self.nc_budget)


    def _timed_accept(self, accept, request_id: str, tokens: list[int]) -> bool:
        if not self.nc_slow:
            return accept(request_id, tokens)
        start = time.thread_time()
        try:
            return accept(request_id, tokens)
        finally:
            self.nc_accepting += time.thread_time() - start


def _stop_row(stop_ids, vocab_size: int) -> torch.Tensor:
    """A packed int32 mask row allowing exactly ``stop_ids``."""
    words = [0] * ((vocab_size + 31) // 32)
    for token in stop_ids:
        words[token >> 5] |= 1 << (token & 31)
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)


class BudgetedXgrammarGrammar(XgrammarGrammar, _Budget):
    """vLLM's xgrammar grammar, its fills and accepts timed against the per-token budget."""

    def fill_bitmask(self, bitmask: torch.Tensor, idx: int) -> None:
        self._timed_fill(super().fill_bitmask, bitmask, idx)

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        return self._timed_accept(super().accept_tokens, request_id, tokens)


def vllm_tokenizer_info(tokenizer, vocab_size: int) -> xgr.TokenizerInfo:
    """The token table vLLM's xgrammar backend builds (backend_xgrammar.py ``__post_init__``)."""
    if is_mistral_tokenizer(tokenizer):
        return xgr.TokenizerInfo(
            encoded_vocab=tokenizer.vocab,
            vocab_type=xgr.VocabType.RAW if tokenizer.is_tekken else xgr.VocabType.BYTE_FALLBACK,
            vocab_size=len(tokenizer.vocab), stop_token_ids=[tokenizer.eos_token_id], add_prefix_space=True,
        )
    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)


def library_tokenizer(tokenizer, info: xgr.TokenizerInfo, vocab_size: int):
    """The library's tokenizer over vLLM's token table: the same pieces, special ids and stop ids."""
    from neuron_constrain.structured import Tokenizer

    pieces = [bytes(p) for p in info.decoded_vocab]
    special = set(int(i) for i in info.special_token_ids)
    names = [("<|special_%d|>" % i) if i in special else "" for i in range(len(pieces))]
    return Tokenizer(
        pieces, special_ids=special, stop_token_ids=list(info.stop_token_ids), names=names,
        encode=lambda text: list(tokenizer.encode(text, add_special_tokens=False)),
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        vocab_size=max(vocab_size, len(pieces)), source=f"vLLM {type(tokenizer).__name__}",
    )


def whitespace(vllm_config) -> str:
    """The JSON whitespace the server's constraints are compiled with (``policy.from_vllm``)."""
    return "none" if vllm_config.structured_outputs_config.disable_any_whitespace else "any"


def served_engine(tokenizer, vocab_size: int, limits, compile_processes: int):
    """The library's ``auto`` engine over vLLM's token table (``vocab_size``: the model's, padded): the engine
    core's backend compiles on it and the API server's admission judges on one built alike, so a grammar the
    admission compiled is the engine core's disk-cache hit (one compile per constraint per server). Bounded
    strings on xgrammar (escape-free, sound), as stock vLLM compiles them: greedy tokens stay stock's."""
    from neuron_constrain.structured.engines import AutoEngine

    info = vllm_tokenizer_info(tokenizer, vocab_size)
    vocab_size = max(vocab_size, info.vocab_size)
    return AutoEngine(library_tokenizer(tokenizer, info, vocab_size), limits=limits,
                      compile_processes=compile_processes, narrow_bounded_strings=True, race=False)


class LibraryGrammar(StructuredOutputGrammar, _Budget):
    """A library matcher (llguidance's, wrapped by ``LLGuidanceMatcher``) behind vLLM's grammar
    interface, with the semantics of vLLM's ``XgrammarGrammar``; its fills and accepts timed like
    :class:`BudgetedXgrammarGrammar`'s."""

    def __init__(self, engine, compiled):
        self.engine, self.compiled = engine, compiled
        self.matcher = engine.matcher(compiled)
        self.num_processed_tokens = 0
        self._is_terminated = False

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        return self._timed_accept(self._accept, request_id, tokens)

    def _accept(self, request_id: str, tokens: list[int]) -> bool:
        if self._is_terminated:
            return True
        for token in tokens:
            if not self.matcher.accept_token(token):
                log.error("neuron_constrain: the grammar (%s) of request %s refused token %s",
                          self.compiled.engine, request_id, token)
                return False
            self.num_processed_tokens += 1
            self._is_terminated = self.matcher.is_terminated()
            if self._is_terminated:
                break
        return True

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        if self._is_terminated:
            return []
        accepted = []
        for token in tokens:
            if not self.matcher.accept_token(token):
                break
            accepted.append(token)
            if self.matcher.is_terminated():
                break
        if accepted:
            self.matcher.rollback(len(accepted))
        return accepted

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)
        self.num_processed_tokens -= num_tokens
        self._is_terminated = self.matcher.is_terminated()

    def fill_bitmask(self, bitmask: torch.Tensor, idx: int) -> None:
        self._timed_fill(self.matcher.fill_next_token_bitmask, bitmask, idx)

    def is_terminated(self) -> bool:
        return self._is_terminated

    def reset(self):
        self.matcher = self.engine.matcher(self.compiled)
        self.num_processed_tokens = 0
        self._is_terminated = False


_KINDS = {
    StructuredOutputOptions.JSON: "json",
    StructuredOutputOptions.JSON_OBJECT: "json_object",
    StructuredOutputOptions.REGEX: "regex",
    StructuredOutputOptions.CHOICE: "choice",
    StructuredOutputOptions.GRAMMAR: "grammar",
    StructuredOutputOptions.STRUCTURAL_TAG: "structural_tag",
}


@dataclasses.dataclass
class LibraryBackend(StructuredOutputBackend):
    """Every request's grammar compiled by the library's ``auto`` engine (xgrammar | llguidance)."""

    def __post_init__(self):
        config = self.vllm_config
        self.whitespace = whitespace(config)
        self.limits = policy.server_limits()
        self.engine = served_engine(self.tokenizer, self.vocab_size, self.limits, COMPILE_PROCESSES)
        self.library_tokenizer = self.engine.tokenizer
        self.vocab_size = self.library_tokenizer.vocab_size
        self.pieces = self.library_tokenizer.pieces  # the text each token adds, as the grammars read it
        self.stop_ids = frozenset(self.library_tokenizer.stop_token_ids)
        spec = config.speculative_config
        self.num_speculative_tokens = spec.num_speculative_tokens if spec is not None else 0
        self._lock = threading.Lock()
        self._compiled: dict = {}
        self.counts = {"xgrammar": 0, "llguidance": 0, "compile_errors": 0, "limit_errors": 0, "over_budget": 0,
                       "budget_ended": 0}
        self.stop_row = _stop_row(self.stop_ids, self.vocab_size)
        self._warm()

    def snapshot(self) -> dict:
        """The counters, with xgrammar's grammars compiled here (``compiled``) and loaded from the disk cache
        (``loaded``: most of them the admission's, compiled in the API server for this vocabulary)."""
        cache = self.engine.xgrammar.disk_cache
        return {**self.counts, "compiled": self.engine.xgrammar.compiles, "loaded": cache.hits if cache else 0}

    def _warm(self) -> None:
        """One small schema compiled as the engine starts (``policy.WARM_SCHEMA``), before the server reports
        ready: the compile workers' start and the first compile's one-time costs (seconds on a busy machine)
        are not the first request's."""
        try:
            self._compile(self.constraint(StructuredOutputOptions.JSON, policy.WARM_SCHEMA))
        except Exception as error:  # noqa: BLE001 - a warm-up only: the first request reports its own failure
            log.warning("neuron_constrain: warming the grammar backend failed: %s", error)

    def constraint(self, request_type: StructuredOutputOptions, grammar_spec: str):
        return policy.from_vllm(_KINDS[request_type], grammar_spec, whitespace=self.whitespace)

    def _compile(self, constraint):
        key = constraint.key
        with self._lock:
            hit = self._compiled.get(key)
        if hit is not None:
            return hit
        compiled = self.engine.compile(constraint)
        with self._lock:
            if len(self._compiled) >= _CACHE:
                self._compiled.pop(next(iter(self._compiled)))
            self._compiled[key] = compiled
        return compiled

    def compile_grammar(self, request_type: StructuredOutputOptions, grammar_spec: str,
                        stop_token_ids: set[int] | None = None) -> StructuredOutputGrammar:
        try:
            constraint = self.constraint(request_type, grammar_spec)
            compiled = self._compile(constraint)
        except Exception as error:
            self.counts["compile_errors"] += 1
            self.counts["limit_errors"] += isinstance(error, LimitError)
            raise  # vLLM fails this request alone (the frontend refused what the policy refuses, with a 400)
        if compiled.engine == "xgrammar":
            grammar = BudgetedXgrammarGrammar(
                matcher=xgr.GrammarMatcher(compiled.grammar,
                                           override_stop_tokens=list(stop_token_ids) if stop_token_ids else None,
                                           max_rollback_tokens=self.num_speculative_tokens),
                vocab_size=self.vocab_size, ctx=compiled.grammar,
            )
        else:
            grammar = LibraryGrammar(self.engine, compiled)
        # what the finished answer is validated against (scheduler.py); a structural tag's answer is free
        # text with tool calls inside, which vLLM's tool parser reads: not one document to validate; a grammar
        # naming control tokens by id (a tool-call family's, validate.py) is not checked by its text
        unchecked = request_type == StructuredOutputOptions.STRUCTURAL_TAG or policy.has_token_references(constraint)
        grammar.nc_constraint = None if unchecked else constraint
        grammar.nc_engine = compiled.engine
        grammar.nc_budget, grammar.nc_stops = self.limits.fill_ms / 1e3, self.stop_row
        self.counts[compiled.engine] += 1
        return grammar

    def text(self, token_ids) -> str:
        """The text the grammar read for ``token_ids`` (stop tokens dropped)."""
        pieces, stops, size = self.pieces, self.stop_ids, len(self.pieces)
        data = b"".join(pieces[t] for t in token_ids if t not in stops and 0 <= t < size)
        return data.decode("utf-8", "replace")

    def allocate_token_bitmask(self, max_num_seqs: int) -> torch.Tensor:
        return xgr.allocate_token_bitmask(max_num_seqs, self.vocab_size)

    def destroy(self):
        self.engine.close()
