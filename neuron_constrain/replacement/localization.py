"""Find the first module whose numerics diverge from a reference, using the taps.

    report = localize(LogitsStep(device_model), LogitsStep(reference), prompts)
    report.culprit        # "model.model.layers.3", or None when nothing diverges
    print(report.summary())

One tapped program answers every question. Each tapped module (default: every
decoder layer's output plus the MoE routers) gets ``Tap(path, capture=True)``; the
taps are ordered as the graph computes them, ``m_0 .. m_{n-1}``. Pass ``k`` runs the
program with the taps of ``m_0 .. m_{k-1}`` fed the reference and the rest off:

    pass k:  capture of m_k  -> local error of m_k (everything upstream is the reference)
             logits          -> propagated error of m_{k-1} (taps on up to it, off after)
    alone i: only m_i's tap on -> does replacing m_i alone restore the logits?

so ``n`` modules cost ``2n + 1`` forward passes, whatever the number of prompts and
positions. Positions are batched: every prompt, teacher-forced with the reference's
greedy continuation (``prompt + max_new_tokens`` tokens), runs in one call, laid out
like a speculative-decode verify step (request ``r`` owns slots ``[r * S, (r + 1) * S)``,
``TensorReplacer.build_context(..., tokens_per_req=S)``; padding slots keep the
model's own values). Causal attention makes the logits at each position those of a
step on the prefix, so this is ``logit_validation``'s loop in one call: the input is
always the reference token (the divergence retry), and a step diverges when the
model's argmax is not the reference's. The culprit is the first module whose local
error exceeds ``atol``; switching taps never re-exports or recompiles.

The reference is an eager module (captured here by :func:`reference_captures`) or
captures already made by it (e.g. loaded from disk): ``[{tap name: [step tensors]}]``
per prompt in :func:`capture`'s layout plus their logits under ``"logits"``.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import torch

from neuron_constrain.core.errors import InputError
from neuron_constrain.passes.tap_modules_pass import report_from_program
from neuron_constrain.core.tap_interface import CAPTURE_PREFIX, Tap, as_taps, match_modules
from neuron_constrain.core.program import user_input_names
from neuron_constrain.replacement.localization_report import LocalizationReport, LocalizationRow, LogitsError
from neuron_constrain.replacement.replacer import TensorReplacer
from neuron_constrain.replacement.validation import capture
from neuron_constrain.core.report import TransformReport
from neuron_constrain.core.tap_context import active_context, recording_captures
from neuron_constrain.core.transform import Transformed, transform

LOGITS = "logits"  # the captures' entry for the reference's logits
LAYERS = "model.layers.*"


# ----------------------------------------------------------------------------- references

def default_taps(model: torch.nn.Module) -> list[str]:
    """Every decoder layer's output, plus each MoE router (a module whose class name
    says Router: GPT-OSS ``mlp.router``, Mixtral ``mlp.gate``)."""
    names = [name for name, _ in model.named_modules()]
    layers = set(match_modules(LAYERS, names))
    routers = [
        name for name, module in model.named_modules()
        if "Router" in type(module).__name__ and any(name.startswith(layer + ".") for layer in layers)
    ]
    return [LAYERS] + routers


def _logits_of(out) -> torch.Tensor:
    logits = getattr(out, "logits", out)
    if isinstance(logits, (tuple, list)):
        logits = logits[0]
    if not isinstance(logits, torch.Tensor):
        raise InputError(f"the model must return logits, got {type(logits).__name__}")
    return logits


def reference_captures(
    reference: torch.nn.Module, prompts: Sequence[Sequence[int]], taps, max_new_tokens: int = 8
) -> list[dict[str, list[torch.Tensor]]]:
    """:func:`capture` (greedy, full recompute) plus each step's logits under ``"logits"``.

    What :func:`localize` needs from a reference, and what to save for the CLI.

    Args:
        reference: the reference model (``forward(input_ids) -> logits``).
        prompts: prompt token ids.
        taps: tap patterns.
        max_new_tokens: greedy steps after each prompt.

    Returns:
        Per prompt, tap name (and ``"logits"``) -> the step tensors.
    """
    calls: list[torch.Tensor] = []

    def record(module, args, out):
        calls.append(_logits_of(out).detach().clone())

    hook = reference.register_forward_hook(record)
    try:
        captures = capture(reference, prompts, taps, max_new_tokens)
    finally:
        hook.remove()
    steps = 1 + max_new_tokens
    for index, prompt in enumerate(prompts):
        mine = calls[index * steps:(index + 1) * steps]
        # step 0: every prompt position; later steps: the new position (the replacer's layout)
        later = [c.reshape(-1, c.shape[-1])[-1:] for c in mine[1:]]
        captures[index][LOGITS] = [mine[0].reshape(len(prompt), -1)] + later
    return captures


# ----------------------------------------------------------------------------- the device program

def _tapped_program(model, taps, example: torch.Tensor):
    """(Transformed, tap names in graph order) for ``model``: a ``Transformed`` with
    capture taps, or a module to export and tap once."""
    if not isinstance(model, Transformed):
        if not isinstance(model, torch.nn.Module) or hasattr(model, "_orig_mod"):
            raise InputError(
                f"localize needs a module (forward(input_ids) -> logits) or a Transformed, got {type(model).__name__}; "
                "to run compiled, compile the Transformed's graph: t.graph_module = torch.compile(t.graph_module)"
            )
        patterns = default_taps(model) if taps is None else list(taps)
        transformed = transform(model, (example,), logit_mask=None, taps=[_capturing(t) for t in as_taps(patterns)])
        return transformed, _graph_order(transformed)
    order = _graph_order(model)
    if not order:
        raise InputError("the Transformed model has no taps: transform it with taps=[Tap(pattern, capture=True), ...]")
    captured = {o[len(CAPTURE_PREFIX):] for p in model.report.passes.values() for o in p.outputs_added
                if o.startswith(CAPTURE_PREFIX)}
    if taps is not None:
        chosen = {path for t in as_taps(taps) for path in match_modules(t.pattern, order)}
        order = [name for name in order if name in chosen]
    missing = [name for name in order if name not in captured]
    if missing:
        raise InputError(
            f"taps {missing} do not return their computed values, which the local error needs; "
            "transform with Tap(pattern, capture=True) for every tapped module"
        )
    return model, order


def _batch_shape(transformed, rows: int, width: int) -> tuple[int, int]:
    """The input_ids shape to run: ours, or the program's static sizes (padded up to)."""
    spec = transformed._user_specs[0] if transformed._user_specs else None
    node = next((n for n in transformed.program.graph.nodes if spec is not None and n.name == spec.arg.name), None)
    val = node.meta.get("val") if node is not None else None
    if not isinstance(val, torch.Tensor) or val.dim() != 2:
        raise InputError("localize runs programs whose first input is input_ids [batch, seq]")
    shape = [d if isinstance(d, int) else need for d, need in zip(val.shape, (rows, width))]
    if shape[0] < rows or shape[1] < width:
        raise InputError(
            f"the program takes input_ids of static shape {tuple(val.shape)} but these {rows} prompts with their "
            f"continuations need ({rows}, {width}); export with dynamic batch and sequence dims, "
            "or use fewer or shorter prompts"
        )
    return shape[0], shape[1]


def load_tapped(program, names: Sequence[str]):
    """A ``Transformed`` for a saved program (whose report was not saved with it).

    A program with tap inputs (``transform(..., taps=[Tap(p, capture=True)])`` then
    saved) gets the report the tap pass reads back from it
    (:func:`~neuron_constrain.passes.tap_modules_pass.report_from_program`), its
    taps named by ``names`` (the captures' tap names); a program without taps gets the
    tap pass now, with capture taps on ``names``.
    """
    report = report_from_program(program, names)
    if report is None:
        return transform(program, logit_mask=None, taps=[Tap(n, capture=True) for n in names])
    added = {i.name for i in report.inputs_added}
    others = [n for n in user_input_names(program)[1:] if n not in added]
    if others:
        raise InputError(f"the program has inputs {others} besides input_ids and its taps; localize runs "
                         "programs rewritten with taps only (transform(..., logit_mask=None, taps=[...]))")
    unfed = sorted(i.name for i in report.inputs_added if i.tap is None)
    if unfed:
        raise InputError(f"the program has tap inputs {unfed} that localize cannot feed (e.g. sequence_parallel's "
                         "tap_rank); localize one rank's program tapped without sequence_parallel")
    return Transformed(program, TransformReport(passes={report.name: report}))


def _capturing(tap: Tap) -> Tap:
    return dataclasses.replace(tap, capture=True)


def _graph_order(transformed) -> list[str]:
    """Tap names in the order the graph computes the tapped values."""
    report = transformed.report.passes.get("tap_modules")
    if report is None:
        return []
    position = {node.name: i for i, node in enumerate(transformed.program.graph.nodes)}
    sites = sorted(report.sites, key=lambda s: position.get(s["node"], len(position)))
    return [s["tap"] for s in sites]


def _device(transformed) -> torch.device:
    tensor = next(iter(transformed.program.state_dict.values()), None)
    return tensor.device if isinstance(tensor, torch.Tensor) else torch.device("cpu")


# ----------------------------------------------------------------------------- measurements

def _max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want|; a value finite on one side only (or NaN on one side) is inf."""
    got, want = got.double(), want.double()
    if got.numel() == 0:
        return 0.0
    both_finite = torch.isfinite(got) & torch.isfinite(want)
    same_special = ~both_finite & ((got == want) | (torch.isnan(got) & torch.isnan(want)))
    if bool((~both_finite & ~same_special).any()):
        return math.inf
    return float((got - want)[both_finite].abs().max()) if bool(both_finite.any()) else 0.0


def _logits_error(logits: torch.Tensor, reference: list[torch.Tensor], lengths: list[int], steps: int,
                  top_k: int) -> LogitsError:
    """The logits at each prompt's decode steps (positions ``len - 1 ..``) vs the reference's."""
    worst, agreement, first = 0.0, 1.0, None
    for prompt, (want, length) in enumerate(zip(reference, lengths)):
        got = logits[prompt, length - 1:length - 1 + steps].double()
        want = want[length - 1:length - 1 + steps].double()
        worst = max(worst, _max_error(got, want))
        k = min(top_k, want.shape[-1])
        for step in range(steps):
            mine, theirs = set(got[step].topk(k).indices.tolist()), set(want[step].topk(k).indices.tolist())
            agreement = min(agreement, len(mine & theirs) / k)
            if int(got[step].argmax()) != int(want[step].argmax()) and (first is None or step < first[1]):
                first = (prompt, step)
    return LogitsError(worst, agreement, first)


def localize(
    model,
    reference,
    prompts: Sequence[Sequence[int]],
    *,
    taps: Sequence[str | Tap] | None = None,
    max_new_tokens: int = 8,
    atol: float = 1e-5,
    top_k: int = 5,
) -> LocalizationReport:
    """Name the first module whose numerics diverge from ``reference`` (see the module doc).

    Every prefix of the taps is fed the reference in one tapped program, so ``n`` modules cost
    ``2n + 1`` forward passes, one export and no recompilation.

    Args:
        model: the device-side module (``forward(input_ids) -> logits [B, S, V]``, exported and
            tapped once here), or a ``Transformed`` that already taps those modules with
            ``capture=True`` (its ``graph_module`` may be compiled, e.g. on XLA).
        reference: the reference module, or its captures from :func:`reference_captures` (then
            ``prompts`` are their prompt token ids and ``max_new_tokens`` is what they cover).
        prompts: prompt token ids; each is teacher-forced with the reference's greedy continuation.
        taps: module patterns (default: every decoder layer plus the MoE routers; on a
            ``Transformed``, a subset of its taps).
        max_new_tokens: greedy steps after each prompt.
        atol: the largest local error (max abs difference of a module's output) and logit error
            that count as agreement.
        top_k: agreement of the top ``top_k`` tokens is reported too.

    Returns:
        The report: ``culprit`` (a ``named_modules()`` path, or ``None``), per module its local
        and propagated errors, ``summary()``, ``to_json()``, ``plot(path)``.

    Raises:
        InputError: no prompt, captures that do not match the prompts, a model that does not
            return logits or has inputs localize cannot feed.
    """
    prompts = [[int(t) for t in p] for p in prompts]
    if not prompts or any(not p for p in prompts):
        raise InputError("localize needs at least one prompt, each with at least one token")
    reference_passes = 0
    if isinstance(reference, torch.nn.Module):
        patterns = taps
        if patterns is None:
            patterns = _graph_order(model) if isinstance(model, Transformed) else default_taps(model)
        with torch.no_grad():
            captures = reference_captures(reference, prompts, patterns, max_new_tokens)
        reference_passes = len(prompts) * (1 + max_new_tokens)
    else:
        captures = list(reference)
        if len(captures) != len(prompts):
            raise InputError(f"{len(captures)} captures but {len(prompts)} prompts: "
                             "pass the prompts the captures were made on")
    if any(LOGITS not in c for c in captures):
        raise InputError(
            f"the reference captures have no {LOGITS!r} entry; make them with "
            "neuron_constrain.replacement.reference_captures(reference, prompts, taps, max_new_tokens)"
        )
    replacer = TensorReplacer(captures, prompts)
    reference_logits = [flat[LOGITS] for flat in replacer.flat]
    lengths = [len(p) for p in prompts]
    # The teacher-forced sequences: each prompt and the reference's greedy continuation.
    sequences = [p + logits[len(p) - 1:-1].argmax(-1).tolist() for p, logits in zip(prompts, reference_logits)]
    steps = min(len(s) - len(p) + 1 for s, p in zip(sequences, prompts))
    width = max(len(s) for s in sequences)
    ids = torch.tensor([s + [s[-1]] * (width - len(s)) for s in sequences], dtype=torch.long)
    transformed, order = _tapped_program(model, taps, ids)
    rows, width = _batch_shape(transformed, len(sequences), width)
    # Padding (slots past a sequence, rows past the prompts) keeps the model's own values.
    ids = torch.tensor([s + [s[-1]] * (width - len(s)) for s in sequences] + [[0] * width] * (rows - len(sequences)))
    absent = sorted({name for name in order if any(name not in c for c in captures)})
    if absent:
        raise InputError(
            f"the reference captures have no values for taps {absent}; capture the same module paths "
            f"(they have {sorted(set(captures[0]) - {LOGITS})[:6]})"
        )
    req_ids = [f"localize-{i}" for i in range(len(prompts))]
    for req, prompt in zip(req_ids, prompts):
        replacer.register_request(req, prompt)
    positions = list(range(width)) * rows
    context = replacer.build_context(req_ids, positions, tokens_per_req=width)
    device = _device(transformed)
    ids_on_device = ids.to(device)
    passes = 0

    def run(on: Sequence[str]) -> tuple[LogitsError, dict[str, torch.Tensor]]:
        nonlocal passes
        with active_context({name: context[name] for name in on}), recording_captures() as calls, torch.no_grad():
            out = _logits_of(transformed(ids_on_device))
            if out.device.type == "xla":  # one graph for the logits and the captures, not one each
                import torch_xla

                torch_xla.sync()
        passes += 1
        if out.dim() != 3 or tuple(out.shape[:2]) != tuple(ids.shape):
            raise InputError(
                f"localize compares the logits at every position: the model must return [batch, seq, vocab] "
                f"logits for input_ids {tuple(ids.shape)} (e.g. testing.LogitsStep), got {tuple(out.shape)}"
            )
        if order and not calls:
            raise InputError("the model returned no captures (is strip_added_outputs being traced?); "
                             "call localize on the Transformed, compiling only its graph_module")
        computed = {name: value.detach().cpu() for name, value in (calls[-1] if calls else {}).items()}
        return _logits_error(out.detach().cpu(), reference_logits, lengths, steps, top_k), computed

    local, propagated = [], []
    baseline = None
    for k in range(len(order) + 1):
        logits_error, computed = run(order[:k])
        if k == 0:
            baseline = logits_error
        else:
            propagated.append(logits_error)
        if k < len(order):
            name = order[k]
            values, enabled = context[name]
            got = computed[name].reshape(values.shape[0], -1)
            local.append(_max_error(got[enabled], values[enabled]))
    alone = [run([name])[0] for name in order]
    rows = [LocalizationRow(name, local[i], propagated[i], alone[i]) for i, name in enumerate(order)]
    return LocalizationReport(rows, baseline, atol, top_k, passes, reference_passes, len(prompts), steps, ids.numel())
