"""Replacement taps and localize: find which module of a "device" model is wrong.

    python examples/taps_and_localize.py

Runs in seconds on the CPU with no download. The reference is a tiny random-weight GPT-OSS
(a mixture-of-experts decoder) from ``neuron_constrain.testing``; the "device" model is the same
model with one MoE router's weights off by 5%, standing in for a wrong kernel on an accelerator.

What it shows:

1. ``transform(..., taps=[...])``: every router's output gets a replacement input and a per-row
   enable flag. GPT-OSS's parent module discards the router logits, and the tap still reaches
   them. With the reference's router logits fed (``capture`` on the reference, a
   ``TensorReplacer`` turning the captures into the taps' inputs), the device model's logits
   equal the reference's; with the taps off, they differ. Switching never re-exports.
2. ``localize``: one tapped program, run with every prefix of the taps fed the reference, names
   the first module whose own output is wrong: the router that was changed.
"""
from __future__ import annotations

import copy

import torch

import neuron_constrain as nc
from neuron_constrain.replacement import TensorReplacer, capture, localize, set_active_context
from neuron_constrain.testing import LogitsStep, tiny_decoder

ROUTERS = ["model.layers.*.mlp.router"]  # module paths as named_modules() spells them; * is one component
BROKEN = "model.model.layers.1.mlp.router"  # the same module as LogitsStep(model).named_modules() spells it


def main() -> None:
    reference = tiny_decoder("gpt_oss", vocab_size=1024)
    device_model = copy.deepcopy(reference)
    with torch.no_grad():
        device_model.model.layers[1].mlp.router.weight.mul_(1.05)  # the "wrong kernel"

    prompts = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]
    ids = torch.tensor(prompts)
    dims = ({0: torch.export.Dim("batch"), 1: torch.export.Dim("seq", max=64)},)
    tapped = nc.transform(LogitsStep(device_model), (ids,), dynamic_shapes=dims, logit_mask=None, taps=ROUTERS)
    print("taps:", [site["tap"] for site in tapped.report.passes["tap_modules"].sites])

    replacer = TensorReplacer(capture(LogitsStep(reference), prompts, ROUTERS), prompts)
    for index, prompt in enumerate(prompts):
        replacer.register_request(f"request-{index}", prompt)  # matched to the captured prompt it starts with

    with torch.no_grad():
        want = LogitsStep(reference)(ids)
        off = tapped(ids)  # no active context: the taps are off, the device's own router logits
        # both requests in one call: slot s belongs to request s // 5, at position s % 5
        set_active_context(replacer.build_context(["request-0", "request-1"], list(range(5)) * 2, tokens_per_req=5))
        try:
            on = tapped(ids)  # the routers' outputs come from the reference
        finally:
            set_active_context(None)
    error_off, error_on = (off - want).abs().max().item(), (on - want).abs().max().item()
    print(f"max |logits - reference|: taps off {error_off:.2e}, routers fed the reference {error_on:.2e}")
    assert error_off > 1e-4 and error_on < 1e-5

    report = localize(LogitsStep(device_model), LogitsStep(reference), prompts, max_new_tokens=4, atol=1e-5)
    print(report.summary())
    assert report.culprit == BROKEN, report.culprit


if __name__ == "__main__":
    main()
