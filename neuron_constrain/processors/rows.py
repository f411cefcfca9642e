"""The one writer of processor rows: what each head row's request asks of the inputs the
process-logits pass added, written for a whole batch at once.

    inputs = ProcessorInputs.from_report(transformed.report["process_logits"])   # names, widths
    request = RequestRows(inputs, min_tokens=5, stop_ids=[2], prompt=ids)       # once per request
    used = write_rows(views, inputs, requests, req=req, pos=pos, outputs=outputs, dirty=dirty)

Row ``r`` is request ``req[r]`` at draft position ``pos[r]`` (0 without speculation):
min_tokens counts the drafts before it (``remaining = max(min_tokens - done - pos, 0)``),
penalties see the output plus those drafts (``drafts_of[i][:pos]``), as vLLM's rejection
sampler does, and the thinking budget counts the thought the drafts before it extend
(``Thinking.advance`` over them: a draft may close or open a thought). ``views`` are numpy arrays sharing memory with the program's inputs; a
group's rows are reset to neutral only when some row used it last time (``dirty``).
:class:`~neuron_constrain.processors.ProcessorState` and the vLLM worker both write
through here.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import numpy as np
import torch

from neuron_constrain.core.processor_interface import (
    BUILTIN_INPUTS,
    BUILTIN_PROCESSORS,
    DEFAULT_WIDTHS,
    WIDTH_OPTIONS,
    Thinking,
    Thought,
    builtin_inputs,
)

__all__ = ["ProcessorInputs", "RequestRows", "write_rows"]


@dataclasses.dataclass(frozen=True)
class ProcessorInputs:
    """One description of a program's processor inputs: name -> (group, dtype, per-row
    shape, neutral fill), in the order the pass added them."""

    specs: Mapping[str, tuple]

    @classmethod
    def from_report(cls, report, processors: Sequence | None = None) -> "ProcessorInputs":
        """The inputs a process-logits pass ``report`` lists, with the widths the program has;
        ``processors``: the resolved list given to ``transform()`` (default: the built-ins
        whose inputs the report lists)."""
        added = {info.name: info for info in report.inputs_added}
        widths = dict(DEFAULT_WIDTHS)
        for key, option in WIDTH_OPTIONS.items():
            name = next((n for n, spec in BUILTIN_INPUTS.items() if spec[2] == (key,) and n in added), None)
            if name is not None:
                widths[option] = int(added[name].shape[-1])
        if processors is None:
            processors = [p for p in BUILTIN_PROCESSORS if any(n in added for n in builtin_inputs(p))]
        return cls.for_processors(processors, widths).only(list(added))

    @classmethod
    def for_processors(cls, processors: Sequence, widths: Mapping[str, int]) -> "ProcessorInputs":
        """The inputs of resolved ``processors`` (built-in names, custom instances) with
        ``widths`` the options ``max_stop_tokens`` / ``max_bias_tokens`` / ``max_penalty_tokens``."""
        sizes = {key: widths[option] for key, option in WIDTH_OPTIONS.items()}
        specs = {}
        for proc in processors:
            if isinstance(proc, str):
                for name in builtin_inputs(proc):
                    group, dtype, shape, fill = BUILTIN_INPUTS[name]
                    specs[name] = (group, dtype, tuple(sizes[d] for d in shape), fill)
            else:
                for key, (dtype, shape, fill) in proc.inputs.items():
                    specs[proc.input_name(key)] = (proc.name, dtype, tuple(shape), fill)
        return cls(specs)

    def only(self, names: Sequence[str]) -> "ProcessorInputs":
        return ProcessorInputs({k: v for k, v in self.specs.items() if k in names})

    def width(self, name: str) -> int:
        return self.specs[name][2][0]

    @property
    def groups(self) -> set[str]:
        return {group for group, *_ in self.specs.values()}

    def names_of(self, group: str) -> list[str]:
        return [name for name, (g, *_) in self.specs.items() if g == group]


class RequestRows:
    """What one request's parameters give its rows (fixed per request, computed once).

    ``custom``: custom processors' values, group -> {input name: value}. ``thinking``
    and ``thinking_budget``: the model's thought markers and this request's budget (both
    or neither).
    """

    __slots__ = ("min_tokens", "stops", "bias_ids", "bias_values", "min_p", "temperature", "penalties",
                 "prompt_unique", "custom", "thinking", "thinking_budget", "_seen", "_thought", "_thought_start")

    def __init__(self, *, min_tokens: int = 0, stop_ids: Sequence[int] = (), logit_bias: Mapping | None = None,
                 min_p: float = 0.0, temperature: float = 1.0, penalties: tuple = (1.0, 0.0, 0.0),
                 prompt: Sequence[int] = (), custom: Mapping[str, Mapping] | None = None,
                 thinking: Thinking | None = None, thinking_budget: int | None = None):
        self.min_tokens = int(min_tokens or 0)
        self.stops = np.asarray(list(stop_ids), dtype=np.int64) if self.min_tokens and len(stop_ids) else None
        self.bias_ids = self.bias_values = None
        if logit_bias:
            self.bias_ids = np.asarray([int(t) for t in logit_bias], dtype=np.int64)
            self.bias_values = np.asarray([float(v) for v in logit_bias.values()], dtype=np.float32)
        self.min_p, self.temperature = float(min_p or 0.0), float(temperature)
        self.penalties = tuple(float(p) for p in penalties) if tuple(penalties) != (1.0, 0.0, 0.0) else None
        self.prompt_unique = np.unique(np.asarray(list(prompt), dtype=np.int64))
        self.custom = dict(custom or {})
        self.thinking = thinking if thinking_budget is not None else None
        self.thinking_budget = thinking_budget if thinking is not None else None
        # thinking budget: (output list, tokens scanned, state), advanced as the output grows
        self._thought_start = None if self.thinking is None else self.thinking.after(prompt)
        self._thought = (None, 0, self._thought_start)
        self._seen = None  # penalties: (output list, tokens counted, ids, counts), updated as the output grows

    def seen(self, output: Sequence[int], width: int) -> tuple[np.ndarray, np.ndarray]:
        """The distinct tokens of the prompt and ``output`` (at most ``width``, ascending) and
        how often ``output`` holds each; counted incrementally while ``output`` only grows."""
        output = output or ()
        cached = self._seen
        if cached is not None and cached[0] is output and cached[1] <= len(output):
            _, counted, ids, counts = cached
            new = output[counted:]
            if not new:
                return ids, counts
            if all(t >= 0 for t in new):
                ids, counts = ids.copy(), counts.copy()
                for token in new:
                    at = int(np.searchsorted(ids, token))
                    if at == len(ids) or ids[at] != token:
                        if len(ids) == width:
                            break  # past the width: recount as the full path truncates
                        ids, counts = np.insert(ids, at, token), np.insert(counts, at, 0)
                    counts[at] += 1
                else:
                    self._seen = (output, len(output), ids, counts)
                    return ids, counts
        ids, counts = _seen_tokens(self.prompt_unique, np.asarray(output, dtype=np.int64), width)
        # cached only when every counted token is final (vLLM's async output holds -1 placeholders a while)
        complete = len(ids) < width and all(t >= 0 for t in output)
        self._seen = (output, len(output), ids, counts) if complete else None
        return ids, counts


    def thought(self, output: Sequence[int], drafts: Sequence[int] = ()) -> Thought:
        """Where the request's thought is after ``output`` and then ``drafts``; the output's
        state is kept and advanced while ``output`` only grows (vLLM's async output holds -1
        placeholders a while: a state is kept only up to the first of them)."""
        output = output or ()
        thinking, budget = self.thinking, self.thinking_budget
        cached_output, scanned, state = self._thought
        if cached_output is not output or scanned > len(output):
            scanned, state = 0, self._thought_start
        for token in output[scanned:]:
            if token < 0:
                break
            state = thinking.advance(state, int(token), budget)
            scanned += 1
        self._thought = (output, scanned, state)
        for token in drafts:
            state = thinking.advance(state, int(token), budget)
        return state


def _seen_tokens(prompt_unique: np.ndarray, seen: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    seen = seen[seen >= 0]
    if not len(seen):
        return prompt_unique[:width], np.zeros(min(len(prompt_unique), width), dtype=np.int32)
    out_ids, out_counts = np.unique(seen, return_counts=True)
    ids = np.union1d(prompt_unique, out_ids)[:width]
    counts = np.zeros(len(ids), dtype=np.int32)
    counts[np.searchsorted(ids, out_ids).clip(max=len(ids) - 1)] = out_counts
    return ids, counts


NEUTRAL = RequestRows()


def _reset(views, inputs: ProcessorInputs, group: str) -> None:
    for name in inputs.names_of(group):
        if name in views:
            views[name][:] = inputs.specs[name][3]


def write_rows(views: Mapping[str, np.ndarray], inputs: ProcessorInputs, requests: Sequence[RequestRows], *,
               req: np.ndarray, pos: np.ndarray, outputs: Sequence[Sequence[int]], dirty: set,
               drafts_of: Sequence[np.ndarray] | None = None) -> set[str]:
    """Write the rows ``0 .. len(req) - 1`` of every processor input in ``views`` (rows past
    them neutral); return the groups some row uses. ``outputs[i]``: request ``i``'s output
    tokens so far; ``dirty``: the groups whose rows are not neutral now (kept up to date)."""
    groups = inputs.groups
    done = np.asarray([len(o or ()) for o in outputs], dtype=np.int64)
    min_tokens = np.asarray([r.min_tokens if r.stops is not None else 0 for r in requests], dtype=np.int64)
    rows = np.arange(len(req))
    used: dict[str, np.ndarray] = {}
    if "min_tokens" in groups:
        used["min_tokens"] = rows[done[req] < min_tokens[req]] if len(rows) else rows
    if "logit_bias" in groups:
        used["logit_bias"] = rows[[requests[i].bias_ids is not None for i in req]] if len(rows) else rows
    if "min_p" in groups:
        used["min_p"] = rows[[bool(requests[i].min_p) or requests[i].temperature != 1.0 for i in req]] if len(rows) else rows
    if "penalties" in groups:
        used["penalties"] = rows[[requests[i].penalties is not None for i in req]] if len(rows) else rows
    if "thinking_budget" in groups:
        used["thinking_budget"] = rows[[requests[i].thinking is not None for i in req]] if len(rows) else rows
    for group in groups - set(BUILTIN_PROCESSORS):
        used[group] = rows[[group in requests[i].custom for i in req]] if len(rows) else rows
    for group, at in used.items():
        if not len(at) and group not in dirty:
            continue  # neutral already: no per-row work
        _reset(views, inputs, group)
        (dirty.add if len(at) else dirty.discard)(group)
        if len(at):
            _write(views, group, requests, at, req, pos, done, outputs, drafts_of)
    return {group for group, at in used.items() if len(at)}


def _write(views, group: str, requests, at: np.ndarray, req, pos, done, outputs, drafts_of) -> None:
    owners = req[at]
    if group == "min_tokens":
        wanted = np.asarray([requests[i].min_tokens for i in owners], dtype=np.int64)
        views["min_tokens_remaining"][at] = np.maximum(wanted - done[owners] - pos[at], 0)
        for r, i in zip(at, owners):
            views["min_tokens_stop_ids"][r, : len(requests[i].stops)] = requests[i].stops
    elif group == "logit_bias":
        for r, i in zip(at, owners):
            request = requests[i]
            views["logit_bias_ids"][r, : len(request.bias_ids)] = request.bias_ids
            views["logit_bias_values"][r, : len(request.bias_ids)] = request.bias_values
    elif group == "min_p":
        views["min_p"][at] = [requests[i].min_p for i in owners]
        if "temperature" in views:
            views["temperature"][at] = [requests[i].temperature for i in owners]
    elif group == "penalties":
        # repetition over prompt + output, frequency / presence over the output (and the drafts before this row)
        scalars = np.asarray([requests[i].penalties for i in owners], dtype=np.float32)
        views["penalty_repetition"][at], views["penalty_frequency"][at], views["penalty_presence"][at] = scalars.T
        width = views["penalty_token_ids"].shape[1]
        for r, i in zip(at, owners):
            if pos[r]:
                seen = np.concatenate([np.asarray(outputs[i] or (), dtype=np.int64), drafts_of[i][: pos[r]]])
                ids, counts = _seen_tokens(requests[i].prompt_unique, seen, width)
            else:
                ids, counts = requests[i].seen(outputs[i], width)
            views["penalty_token_ids"][r, : len(ids)] = ids
            views["penalty_token_counts"][r, : len(ids)] = counts
    elif group == "thinking_budget":
        left, end_id = views["thinking_budget_left"], views["thinking_end_id"]
        for r, i in zip(at, owners):
            request = requests[i]
            if drafts_of is not None or not pos[r]:
                state = request.thought(outputs[i], drafts_of[i][: pos[r]] if pos[r] else ())
            else:  # draft tokens not given: each position before this row counts as a thought token
                state = request.thought(outputs[i])
                state = dataclasses.replace(state, count=state.count + int(pos[r])) if state.inside else state
            left[r], end_id[r] = request.thinking.row(state, request.thinking_budget)
    else:  # a custom processor's inputs
        for r, i in zip(at, owners):
            for name, value in requests[i].custom[group].items():
                view = views[name]
                view[r] = torch.as_tensor(value, dtype=view.dtype) if isinstance(view, torch.Tensor) else value
