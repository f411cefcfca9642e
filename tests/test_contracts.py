"""Each pass's declared contract (``neuron_constrain.contract``): one name (file =
function = report key), the options ``transform()`` hands it, and what it requires
and ensures, checked by ``checks.check_contract`` on a real program before and after."""
from __future__ import annotations

import inspect
import pathlib

import pytest
import torch

import neuron_constrain as nc
from neuron_constrain.checks import CONDITIONS, check_contract
from neuron_constrain.passes import mask_logits_pass, process_logits_pass, split_at_mask_pass, tap_modules_pass
from neuron_constrain.tap_interface import match_modules
from neuron_constrain.testing import SamplingStep, exponential_noise, random_ids, tiny_decoder
from neuron_constrain.transform import PASSES

ALL_PASSES = (tap_modules_pass, mask_logits_pass, process_logits_pass, split_at_mask_pass)
OPTIONS = {tap_modules_pass: {"taps": ["model.layers.*.mlp"]}, mask_logits_pass: {}, process_logits_pass: {}}


@pytest.mark.parametrize("run", ALL_PASSES, ids=lambda f: f.__name__)
def test_one_name_file_function_report_key(run):
    contract = run.contract
    assert run.__name__ == f"{contract.name}_pass"
    assert pathlib.Path(inspect.getsourcefile(run)).name == f"{contract.name}_pass.py"
    assert set(contract.requires) | set(contract.ensures) <= set(CONDITIONS)
    parameters = inspect.signature(run).parameters
    assert set(contract.options) <= set(parameters), "every declared option is a parameter of the pass"


def test_transform_runs_the_declared_order_and_files_reports_by_name():
    assert [run.contract.name for run in PASSES] == ["tap_modules", "mask_logits", "process_logits"]
    inputs = (random_ids(2, 5, 1000), exponential_noise(2, 1000))
    t = nc.transform(SamplingStep(tiny_decoder()), inputs, taps=["model.layers.*.mlp"], processors=["min_p"])
    assert list(t.report.passes) == ["tap_modules", "mask_logits", "process_logits"]
    assert t.report["logit_mask"] is t.report["mask_logits"]  # the former names still read


def test_each_pass_requires_before_and_ensures_after():
    inputs = (random_ids(2, 5, 1000), exponential_noise(2, 1000))
    step = SamplingStep(tiny_decoder())
    tapped = tuple(match_modules("model.layers.*.mlp", [name for name, _ in step.named_modules()]))
    with torch.no_grad():
        program = torch.export.export(step, inputs, preserve_module_call_signature=tapped)
    for run in PASSES:
        contract = run.contract
        assert check_contract(program, contract, "requires") == []
        assert check_contract(program, contract, "ensures"), f"{contract.name}'s ensures held before it ran"
        program, report = run(program, **OPTIONS[run])
        assert report.name == contract.name
        assert check_contract(program, contract, "ensures") == []
        assert check_contract(program, contract, "requires"), f"{contract.name} may run twice"
    assert check_contract(program, split_at_mask_pass.contract, "requires") == []
