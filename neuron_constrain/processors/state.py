"""Host state for the logits-processors pass: batch updates and the per-slot tensors
fed to the graph inputs the pass added (per-request parameters: ``params.py``)."""
from __future__ import annotations

import dataclasses
import math
import operator
from typing import Sequence

import torch

from neuron_constrain.processors.params import RequestParams
from neuron_constrain.processors.registry import (
    BUILTIN_INPUTS,
    BUILTIN_PROCESSORS,
    PASS_NAME,
    ProcessorError,
    builtin_inputs,
    resolve_processors,
)

MOVE, SWAP = "move", "swap"


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
    """Changes to the persistent batch since the last step, applied in this order:
    ``removed`` slots, ``added`` ``(slot, params, prompt_token_ids[, output_token_ids])``
    (a slot may be reused), ``moved`` ``(a, b, "move" | "swap")`` — "move": b takes
    a's request and a is emptied; "swap": they exchange. ``batch_size``: the rows the
    graph gets (slots ``0 .. batch_size - 1``).
    """

    batch_size: int
    removed: Sequence[int] = ()
    added: Sequence[tuple] = ()
    moved: Sequence[tuple[int, int, str]] = ()


class ProcessorState:
    """Per-slot processor state for a persistent batch; see the module docstring.

    ``vocab_size``: token ids must lie below it. ``max_stop_tokens`` /
    ``max_bias_tokens`` / ``max_penalty_tokens``: the graph's fixed S / K / L (a
    request that needs more raises, naming the option). ``input_names``: the inputs
    the graph takes (default: all of the listed processors'); the pass leaves out
    min_p and temperature when every site is greedy, and temperature on paths that
    scale their logits themselves, so :meth:`for_model` reads them from the program.
    """

    def __init__(
        self,
        max_num_reqs: int,
        *,
        vocab_size: int,
        processors: Sequence | None = BUILTIN_PROCESSORS,
        max_stop_tokens: int = 4,
        max_bias_tokens: int = 16,
        max_penalty_tokens: int = 1024,
        num_speculative_tokens: int = 0,
        eos_token_id: int | None = None,
        input_names: Sequence[str] | None = None,
    ):
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.spec_rows = 1 + num_speculative_tokens
        self.eos_token_id = eos_token_id
        self.processors = resolve_processors(processors, num_speculative_tokens=num_speculative_tokens)
        sizes = {"S": max_stop_tokens, "K": max_bias_tokens, "L": max_penalty_tokens}
        # name -> (group, dtype, per-row shape, fill)
        self._specs: dict[str, tuple] = {}
        for proc in self.processors:
            if isinstance(proc, str):
                for name in builtin_inputs(proc):
                    group, dtype, shape, fill = BUILTIN_INPUTS[name]
                    self._specs[name] = (group, dtype, tuple(sizes[d] for d in shape), fill)
            else:
                for key, (dtype, shape, fill) in proc.inputs.items():
                    self._specs[proc.input_name(key)] = (proc.name, dtype, tuple(shape), fill)
        if input_names is not None:
            unknown = sorted(set(input_names) - set(self._specs))
            if unknown:
                raise ProcessorError(
                    f"the graph takes processor inputs {unknown} that processors={self._names()} do not feed; "
                    "pass the processors list given to transform()"
                )
            self._specs = {k: v for k, v in self._specs.items() if k in input_names}
        self.storage = {
            name: torch.full((max_num_reqs, *shape), fill, dtype=dtype) for name, (_, dtype, shape, fill) in self._specs.items()
        }
        self.groups = {g for g, *_ in self._specs.values()}
        self.uses: dict[str, set[int]] = {g: set() for g in self.groups}  # group -> slots with non-neutral rows
        self.requests: list[RequestParams | None] = [None] * max_num_reqs
        # penalties: per slot, token id -> its column in penalty_token_ids / _counts
        self.columns: list[dict[int, int]] = [{} for _ in range(max_num_reqs)]
        self.batch_size = 0
        self._cache: dict[str, torch.Tensor] | None = None
        self._neutral: dict[tuple[str, int], torch.Tensor] = {}

    @classmethod
    def for_model(cls, model, max_num_reqs: int, *, processors: Sequence | None = None, **options) -> "ProcessorState":
        """State for a ``Transformed`` model: input names, vocab_size and S/K/L read from its report."""
        if PASS_NAME not in model.report.passes:
            raise ProcessorError("the model was transformed without processors; pass processors=[...] to transform()")
        report = model.report.passes[PASS_NAME]
        added = {i.name: i for i in report.inputs_added}
        options.setdefault("vocab_size", report.sites[0]["vocab_size"])
        if "min_tokens_stop_ids" in added:
            options.setdefault("max_stop_tokens", int(added["min_tokens_stop_ids"].shape[-1]))
        if "logit_bias_ids" in added:
            options.setdefault("max_bias_tokens", int(added["logit_bias_ids"].shape[-1]))
        if "penalty_token_ids" in added:
            options.setdefault("max_penalty_tokens", int(added["penalty_token_ids"].shape[-1]))
        if processors is None:
            processors = [p for p in BUILTIN_PROCESSORS if any(n in added for n in builtin_inputs(p))]
        return cls(max_num_reqs, processors=processors, input_names=list(added), **options)

    def _names(self) -> list[str]:
        return [p if isinstance(p, str) else p.name for p in self.processors]

    # ------------------------------------------------------------------ per-request rows
    def _rows(self, params: RequestParams, prompt: Sequence[int], output: Sequence[int]) -> dict[str, dict]:
        """group -> {input name: row value} for the groups this request uses (non-neutral)."""
        self._check_params(params, prompt, output)
        rows: dict[str, dict] = {}
        if "min_tokens" in self.groups and params.min_tokens > len(output):
            stops = list(dict.fromkeys([*params.stop_token_ids, *([self.eos_token_id] if self.eos_token_id is not None else [])]))
            limit = self._specs["min_tokens_stop_ids"][2][0]
            if len(stops) > limit:
                raise ProcessorError(
                    f"a request has {len(stops)} stop ids (EOS included) but the graph holds max_stop_tokens={limit}; "
                    f"transform with max_stop_tokens>={len(stops)}"
                )
            self._check_ids(stops, "stop_token_ids")
            if stops:
                rows["min_tokens"] = {
                    "min_tokens_remaining": params.min_tokens - len(output),
                    "min_tokens_stop_ids": stops + [-1] * (limit - len(stops)),
                }
        if "logit_bias" in self.groups and params.logit_bias:
            limit = self._specs["logit_bias_ids"][2][0]
            if len(params.logit_bias) > limit:
                raise ProcessorError(
                    f"a request biases {len(params.logit_bias)} tokens but the graph holds max_bias_tokens={limit}; "
                    f"transform with max_bias_tokens>={len(params.logit_bias)}"
                )
            ids = [int(i) for i in params.logit_bias]
            self._check_ids(ids, "logit_bias")
            values = [float(v) for v in params.logit_bias.values()]
            if any(math.isnan(v) or v == math.inf for v in values):
                raise ProcessorError(f"logit_bias values {values} include NaN or +inf; use finite values or -inf to ban")
            pad = limit - len(ids)
            rows["logit_bias"] = {"logit_bias_ids": ids + [-1] * pad, "logit_bias_values": values + [0.0] * pad}
        if "penalties" in self.groups:
            rep, freq, pres = params.repetition_penalty, params.frequency_penalty, params.presence_penalty
            if (rep, freq, pres) != (1.0, 0.0, 0.0):
                columns = {int(t): i for i, t in enumerate(dict.fromkeys([*prompt, *output]))}
                limit = self._specs["penalty_token_ids"][2][0]
                if len(columns) > limit:
                    raise ProcessorError(
                        f"a request has seen {len(columns)} distinct tokens but the graph holds max_penalty_tokens={limit}; "
                        f"transform with max_penalty_tokens>={len(columns)} (prompt + max output length)"
                    )
                counts = [0] * limit
                for token in output:
                    counts[columns[int(token)]] += 1
                rows["penalties"] = {
                    "penalty_repetition": rep,
                    "penalty_frequency": freq,
                    "penalty_presence": pres,
                    "penalty_token_ids": list(columns) + [-1] * (limit - len(columns)),
                    "penalty_token_counts": counts,
                    "columns": columns,
                }
        if "min_p" in self.groups:
            if not params.temperature > 0:  # a sampling graph divides by it
                raise ProcessorError(
                    f"min_p={params.min_p}, temperature={params.temperature}: min_p must be in [0, 1] and temperature > 0 "
                    "(greedy requests use a greedy graph; min_p and temperature do not change an argmax)"
                )
            row = {"min_p": params.min_p, "temperature": params.temperature}
            row = {k: v for k, v in row.items() if k in self._specs}
            if params.min_p or params.temperature != 1.0:
                rows["min_p"] = row
        for proc in self.processors:
            if isinstance(proc, str):
                continue
            values = proc.row(params)
            if values:
                rows[proc.name] = {proc.input_name(k): v for k, v in values.items()}
        return {
            g: {k: v for k, v in r.items() if k in self._specs or k == "columns"} for g, r in rows.items() if g in self.groups
        }

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
        self.requests[slot] = None
        self.columns[slot] = {}
        for group, slots in self.uses.items():
            if slot in slots:
                slots.discard(slot)
                for name, (g, _, _, fill) in self._specs.items():
                    if g == group:
                        self.storage[name][slot] = fill
                self._cache = None

    def _check_slot(self, slot: int) -> None:
        if not _is_index(slot):
            raise ProcessorError(f"batch slot {slot!r} is not an index: use an int in [0, {self.max_num_reqs})")
        if not 0 <= slot < self.max_num_reqs:
            raise ProcessorError(f"batch slot {slot} is outside [0, {self.max_num_reqs}); raise max_num_reqs")

    def update(self, batch: BatchUpdate | None) -> None:
        """Apply removed, then added, then moved; rows are rebuilt only where something changed."""
        if batch is None:
            return
        if not _is_index(batch.batch_size) or not 0 <= batch.batch_size <= self.max_num_reqs:
            raise ProcessorError(f"batch_size={batch.batch_size} is outside [0, {self.max_num_reqs}]")
        for slot in batch.removed:
            self._check_slot(slot)
            self._clear(slot)
        for slot, params, prompt, *rest in batch.added:
            self._check_slot(slot)
            rows = self._rows(params, prompt, rest[0] if rest else ())  # validate before touching the slot
            self._clear(slot)
            self.requests[slot] = params
            for group, values in rows.items():
                for name, value in values.items():
                    if name == "columns":
                        self.columns[slot] = value
                        continue
                    self.storage[name][slot] = torch.as_tensor(value, dtype=self._specs[name][1])
                self.uses[group].add(slot)
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
        self.requests[a], self.requests[b] = (self.requests[b] if swap else None), self.requests[a]
        self.columns[a], self.columns[b] = (self.columns[b] if swap else {}), self.columns[a]
        for group, slots in self.uses.items():
            in_a, in_b = a in slots, b in slots
            if not (in_a or in_b):
                continue
            for name, (g, _, _, fill) in self._specs.items():
                if g != group:
                    continue
                store = self.storage[name]
                row_a = store[a].clone()
                store[a] = store[b] if swap else fill
                store[b] = row_a
            slots.discard(a)
            slots.discard(b)
            if in_a:
                slots.add(b)
            if in_b and swap:
                slots.add(a)
            self._cache = None

    def append_tokens(self, tokens) -> None:
        """Count the tokens just sampled: ``tokens[row]`` an int (or a list of accepted
        tokens with speculative decoding) for each row ``< batch_size``."""
        rows = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
        if len(rows) != self.batch_size:
            raise ProcessorError(f"append_tokens got {len(rows)} rows but the batch has {self.batch_size}")
        self._check_ids([t for row in rows for t in (row if isinstance(row, list) else [row])], "sampled tokens")
        for slot in sorted(self.uses.get("min_tokens", ())):
            if slot >= self.batch_size:
                continue
            accepted = rows[slot] if isinstance(rows[slot], list) else [rows[slot]]
            remaining = self.storage["min_tokens_remaining"]
            left = int(remaining[slot]) - len(accepted)
            if left <= 0:
                self._clear_group(slot, "min_tokens")
            else:
                remaining[slot] = left
            self._cache = None
        for slot in sorted(self.uses.get("penalties", ())):
            if slot >= self.batch_size:
                continue
            accepted = rows[slot] if isinstance(rows[slot], list) else [rows[slot]]
            self._check_ids(accepted, "sampled tokens")
            columns = self.columns[slot]
            ids, counts = self.storage["penalty_token_ids"][slot], self.storage["penalty_token_counts"][slot]
            for token in accepted:
                if token not in columns:
                    if len(columns) == ids.shape[0]:
                        raise ProcessorError(
                            f"the request in slot {slot} has seen more than max_penalty_tokens={ids.shape[0]} "
                            "distinct tokens; transform with a larger max_penalty_tokens (prompt + max output length)"
                        )
                    columns[token] = len(columns)
                    ids[columns[token]] = token
                counts[columns[token]] += 1
            self._cache = None

    def _clear_group(self, slot: int, group: str) -> None:
        self.uses[group].discard(slot)
        for name, (g, _, _, fill) in self._specs.items():
            if g == group:
                self.storage[name][slot] = fill

    # ------------------------------------------------------------------ graph inputs
    def inputs(self) -> dict[str, torch.Tensor]:
        """Every processor input of the graph for the current batch (keyword arguments).

        The same dict object while nothing changed. Tensors are views of the state's
        storage or cached neutral tensors: read them, do not write them, and do not
        keep them across :meth:`update` / :meth:`append_tokens`.
        """
        if self._cache is not None:
            return self._cache
        rows = self.batch_size
        out = {}
        for name, (group, dtype, shape, fill) in self._specs.items():
            if not any(s < rows for s in self.uses[group]):  # nobody uses it: neutral, no per-slot work
                key = (name, rows)
                if key not in self._neutral:
                    self._neutral[key] = torch.full((rows * self.spec_rows, *shape), fill, dtype=dtype)
                out[name] = self._neutral[key]
            elif self.spec_rows == 1:
                out[name] = self.storage[name][:rows]
            else:  # one row per request and draft position (only min_tokens runs with drafts)
                value = self.storage[name][:rows].repeat_interleave(self.spec_rows, 0)
                if name == "min_tokens_remaining":
                    offset = torch.arange(self.spec_rows, dtype=value.dtype).repeat(rows)
                    value = (value - offset).clamp(min=0)
                out[name] = value
        self._cache = out
        return out
