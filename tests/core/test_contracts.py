"""Each pass's declared contract (``neuron_constrain.core.contract``): one name (file =
function = report key), the options ``transform()`` hands it, what it requires and
ensures, and the passes it runs after. The pass manager (``neuron_constrain.core.pass_manager``)
orders passes by their contracts, checks ``requires`` before each and ``ensures`` after it,
and names the pass (and the ones before it) when a check fails or the pass raises."""
from __future__ import annotations

import inspect
import pathlib

import pytest
import torch

import neuron_constrain as nc
from neuron_constrain.core.canonical import canonical_text
from neuron_constrain.core.checks import CONDITIONS, check_contract
from neuron_constrain.core.contract import PassContract, PassResult, declares
from neuron_constrain.core.errors import PassError, TransformError
from neuron_constrain.core.pass_manager import PassManager
from neuron_constrain.passes import mask_logits_pass, process_logits_pass, split_at_mask_pass, tap_modules_pass
from neuron_constrain.core.program import ProgramEditor
from neuron_constrain.core.report import PassReport
from neuron_constrain.core.tap_interface import match_modules
from neuron_constrain.testing import SamplingStep, exponential_noise, random_ids, tiny_decoder
from neuron_constrain.core.transform import PASSES

ALL_PASSES = (tap_modules_pass, mask_logits_pass, process_logits_pass, split_at_mask_pass)
OPTIONS = {tap_modules_pass: {"taps": ["model.layers.*.mlp"]}, mask_logits_pass: {}, process_logits_pass: {}}
TAPS = ["model.layers.*.mlp"]


@pytest.fixture(scope="module")
def programs():
    """The step exported plainly, rewritten by every pass, and masked as one of two vocab shards:
    between them, a program on which each condition of ``checks.CONDITIONS`` fails."""
    inputs = (random_ids(2, 5, 1000), exponential_noise(2, 1000))
    step = SamplingStep(tiny_decoder())
    tapped = tuple(match_modules(TAPS[0], [name for name, _ in step.named_modules()]))
    with torch.no_grad():
        plain = torch.export.export(step, inputs, preserve_module_call_signature=tapped)
    full = nc.transform(plain, taps=TAPS, processors=["min_p"]).program
    sharded = nc.transform(plain, tp_degree=2).program
    return {"plain": plain, "full": full, "sharded": sharded}


FAILS_ON = {"untapped": "full", "taps_reach_readers": "plain", "unmasked": "full", "every_site_masked": "plain",
            "unprocessed": "full", "full_vocabulary": "sharded", "processors_reach_sites": "plain",
            "has_head_inputs": "plain"}


@declares(PassContract(name="first"))
def first_pass(program):
    return PassResult(program, PassReport(name="first"))


@pytest.mark.parametrize("run", ALL_PASSES, ids=lambda f: f.__name__)
def test_one_name_file_function_report_key(run):
    contract = run.contract
    assert run.__name__ == f"{contract.name}_pass"
    assert pathlib.Path(inspect.getsourcefile(run)).name == f"{contract.name}_pass.py"
    assert set(contract.requires) | set(contract.ensures) <= set(CONDITIONS)
    assert set(contract.after) | set(contract.before) <= {p.contract.name for p in ALL_PASSES}
    parameters = inspect.signature(run).parameters
    assert set(contract.options) <= set(parameters), "every declared option is a parameter of the pass"


def test_the_contracts_order_the_passes_whatever_the_list_order():
    names = ["tap_modules", "mask_logits", "process_logits", "split_at_mask"]
    for listed in (ALL_PASSES, tuple(reversed(ALL_PASSES)), (process_logits_pass, split_at_mask_pass,
                                                              tap_modules_pass, mask_logits_pass)):
        assert [run.contract.name for run in PassManager(listed).passes] == names
    assert [run.contract.name for run in PassManager(PASSES).passes] == names[:3]

    @declares(PassContract(name="late", before=("first",), after=("mask_logits",)))
    def late_pass(program):
        return PassResult(program, PassReport(name="late"))

    order = [r.contract.name for r in PassManager([first_pass, late_pass, mask_logits_pass]).passes]
    assert order == ["mask_logits", "late", "first"]  # before= and after= both bind
    waiting = declares(PassContract(name="waiting", after=("late",)))(_named("waiting_pass"))
    with pytest.raises(TransformError, match=r"cycle \(late after \['waiting'\], waiting after \['late'\]\)"):
        PassManager([late_pass, declares(PassContract(name="waiting", after=("late",), before=("late",)))(
            _named("waiting_pass"))])
    assert [r.contract.name for r in PassManager([waiting, late_pass, mask_logits_pass]).passes] == [
        "mask_logits", "late", "waiting"]
    with pytest.raises(TransformError, match="listed twice"):
        PassManager([first_pass, first_pass])
    with pytest.raises(TransformError, match="declares no contract"):
        PassManager([lambda program: program])
    with pytest.raises(TransformError, match=r"condition\(s\) \['unmaskd'\]"):
        PassManager([declares(PassContract(name="typo", requires=("unmaskd",)))(_named("typo_pass"))])


def _named(name):
    def run(program):
        return PassResult(program, PassReport(name=name.removesuffix("_pass")))

    run.__name__ = name
    return run


def test_transform_files_reports_by_name_and_checks_cost_nothing_in_the_result(programs):
    t = nc.transform(programs["plain"], taps=TAPS, processors=["min_p"])
    assert list(t.report.passes) == ["tap_modules", "mask_logits", "process_logits"]
    assert t.report["logit_mask"] is t.report["mask_logits"]  # the former names still read
    unchecked = nc.transform(programs["plain"], taps=TAPS, processors=["min_p"], check_contracts=False)
    assert canonical_text(unchecked.program) == canonical_text(t.program)
    with pytest.raises(TransformError, match=r"option\(s\) \['processors'\] are taken by none of the passes"):
        PassManager([mask_logits_pass]).run(programs["plain"], processors=["min_p"])


def test_each_pass_requires_before_and_ensures_after(programs):
    program = programs["plain"]
    for run in PASSES:
        contract = run.contract
        assert check_contract(program, contract, "requires") == []
        assert check_contract(program, contract, "ensures"), f"{contract.name}'s ensures held before it ran"
        result = run(program, **OPTIONS[run])
        assert result.report.name == contract.name and result.programs == {}
        program = result.program
        assert check_contract(program, contract, "ensures") == []
        assert check_contract(program, contract, "requires"), f"{contract.name} may run twice"
    assert check_contract(program, split_at_mask_pass.contract, "requires") == []
    split = PassManager(PASSES + (split_at_mask_pass,)).run(
        programs["plain"], taps=TAPS, processors=["min_p"], head_inputs=["logit_mask", "min_p"])
    assert list(split.report.passes)[-1] == "split_at_mask" and set(split.programs) == {"head"}
    assert split.report["split_at_mask"].head_ops > 0


@pytest.mark.parametrize("condition", sorted(CONDITIONS))
def test_a_pass_given_what_it_does_not_require_is_named_and_never_runs(programs, condition):
    called = []

    @declares(PassContract(name="needy", requires=(condition,)))
    def needy_pass(program):
        called.append(program)
        return PassResult(program, PassReport(name="needy"))

    with pytest.raises(PassError, match=rf"checking what needy requires \(after first\): needy requires {condition}: ") as e:
        PassManager([first_pass, needy_pass]).run(programs[FAILS_ON[condition]])
    assert (e.value.pass_name, e.value.after, called) == ("needy", ["first"], [])


@pytest.mark.parametrize("condition", sorted(CONDITIONS))
def test_a_pass_that_breaks_what_it_ensures_is_named(programs, condition):
    """The broken pass returns a program on which the condition it declares fails."""

    @declares(PassContract(name="broken", ensures=(condition,)))
    def broken_pass(program):
        return PassResult(programs[FAILS_ON[condition]], PassReport(name="broken"))

    with pytest.raises(PassError, match=rf"checking what broken ensures \(after first\): broken ensures {condition}: "):
        PassManager([first_pass, broken_pass]).run(programs["plain"])
    unchecked = PassManager([first_pass, broken_pass], check=False).run(programs["plain"])
    assert unchecked.program is programs[FAILS_ON[condition]]  # the check is what caught it


def _add_inputs_and_forget_them(program, names):
    editor = ProgramEditor(program)
    for name in names:
        dtype = torch.bool if name.endswith("_enabled") else torch.float32 if name.startswith("tap_") else torch.int32
        editor.add_tensor_input(name, (2, 32), dtype, 0)
    return editor.build()


# Real bugs: each pass adds its inputs and never wires them into the graph.
FORGETFUL = {
    "tap_modules": (("tap_model_layers_0_mlp", "tap_model_layers_0_mlp_enabled"), "taps_reach_readers",
                    r"tap tap_model_layers_0_mlp: no where\("),
    "mask_logits": (("logit_mask",), "every_site_masked", "which does not depend on logit_mask"),
    "process_logits": (("min_p",), "processors_reach_sites", "processor input min_p feeds no sampling site's logits"),
}


@pytest.mark.parametrize("name", sorted(FORGETFUL))
def test_a_pass_that_adds_inputs_it_never_uses_breaks_its_ensures(programs, name):
    inputs, condition, failure = FORGETFUL[name]

    def forgetful(program):
        return PassResult(_add_inputs_and_forget_them(program, inputs), PassReport(name=f"forgetful_{name}"))

    forgetful.__name__ = f"forgetful_{name}_pass"
    broken = declares(PassContract(name=f"forgetful_{name}", ensures=(condition,)))(forgetful)
    with pytest.raises(PassError, match=rf"checking what forgetful_{name} ensures \(after first\): forgetful_{name} "
                                        rf"ensures {condition}: .*{failure}") as e:
        PassManager([first_pass, broken]).run(programs["plain"])
    assert e.value.pass_name == f"forgetful_{name}"


def test_an_error_inside_a_pass_names_it_and_the_passes_before_it(programs):
    with pytest.raises(PassError, match=r"^while running mask_logits \(after tap_modules\): vocab_size=2000 is larger") as e:
        nc.transform(programs["plain"], taps=TAPS, vocab_size=2000)
    assert type(e.value.__cause__) is TransformError and "vocab_size=2000" in str(e.value.__cause__)
    assert isinstance(e.value, TransformError) and isinstance(e.value, nc.Error)

    @declares(PassContract(name="exploding", after=("mask_logits",)))
    def exploding_pass(program):
        raise RuntimeError("boom")

    with pytest.raises(PassError, match=r"^while running exploding \(after tap_modules, mask_logits\): RuntimeError: boom"
                       ) as e:
        PassManager([exploding_pass, *PASSES]).run(programs["plain"], taps=TAPS)
    assert isinstance(e.value.__cause__, RuntimeError) and e.value.after == ["tap_modules", "mask_logits"]
