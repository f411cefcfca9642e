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

from neuron_constrain.errors import Error
from neuron_constrain.kernels import (
    apply_logit_bias,
    apply_min_tokens_and_logit_bias,
    apply_min_p,
    apply_min_tokens,
    apply_penalties,
    apply_temperature,
)

PASS_NAME = "process_logits"  # the key of the pass's entry in a TransformReport
BUILTIN_PROCESSORS = ("min_tokens", "logit_bias", "penalties", "min_p")
# the fixed per-row widths "S" / "K" / "L" of the built-in inputs: the option that sets each, and its default
WIDTH_OPTIONS = {"S": "max_stop_tokens", "K": "max_bias_tokens", "L": "max_penalty_tokens"}
DEFAULT_WIDTHS = {"max_stop_tokens": 4, "max_bias_tokens": 16, "max_penalty_tokens": 1024}
ENTRY_POINT_GROUP = "neuron_constrain.processors"


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
        raise NotImplementedError

    def row(self, params: RequestParams) -> Mapping[str, Any] | None:
        return None

    def input_name(self, key: str) -> str:
        """The graph input that feeds ``inputs[key]``: ``<name>_<key>``."""
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
    "temperature": "per-row temperature before min_p (> 0; 1 = off)",
    "min_p": "min_p threshold in [0, 1] (0 = off)",
}
