"""Replacement taps on real MoE decoders: routing follows the reference, taps switch
without recompiling, and the host runtime (contexts, captures, validation)."""
from __future__ import annotations

import copy
import functools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import neuron_constrain as nc
from neuron_constrain.core.errors import InputError, TransformError
from neuron_constrain.passes import tap_modules_pass
from neuron_constrain.core.tap_interface import match_modules
from neuron_constrain.replacement import (
    TensorReplacer,
    active_context,
    capture,
    get_replacement_tensor,
    logit_validation,
    recording_captures,
    set_active_context,
)
from neuron_constrain.testing import LogitsStep, random_ids, tiny_decoder
from conftest import require_torch_xla

VOCAB, BATCH, SEQ, EXPERTS, TOP_K = 256, 4, 5, 4, 2
DIMS = ({0: torch.export.Dim("batch", min=1), 1: torch.export.Dim("seq", min=1, max=64)},)
ROUTER = {"gpt_oss": "model.layers.*.mlp.router", "mixtral": "model.layers.*.mlp.gate"}


def router_names(arch: str, layers: int = 2) -> list[str]:
    leaf = ROUTER[arch].split(".")[-1]
    return [f"model.model.layers.{i}.mlp.{leaf}" for i in range(layers)]


@functools.lru_cache(maxsize=None)
def tapped(arch: str):
    """Model A with router taps, capturing the computed logits and the routing indices."""
    model = tiny_decoder(arch, vocab_size=VOCAB, seed=0)
    ids = random_ids(BATCH, SEQ, VOCAB)
    with torch.no_grad():
        plain = torch.export.export(LogitsStep(model), (ids,), dynamic_shapes=DIMS)
    taps = [nc.Tap(ROUTER[arch], capture=True), nc.Tap(ROUTER[arch] + ":2", capture=True)]
    t = nc.transform(LogitsStep(model), (ids,), dynamic_shapes=DIMS, logit_mask=None, taps=taps)
    return model, ids, plain, t


def reference_router_logits(arch: str, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Router logits of a differently-seeded model B on the same tokens ([B*S, E] per layer)."""
    reference = tiny_decoder(arch, vocab_size=VOCAB, seed=1)
    captured = {}
    hooks = [
        module.register_forward_hook(lambda m, a, out, name=name: captured.__setitem__(name, out[0].detach()))
        for name, module in LogitsStep(reference).named_modules() if name in router_names(arch)
    ]
    LogitsStep(reference)(ids)
    for h in hooks:
        h.remove()
    return captured


@pytest.mark.parametrize("arch", ["gpt_oss", "mixtral"])
def test_replaced_router_logits_drive_routing(arch):
    model, ids, plain, t = tapped(arch)
    reference = reference_router_logits(arch, ids)
    rows = BATCH * SEQ
    enabled = torch.rand(rows, generator=torch.Generator().manual_seed(3)) < 0.5
    enabled[0], enabled[1] = True, False
    with recording_captures() as calls, active_context({n: (reference[n], enabled) for n in router_names(arch)}):
        t(ids)
    (seen,) = calls
    assert set(seen) == set(router_names(arch)) | {n + ":2" for n in router_names(arch)}
    for name in router_names(arch):
        own, routing = seen[name], seen[name + ":2"]
        scores = torch.where(enabled.unsqueeze(-1), reference[name], own)
        if arch == "mixtral":  # Mixtral ranks softmax probabilities, GPT-OSS the logits: same order
            scores = scores.float().softmax(-1)
        assert torch.equal(routing, scores.topk(TOP_K, dim=-1).indices)
        assert torch.equal(routing[enabled], reference[name][enabled].topk(TOP_K, dim=-1).indices)
        assert torch.equal(routing[~enabled], own[~enabled].topk(TOP_K, dim=-1).indices)
        # the reference really routes differently: the test would notice a tap that does nothing
        assert not torch.equal(reference[name].topk(TOP_K).indices, own.topk(TOP_K).indices)


@pytest.mark.parametrize("arch", ["gpt_oss", "mixtral"])
def test_all_taps_disabled_is_the_untransformed_model(arch):
    model, ids, plain, t = tapped(arch)
    set_active_context(None)
    with torch.no_grad():
        expected = plain.module()(ids)
        eager = LogitsStep(model)(ids)
    got = t(ids)
    assert torch.equal(got, expected)
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)
    # an explicit context with every row disabled is the same graph call and the same result
    off = {n: (torch.randn(BATCH * SEQ, EXPERTS), torch.zeros(BATCH * SEQ, dtype=torch.bool)) for n in router_names(arch)}
    with active_context(off):
        assert torch.equal(t(ids), expected)


def test_tap_inputs_and_report():
    _, _, _, t = tapped("gpt_oss")
    report = t.report["tap_modules"]
    assert [s["tap"] for s in report.sites] == [
        "model.model.layers.0.mlp.router", "model.model.layers.1.mlp.router",
        "model.model.layers.0.mlp.router:2", "model.model.layers.1.mlp.router:2",
    ]
    names = [i.name for i in report.inputs_added]
    assert names[:2] == ["tap_model_model_layers_0_mlp_router", "tap_model_model_layers_0_mlp_router_enabled"]
    first = report.inputs_added[0]
    assert first.dtype == torch.float32 and first.shape[-1] == EXPERTS and str(first.shape[0]) != str(BATCH * SEQ)
    assert report.outputs_added == ["capture_" + s["tap"] for s in report.sites]
    # the taps are plain aten: where(enabled, replacement, computed)
    wheres = [n for n in t.program.graph.nodes if n.target == torch.ops.aten.where.self]
    assert len(wheres) == 4


def test_post_turns_reference_logits_into_the_tapped_form():
    """Integration pattern 1: tap the scores and indices, derive both from reference logits."""
    model = tiny_decoder("gpt_oss", vocab_size=VOCAB, seed=0)
    ids = random_ids(2, SEQ, VOCAB)
    router = ROUTER["gpt_oss"]
    derived = nc.transform(LogitsStep(model), (ids,), dynamic_shapes=DIMS, logit_mask=None, taps=[
        nc.Tap(router + ":1", post=lambda logits: logits.topk(TOP_K, dim=-1).values.softmax(dim=1), features=EXPERTS),
        nc.Tap(router + ":2", post=lambda logits: logits.topk(TOP_K, dim=-1).indices, features=EXPERTS),
    ])
    direct = nc.transform(LogitsStep(model), (ids,), dynamic_shapes=DIMS, logit_mask=None, taps=[router])
    reference = reference_router_logits("gpt_oss", ids)
    with active_context({f"{n}:{k}": reference[n] for n in router_names("gpt_oss") for k in (1, 2)}):
        got = derived(ids)
    with active_context(reference):
        want = direct(ids)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(want, direct(ids), atol=1e-3)  # and the replacement mattered


def test_sequence_parallel_slices_the_full_replacement_per_rank():
    model = tiny_decoder("gpt_oss", vocab_size=VOCAB, seed=0)
    ids = random_ids(BATCH, SEQ, VOCAB)
    router = ROUTER["gpt_oss"]
    t = nc.transform(LogitsStep(model), (ids[:2],), dynamic_shapes=DIMS, logit_mask=None, sequence_parallel=2,
                     taps=[router, nc.Tap(router + ":2", capture=True)])
    assert t.report["tap_modules"].inputs_added[0].name == "tap_rank"
    reference = reference_router_logits("gpt_oss", ids)  # full: all BATCH * SEQ tokens
    local = BATCH // 2 * SEQ
    with active_context(reference):
        for rank in range(2):
            with recording_captures() as calls:
                t(ids[rank * 2:(rank + 1) * 2], tap_rank=torch.tensor(rank))
            for name in router_names("gpt_oss"):
                rows = reference[name][rank * local:(rank + 1) * local]
                assert torch.equal(calls[0][name + ":2"], rows.topk(TOP_K, dim=-1).indices)
        with pytest.raises(InputError, match="tap_rank is required"):
            t(ids[:2])


# ----------------------------------------------------------------------------- no recompiles

def test_switching_taps_never_recompiles_under_torch_compile():
    model, ids, plain, t = tapped("gpt_oss")
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(t, backend=counting_backend)
    reference = reference_router_logits("gpt_oss", ids)
    some = torch.arange(BATCH * SEQ) % 3 == 0
    contexts = [None, reference, {n: (v, some) for n, v in reference.items()}, {}, None]
    with torch._dynamo.config.patch(error_on_recompile=True):
        outs, compiled_after = [], []
        for ctx in contexts:
            with active_context(ctx):
                outs.append((compiled(ids), t(ids)))
            compiled_after.append(len(graphs))
    # the host-side feeding is a graph break; the model graph is compiled once
    assert compiled_after[0] >= 1 and compiled_after == compiled_after[:1] * len(contexts)
    assert sum(len([n for n in g.graph.nodes if n.op == "call_function"]) > 100 for g in graphs) == 1
    for got, want in outs:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(outs[0][1], outs[1][1], atol=1e-3)


def test_switching_taps_compiles_once_on_xla():
    require_torch_xla()
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as metrics

    from neuron_constrain.decoding.xla import to_xla

    model = tiny_decoder("llama", vocab_size=VOCAB, seed=0)
    ids = random_ids(2, SEQ, VOCAB)
    t = nc.transform(LogitsStep(model), (ids,), logit_mask=None, taps=["model.layers.*.mlp"])
    device = xm.xla_device()
    on_xla = to_xla(t, device)  # a copy: t.program stays on the host
    names = [s["tap"] for s in t.report["tap_modules"].sites]
    reference = {n: torch.randn(2, SEQ, 64) for n in names}
    half = torch.tensor([True, False] * SEQ)
    contexts = [None, reference, {n: (v.reshape(2 * SEQ, 64), half) for n, v in reference.items()}, None]
    before = (metrics.metric_data("CompileTime") or (0,))[0]
    for ctx in contexts:
        with active_context(ctx):
            got = on_xla(ids.to(device)).cpu()
            want = t(ids)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert metrics.metric_data("CompileTime")[0] - before == 1


# ----------------------------------------------------------------------------- errors

def test_pattern_that_matches_nothing_lists_near_misses():
    model = tiny_decoder("gpt_oss", vocab_size=VOCAB)
    with pytest.raises(TransformError, match=r"matches no module.*model\.model\.layers\.0\.mlp\.router"):
        nc.transform(LogitsStep(model), (random_ids(2, SEQ, VOCAB),), logit_mask=None, taps=["model.layers.*.mlp.routr"])


def test_bad_selector_and_bad_context_are_named():
    model, ids, plain, t = tapped("gpt_oss")
    with torch.no_grad():
        preserved = torch.export.export(LogitsStep(model), (ids,), preserve_module_call_signature=("model.model.layers.0.mlp.router",))
    with pytest.raises(TransformError, match="no tensor output 5"):
        tap_modules_pass(preserved, ["model.layers.0.mlp.router:5"])
    with pytest.raises(TransformError, match="tap inputs"):
        tap_modules_pass(t.program, ["model.layers.0.mlp.router"])
    with active_context({"model.model.layers.0.mlp.router": torch.zeros(3, EXPERTS)}):
        with pytest.raises(InputError, match="has shape \\(3, 4\\).*tapped value is \\(20, 4\\)"):
            t(ids)
    with pytest.raises(InputError, match="mapping of tap name"):
        set_active_context([torch.zeros(1)])


def test_program_without_recorded_signature_falls_back_or_explains():
    model = tiny_decoder("gpt_oss", vocab_size=VOCAB)
    ids = random_ids(2, SEQ, VOCAB)
    with torch.no_grad():
        plain = torch.export.export(LogitsStep(model), (ids,))
    report = tap_modules_pass(plain, ["model.layers.0.mlp.experts"]).report  # one value leaves it
    assert report.sites[0]["module"] == "model.model.layers.0.mlp.experts"
    with pytest.raises(TransformError, match="preserve_module_call_signature"):
        tap_modules_pass(plain, ["model.layers.0.mlp.router"])  # three values, which is which?


def test_tapped_program_saves_and_runs_without_the_library(tmp_path):
    _, ids, plain, t = tapped("gpt_oss")
    t.save(tmp_path / "tapped.pt2")
    loaded = torch.export.load(tmp_path / "tapped.pt2").module()
    feeds = {i.name: torch.full(i.shape_for({s: v for s, v in zip(_symbols(t), ids.shape)}), i.fill, dtype=i.dtype)
             for i in t.report.inputs_added}
    out, *captured = loaded(ids, **feeds)
    assert torch.equal(out, t(ids)) and len(captured) == 4


def _symbols(t):
    return [symbol for _, _, symbol in t._symbolic_dims]


# ----------------------------------------------------------------------------- the host runtime

def test_plain_context_lookup():
    assert get_replacement_tensor("x") is None
    value = torch.ones(2, 3)
    with active_context({"x": value}):
        assert get_replacement_tensor("x") is value
    assert get_replacement_tensor("x") is None


def _replacer(prompts, features=2):
    captures = []
    for i, p in enumerate(prompts):
        rows = torch.arange(len(p) + 2, dtype=torch.float32).unsqueeze(-1) * 10 + i
        steps = [rows[: len(p)].expand(-1, features).reshape(1, len(p), features)]
        steps += [rows[: len(p) + k + 1].expand(-1, features).reshape(1, len(p) + k + 1, features) for k in range(2)]
        captures.append({"t": steps})
    return TensorReplacer(captures, prompts)


def test_prefix_matching_longest_match_wins():
    r = _replacer([[1, 2, 3], [1, 2, 3, 4, 5], [40, 50]])
    assert r.register_request("a", [1, 2, 3, 4, 5]) == 1       # both match; the longer wins
    assert r.register_request("b", [1, 2, 3, 77, 88]) == 0     # retry of prompt 0
    assert r.register_request("c", [1, 2, 3, 4]) == 0          # shorter than prompt 1
    assert r.register_request("d", [40, 50, 60]) == 2
    with pytest.raises(InputError, match="starts with none"):
        r.register_request("e", [2, 3])
    with pytest.raises(InputError, match="not registered"):
        r.build_context(["zzz"], [0])


def test_prefix_matching_known_corner_case():
    """A retry of prompt 0 whose generated tokens spell prompt 1 maps to prompt 1 (documented)."""
    r = _replacer([[1, 2, 3], [1, 2, 3, 4, 5]])
    assert r.register_request("retry-of-0", [1, 2, 3, 4, 5]) == 1


def test_flattening_takes_the_last_row_of_each_decode_step():
    r = _replacer([[7, 8, 9]])
    assert r.flat[0]["t"][:, 0].tolist() == [0.0, 10.0, 20.0, 30.0, 40.0]


def test_prefill_padding_decode_padding_and_positions_past_the_capture():
    r = _replacer([[1, 2, 3], [4, 5]])
    r.register_request("p", [1, 2, 3])
    r.register_request("q", [4, 5])
    values, enabled = r.build_context(["p"], [0, 1, 2, 0, 0], is_prefill=True)["t"]
    assert enabled.tolist() == [True, True, True, False, False]  # first repeated position: padding
    assert values[:3, 0].tolist() == [0.0, 10.0, 20.0]
    values, enabled = r.build_context(["p", "q"], [4, 3, 0, 0])["t"]  # two requests, two padding slots
    assert enabled.tolist() == [True, True, False, False]
    assert values[:2, 0].tolist() == [40.0, 31.0]
    values, enabled = r.build_context(["p", "q"], [5, 9])["t"]  # past both captures: keep computed
    assert enabled.tolist() == [False, False]


def test_speculative_decode_slot_mapping():
    r = _replacer([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [4, 5, 6, 7, 8, 9]])
    r.register_request("a", list(range(1, 11)))
    r.register_request("b", [4, 5, 6, 7, 8, 9])
    values, enabled = r.build_context(["a", "b"], [8, 9, 10, 11, 5, 6, 7, 8, 0, 0], tokens_per_req=4)["t"]
    assert enabled.tolist() == [True] * 4 + [True, True, True, False] + [False, False]  # b's capture ends at 7
    assert values[:7, 0].tolist() == [80.0, 90.0, 100.0, 110.0, 51.0, 61.0, 71.0]
    warm_values, warm_enabled = r.warmup_context(16)["t"]
    assert warm_values.shape == (16, 2) and not warm_enabled.any()


@given(
    lengths=st.lists(st.integers(1, 6), min_size=1, max_size=4),
    tokens_per_req=st.integers(1, 4),
    extra_slots=st.integers(0, 5),
    data=st.data(),
)
def test_build_context_matches_a_plain_lookup(lengths, tokens_per_req, extra_slots, data):
    prompts = [[100 * i + j for j in range(n)] for i, n in enumerate(lengths)]
    r = _replacer(prompts, features=3)
    requests = data.draw(st.lists(st.integers(0, len(prompts) - 1), min_size=1, max_size=4))
    req_ids = [f"r{k}" for k in range(len(requests))]
    for req, prompt in zip(req_ids, requests):
        r.register_request(req, prompts[prompt])
    slots = len(requests) * tokens_per_req + extra_slots
    positions = data.draw(st.lists(st.integers(-1, 9), min_size=slots, max_size=slots))
    values, enabled = r.build_context(req_ids, positions, tokens_per_req=tokens_per_req)["t"]
    for slot, position in enumerate(positions):
        request = slot // tokens_per_req
        captured = len(prompts[requests[request]]) + 2 if request < len(requests) else 0
        expect = request < len(requests) and 0 <= position < captured
        assert bool(enabled[slot]) == expect
        if expect:
            assert values[slot].tolist() == [position * 10.0 + requests[request]] * 3
        else:
            assert not values[slot].any()


@given(parts=st.lists(st.sampled_from(["model", "layers", "0", "1", "mlp", "router", "gate"]), min_size=1, max_size=5))
def test_patterns_match_suffixes_and_one_component_per_star(parts):
    path = ".".join(parts)
    paths = [path, "root." + path, "unrelated.module"]
    assert match_modules(path, paths)[:2] == [path, "root." + path]
    starred = ".".join("*" if i % 2 else p for i, p in enumerate(parts))
    assert path in match_modules(starred, paths)
    assert "unrelated.module" not in match_modules(path, paths) or path.endswith("module")


# ----------------------------------------------------------------------------- capture and validation

def _validation_models():
    model = tiny_decoder("gpt_oss", vocab_size=VOCAB, seed=0)
    reference = copy.deepcopy(model)  # the same decoder but for its routers
    torch.manual_seed(7)
    for layer in reference.model.layers:
        layer.mlp.router.weight.data.normal_(0, 1.0)
    return model, reference


def test_captures_from_a_reference_make_the_transformed_model_match_it():
    model, reference = _validation_models()
    prompts = [[3, 14, 15, 92, 65], [27, 18, 28]]
    router = ROUTER["gpt_oss"]
    captures = capture(LogitsStep(reference), prompts, [router], max_new_tokens=4)
    assert [len(c["model.model.layers.0.mlp.router"]) for c in captures] == [5, 5]
    assert captures[0]["model.model.layers.0.mlp.router"][0].shape == (5, EXPERTS)
    t = nc.transform(LogitsStep(model), (random_ids(2, 4, VOCAB),), dynamic_shapes=DIMS, logit_mask=None, taps=[router])
    unreplaced = logit_validation(t, LogitsStep(reference), prompts, max_new_tokens=4)
    assert not unreplaced.passed and unreplaced.max_abs_error > 1e-2
    replacer = TensorReplacer(captures, prompts)
    replaced = logit_validation(t, LogitsStep(reference), prompts, max_new_tokens=4, replacer=replacer, atol=1e-4)
    assert replaced.passed, replaced.summary()
    assert len(replaced.steps) == 8 and min(s.topk_agreement for s in replaced.steps) == 1.0


def test_validation_against_a_float64_twin_passes():
    model = tiny_decoder("llama", vocab_size=VOCAB, seed=0)
    t = nc.transform(LogitsStep(model), (random_ids(2, 4, VOCAB),), dynamic_shapes=DIMS, logit_mask=None,
                     taps=["model.layers.0.mlp"])
    twin = copy.deepcopy(model).double()
    report = logit_validation(t, LogitsStep(twin), [[5, 6, 7], [8, 9, 10, 11]], max_new_tokens=5)
    assert report.passed, report.summary()
    assert 0 < report.max_abs_error < 1e-4


def test_validation_reports_where_a_perturbed_layer_diverges():
    model = tiny_decoder("llama", vocab_size=VOCAB, seed=0)
    t = nc.transform(LogitsStep(model), (random_ids(2, 4, VOCAB),), dynamic_shapes=DIMS, logit_mask=None)
    perturbed = copy.deepcopy(model)
    torch.manual_seed(1)
    perturbed.model.layers[1].mlp.down_proj.weight.data += 0.5 * torch.randn_like(perturbed.model.layers[1].mlp.down_proj.weight)
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    report = logit_validation(t, LogitsStep(perturbed), prompts, max_new_tokens=6)
    assert not report.passed and report.divergences
    for p, prompt in enumerate(prompts):  # an independent teacher-forced loop finds the same first step
        ids, first = list(prompt), None
        for step in range(6):
            with torch.no_grad():
                mine = LogitsStep(model)(torch.tensor([ids]))[0, -1].argmax().item()
                ref = LogitsStep(perturbed)(torch.tensor([ids]))[0, -1].argmax().item()
            if mine != ref and first is None:
                first = step
            ids.append(ref)
        assert report.first_divergence(p) == first
    assert f"diverged at step {report.divergences[0].step}" in report.summary()


def test_replacement_contexts_are_per_thread():
    """Two server threads share one Transformed: each call sees its own thread's references."""
    import threading

    model = tiny_decoder("llama", vocab_size=VOCAB, seed=0)
    ids = random_ids(2, 4, VOCAB)
    t = nc.transform(LogitsStep(model), (ids,), logit_mask=None, taps=["model.layers.0.mlp"])
    (name,) = {i.tap[0] for i in t.report["tap_modules"].inputs_added}
    hidden = model.config.hidden_size
    references = [torch.full((8, hidden), 0.5), torch.full((8, hidden), -2.0)]
    expected = []
    for reference in references:
        with active_context({name: reference}):
            expected.append(t(ids))
    assert not torch.equal(expected[0], expected[1])  # the references really change the logits
    barrier, results, errors = threading.Barrier(2), {}, []

    def serve(index: int):
        try:
            set_active_context({name: references[index]})
            barrier.wait(timeout=60)  # both contexts are set before either thread calls
            results[index] = [t(ids) for _ in range(3)]
            set_active_context(None)
        except Exception as error:  # surfaced below, never a silent pass
            errors.append(error)

    threads = [threading.Thread(target=serve, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors and all(not thread.is_alive() for thread in threads)
    for index in range(2):
        assert all(torch.equal(out, expected[index]) for out in results[index])
    assert get_replacement_tensor(name) is None  # this thread never set a context
