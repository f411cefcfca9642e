"""Reference captures from an eager model, and teacher-forced logit validation."""
from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

import torch

from neuron_constrain.core.errors import InputError
from neuron_constrain.core.tap_interface import as_taps, match_modules
from neuron_constrain.replacement.replacer import TensorReplacer
from neuron_constrain.core.tap_context import active_context


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

    Args:
        model: the eager reference model (``forward(input_ids) -> logits``).
        prompts: prompt token ids.
        taps: tap patterns, as given to ``transform``.
        max_new_tokens: greedy steps after the prompt.

    Returns:
        Per prompt, tap name -> the step tensors.

    Raises:
        InputError: the model does not return logits, or a pattern matches no module.
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
    """One compared step of :func:`logit_validation`.

    Attributes:
        prompt: the prompt's index.
        step: the step (0: the prompt's last position).
        position: the position compared.
        max_abs_error: max abs difference of the two models' logits there.
        topk_agreement: the share of the reference's top-k tokens the model also ranks top-k.
        token: the model's greedy token.
        reference_token: the reference's (decoding continues from it).
        nonfinite_mismatches: logits finite on one side and -inf/NaN on the other.
    """

    prompt: int
    step: int
    position: int
    max_abs_error: float
    topk_agreement: float
    token: int
    reference_token: int
    nonfinite_mismatches: int = 0  # logits finite on one side and -inf/NaN on the other (or NaN on both)

    @property
    def diverged(self) -> bool:
        """Whether the model's greedy token differs from the reference's."""
        return self.token != self.reference_token


@dataclasses.dataclass
class ValidationReport:
    """What :func:`logit_validation` found; ``summary()`` prints it.

    Attributes:
        steps: every compared step.
        atol: the tolerance the comparison used.
        top_k: the k of the top-k agreement.
    """

    steps: list[StepResult]
    atol: float
    top_k: int

    @property
    def max_abs_error(self) -> float:
        """The largest logit error over every step (0 with no step)."""
        return max((s.max_abs_error for s in self.steps), default=0.0)

    @property
    def divergences(self) -> list[StepResult]:
        """The steps where the greedy tokens differ."""
        return [s for s in self.steps if s.diverged]

    def first_divergence(self, prompt: int) -> int | None:
        """Where a prompt first diverged.

        Args:
            prompt: the prompt's index.

        Returns:
            Its first diverged step, or None.
        """
        return next((s.step for s in self.steps if s.prompt == prompt and s.diverged), None)

    @property
    def nonfinite_mismatches(self) -> list[StepResult]:
        """The steps with logits finite on one side and -inf/NaN on the other."""
        return [s for s in self.steps if s.nonfinite_mismatches]

    @property
    def passed(self) -> bool:
        """No divergence, no non-finite mismatch, and every logit error within ``atol``."""
        return not self.divergences and not self.nonfinite_mismatches and self.max_abs_error <= self.atol

    def summary(self) -> str:
        """The report as text.

        Returns:
            PASSED or FAILED with the steps, the largest error and the least top-k agreement, then the
            non-finite mismatches and each prompt's first divergence.
        """
        prompts = sorted({s.prompt for s in self.steps})
        lines = [
            f"logit validation {'PASSED' if self.passed else 'FAILED'}: {len(self.steps)} steps over {len(prompts)} prompt(s), "
            f"max |logit error| {self.max_abs_error:.3g} (atol {self.atol:g}), "
            f"min top-{self.top_k} agreement {min((s.topk_agreement for s in self.steps), default=1.0):.2f}"
        ]
        if self.nonfinite_mismatches:
            first = self.nonfinite_mismatches[0]
            total = sum(s.nonfinite_mismatches for s in self.nonfinite_mismatches)
            lines.append(
                f"  {total} logit(s) finite on one side and -inf/NaN on the other, in {len(self.nonfinite_mismatches)} "
                f"step(s); first: prompt {first.prompt} step {first.step} (position {first.position}), "
                f"reference token {first.reference_token}"
            )
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

    Args:
        transformed: the model under test (a tapped ``Transformed`` or any module returning logits).
        reference: the reference module.
        prompts: prompt token ids.
        max_new_tokens: steps compared per prompt after the prompt.
        replacer: feed the taps from these captures at every position.
        atol: the largest logit error that counts as agreement.
        top_k: agreement is also measured on the top ``top_k`` tokens.

    Returns:
        Per step, the max abs error, top-k agreement and both tokens (``.summary()`` prints them).

    Raises:
        InputError: a model that does not return logits, or logits of different widths.
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
            # -inf on both sides (a masked token) agrees; finite on one side only, or NaN, does not.
            same_inf = (got == want) & torch.isinf(want)
            mismatched = int((~finite & ~same_inf).sum())
            ref_token = int(want.argmax())
            results.append(
                StepResult(index, step, ids.shape[1] - 1, error, agree, int(got.argmax()), ref_token, mismatched)
            )
            ids = torch.cat([ids, torch.tensor([[ref_token]])], dim=1)
    return ValidationReport(results, atol, top_k)
