"""What a logits processor is: the built-ins (their graph inputs with dtype, per-row
shape and neutral fill, kernel and order), custom ``LogitsProcessor`` subclasses, how
names resolve, and one request's parameters (``RequestParams``, what a custom
processor's ``row()`` reads). The graph core's side of the processors: the
process-logits pass and the checks import it; the host state (``processors/``) too.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
from typing import Any, Mapping, Sequence

import torch

from neuron_constrain.core.errors import Error
from neuron_constrain.kernels import (
    apply_logit_bias,
    apply_min_tokens_and_logit_bias,
    apply_min_p,
    apply_min_tokens,
    apply_penalties,
    apply_temperature,
    apply_thinking_budget,
)

PASS_NAME = "process_logits"  # the key of the pass's entry in a TransformReport
BUILTIN_PROCESSORS = ("min_tokens", "logit_bias", "penalties", "thinking_budget", "min_p")
# what speculative decoding keeps: processors that only force or forbid tokens (a draft is checked against them)
SPECULATIVE_PROCESSORS = ("min_tokens", "thinking_budget")
# the fixed per-row widths "S" / "K" / "L" of the built-in inputs: the option that sets each, and its default
WIDTH_OPTIONS = {"S": "max_stop_tokens", "K": "max_bias_tokens", "L": "max_penalty_tokens"}
DEFAULT_WIDTHS = {"max_stop_tokens": 4, "max_bias_tokens": 16, "max_penalty_tokens": 1024}
ENTRY_POINT_GROUP = "neuron_constrain.processors"


@dataclasses.dataclass(frozen=True)
class RequestParams:
    """One request's processor parameters (neutral defaults: the processor is off).

    Args:
        min_tokens: tokens the request must write before a stop token is allowed.
        stop_token_ids: the ids ``min_tokens`` keeps masked (the state adds its ``eos_token_id``).
        logit_bias: token id -> value added to its logit.
        min_p: drop tokens below ``min_p`` times the most likely one's probability (sampling).
        temperature: the row's sampling temperature.
        repetition_penalty: vLLM's repetition penalty (1.0: off); ``frequency_penalty`` and
            ``presence_penalty`` likewise (0.0: off).
        thinking_token_budget: thought tokens the request may write before the end-of-thought
            token is forced (the state's ``thinking`` markers; ``None``: no budget).
        extra: values for custom processors' ``row()``.
    """

    min_tokens: int = 0
    stop_token_ids: Sequence[int] = ()
    logit_bias: Mapping[int, float] | None = None
    min_p: float = 0.0
    temperature: float = 1.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    thinking_token_budget: int | None = None
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)


class ProcessorError(Error, ValueError):
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
        """The processor's math, traced into the graph after the mask (a subclass defines it).

        Args:
            logits: the masked logits ``[rows, V]``.
            **inputs: each key of :attr:`inputs`, a tensor ``[rows, *per-row shape]``.

        Returns:
            The processed logits, of the same shape.

        Raises:
            NotImplementedError: the subclass did not define it.
        """
        raise NotImplementedError

    def row(self, params: RequestParams) -> Mapping[str, Any] | None:
        """One request's values of the processor's inputs, on the host (a subclass defines it).

        Args:
            params: the request's parameters (its own under ``params.extra``).

        Returns:
            Key -> value for this request, or None for the neutral fills (the default: the processor is off).
        """
        return None

    def input_name(self, key: str) -> str:
        """The graph input that feeds one of :attr:`inputs`.

        Args:
            key: a key of :attr:`inputs`.

        Returns:
            ``<name>_<key>``.
        """
        return f"{self.name}_{key}"


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
    """The processors a ``processors=`` list names, in the order the graph runs them.

    Args:
        specs: built-in names, entry-point names (group ``neuron_constrain.processors``),
            ``"module:Qualname"`` strings, ``LogitsProcessor`` classes or instances.
        num_speculative_tokens: above 0, only processors that force or forbid tokens
            (``min_tokens``, ``thinking_budget``) are allowed.

    Returns:
        Built-in names (in graph order) followed by custom ``LogitsProcessor`` instances.

    Raises:
        ProcessorError: an unknown name, a definition that does not build, or a processor not
            allowed with speculative tokens.
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
        rejected = [n for n in names if n not in SPECULATIVE_PROCESSORS]
        if rejected:
            raise ProcessorError(
                f"speculative decoding (num_speculative_tokens={num_speculative_tokens}) keeps only "
                f"{', '.join(SPECULATIVE_PROCESSORS)}, but {rejected} were requested: they change the target "
                "distribution that rejection sampling compares draft tokens against. Pass "
                f"processors={list(SPECULATIVE_PROCESSORS)} (or a part) or num_speculative_tokens=0"
            )
    return [n for n in BUILTIN_PROCESSORS if n in builtins] + custom


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
    "thinking_budget_left": ("thinking_budget", torch.int32, (), 0),
    "thinking_end_id": ("thinking_budget", torch.int64, (), -1),
    "temperature": ("min_p", torch.float32, (), 1.0),
    "min_p": ("min_p", torch.float32, (), 0.0),
}


def builtin_inputs(name: str) -> list[str]:
    """The graph inputs of a built-in processor, in the order the pass adds them.

    Args:
        name: a built-in processor (``"min_tokens"``, ``"logit_bias"``, ...).

    Returns:
        Its input names; empty for a name that is not built in.
    """
    return [k for k, v in BUILTIN_INPUTS.items() if v[0] == name]


FUSED_MIN_TOKENS_LOGIT_BIAS = "min_tokens+logit_bias"

# built-in -> (kernel, its graph inputs in kernel argument order, node name prefix)
KERNELS = {
    "min_tokens": (apply_min_tokens, ["min_tokens_remaining", "min_tokens_stop_ids"], "min_tokens"),
    "logit_bias": (apply_logit_bias, ["logit_bias_ids", "logit_bias_values"], "logit_bias"),
    "penalties": (
        apply_penalties,
        ["penalty_token_ids", "penalty_token_counts", "penalty_repetition", "penalty_frequency", "penalty_presence"],
        "penalty",
    ),
    "thinking_budget": (apply_thinking_budget, ["thinking_budget_left", "thinking_end_id"], "thinking_budget"),
    "temperature": (apply_temperature, ["temperature"], "temperature"),
    "min_p": (apply_min_p, ["min_p"], "min_p"),
    # min_tokens then logit_bias, fused: one scatter-add, one copy of the logits (same values)
    FUSED_MIN_TOKENS_LOGIT_BIAS: (
        apply_min_tokens_and_logit_bias,
        ["min_tokens_remaining", "min_tokens_stop_ids", "logit_bias_ids", "logit_bias_values"],
        "min_tokens_logit_bias",
    ),
}


def fuse_adjacent(stage: list) -> list:
    """``stage`` with each ``"min_tokens", "logit_bias"`` pair run as their fused kernel."""
    out = []
    for proc in stage:
        if proc == "logit_bias" and out and out[-1] == "min_tokens":
            out[-1] = FUSED_MIN_TOKENS_LOGIT_BIAS
        else:
            out.append(proc)
    return out

DOCS = {
    "min_tokens_remaining": "tokens a row must still generate before a stop id may be sampled",
    "min_tokens_stop_ids": "stop token ids masked while min_tokens_remaining > 0, -1 padded",
    "logit_bias_ids": "token ids to bias, -1 padded",
    "logit_bias_values": "bias added to each logit_bias_ids token",
    "penalty_token_ids": "distinct tokens of the prompt and output so far, -1 padded",
    "penalty_token_counts": "times each penalty_token_ids token was generated (0: prompt only)",
    "penalty_repetition": "repetition penalty (> 0; 1 = off)",
    "penalty_frequency": "frequency penalty (0 = off)",
    "penalty_presence": "presence penalty (0 = off)",
    "thinking_budget_left": "thought tokens the row may still write before its end-of-thought token is forced",
    "thinking_end_id": "the end-of-thought token forced (+1e9) once thinking_budget_left <= 0 (-1: not in a thought)",
    "temperature": "per-row temperature before min_p (> 0; 1 = off)",
    "min_p": "min_p threshold in [0, 1] (0 = off)",
}


# ----------------------------------------------------------------------------- thoughts


@dataclasses.dataclass(frozen=True, slots=True)
class Thought:
    """Where a sequence is, thought-wise, after some tokens: ``inside`` a thought, its
    ``count`` of thought tokens so far (every token after the start marker), ``forced``:
    end-marker tokens written since the budget ran out, ``tail``: the last tokens (to
    spot a marker of several tokens)."""

    inside: bool = False
    count: int = 0
    forced: int = 0
    tail: tuple = ()


class Thinking:
    """A reasoning model's thought markers (token ids) and the thinking budget's rule.

    A thought opens at ``start`` and closes at ``end`` (each one token or several). A
    request with budget ``N`` writes at most ``N`` thought tokens: from there the next
    token of ``end`` is the only one allowed (:meth:`forced`), as vLLM's
    ``thinking_token_budget`` does; a thought that closes by itself is not forced, and a
    later thought gets the budget again. The state is a value (:class:`Thought`), so a
    draft position's state is the output's advanced by the drafts before it.

        thinking = Thinking(start=[32002], end=[32003])
        state = thinking.after(prompt)                      # the prompt may open the thought
        state = thinking.advance(state, token, budget)      # per output token
        left, end_id = thinking.row(state, budget)          # the processor's inputs

    Args:
        start: the start marker's token ids.
        end: the end marker's token ids.

    Raises:
        ProcessorError: a marker that is not a non-empty list of token ids.
    """

    def __init__(self, start: Sequence[int], end: Sequence[int]):
        for name, ids in (("start", start), ("end", end)):
            if isinstance(ids, (str, bytes)) or not len(ids) or not all(
                    isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
                raise ProcessorError(f"thinking {name}={ids!r}: pass the marker's token ids, a non-empty list of ints >= 0")
        self.start, self.end = tuple(int(t) for t in start), tuple(int(t) for t in end)
        self._keep = max(len(self.start), len(self.end))

    def __repr__(self) -> str:
        return f"Thinking(start={list(self.start)}, end={list(self.end)})"

    def __eq__(self, other) -> bool:
        return isinstance(other, Thinking) and (self.start, self.end) == (other.start, other.end)

    def __hash__(self) -> int:
        return hash((self.start, self.end))

    def after(self, prompt: Sequence[int]) -> Thought:
        """The state after a prompt: inside a thought when its last start marker comes after its last end
        marker, with the tokens after that start counted.

        Args:
            prompt: the prompt's token ids.

        Returns:
            The state the output starts from.
        """
        prompt = list(prompt)
        opened, closed = _last(prompt, self.start), _last(prompt, self.end)
        tail = tuple(prompt[-self._keep:])
        if opened > closed:
            return Thought(True, len(prompt) - opened - len(self.start), 0, tail)
        return Thought(False, 0, 0, tail)

    def advance(self, state: Thought, token: int, budget: int | None) -> Thought:
        """The state after one more token.

        Args:
            state: the state before it.
            token: the token.
            budget: the request's thinking budget, or None.

        Returns:
            The new state (the one given is unchanged).
        """
        tail = (state.tail + (token,))[-self._keep:]
        if not state.inside:
            return Thought(True, 0, 0, tail) if tail[-len(self.start):] == self.start else Thought(False, 0, 0, tail)
        if tail[-len(self.end):] == self.end:
            return Thought(False, 0, 0, tail)
        forced = state.forced
        if budget is not None and state.count >= budget and forced < len(self.end) and token == self.end[forced]:
            forced += 1
        return Thought(True, state.count + 1, forced, tail)

    def forced(self, state: Thought, budget: int | None) -> int | None:
        """The token the budget forces next.

        Args:
            state: the sequence's state.
            budget: the request's thinking budget, or None.

        Returns:
            The end marker's next token once the budget is spent inside a thought, else None.
        """
        if budget is None or not state.inside or state.count < budget:
            return None
        return self.end[min(state.forced, len(self.end) - 1)]

    def row(self, state: Thought, budget: int) -> tuple[int, int]:
        """The thinking-budget processor's inputs for a row.

        Args:
            state: the row's state.
            budget: the request's thinking budget.

        Returns:
            ``(thinking_budget_left, thinking_end_id)``: the graph forces ``end_id`` where ``left <= 0``;
            outside a thought ``(0, -1)``, neutral.
        """
        if not state.inside:
            return 0, -1
        return min(budget - state.count, 2**31 - 1), self.end[min(state.forced, len(self.end) - 1)]


def _last(tokens: list, marker: tuple) -> int:
    """Where ``marker``'s last occurrence in ``tokens`` starts (-1: none)."""
    n = len(marker)
    for at in range(len(tokens) - n, -1, -1):
        if tokens[at] == marker[0] and tuple(tokens[at:at + n]) == marker:
            return at
    return -1
