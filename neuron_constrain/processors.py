"""Logits processors: which ones exist, how custom ones load, and the host state that
feeds the graph inputs the logits-processors pass adds.

Built-ins, in graph order (see ``neuron_constrain.passes.logits_processors_pass``)::

    min_tokens   stop ids masked while a row still has to generate tokens
    logit_bias   sparse per-row token biases (fixed K ids/values per row)
    penalties    repetition / frequency / presence on the distinct tokens a row has seen
                 (prompt and output; fixed L ids per row, with output counts)
    min_p        probability-space threshold; with a per-row temperature before it
                 (sampling paths only: both are argmax-invariant)

Custom processors subclass :class:`LogitsProcessor` and are named in
``processors=[...]`` as an entry point of the ``neuron_constrain.processors`` group or
as ``"module:Qualname"``; a name that does not load, or does not name a
``LogitsProcessor``, raises :class:`ProcessorError` when the list is resolved (at
transform time and when the host state is built), never skipped.

Host state: :class:`ProcessorState` keeps every processor's per-request values in
persistent batch slots (one row per slot, shaped like the graph inputs) and applies
a :class:`BatchUpdate` in the order removed, added, moved (one-way or swap)::

    state = ProcessorState.for_model(transformed, max_num_reqs=64, eos_token_id=eos)
    state.update(BatchUpdate(batch_size=2, added=[(0, RequestParams(min_tokens=5), prompt_ids), ...]))
    tokens = transformed(ids, **state.inputs())        # fixed-shape inputs, one per graph input
    state.append_tokens(tokens)                         # output counts, min_tokens countdown

``inputs()`` returns the same dict object while nothing changed, and for a processor
no request uses it returns cached neutral tensors without touching per-slot data
(the graph still receives every input).
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import math
from typing import Any, Mapping, Sequence

import torch

__all__ = [
    "BUILTIN_PROCESSORS",
    "ENTRY_POINT_GROUP",
    "BatchUpdate",
    "LogitsProcessor",
    "ProcessorError",
    "ProcessorState",
    "RequestParams",
    "resolve_processors",
]

BUILTIN_PROCESSORS = ("min_tokens", "logit_bias", "penalties", "min_p")
ENTRY_POINT_GROUP = "neuron_constrain.processors"
MOVE, SWAP = "move", "swap"


class ProcessorError(ValueError):
    """A processor name, definition or per-request parameter is not usable."""


class LogitsProcessor:
    """A custom in-graph logits processor.

    Subclass it, set the class attributes and define ``apply`` (traced into the graph
    with the program's fake tensors: plain torch ops, no branching on values or batch
    size) and ``row`` (host side: this request's values, or ``None`` for neutral)::

        class Scale(LogitsProcessor):
            name = "scale"                                  # inputs are named scale_<key>
            argmax_invariant = False                        # True: sampling paths only
            inputs = {"factor": (torch.float32, (), 1.0)}   # key: (dtype, per-row shape, neutral fill)

            def apply(self, logits, factor):
                return logits * factor.unsqueeze(-1)

            def row(self, params):
                return {"factor": params.extra["scale"]} if "scale" in params.extra else None

    It must build with no arguments. ``apply`` with every input at its fill must
    leave the logits unchanged (what unconfigured rows and omitted inputs get).
    """

    name: str = ""
    argmax_invariant: bool = False
    inputs: Mapping[str, tuple[torch.dtype, tuple[int, ...], Any]] = {}

    def apply(self, logits: torch.Tensor, **inputs: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def row(self, params: "RequestParams") -> Mapping[str, Any] | None:
        return None


# ----------------------------------------------------------------------------- resolving names


def _load_object(spec: str):
    if ":" in spec:
        module_name, _, qualname = spec.partition(":")
        try:
            obj = importlib.import_module(module_name)
            for part in qualname.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as exc:
            raise ProcessorError(
                f"logits processor {spec!r} does not load ({type(exc).__name__}: {exc}); "
                "use 'module:Qualname' of an importable LogitsProcessor subclass"
            ) from exc
        return obj
    found = [ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.name == spec]
    if not found:
        raise ProcessorError(
            f"unknown logits processor {spec!r}: not a built-in {BUILTIN_PROCESSORS}, not an entry point of the "
            f"{ENTRY_POINT_GROUP!r} group, and not a 'module:Qualname' string"
        )
    try:
        return found[0].load()
    except Exception as exc:  # an entry point can fail in any way its module does
        raise ProcessorError(f"the {ENTRY_POINT_GROUP!r} entry point {spec!r} does not load: {exc}") from exc


def _check_custom(obj, spec) -> LogitsProcessor:
    if isinstance(obj, type) and issubclass(obj, LogitsProcessor):
        obj = obj()
    if not isinstance(obj, LogitsProcessor):
        raise ProcessorError(
            f"logits processor {spec!r} is {obj!r}, not a LogitsProcessor; subclass "
            "neuron_constrain.processors.LogitsProcessor (name, argmax_invariant, inputs, apply, row)"
        )
    if not (isinstance(obj.name, str) and obj.name.isidentifier()) or obj.name in BUILTIN_PROCESSORS:
        raise ProcessorError(
            f"logits processor {spec!r} has name {obj.name!r}; set a Python identifier that is not a built-in name"
        )
    for key, value in obj.inputs.items():
        ok = isinstance(value, tuple) and len(value) == 3 and isinstance(value[0], torch.dtype)
        if not ok or not all(isinstance(d, int) and d > 0 for d in value[1]):
            raise ProcessorError(
                f"logits processor {obj.name!r}: inputs[{key!r}] = {value!r}; use (dtype, per-row shape tuple, fill)"
            )
    return obj


def resolve_processors(specs: Sequence | None, *, num_speculative_tokens: int = 0) -> list:
    """Built-in names, entry points, ``module:Qualname`` strings, classes or instances
    -> built-in names (in graph order) followed by custom ``LogitsProcessor`` instances.
    """
    specs = list(specs or ())
    builtins, custom = [], []
    for spec in specs:
        if isinstance(spec, str) and spec in BUILTIN_PROCESSORS:
            builtins.append(spec)
            continue
        custom.append(_check_custom(_load_object(spec) if isinstance(spec, str) else spec, spec))
    names = builtins + [c.name for c in custom]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ProcessorError(f"logits processor(s) {repeated} named twice; list each once")
    if num_speculative_tokens:
        rejected = [n for n in names if n != "min_tokens"]
        if rejected:
            raise ProcessorError(
                f"speculative decoding (num_speculative_tokens={num_speculative_tokens}) keeps only min_tokens, "
                f"but {rejected} were requested: they change the target distribution that rejection sampling "
                "compares draft tokens against. Pass processors=['min_tokens'] or num_speculative_tokens=0"
            )
    return [n for n in BUILTIN_PROCESSORS if n in builtins] + custom


# ----------------------------------------------------------------------------- per-request parameters


@dataclasses.dataclass(frozen=True)
class RequestParams:
    """One request's processor parameters (neutral defaults: the processor is off).

    ``stop_token_ids``: the ids ``min_tokens`` keeps masked (the state adds its
    ``eos_token_id``). ``extra``: values for custom processors' ``row()``.
    """

    min_tokens: int = 0
    stop_token_ids: Sequence[int] = ()
    logit_bias: Mapping[int, float] | None = None
    min_p: float = 0.0
    temperature: float = 1.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)


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


# ----------------------------------------------------------------------------- host state

# input name -> (group, dtype, per-row shape key, neutral fill); "S"/"K"/"L" are sized at run time.
BUILTIN_INPUTS = {
    "min_tokens_remaining": ("min_tokens", torch.int32, (), 0),
    "min_tokens_stop_ids": ("min_tokens", torch.int64, ("S",), -1),
    "logit_bias_ids": ("logit_bias", torch.int64, ("K",), -1),
    "logit_bias_values": ("logit_bias", torch.float32, ("K",), 0.0),
    "penalty_repetition": ("penalties", torch.float32, (), 1.0),
    "penalty_frequency": ("penalties", torch.float32, (), 0.0),
    "penalty_presence": ("penalties", torch.float32, (), 0.0),
    "penalty_token_ids": ("penalties", torch.int64, ("L",), -1),
    "penalty_token_counts": ("penalties", torch.int32, ("L",), 0),
    "temperature": ("min_p", torch.float32, (), 1.0),
    "min_p": ("min_p", torch.float32, (), 0.0),
}


def builtin_inputs(name: str) -> list[str]:
    """The graph inputs of a built-in processor, in the order the pass adds them."""
    return [k for k, v in BUILTIN_INPUTS.items() if v[0] == name]


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
                    self._specs[f"{proc.name}_{key}"] = (proc.name, dtype, tuple(shape), fill)
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
        from neuron_constrain.passes.logits_processors_pass import PASS_NAME  # noqa: PLC0415 (cycle)

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
            if not rep > 0 or not (math.isfinite(freq) and math.isfinite(pres)):
                raise ProcessorError(
                    f"penalties repetition={rep}, frequency={freq}, presence={pres}: repetition must be > 0 and "
                    "the others finite (1.0 / 0.0 / 0.0 turn them off)"
                )
            if (rep, freq, pres) != (1.0, 0.0, 0.0):
                self._check_ids(list(prompt) + list(output), "prompt/output token ids")
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
            if not 0.0 <= params.min_p <= 1.0 or not params.temperature > 0:
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
                rows[proc.name] = {f"{proc.name}_{k}": v for k, v in values.items()}
        return {
            g: {k: v for k, v in r.items() if k in self._specs or k == "columns"} for g, r in rows.items() if g in self.groups
        }

    def _check_ids(self, ids: Sequence[int], what: str) -> None:
        bad = [i for i in ids if not 0 <= int(i) < self.vocab_size]
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
        if not 0 <= slot < self.max_num_reqs:
            raise ProcessorError(f"batch slot {slot} is outside [0, {self.max_num_reqs}); raise max_num_reqs")

    def update(self, batch: BatchUpdate | None) -> None:
        """Apply removed, then added, then moved; rows are rebuilt only where something changed."""
        if batch is None:
            return
        if not 0 <= batch.batch_size <= self.max_num_reqs:
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
