"""A decode step's fills: every constrained row of a layout written by its grammar, in the one buffer.

    fills = Fills(engine, requests, mask, limits, stop_token_ids, parallel_min_rows=16)
    seconds = fills.run(plan, forced=False)    # the layout's rows, then its draft rows; the engine's seconds

A few rows fill on the calling thread, more in the engine's batch fill (its threads, without the
GIL); a reasoning request's matcher fills its own row. Each fill runs within the per-token budget
(``fill_budget.py``). A fill that raises, hangs or stays past the budget fails its request alone
(its rows then allow only stop tokens; a hung fill may still write, so the buffer is replaced),
unless its grammar may end there: then its row allows only stop tokens and its answer ends
(``budget_ended`` counts those).
"""
from __future__ import annotations

import time

import torch

from neuron_constrain.structured.constraints import engine_message
from neuron_constrain.structured.engines.base import fill_each
from neuron_constrain.structured.engines.xgrammar.fill_threads import FillTimeout
from neuron_constrain.structured.errors import BatchLayoutError, GrammarFillError
from neuron_constrain.structured.runtime.fill_budget import may_end, within_budget
from neuron_constrain.structured.runtime.layout import Layout
from neuron_constrain.structured.runtime.mask_buffer import MaskBuffer
from neuron_constrain.structured.runtime.reasoning import ReasoningMatcher
from neuron_constrain.structured.runtime.requests import Requests
from neuron_constrain.structured.schema.limits import LimitError, Limits


class Fills:
    """Fills the rows of a step's layout (``StructuredRuntime.step``'s fills).

    Args:
        engine: the runtime's grammar engine (``engines/base.py``'s contract).
        requests: the runtime's requests (a failed fill fails one of them).
        mask: the runtime's mask buffer.
        limits: the per-token fill budget is ``limits.fill_ms``.
        stop_token_ids: the tokenizer's stop tokens (a request past its budget may end on one).
        parallel_min_rows: from this many rows on, the engine's batch fill runs them.
    """

    def __init__(self, engine, requests: Requests, mask: MaskBuffer, limits: Limits, stop_token_ids: frozenset,
                 parallel_min_rows: int):
        self.engine, self.requests, self.mask, self.limits = engine, requests, mask, limits
        self.stop_token_ids = stop_token_ids
        self.parallel_min_rows = parallel_min_rows
        self.budget_ended = 0  # requests ended with a stop token when their fill passed limits.fill_ms
        self._strikes, self._own_strikes = {}, {}  # tokens past fill_ms in a row (rows; reasoning rows)

    def run(self, plan: Layout, forced: bool) -> float:
        """Fills the layout's constrained rows, then its draft rows.

        Args:
            plan: the step's layout (``layout.py``); its fixed rows are already written.
            forced: the drafts are forced runs: row ``i`` allows exactly draft ``i``.

        Returns:
            The seconds the fills took.

        Raises:
            BatchLayoutError: a draft token past the vocabulary, or a forced token its grammar does not take
                (the caller's drafts; every other failure fails its request alone).
        """
        seconds = 0.0
        if plan.matchers:
            tick = time.perf_counter()
            failures = self._fill(plan.matchers, plan.fill_rows)
            seconds = time.perf_counter() - tick
            if failures:
                self._fill_failed(plan, failures)
        if plan.drafts:
            seconds += self._fill_drafts(plan, forced)
        return seconds

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
        # Fewer constrained rows than parallel_min_rows are filled on this thread: waking a fill thread costs
        # ~25 us each way on a 2-core VM, about what batch 8's whole fill takes (bench_host.py).
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
