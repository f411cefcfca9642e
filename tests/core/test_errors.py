"""Bad input is refused at transform time (or at the call) with a message naming the
thing and the fix; each case here was reproduced as a bare torch error or a silent
acceptance before (issue 12)."""
from __future__ import annotations

import inspect

import pytest
import sympy
import torch

import neuron_constrain as nc
from neuron_constrain.core.errors import InputError, TransformError
from neuron_constrain.kernels import pack_bool_mask, packed_width
from neuron_constrain.replacement import logit_validation
from neuron_constrain.core.report import evaluate_dim, unsizable
from neuron_constrain.testing import GreedyStep, LogitsStep, random_ids, tiny_decoder
from cli_runner import run_cli

VOCAB = 1000
BATCH = torch.export.Dim("batch")


@pytest.fixture(scope="module")
def model():
    return tiny_decoder("llama", vocab_size=VOCAB)


@pytest.fixture(scope="module")
def greedy(model):
    ids = random_ids(3, 5, VOCAB)
    return nc.transform(GreedyStep(model), (ids,), dynamic_shapes=({0: BATCH},), vocab_size=VOCAB), ids


class StridedLogits(torch.nn.Module):
    """Logits of every other position: a leading dim ``(s + 1) // 2`` of a dynamic sequence."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).logits[:, ::2]


def test_a_floor_divided_dynamic_dim_is_sized_at_every_call(model):
    seq = torch.export.Dim("seq", min=3, max=64)
    t = nc.transform(StridedLogits(model), (random_ids(2, 6, VOCAB),), dynamic_shapes=({0: BATCH, 1: seq},))
    (mask,) = t.report["mask_logits"].inputs_added
    assert any(isinstance(d, sympy.Expr) and not isinstance(d, sympy.Symbol) for d in mask.shape), mask.shape
    for length in (5, 8):
        ids = random_ids(2, length, VOCAB)
        allowed = torch.zeros(2, (length + 1) // 2, VOCAB, dtype=torch.bool)
        allowed[..., 7] = True
        logits = t(ids, logit_mask=pack_bool_mask(allowed))  # omitted or fed: both sized from the call
        assert logits.shape == (2, (length + 1) // 2, VOCAB)
        assert torch.isfinite(logits[..., 7]).all() and torch.isinf(logits[..., 8]).all()
        assert t(ids).shape == logits.shape


def test_sizes_the_runtime_cannot_evaluate_are_named():
    s0, s1 = sympy.symbols("s0 s1", integer=True, positive=True)
    assert unsizable((s0, 32), {s0}) is None
    assert "s1" in unsizable((s1, 32), {s0})
    assert "cannot evaluate" in unsizable((sympy.sqrt(s0),), {s0})
    assert evaluate_dim(sympy.Max(s0, 3), {s0: 5}) == 5 and evaluate_dim(sympy.Min(s0, 3), {s0: 5}) == 3


def test_positional_input_passed_by_name(greedy):
    t, ids = greedy
    assert torch.equal(t(input_ids=ids), t(ids))  # the exported argument's own name works
    with pytest.raises(InputError, match=r"takes 1 positional input\(s\) \(input_ids\).*unknown keyword\(s\) \['ids'\]"):
        t(ids=ids)


def test_tap_rank_out_of_range_is_named(model):
    ids = random_ids(2, 4, VOCAB)
    t = nc.transform(LogitsStep(model), (ids,), logit_mask=None, taps=["model.layers.0.mlp"], sequence_parallel=2)
    t(ids, tap_rank=torch.tensor(1))
    with pytest.raises(InputError, match=r"tap_rank=2 is outside \[0, 2\)"):
        t(ids, tap_rank=torch.tensor(2))


def test_strings_where_lists_belong(model):
    ids = random_ids(2, 4, VOCAB)
    with pytest.raises(TransformError, match=r"processors='min_p' is a string; pass a list: processors=\['min_p'\]"):
        nc.transform(GreedyStep(model), (ids,), processors="min_p")
    with pytest.raises(TransformError, match=r"taps='h' is a string; pass a list: taps=\['h'\]"):
        nc.transform(GreedyStep(model), (ids,), taps="h")


@pytest.mark.parametrize("vocab_size", [70.0, 0, -3, True, "1000"])
def test_vocab_size_must_be_a_positive_int(model, vocab_size):
    with pytest.raises(TransformError, match=r"vocab_size=.*positive int"):
        nc.transform(GreedyStep(model), (random_ids(2, 4, VOCAB),), vocab_size=vocab_size)


def test_near_matches_never_list_the_root(model):
    with pytest.raises(TransformError, match=r"matches no module; nearest module paths: \[") as info:
        nc.transform(LogitsStep(model), (random_ids(2, 4, VOCAB),), logit_mask=None, taps=["zz"])
    assert "''" not in str(info.value) and "model" in str(info.value)


def test_mask_format_and_width_messages_name_the_fix(greedy):
    t, ids = greedy
    with pytest.raises(InputError, match=r"dtype torch.bool but the graph takes torch.int32.*pack_bool_mask"):
        t(ids, logit_mask=torch.ones(3, VOCAB, dtype=torch.bool))
    with pytest.raises(InputError, match=r"shape \(3, 31\).*ceil\(1000/32\) = 32 int32 words"):
        t(ids, logit_mask=torch.full((3, 31), -1, dtype=torch.int32))
    bool_graph = nc.transform(GreedyStep(tiny_decoder("llama", vocab_size=VOCAB)), (ids,), logit_mask="bool", vocab_size=VOCAB)
    with pytest.raises(InputError, match=r"dtype torch.int32 but the graph takes torch.bool.*unpack_bitmask\(mask, 1000\)"):
        bool_graph(ids, logit_mask=torch.full((3, packed_width(VOCAB)), -1, dtype=torch.int32))


def test_a_transformed_model_runs_on_the_meta_device(greedy):
    import copy

    from torch.export.passes import move_to_device_pass

    t, ids = greedy
    meta = nc.Transformed(move_to_device_pass(copy.deepcopy(t.program), "meta"), t.report)
    token = meta(ids.to("meta"), logit_mask=torch.full((3, 32), -1, dtype=torch.int32, device="meta"))
    assert token.device.type == "meta" and token.shape == (3,)


def test_compiled_model_names_a_misspelled_keyword(model):
    compiled = nc.compile(GreedyStep(model), inner="eager", vocab_size=VOCAB)
    with pytest.raises(InputError, match=r"unexpected keyword\(s\) \['scael'\].*check the spelling"):
        compiled(random_ids(2, 4, VOCAB), scael=2.0)


def test_the_documented_default_backend_line_works():
    assert isinstance(nc.default_backend, nc.Backend) and nc.default_backend.inner == "inductor"
    assert isinstance(nc.backend(inner="eager", vocab_size=VOCAB), nc.Backend)  # and the factory, a plain function
    assert inspect.isfunction(nc.backend) and not hasattr(nc, "Compiled")  # no callable module; TorchCompiled


def test_rewrite_refuses_tp_degree_zero(tmp_path, model):
    ids = random_ids(2, 4, VOCAB)
    path = tmp_path / "step.pt2"
    torch.export.save(torch.export.export(GreedyStep(model), (ids,)), path)
    result = run_cli("rewrite", path, "-o", tmp_path / "out.pt2", "--tp-degree", "0")  # in-process cli.main
    assert result.returncode == 2, result.stdout + result.stderr
    assert "tp_degree=0" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out.pt2").exists()


class MaskingWrapper(torch.nn.Module):
    """Sets all but the 5 best logits to -inf: a 'device' model that looks exact where finite."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        logits = self.model(input_ids=input_ids, use_cache=False).logits
        keep = logits.topk(5, dim=-1).indices
        return torch.full_like(logits, float("-inf")).scatter(-1, keep, logits.gather(-1, keep))


def test_logit_validation_counts_logits_that_are_finite_on_one_side_only(model):
    prompts = [[1, 2, 3, 4]]
    report = logit_validation(MaskingWrapper(model), LogitsStep(model), prompts, max_new_tokens=2)
    assert not report.passed
    assert report.max_abs_error == 0.0  # where both are finite they agree exactly
    (first, *_) = report.nonfinite_mismatches
    assert first.nonfinite_mismatches == VOCAB - 5 and first.step == 0
    assert "finite on one side and -inf/NaN on the other" in report.summary()
    assert logit_validation(LogitsStep(model), LogitsStep(model), prompts, max_new_tokens=2).passed


def test_compile_masks_a_decoder_called_with_grad_enabled(model):
    """HF's rotary embedding runs under @torch.no_grad(): dynamo's graph toggles grad mode,
    and re-exporting it wrapped the lm_head in a set-grad region the pass could not see."""
    torch._dynamo.reset()
    compiled = nc.compile(GreedyStep(model), inner="eager", vocab_size=VOCAB)
    allowed = torch.zeros(2, VOCAB, dtype=torch.bool)
    allowed[:, 11] = True
    assert torch.is_grad_enabled()
    tokens = compiled(random_ids(2, 4, VOCAB), logit_mask=pack_bool_mask(allowed))
    assert tokens.tolist() == [11, 11] and len(compiled.backend.reports) == 1
    torch._dynamo.reset()


# ----------------------------------------------------------------------------- one error family

# Each error's builtin base, kept under neuron_constrain.Error (callers catch ValueError etc.).
BUILTIN_BASES = {
    "TransformError": ValueError, "CheckError": ValueError, "InputError": ValueError, "LoadError": ValueError,
    "ProcessorError": ValueError, "ConstraintError": ValueError, "TokenizerInfoError": ValueError,
    "StructuredOutputsDisabledError": ValueError, "BatchLayoutError": ValueError, "ConfigError": ValueError,
    "GrammarFailedError": ValueError, "DisallowedTokenError": ValueError, "NoAllowedTokenError": ValueError,
    "EmptyMaskRowError": RuntimeError, "ModelNotInstalledError": RuntimeError, "GrammarFillError": RuntimeError,
    "MissingDependencyError": ImportError, "PipelineTimeout": TimeoutError, "FillTimeout": TimeoutError,
    "RequestFailedError": Exception, "UsageError": Exception,
}


def _library_exceptions() -> dict[str, type]:
    """Every exception class the package's modules define, found by importing each module of
    the source tree (the vLLM plugin's modules need vLLM: read, not imported, in other lanes)."""
    import ast
    import importlib
    import pathlib

    from neuron_constrain.vllm import vllm_version

    root = pathlib.Path(nc.__file__).resolve().parent.parent
    folders = {"neuron_constrain": root / "neuron_constrain", "neuron_constrain.passes": root / "passes",
               "neuron_constrain.kernels": root / "kernels"}
    found = {}
    for package, folder in folders.items():
        for path in sorted(folder.rglob("*.py")):
            module = ".".join((package, *path.relative_to(folder).with_suffix("").parts)).removesuffix(".__init__")
            if module.endswith("__main__"):
                continue  # runs the CLI
            try:
                loaded = importlib.import_module(module)
            except (RuntimeError, ImportError):  # a plugin module that imports vLLM, in a lane without it
                assert module.startswith("neuron_constrain.vllm.") and vllm_version() is None, module
                classes = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)]
                raising = [c.name for c in classes if any(ast.unparse(b).endswith(("Error", "Exception", "Timeout"))
                                                          for b in c.bases)]
                assert not raising, f"{module} (imported only with vLLM) defines {raising}: define errors where they import"
                continue
            for value in vars(loaded).values():
                if isinstance(value, type) and issubclass(value, BaseException) and value.__module__ == module:
                    found[f"{module}.{value.__qualname__}"] = value
    return found


@pytest.mark.torch_agnostic
def test_every_library_error_is_a_neuron_constrain_error_and_keeps_its_builtin_base():
    found = _library_exceptions()
    names = {cls.__name__ for cls in found.values()}
    assert set(BUILTIN_BASES) <= names, f"not found by the walk: {set(BUILTIN_BASES) - names}"
    outside = [name for name, cls in found.items() if not issubclass(cls, nc.Error)]
    assert not outside, f"errors outside the family (derive them from neuron_constrain.Error): {outside}"
    for name, cls in found.items():
        assert issubclass(cls, BUILTIN_BASES.get(cls.__name__, Exception)), f"{name} lost its builtin base"
        try:
            raise cls.__new__(cls)  # the class decides what `except` matches, not the constructor's arguments
        except nc.Error as caught:
            assert type(caught) is cls
