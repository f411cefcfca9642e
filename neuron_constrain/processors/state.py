"""Host state for the process-logits pass: batch updates and the per-slot requests whose
rows feed the graph inputs the pass added (what a processor is and a request's
parameters: ``neuron_constrain/core/processor_interface.py``; the rows themselves:
``rows.py``, the one writer of processor rows)."""
from __future__ import annotations

import dataclasses
import math
import operator
from typing import Sequence

import numpy as np
import torch

from neuron_constrain.core.processor_interface import (
    BUILTIN_PROCESSORS,
    DEFAULT_WIDTHS,
    PASS_NAME,
    ProcessorError,
    RequestParams,
    Thinking,
    resolve_processors,
)
from neuron_constrain.processors.rows import NEUTRAL, ProcessorInputs, RequestRows, write_rows

MOVE = "move"  # BatchUpdate.moved: (a, b, MOVE), b takes a's request and a is emptied
SWAP = "swap"  # BatchUpdate.moved: (a, b, SWAP), a and b exchange their requests


def _is_index(value) -> bool:
    """An integer (Python, NumPy or a 0-d integer tensor), not a bool or a float."""
    if isinstance(value, bool):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


@dataclasses.dataclass(frozen=True)
class BatchUpdate:
    """Changes to the persistent batch since the last step, applied in the order of the fields.

    Args:
        batch_size: the rows the graph gets (slots ``0 .. batch_size - 1``).
        removed: slots whose requests left.
        added: ``(slot, params, prompt_token_ids[, output_token_ids])`` per new request (a slot
            may be reused); ``params`` a :class:`RequestParams`.
        moved: ``(a, b, "move" | "swap")``: ``"move"``, b takes a's request and a is emptied;
            ``"swap"``, they exchange.
    """

    batch_size: int
    removed: Sequence[int] = ()
    added: Sequence[tuple] = ()
    moved: Sequence[tuple[int, int, str]] = ()


class ProcessorState:
    """Per-slot processor state for a persistent batch; see the module docstring.

    Build it with :meth:`for_model`, which reads the widths and input names from the program.

    Args:
        max_num_reqs: slots of the persistent batch.
        vocab_size: token ids must lie below it.
        processors: the processors the graph runs (as given to ``transform``).
        max_stop_tokens: the graph's fixed per-row width S of stop ids (a request that needs
            more raises, naming the option).
        max_bias_tokens: its width K of logit_bias entries.
        max_penalty_tokens: its width L of the distinct tokens penalties see.
        num_speculative_tokens: draft tokens per request: each slot has ``1 + k`` rows.
        eos_token_id: a stop id every min_tokens row masks beside the request's own.
        input_names: the inputs the graph takes (default: all of the listed processors'); the
            pass leaves out min_p and temperature when every site is greedy.
        inputs: the inputs' description read from the program's report (:meth:`for_model` passes
            it); default: built from ``processors`` and the widths.
        thinking: the model's thought markers (:class:`Thinking`), which a request's
            ``thinking_token_budget`` counts against.

    Raises:
        ProcessorError: an unknown processor, ``input_names`` the processors do not feed, or
            ``thinking`` that is not a :class:`Thinking`; later, a request whose parameters do
            not fit (named, with the option to raise).
    """

    def __init__(
        self,
        max_num_reqs: int,
        *,
        vocab_size: int,
        processors: Sequence | None = BUILTIN_PROCESSORS,
        max_stop_tokens: int = DEFAULT_WIDTHS["max_stop_tokens"],
        max_bias_tokens: int = DEFAULT_WIDTHS["max_bias_tokens"],
        max_penalty_tokens: int = DEFAULT_WIDTHS["max_penalty_tokens"],
        num_speculative_tokens: int = 0,
        eos_token_id: int | None = None,
        input_names: Sequence[str] | None = None,
        inputs: ProcessorInputs | None = None,
        thinking: Thinking | None = None,
    ):
        self.max_num_reqs = max_num_reqs
        if thinking is not None and not isinstance(thinking, Thinking):
            raise ProcessorError(f"thinking={thinking!r}: pass a Thinking(start=[ids], end=[ids]) or None")
        self.thinking = thinking
        self.vocab_size = vocab_size
        self.spec_rows = 1 + num_speculative_tokens
        self.eos_token_id = eos_token_id
        self.processors = resolve_processors(processors, num_speculative_tokens=num_speculative_tokens)
        widths = {"max_stop_tokens": max_stop_tokens, "max_bias_tokens": max_bias_tokens,
                  "max_penalty_tokens": max_penalty_tokens}
        self.inputs_of = inputs or ProcessorInputs.for_processors(self.processors, widths)
        if input_names is not None:
            unknown = sorted(set(input_names) - set(self.inputs_of.specs))
            if unknown:
                raise ProcessorError(
                    f"the graph takes processor inputs {unknown} that processors={self._names()} do not feed; "
                    "pass the processors list given to transform()"
                )
            self.inputs_of = self.inputs_of.only(input_names)
        specs = self.inputs_of.specs
        # the rows write_rows fills: one per slot and draft position
        self.storage = {name: torch.full((max_num_reqs * self.spec_rows, *shape), fill, dtype=dtype)
                        for name, (_, dtype, shape, fill) in specs.items()}
        self._views = {name: t.numpy() if t.dtype != torch.bfloat16 else t for name, t in self.storage.items()}
        self.groups = self.inputs_of.groups
        self._dirty: set[str] = set()  # groups whose stored rows are not neutral
        self.requests: list[RequestParams | None] = [None] * max_num_reqs
        self.rows: list[RequestRows] = [NEUTRAL] * max_num_reqs
        self.outputs: list[list[int]] = [[] for _ in range(max_num_reqs)]
        self.seen: list[set[int] | None] = [None] * max_num_reqs  # penalties: distinct tokens of prompt + output
        self.batch_size = 0
        self._cache: dict[str, torch.Tensor] | None = None
        self._neutral: dict[tuple[str, int], torch.Tensor] = {}

    @classmethod
    def for_model(cls, model, max_num_reqs: int, *, processors: Sequence | None = None, **options) -> "ProcessorState":
        """State for a ``Transformed`` model: input names, vocab_size and S/K/L read from its report.

        Args:
            model: the program ``transform(..., processors=[...])`` returned.
            max_num_reqs: slots of the persistent batch.
            processors: the processors, when they are not the report's.
            **options: other keywords of the constructor (``eos_token_id``, ``thinking``...).

        Returns:
            The state; feed ``state.inputs()`` to every call of ``model``.

        Raises:
            ProcessorError: the model was transformed without processors.
        """
        if PASS_NAME not in model.report.passes:
            raise ProcessorError("the model was transformed without processors; pass processors=[...] to transform()")
        report = model.report.passes[PASS_NAME]
        options.setdefault("vocab_size", report.sites[0]["vocab_size"])
        resolved = None if processors is None else resolve_processors(
            processors, num_speculative_tokens=options.get("num_speculative_tokens", 0))
        inputs = ProcessorInputs.from_report(report, resolved)
        if processors is None:
            processors = [p for p in BUILTIN_PROCESSORS if p in inputs.groups]
        for key, name in (("max_stop_tokens", "min_tokens_stop_ids"), ("max_bias_tokens", "logit_bias_ids"),
                          ("max_penalty_tokens", "penalty_token_ids")):
            if name in inputs.specs:
                options.setdefault(key, inputs.width(name))
        return cls(max_num_reqs, processors=processors, input_names=[i.name for i in report.inputs_added],
                   inputs=inputs, **options)

    def _names(self) -> list[str]:
        return [p if isinstance(p, str) else p.name for p in self.processors]

    # ------------------------------------------------------------------ per-request rows
    def _rows(self, params: RequestParams, prompt: Sequence[int], output: Sequence[int]) -> RequestRows:
        """What this request gives its rows, after checking it fits the graph's widths."""
        self._check_params(params, prompt, output)
        specs = self.inputs_of.specs
        stops = []
        if "min_tokens" in self.groups and params.min_tokens > len(output):
            stops = list(dict.fromkeys([*params.stop_token_ids, *([self.eos_token_id] if self.eos_token_id is not None else [])]))
            limit = self.inputs_of.width("min_tokens_stop_ids")
            if len(stops) > limit:
                raise ProcessorError(
                    f"a request has {len(stops)} stop ids (EOS included) but the graph holds max_stop_tokens={limit}; "
                    f"transform with max_stop_tokens>={len(stops)}"
                )
            self._check_ids(stops, "stop_token_ids")
        bias = params.logit_bias if "logit_bias" in self.groups else None
        if bias:
            limit = self.inputs_of.width("logit_bias_ids")
            if len(bias) > limit:
                raise ProcessorError(
                    f"a request biases {len(bias)} tokens but the graph holds max_bias_tokens={limit}; "
                    f"transform with max_bias_tokens>={len(bias)}"
                )
        penalties = (params.repetition_penalty, params.frequency_penalty, params.presence_penalty)
        if "penalties" not in self.groups:
            penalties = (1.0, 0.0, 0.0)
        elif penalties != (1.0, 0.0, 0.0):
            distinct = len(set(map(int, prompt)) | set(map(int, output)))
            limit = self.inputs_of.width("penalty_token_ids")
            if distinct > limit:
                raise ProcessorError(
                    f"a request has seen {distinct} distinct tokens but the graph holds max_penalty_tokens={limit}; "
                    f"transform with max_penalty_tokens>={distinct} (prompt + max output length)"
                )
        min_p, temperature = 0.0, 1.0
        if "min_p" in self.groups:
            if not params.temperature > 0:  # a sampling graph divides by it
                raise ProcessorError(
                    f"min_p={params.min_p}, temperature={params.temperature}: min_p must be in [0, 1] and temperature > 0 "
                    "(greedy requests use a greedy graph; min_p and temperature do not change an argmax)"
                )
            min_p = params.min_p
            temperature = params.temperature if "temperature" in specs else 1.0
        budget = params.thinking_token_budget
        if budget is not None and "thinking_budget" not in self.groups:
            raise ProcessorError(
                f"thinking_token_budget={budget}: the graph has no thinking_budget processor; transform with "
                "processors=[..., 'thinking_budget'] or drop the budget"
            )
        custom = {}
        for proc in self.processors:
            if not isinstance(proc, str) and proc.name in self.groups:
                values = proc.row(params)
                if values:
                    custom[proc.name] = {n: v for k, v in values.items() if (n := proc.input_name(k)) in specs}
        return RequestRows(min_tokens=params.min_tokens, stop_ids=stops, logit_bias=bias, min_p=min_p,
                           temperature=temperature, penalties=penalties, prompt=prompt, custom=custom,
                           thinking=self.thinking, thinking_budget=budget)

    def _check_params(self, params: RequestParams, prompt: Sequence[int], output: Sequence[int]) -> None:
        """Every documented constraint, whichever processors the graph has: a value the
        graph does not read is still refused rather than silently taken."""
        if not isinstance(params, RequestParams):
            raise ProcessorError(f"an added request takes a RequestParams, got {type(params).__name__}")
        if not _is_index(params.min_tokens) or params.min_tokens < 0:
            raise ProcessorError(f"min_tokens={params.min_tokens!r}: use an int >= 0 (0 turns it off)")
        self._check_ids(params.stop_token_ids, "stop_token_ids")
        if params.logit_bias:
            self._check_ids(list(params.logit_bias), "logit_bias")
            values = list(params.logit_bias.values())
            if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
                raise ProcessorError(f"logit_bias values {values} must be numbers (a float per token id)")
            if any(math.isnan(v) or v == math.inf for v in values):
                raise ProcessorError(f"logit_bias values {values} include NaN or +inf; use finite values or -inf to ban")
        rep, freq, pres = params.repetition_penalty, params.frequency_penalty, params.presence_penalty
        if not 0 < rep < math.inf or not (math.isfinite(freq) and math.isfinite(pres)):
            raise ProcessorError(
                f"penalties repetition={rep}, frequency={freq}, presence={pres}: repetition must be > 0 and finite, "
                "the others finite (1.0 / 0.0 / 0.0 turn them off)"
            )
        budget = params.thinking_token_budget
        if budget is not None and (not _is_index(budget) or budget < 0):
            raise ProcessorError(f"thinking_token_budget={budget!r}: use an int >= 0 (None: no budget)")
        if budget is not None and self.thinking is None:
            raise ProcessorError(
                f"thinking_token_budget={budget}: the state knows no thought markers; build it with "
                "thinking=Thinking(start=[ids], end=[ids]) (the model's <think> and </think> token ids)"
            )
        if not 0.0 <= params.min_p <= 1.0 or not 0 <= params.temperature < math.inf:
            raise ProcessorError(
                f"min_p={params.min_p}, temperature={params.temperature}: min_p must be in [0, 1] and temperature > 0 "
                "and finite (a greedy graph also takes 0: min_p and temperature do not change an argmax)"
            )
        self._check_ids(list(prompt) + list(output), "prompt/output token ids")

    def _check_ids(self, ids: Sequence[int], what: str) -> None:
        bad = [i for i in ids if not _is_index(i) or not 0 <= operator.index(i) < self.vocab_size]
        if bad:
            raise ProcessorError(f"{what} has ids {bad} outside the vocabulary [0, {self.vocab_size})")

    # ------------------------------------------------------------------ batch updates
    def _clear(self, slot: int) -> None:
        if self.requests[slot] is not None or self.rows[slot] is not NEUTRAL:
            self._cache = None
        self.requests[slot], self.rows[slot], self.outputs[slot], self.seen[slot] = None, NEUTRAL, [], None

    def _check_slot(self, slot: int) -> None:
        if not _is_index(slot):
            raise ProcessorError(f"batch slot {slot!r} is not an index: use an int in [0, {self.max_num_reqs})")
        if not 0 <= slot < self.max_num_reqs:
            raise ProcessorError(f"batch slot {slot} is outside [0, {self.max_num_reqs}); raise max_num_reqs")

    def update(self, batch: BatchUpdate | None) -> None:
        """Apply a batch's changes: removed, then added, then moved slots.

        The rows are rewritten only when something changed.

        Args:
            batch: the changes since the last step, or ``None`` for none.

        Raises:
            ProcessorError: a slot outside the batch, a ``batch_size`` past ``max_num_reqs``, an
                unknown move kind, or an added request's parameters out of range.
        """
        if batch is None:
            return
        if not _is_index(batch.batch_size) or not 0 <= batch.batch_size <= self.max_num_reqs:
            raise ProcessorError(f"batch_size={batch.batch_size} is outside [0, {self.max_num_reqs}]")
        for slot in batch.removed:
            self._check_slot(slot)
            self._clear(slot)
        for slot, params, prompt, *rest in batch.added:
            self._check_slot(slot)
            output = list(rest[0]) if rest else []
            rows = self._rows(params, prompt, output)  # validate before touching the slot
            self._clear(slot)
            self.requests[slot], self.rows[slot], self.outputs[slot] = params, rows, output
            if rows.penalties is not None:
                self.seen[slot] = set(map(int, prompt)) | set(map(int, output))
            self._cache = None
        for a, b, kind in batch.moved:
            self._check_slot(a)
            self._check_slot(b)
            if kind not in (MOVE, SWAP):
                raise ProcessorError(f"move kind {kind!r}: use {MOVE!r} (a -> b, a emptied) or {SWAP!r}")
            self._move(a, b, kind == SWAP)
        if batch.batch_size != self.batch_size:
            self.batch_size = batch.batch_size
            self._cache = None

    def _move(self, a: int, b: int, swap: bool) -> None:
        if self.requests[a] is None and self.requests[b] is None:
            return
        for slots in (self.requests, self.rows, self.outputs, self.seen):
            slots[a], slots[b] = slots[b], slots[a]
        if not swap:
            self._clear(a)
        self._cache = None

    def append_tokens(self, tokens) -> None:
        """Count the tokens just sampled (output counts, min_tokens countdown, thought budgets).

        Args:
            tokens: per row ``< batch_size``, the token (or, with speculative decoding, the list
                of accepted tokens).

        Raises:
            ProcessorError: not one entry per row of the batch, or a token outside the vocabulary.
        """
        rows = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
        if len(rows) != self.batch_size:
            raise ProcessorError(f"append_tokens got {len(rows)} rows but the batch has {self.batch_size}")
        self._check_ids([t for row in rows for t in (row if isinstance(row, list) else [row])], "sampled tokens")
        for slot, row in enumerate(rows):
            request = self.rows[slot]
            counting = request.stops is not None and len(self.outputs[slot]) < request.min_tokens
            if not counting and request.penalties is None and request.thinking is None:
                continue  # nothing of this request's rows depends on its output
            accepted = row if isinstance(row, list) else [row]
            seen = self.seen[slot]
            if seen is not None:
                limit = self.inputs_of.width("penalty_token_ids")
                seen.update(int(t) for t in accepted)
                if len(seen) > limit:
                    raise ProcessorError(
                        f"the request in slot {slot} has seen more than max_penalty_tokens={limit} "
                        "distinct tokens; transform with a larger max_penalty_tokens (prompt + max output length)"
                    )
            self.outputs[slot].extend(int(t) for t in accepted)
            self._cache = None

    # ------------------------------------------------------------------ graph inputs
    def inputs(self) -> dict[str, torch.Tensor]:
        """Every processor input of the graph for the current batch.

        Returns:
            Keyword arguments for the program: the same dict object while nothing changed. The
            tensors are views of the state's storage or cached neutral tensors: read them, do not
            write them, and do not keep them across :meth:`update` / :meth:`append_tokens`.
        """
        if self._cache is not None:
            return self._cache
        n, spec = self.batch_size, self.spec_rows
        rows = n * spec
        used = write_rows(self._views, self.inputs_of, self.rows[:n], req=np.repeat(np.arange(n), spec),
                          pos=np.tile(np.arange(spec), n), outputs=self.outputs[:n], dirty=self._dirty)
        out = {}
        for name, (group, dtype, shape, fill) in self.inputs_of.specs.items():
            if group in used:
                out[name] = self.storage[name][:rows]
                continue
            key = (name, rows)  # nobody uses it: a shared neutral tensor
            if key not in self._neutral:
                self._neutral[key] = torch.full((rows, *shape), fill, dtype=dtype)
            out[name] = self._neutral[key]
        self._cache = out
        return out
