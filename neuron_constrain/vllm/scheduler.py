"""The plugin's vLLM scheduler: the library's grammars for every request, and the last line of defence.

    --scheduler-cls neuron_constrain.vllm.scheduler.NeuronConstrainScheduler    (in ``server_args()``)

vLLM's own scheduler (``vllm.v1.core.sched.scheduler.Scheduler``; the CPU platform turns
async scheduling off, so it is the one vLLM would use) with two additions, both in the
engine-core process, where vLLM's grammars live:

* **The library's grammars.** Before any request it installs ``grammar_backend.LibraryBackend``
  as the engine's structured-output backend (vLLM's ``StructuredOutputManager`` builds a
  backend only while it has none): each request's grammar comes from the library's
  ``auto`` engine (xgrammar or llguidance, per request) under the library's keyword
  policy. vLLM's manager still fills the bitmask the plugin's head applies.
* **A finished constrained answer is checked.** When a structured request stops (EOS or a
  stop token; a length cut or an abort is not a finished answer), the text its grammar
  read is validated against its constraint (``policy.violation``: ``jsonschema`` for JSON,
  ``re`` for regex, ...). A violation is logged, counted (``invalid_outputs`` in the
  engine counters file, ``<NEURON_CONSTRAIN_VLLM_METRICS>.engine``) and the request ends
  with vLLM's ``error`` finish reason — an HTTP 500 for a non-streamed request, an error
  event for a stream, counted by vLLM's ``/metrics`` as
  ``vllm:request_success_total{finished_reason="error"}`` — never as a valid-looking answer.
  Structural tags (``tool_choice="auto"``: free text with tool calls inside) are not checked
  here; their calls are parsed by vLLM's tool parser. Nor is the answer of an EBNF grammar whose work for a
  token took a quarter of ``fill_ms`` in CPU time (``unchecked_outputs``): its referee, xgrammar again,
  would redo the whole answer's work on the step loop. With ``--reasoning-parser`` the
  grammar starts after the thought (vLLM's manager), so what is checked is the answer, the
  tokens the grammar read; a request whose thought never ended has no answer to check.
* **Bounded work per request.** Grammars compile on two lanes by size (``structured/runtime/lanes.py``,
  in place of vLLM's one grammar thread pool), so a flood of large constraints never queues
  in front of small ones; a request whose grammar passed its per-token fill budget
  (``grammar_backend.py``) ends there, alone: with its stop token where its grammar may end
  (``budget_ended`` in the engine counters), else with the ``error`` finish reason after that
  step (``over_budget``).
"""
from __future__ import annotations

import logging
import os
import threading

from neuron_constrain.vllm import METRICS_ENV, check_vllm_version
from neuron_constrain.vllm import policy
from neuron_constrain.vllm.counters import CountersFile

check_vllm_version()

from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from neuron_constrain.structured.runtime.lanes import Lanes  # noqa: E402
from neuron_constrain.vllm.grammar_backend import LibraryBackend  # noqa: E402

log = logging.getLogger("vllm.neuron_constrain")

ENGINE_METRICS_SUFFIX = ".engine"  # the scheduler's counters: <METRICS path>.engine


class _GrammarLanes(Lanes):
    """vLLM's grammar executor (``manager.executor.submit(create_grammar, request)``) on two lanes,
    by the size of the request's constraint."""

    def __init__(self):
        super().__init__(2, name="neuron-constrain-grammar")

    def submit(self, fn, request, /):  # noqa: D102 - vLLM's call
        _, spec = request.structured_output_request.structured_output_key
        return super().submit(len(spec or ""), fn, request)


class NeuronConstrainScheduler(Scheduler):
    """vLLM's scheduler whose structured outputs are the library's, finished answers validated."""

    def __init__(self, vllm_config, *args, **kwargs):
        super().__init__(vllm_config, *args, **kwargs)
        manager = self.structured_output_manager
        self.library_backend = None
        if manager is not None and not vllm_config.model_config.skip_tokenizer_init:
            if manager.backend is not None:  # vLLM built one already: not the version this was written for
                raise RuntimeError("neuron_constrain: vLLM's structured-output backend was built before the "
                                   "scheduler; the plugin cannot install the library's grammars")
            self.library_backend = LibraryBackend(vllm_config, tokenizer=manager.tokenizer,
                                                  vocab_size=vllm_config.model_config.get_vocab_size())
            manager.backend = self.library_backend
            manager.executor.shutdown(wait=False)
            manager.executor = _GrammarLanes()
        self.output_counters = {"validated_outputs": 0, "invalid_outputs": 0, "unchecked_outputs": 0}
        self.violations: list[dict] = []
        self._counters_lock = threading.Lock()
        path = os.environ.get(METRICS_ENV)
        self._counters_file = CountersFile(path + ENGINE_METRICS_SUFFIX, self.snapshot) if path else None
        if self._counters_file is not None:
            self._counters_file.notify()

    def snapshot(self) -> dict:
        backend = self.library_backend
        with self._counters_lock:
            return {**self.output_counters, **({} if backend is None else backend.snapshot()),
                    "violations": list(self.violations[-20:])}

    def _update_request_with_output(self, request, new_token_ids, is_stale: bool = False):
        new_token_ids, stopped = super()._update_request_with_output(request, new_token_ids, is_stale)
        structured = request.structured_output_request
        failure = getattr(structured.grammar, "nc_failure", None) if structured is not None else None
        if failure is not None and not stopped:  # past its per-token budget: this step was the last it slows
            log.error("neuron_constrain: request %s stopped: %s", request.request_id, failure)
            with self._counters_lock:
                self.library_backend.counts["over_budget"] += 1
            request.status = RequestStatus.FINISHED_ERROR
            stopped = True
        if stopped and structured is not None and getattr(structured.grammar, "nc_budget_ended", False):
            with self._counters_lock:
                self.library_backend.counts["budget_ended"] += 1
        if stopped and request.structured_output_request:
            if request.status == RequestStatus.FINISHED_STOPPED:
                self._check_finished(request, new_token_ids)
            if self._counters_file is not None:  # the grammars compiled per engine, too
                self._counters_file.notify()
        return new_token_ids, stopped

    def _check_finished(self, request, new_token_ids) -> None:
        grammar = request.structured_output_request.grammar
        constraint = getattr(grammar, "nc_constraint", None)
        backend = self.library_backend
        if constraint is None or backend is None or (constraint.kind == "ebnf" and getattr(grammar, "nc_costly", False)):
            # an EBNF answer's referee is a fresh xgrammar matcher: for a costly grammar (a token's work past a
            # quarter of the budget in CPU time: an ambiguous one's grows with its text) it would redo every
            # accept here, on the step loop (0.8 s for bench_hostile's `ambiguous_ebnf`), where the request's
            # own matcher already took each token
            with self._counters_lock:
                self.output_counters["unchecked_outputs"] += 1
            return
        ids = self._answer_ids(request, grammar, list(new_token_ids))
        if ids is None:  # stopped inside its thought: the grammar never started (counted, not an answer)
            with self._counters_lock:
                self.output_counters["unchecked_outputs"] += 1
            return
        params = getattr(request, "sampling_params", None)
        stops = set(getattr(params, "all_stop_token_ids", None) or ())
        if ids and ids[-1] in stops:  # the stop token that ended it (EOS or one of the request's own)
            ids.pop()
        text = backend.text(ids)
        why = policy.violation(constraint, text)
        with self._counters_lock:
            self.output_counters["validated_outputs"] += 1
            if why is not None:
                self.output_counters["invalid_outputs"] += 1
                self.violations.append({"request": request.request_id, "engine": getattr(grammar, "nc_engine", ""),
                                        "why": why[:300], "text": text[:300]})
        if why is not None:
            log.error("neuron_constrain: request %s finished with an answer its constraint (%s, on %s) does not "
                      "accept: %s; answered with an error instead. Text: %r", request.request_id,
                      constraint.describe(), getattr(grammar, "nc_engine", "?"), why, text[:200])
            request.status = RequestStatus.FINISHED_ERROR

    def _answer_ids(self, request, grammar, new: list[int]) -> list[int] | None:
        """The output tokens the grammar reads: those it took, then this step's ``new`` ones (vLLM's
        manager accepts them after this check) from where it starts in them — all of them unless a
        reasoning parser holds the grammar back until the thought ends. None: the thought never ended."""
        ids = list(request.output_token_ids)
        manager = self.structured_output_manager
        if manager.reasoner_cls is None or manager.enable_in_reasoning:
            return ids
        before = ids[: len(ids) - len(new)]
        taken = before[len(before) - grammar.num_processed_tokens:] if grammar.num_processed_tokens else []
        # where the grammar starts in ``new``: the call the manager's accept_tokens makes next (vLLM 0.32)
        start = manager._get_constraint_bounds(request, new, spec_tokens_committed=True).grammar_start
        if not taken and start >= len(new) and request.structured_output_request.reasoning_ended is not True:
            return None
        return taken + new[start:]
