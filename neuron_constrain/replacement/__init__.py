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
cast to its dtype and moved to its device. The context itself lives in
:mod:`neuron_constrain.core.tap_context`, which ``Transformed`` reads (the core imports
nothing of this package); its functions are re-exported here.

:class:`TensorReplacer` turns step-wise reference captures (from :func:`capture`
or any other reference) into those contexts for prefill, batched decode and
speculative decode; :func:`save_captures` / :func:`load_captures` keep captures on
disk without pickle (``TensorReplacer.from_files`` reads them); :func:`logit_validation`
compares a transformed model's logits with a reference, teacher-forced, retrying with
the reference token on divergence.

:func:`localize` uses one program tapped with ``capture=True`` to name the first
module whose numerics diverge from the reference (2n + 1 forward passes for n
tapped modules).
"""
from neuron_constrain.replacement.files import load_captures, save_captures
from neuron_constrain.replacement.localization_report import LocalizationReport, LocalizationRow
from neuron_constrain.replacement.localization import localize, reference_captures
from neuron_constrain.replacement.replacer import TensorReplacer
from neuron_constrain.replacement.validation import StepResult, ValidationReport, capture, logit_validation
from neuron_constrain.core.tap_context import (
    active_context,
    get_replacement_tensor,
    recording_captures,
    set_active_context,
)

__all__ = [
    "set_active_context",
    "get_replacement_tensor",
    "active_context",
    "recording_captures",
    "TensorReplacer",
    "save_captures",
    "load_captures",
    "capture",
    "logit_validation",
    "ValidationReport",
    "StepResult",
    "localize",
    "reference_captures",
    "LocalizationReport",
    "LocalizationRow",
]
