"""Host runtime for replacement taps: the active context, reference captures, and
logit validation.

A program rewritten with ``transform(..., taps=[...])`` has, per tap, a
replacement input and a per-row enable flag. ``Transformed`` fills them on every
call from the *active context*::

    set_active_context({"model.layers.0.mlp.router": ref})     # every row replaced
    set_active_context(replacer.build_context(req_ids, positions, is_prefill))  # per-row
    out = transformed(ids)
    set_active_context(None)                                    # taps off (zeros, enable False)

A context maps tap names (module paths as ``named_modules()`` spells them, plus
``:N`` when a selector was used) to a tensor, or to ``(values, enabled)`` where
``values`` is ``[rows, features]`` over the flattened leading dims of the tapped
value and ``enabled`` is ``bool[rows]``. Tensors are reshaped to the graph's layout,
cast to its dtype and moved to its device.

:class:`TensorReplacer` turns step-wise reference captures (from :func:`capture`
or any other reference) into those contexts for prefill, batched decode and
speculative decode; :func:`logit_validation` compares a transformed model's logits
with a reference, teacher-forced, retrying with the reference token on divergence.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Iterable, Mapping, Sequence

import torch

from neuron_constrain.errors import InputError
from neuron_constrain.passes.replacement_tap_pass import as_taps, match_modules

__all__ = [
    "set_active_context",
    "get_replacement_tensor",
    "active_context",
    "recording_captures",
    "TensorReplacer",
    "capture",
    "logit_validation",
    "ValidationReport",
]

Entry = tuple[torch.Tensor, "torch.Tensor | None"]
_active: dict[str, Entry] | None = None
_recorders: list[list[dict[str, torch.Tensor]]] = []


def _entries(ctx: Mapping | None) -> dict[str, Entry] | None:
    if ctx is None:
        return None
    if not isinstance(ctx, Mapping):
        raise InputError(f"a replacement context is a mapping of tap name -> tensor, got {type(ctx).__name__}")
    entries = {}
    for name, item in ctx.items():
        values, enabled = item if isinstance(item, tuple) else (item, None)
        if not isinstance(values, torch.Tensor) or not (enabled is None or isinstance(enabled, torch.Tensor)):
            raise InputError(f"replacement for {name!r} must be a tensor or (tensor, bool tensor), got {item!r:.80}")
        entries[name] = (values, enabled)
    return entries


def set_active_context(ctx: Mapping | None) -> None:
    """Make ``ctx`` (tap name -> tensor or (values, enabled)) the replacements of every
    later call; ``None`` turns all taps off."""
    global _active
    _active = _entries(ctx)


def get_replacement_tensor(name: str) -> torch.Tensor | None:
    """The active replacement values for tap ``name``, or None."""
    entry = (_active or {}).get(name)
    return None if entry is None else entry[0]


def active_replacement(name: str) -> Entry | None:
    return (_active or {}).get(name)


@contextlib.contextmanager
def active_context(ctx: Mapping | None):
    """``set_active_context(ctx)`` for the ``with`` block, restoring the previous one after."""
    global _active
    previous = _active
    set_active_context(ctx)
    try:
        yield
    finally:
        _active = previous


@contextlib.contextmanager
def recording_captures():
    """Collect, per call of a ``Transformed`` model, the values its capture taps computed."""
    calls: list[dict[str, torch.Tensor]] = []
    _recorders.append(calls)
    try:
        yield calls
    finally:
        _recorders.remove(calls)


def record_captures(values: dict[str, torch.Tensor]) -> None:
    for calls in _recorders:
        calls.append(values)


def tap_input(name: str, shape: tuple, dtype: torch.dtype, device, role: str) -> torch.Tensor | None:
    """The active context's tensor for one tap input, in the graph's layout (None: not set)."""
    entry = active_replacement(name)
    if entry is None:
        return None
    values, enabled = entry
    if role == "enabled":
        rows = shape
        if enabled is None:
            return torch.ones(rows, dtype=torch.bool).to(device)
        if enabled.numel() != math.prod(rows):
            raise InputError(f"the enable flags for tap {name!r} have {enabled.numel()} rows; the graph has {math.prod(rows)} {tuple(rows)}")
        return enabled.reshape(rows).to(device=device, dtype=torch.bool)
    if values.numel() != math.prod(shape):
        raise InputError(
            f"the replacement for tap {name!r} has shape {tuple(values.shape)} ({values.numel()} values) but the "
            f"tapped value is {tuple(shape)}: give [rows, features] for exactly these inputs' rows"
        )
    return values.reshape(shape).to(device=device, dtype=dtype)


# ----------------------------------------------------------------------------- reference captures

class TensorReplacer:
    """Reference captures indexed by prompt and position, turned into tap contexts.

    ``reference_captures[i][tap]`` is the list of step tensors of prompt ``i``: step 0
    (prefill) covers the prompt's positions, each later step contributes its last
    row (a full recompute or a one-token decode step alike). They are flattened to
    ``[positions, features]`` once, here.
    """

    def __init__(self, reference_captures: Sequence[Mapping[str, Sequence[torch.Tensor]]], prompt_token_ids: Sequence[Sequence[int]]):
        if len(reference_captures) != len(prompt_token_ids):
            raise InputError(
                f"{len(reference_captures)} captures but {len(prompt_token_ids)} prompts: one capture dict per prompt"
            )
        self.prompts = [tuple(int(t) for t in p) for p in prompt_token_ids]
        self.taps = sorted({name for c in reference_captures for name in c})
        self.flat: list[dict[str, torch.Tensor]] = [
            {name: _flatten_steps(name, steps, len(prompt)) for name, steps in captures.items()}
            for captures, prompt in zip(reference_captures, self.prompts)
        ]
        self.features = {}
        for flat in self.flat:
            for name, rows in flat.items():
                if self.features.setdefault(name, rows.shape[1]) != rows.shape[1]:
                    raise InputError(f"tap {name!r} has {rows.shape[1]} features in one prompt and {self.features[name]} in another")
        self._by_length: dict[int, dict[int, list[int]]] = {}
        for index, prompt in enumerate(self.prompts):
            self._by_length.setdefault(len(prompt), {}).setdefault(hash(prompt), []).append(index)
        self._requests: dict[str, int] = {}

    def register_request(self, req_id: str, tokens: Sequence[int]) -> int:
        """Map ``req_id`` to the stored prompt that is the longest prefix of ``tokens``.

        Every stored length is tried (hash, then the tokens themselves are compared),
        so a request extending prompt 0 with generated tokens still maps to prompt 0.
        Known corner case: if those generated tokens happen to spell out a longer
        stored prompt, the longer prompt wins.
        """
        tokens = tuple(int(t) for t in tokens)
        best, best_length = None, -1
        for length, by_hash in self._by_length.items():
            if length > len(tokens) or length <= best_length:
                continue
            prefix = tokens[:length]
            for index in by_hash.get(hash(prefix), ()):
                if self.prompts[index] == prefix:
                    best, best_length = index, length
                    break
        if best is None:
            raise InputError(
                f"request {req_id!r} ({len(tokens)} tokens) starts with none of the {len(self.prompts)} captured prompts"
            )
        self._requests[req_id] = best
        return best

    def prompt_index(self, req_id: str) -> int:
        if req_id not in self._requests:
            raise InputError(f"request {req_id!r} is not registered: call register_request(req_id, tokens) at its prefill")
        return self._requests[req_id]

    def build_context(
        self,
        req_ids: Sequence[str],
        positions: Sequence[int] | torch.Tensor,
        is_prefill: bool = False,
        tokens_per_req: int = 1,
        device: torch.device | str = "cpu",
    ) -> dict[str, Entry]:
        """Tap inputs for one forward pass over ``len(positions)`` token slots.

        Slot ``s`` belongs to request ``s // tokens_per_req`` (speculative decode:
        1 + drafts slots per request). A prefill with one request owns every slot
        and, as in the scheduler's layout, the first repeated position marks where
        padding starts. Slots past the requests, negative positions and positions
        past a capture are not enabled: the model keeps its own value there.
        """
        positions = [int(p) for p in (positions.tolist() if isinstance(positions, torch.Tensor) else positions)]
        if tokens_per_req < 1:
            raise InputError(f"tokens_per_req={tokens_per_req}: use 1 + the number of draft tokens")
        per_request = len(positions) if is_prefill and len(req_ids) == 1 else tokens_per_req
        prompts = [self.prompt_index(r) for r in req_ids]
        rows: list[tuple[int, int, int]] = []  # (slot, prompt, position)
        seen: dict[int, set[int]] = {}  # prefill: positions of each request so far
        padded: set[int] = set()        # prefill: requests whose padding has started
        for slot, position in enumerate(positions):
            request = slot // per_request
            if request >= len(req_ids) or position < 0 or request in padded:
                continue
            if is_prefill:
                if position in seen.setdefault(request, set()):
                    padded.add(request)
                    continue
                seen[request].add(position)
            rows.append((slot, prompts[request], position))
        context = {}
        for name in self.taps:
            values = torch.zeros(len(positions), self.features[name], dtype=self._dtype(name))
            enabled = torch.zeros(len(positions), dtype=torch.bool)
            for slot, prompt, position in rows:
                flat = self.flat[prompt].get(name)
                if flat is not None and position < flat.shape[0]:
                    values[slot] = flat[position]
                    enabled[slot] = True
            context[name] = (values.to(device), enabled.to(device))
        return context

    def warmup_context(self, num_tokens: int, device: torch.device | str = "cpu") -> dict[str, Entry]:
        """Zeros with every slot disabled: the shapes of a real context, nothing replaced."""
        return {
            name: (torch.zeros(num_tokens, self.features[name], dtype=self._dtype(name), device=device),
                   torch.zeros(num_tokens, dtype=torch.bool, device=device))
            for name in self.taps
        }

    def _dtype(self, name: str) -> torch.dtype:
        return next(f[name].dtype for f in self.flat if name in f)


def _flatten_steps(name: str, steps: Sequence[torch.Tensor], prompt_length: int) -> torch.Tensor:
    if not steps:
        raise InputError(f"tap {name!r} has no captured steps")
    first = steps[0]
    if prompt_length == 0 or first.numel() % prompt_length:
        raise InputError(
            f"step 0 of tap {name!r} has shape {tuple(first.shape)}, which is not {prompt_length} prompt positions"
        )
    features = first.numel() // prompt_length
    rows = [first.reshape(prompt_length, features)]
    for step in steps[1:]:
        if step.numel() % features:
            raise InputError(f"a decode step of tap {name!r} has shape {tuple(step.shape)}, not rows of {features}")
        rows.append(step.reshape(-1, features)[-1:])
    return torch.cat(rows).detach()


# ----------------------------------------------------------------------------- capture and validation

def _last_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """The last position's logits row of ``model`` on ``ids`` ([1, S])."""
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=False) if hasattr(model, "config") else model(ids)
    logits = getattr(out, "logits", out)
    if isinstance(logits, (tuple, list)):
        logits = logits[0]
    if not isinstance(logits, torch.Tensor) or logits.dim() < 2:
        raise InputError(f"the model must return logits ([1, S, V] or [1, V]); got {type(logits).__name__}")
    return logits[0, -1] if logits.dim() == 3 else logits[0]


def capture(model: torch.nn.Module, prompts: Sequence[Sequence[int]], taps: Iterable, max_new_tokens: int = 0) -> list[dict[str, list[torch.Tensor]]]:
    """Reference captures from an eager model: ``[{tap name: [step tensors]}]`` per prompt.

    Greedy decoding by full recompute: step 0 is the prompt, each of the
    ``max_new_tokens`` later steps appends the token picked before, so the captures
    cover positions ``[0, len(prompt) + max_new_tokens)``. ``taps`` are the patterns
    given to ``transform`` (``Tap`` or ``"path"`` / ``"path:N"``); names match the
    tap names of the transformed model when ``model`` is built like it.
    """
    modules = dict(model.named_modules())
    hooks, current = [], {}
    try:
        for tap in as_taps(taps):
            for path in match_modules(tap.module_pattern, modules):
                name = path if tap.selector is None else f"{path}:{tap.selector}"

                def record(module, args, output, name=name, index=tap.selector or 0):
                    value = output[index] if isinstance(output, (tuple, list)) else output
                    current[name] = value.detach().clone()

                hooks.append(modules[path].register_forward_hook(record))
        captures = []
        for prompt in prompts:
            ids = torch.tensor([list(prompt)], dtype=torch.long)
            steps: dict[str, list[torch.Tensor]] = {}
            for _ in range(1 + max_new_tokens):
                current.clear()
                token = _last_logits(model, ids).argmax()
                for name, value in current.items():
                    steps.setdefault(name, []).append(value)
                ids = torch.cat([ids, token.view(1, 1)], dim=1)
            captures.append(steps)
        return captures
    finally:
        for hook in hooks:
            hook.remove()


@dataclasses.dataclass
class StepResult:
    prompt: int
    step: int
    position: int
    max_abs_error: float
    topk_agreement: float
    token: int
    reference_token: int

    @property
    def diverged(self) -> bool:
        return self.token != self.reference_token


@dataclasses.dataclass
class ValidationReport:
    steps: list[StepResult]
    atol: float
    top_k: int

    @property
    def max_abs_error(self) -> float:
        return max((s.max_abs_error for s in self.steps), default=0.0)

    @property
    def divergences(self) -> list[StepResult]:
        return [s for s in self.steps if s.diverged]

    def first_divergence(self, prompt: int) -> int | None:
        return next((s.step for s in self.steps if s.prompt == prompt and s.diverged), None)

    @property
    def passed(self) -> bool:
        return not self.divergences and self.max_abs_error <= self.atol

    def summary(self) -> str:
        prompts = sorted({s.prompt for s in self.steps})
        lines = [
            f"logit validation {'PASSED' if self.passed else 'FAILED'}: {len(self.steps)} steps over {len(prompts)} prompt(s), "
            f"max |logit error| {self.max_abs_error:.3g} (atol {self.atol:g}), "
            f"min top-{self.top_k} agreement {min((s.topk_agreement for s in self.steps), default=1.0):.2f}"
        ]
        for p in prompts:
            step = self.first_divergence(p)
            if step is not None:
                s = next(x for x in self.steps if x.prompt == p and x.step == step)
                lines.append(f"  prompt {p}: diverged at step {step} (position {s.position}): "
                             f"picked {s.token}, reference {s.reference_token}; continued with the reference token")
        return "\n".join(lines)


def logit_validation(
    transformed: torch.nn.Module,
    reference: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int = 8,
    *,
    replacer: TensorReplacer | None = None,
    atol: float = 1e-3,
    top_k: int = 5,
) -> ValidationReport:
    """Teacher-forced comparison of ``transformed``'s last-position logits with ``reference``'s.

    Each step runs both on the same tokens (full recompute, batch 1) and then appends
    the *reference* token: when the transformed model picks another token that is
    recorded as a divergence and decoding continues from the reference's choice (the
    retry), so later steps still compare like with like. With a ``replacer`` each
    step is registered as a new request (longest-prefix matched to its prompt) and
    its taps are fed from the captures at every position. ``transformed`` must
    return logits ([1, S, V] or [1, V]); so must ``reference`` (an eager model, e.g.
    the same model in float64).
    """
    results = []
    for index, prompt in enumerate(prompts):
        ids = torch.tensor([list(prompt)], dtype=torch.long)
        for step in range(max_new_tokens):
            context = None
            if replacer is not None:
                req_id = f"validation-{index}-{step}"
                replacer.register_request(req_id, ids[0].tolist())
                context = replacer.build_context([req_id], range(ids.shape[1]), is_prefill=True)
            with active_context(context):
                got = _last_logits(transformed, ids).double()
            want = _last_logits(reference, ids).double()
            if got.shape != want.shape:
                raise InputError(f"the models' logits differ in width: {got.shape[-1]} vs reference {want.shape[-1]}")
            k = min(top_k, want.numel())
            agree = len(set(got.topk(k).indices.tolist()) & set(want.topk(k).indices.tolist())) / k
            finite = torch.isfinite(want) & torch.isfinite(got)
            error = float((got - want)[finite].abs().max()) if bool(finite.any()) else 0.0
            ref_token = int(want.argmax())
            results.append(StepResult(index, step, ids.shape[1] - 1, error, agree, int(got.argmax()), ref_token))
            ids = torch.cat([ids, torch.tensor([[ref_token]])], dim=1)
    return ValidationReport(results, atol, top_k)
