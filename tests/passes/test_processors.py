"""The logits-processors pass: numerics against a reference written from the
semantics, the argmax-invariant pruning contract, order, empty rows, custom processors."""
from __future__ import annotations

import collections
import functools
import math

import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st

import neuron_constrain as nc
from neuron_constrain.core.errors import EmptyMaskRowError, TransformError
from neuron_constrain.kernels import (
    apply_logit_bias,
    apply_min_tokens,
    apply_min_tokens_and_logit_bias,
    apply_thinking_budget,
    pack_bool_mask,
)
from neuron_constrain.passes import process_logits_pass
from neuron_constrain.processors import (
    ENTRY_POINT_GROUP,
    BatchUpdate,
    LogitsProcessor,
    ProcessorError,
    ProcessorState,
    RequestParams,
    resolve_processors,
)
from neuron_constrain.testing import GreedyStep, SamplingStep, TopKMultinomialStep, random_ids, tiny_decoder
from conftest import require_torch_xla
from neuron_constrain.core.processor_interface import Thinking
from references import END, NEG_INF, THINK, argmax, reference_row, reference_sample

aten = torch.ops.aten
ALL = ["min_tokens", "logit_bias", "penalties", "thinking_budget", "min_p"]
BATCH_DIM = torch.export.Dim("batch")


# ----------------------------------------------------------------------------- reference, from the semantics


# ----------------------------------------------------------------------------- synthetic decoders

VOCAB, WIDTH, EOS, SLOTS = 70, 80, 3, 5


class Synthetic(torch.nn.Module):
    """Embedding -> MLP -> lm_head padded past the vocabulary, then a sampler.

    kind: "greedy" (argmax); "race" (softmax / noise, no temperature of its own);
    "race_temp" (softmax(logits / 0.7) / noise); "both" (greedy and race tokens).
    """

    def __init__(self, kind: str):
        super().__init__()
        torch.manual_seed(1)
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
        self.lm_head = torch.nn.Linear(16, WIDTH)
        with torch.no_grad():
            self.lm_head.weight.mul_(4)  # spread the logits (no mul in the graph: that would read as a temperature)
        self.kind = kind

    def logits(self, ids):
        return self.lm_head(self.body(self.embed(ids)))[:, -1]

    def forward(self, ids, noise):
        logits = self.logits(ids)
        race = (logits / 0.7 if self.kind == "race_temp" else logits).softmax(-1) / noise
        if self.kind == "greedy":
            return logits.argmax(-1)
        if self.kind == "both":
            return logits.argmax(-1), race.argmax(-1)
        return race.argmax(-1)


@functools.lru_cache(maxsize=None)
def synthetic(kind: str, empty_row="flag", logit_mask="bool"):
    module = Synthetic(kind)
    args = (torch.zeros(2, 3, dtype=torch.long), torch.ones(2, WIDTH))
    t = nc.transform(
        module, args, dynamic_shapes=({0: BATCH_DIM}, {0: BATCH_DIM}), logit_mask=logit_mask, vocab_size=VOCAB,
        empty_row=empty_row, processors=ALL, max_stop_tokens=3, max_bias_tokens=4,
    )
    return module, t


def params_strategy():
    tokens = st.integers(0, VOCAB - 1)
    return st.builds(
        RequestParams,
        min_tokens=st.sampled_from([0, 1, 4]),
        stop_token_ids=st.lists(tokens, max_size=2, unique=True),
        logit_bias=st.one_of(st.none(), st.dictionaries(tokens, st.floats(-8, 8, width=32), max_size=4)),
        min_p=st.sampled_from([0.0, 0.05, 0.3]),
        temperature=st.sampled_from([1.0, 0.5, 2.0]),
        repetition_penalty=st.sampled_from([1.0, 1.3, 0.7]),
        frequency_penalty=st.sampled_from([0.0, 0.5]),
        presence_penalty=st.sampled_from([0.0, -0.4, 1.0]),
        thinking_token_budget=st.sampled_from([None, 0, 1, 2]),
    )


@given(
    kind=st.sampled_from(["greedy", "race", "race_temp", "both"]),
    masked=st.booleans(),
    data=st.data(),
)
def test_property_graph_matches_reference_over_batch_updates(kind, masked, data):
    module, t = synthetic(kind)
    state = ProcessorState.for_model(t, SLOTS, eos_token_id=EOS, thinking=Thinking(THINK, END))
    requests: dict[int, list] = {}  # slot -> [params, prompt, outputs]
    tokens = st.integers(0, VOCAB - 1)
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    for _ in range(data.draw(st.integers(1, 3), label="steps")):
        removed = data.draw(st.lists(st.sampled_from(sorted(requests)), unique=True) if requests else st.just([]))
        for slot in removed:
            del requests[slot]
        free = [s for s in range(SLOTS) if s not in requests]
        # half the prompts end inside a thought (its start marker, then 0-1 thought tokens)
        added = [(s, data.draw(params_strategy()), data.draw(st.lists(tokens, max_size=3))
                  + data.draw(st.sampled_from([[], THINK, THINK + [7]])))
                 for s in data.draw(st.lists(st.sampled_from(free), unique=True, max_size=3) if free else st.just([]))]
        for slot, params, prompt in added:
            requests[slot] = [params, prompt, []]
        moved = data.draw(st.lists(st.tuples(st.integers(0, SLOTS - 1), st.integers(0, SLOTS - 1),
                                             st.sampled_from(["move", "swap"])).filter(lambda m: m[0] != m[1]), max_size=2))
        for a, b, how in moved:
            ra, rb = requests.pop(a, None), requests.pop(b, None)
            if ra is not None:
                requests[b] = ra
            if how == "swap" and rb is not None:
                requests[a] = rb
        batch = data.draw(st.integers(1, SLOTS), label="batch")
        state.update(BatchUpdate(batch, removed, added, moved))

        ids = torch.randint(0, VOCAB, (batch, 3), generator=generator)
        noise = torch.empty(batch, WIDTH).exponential_(generator=generator)
        allowed = torch.ones(batch, VOCAB, dtype=torch.bool)
        if masked:  # sparse grammar masks; some rows allow only EOS (min_tokens can empty them)
            allowed = torch.rand(batch, VOCAB, generator=generator) < 0.3
            allowed[:, EOS] = True
            allowed[torch.rand(batch, generator=generator) < 0.3] = False
            allowed[:, EOS] = True
        raw = module.logits(ids).detach()

        def reference_rows():
            rows = []
            for row in range(batch):
                params, prompt, outputs = requests.get(row, [RequestParams(), [], []])
                rows.append(reference_row(raw[row].tolist(), allowed[row].tolist(), params, prompt, outputs,
                                          eos=EOS, vocab=VOCAB))
            return rows, [row for row, x in enumerate(rows) if all(v == NEG_INF for v in x[:VOCAB])]

        rows, empty = reference_rows()
        if empty:
            with pytest.raises(EmptyMaskRowError) as info:
                t(ids, noise, logit_mask=allowed, **state.inputs())
            assert info.value.rows == empty
            # and the example goes on: as a runtime would, lift those rows' grammar mask
            # (min_tokens alone never empties a row: only EOS and <= 2 stop ids are banned)
            allowed[empty] = True
            rows, empty = reference_rows()
            assert empty == []
            event("an empty row named, lifted, and the example went on")
        got = t(ids, noise, logit_mask=allowed, **state.inputs())
        greedy = [argmax(x) for x in rows]
        sampled = []
        for row, x in enumerate(rows):
            params = requests.get(row, [RequestParams()])[0]
            temperature = 0.7 if kind == "race_temp" else params.temperature
            sampled.append(reference_sample(x, params, noise[row].tolist(), temperature=temperature))
        if kind == "greedy":
            assert got.tolist() == greedy
        elif kind == "both":
            assert got[0].tolist() == greedy and got[1].tolist() == sampled
        else:
            assert got.tolist() == sampled
        picked = got[1] if kind == "both" else got
        state.append_tokens(picked)
        for row, token in enumerate(picked.tolist()):
            if row in requests:
                requests[row][2].append(token)


@given(rows=st.integers(1, 4), width=st.integers(1, 9), data=st.data())
def test_property_thinking_budget_kernel_matches_the_rule(rows, width, data):
    """A row with ``left <= 0`` and an end id in ``[0, W)``: the end id's logit gains 1e9 (its argmax,
    every other token's probability 0; a masked -inf stays -inf); any other row is unchanged, bit for bit."""
    logits = torch.tensor(data.draw(st.lists(st.lists(st.one_of(st.floats(-5, 5, width=32), st.just(NEG_INF)),
                                                       min_size=width, max_size=width), min_size=rows, max_size=rows)))
    left = torch.tensor(data.draw(st.lists(st.integers(-2, 2), min_size=rows, max_size=rows)), dtype=torch.int32)
    end = torch.tensor(data.draw(st.lists(st.integers(-1, width), min_size=rows, max_size=rows)), dtype=torch.int64)
    got = apply_thinking_budget(logits, left, end)
    for r in range(rows):
        if left[r] <= 0 and 0 <= end[r] < width:
            e = int(end[r])
            assert got[r, e] == logits[r, e] + 1e9 and torch.equal(got[r, :e], logits[r, :e])
            assert torch.equal(got[r, e + 1:], logits[r, e + 1:])
            if logits[r, e].isfinite():
                assert int(got[r].argmax()) == e and got[r].softmax(-1)[e] == 1.0
        else:
            assert torch.equal(got[r], logits[r])


@given(budgets=st.lists(st.sampled_from([0, 1, 2, 3]), min_size=1, max_size=SLOTS),
       opened=st.lists(st.sampled_from([[], THINK, THINK + [7]]), min_size=SLOTS, max_size=SLOTS),
       seed=st.integers(0, 2**16))
def test_property_thinking_budget_writes_exactly_the_budget_then_the_end_marker(budgets, opened, seed):
    """Greedy decoding where every request has a budget: a thought the prompt opens (or the
    model does) gets exactly ``budget`` thought tokens, then the end marker's two tokens, forced
    on greedy rows too; the graph's tokens equal the reference's at every step."""
    module, t = synthetic("greedy")
    state = ProcessorState.for_model(t, SLOTS, eos_token_id=EOS, thinking=Thinking(THINK, END))
    batch = len(budgets)
    prompts = [[5, 9] + opened[row] for row in range(batch)]
    state.update(BatchUpdate(batch, added=[(row, RequestParams(thinking_token_budget=budgets[row]), prompts[row])
                                           for row in range(batch)]))
    generator = torch.Generator().manual_seed(seed)
    outputs = [[] for _ in range(batch)]
    for _ in range(6):
        ids = torch.randint(0, VOCAB, (batch, 3), generator=generator)
        raw = module.logits(ids).detach()
        want = [argmax(reference_row(raw[row].tolist(), [True] * VOCAB, RequestParams(
            thinking_token_budget=budgets[row]), prompts[row], outputs[row], eos=EOS, vocab=VOCAB)) for row in range(batch)]
        got = t(ids, torch.ones(batch, WIDTH), logit_mask=torch.ones(batch, VOCAB, dtype=torch.bool), **state.inputs())
        assert got.tolist() == want
        state.append_tokens(got)
        for row, token in enumerate(got.tolist()):
            outputs[row].append(token)
    for row in range(batch):  # a prompt that opened a thought: budget tokens (less those in the prompt), then END
        if opened[row]:
            written = max(budgets[row] - (len(opened[row]) - 1), 0)
            if END[0] not in outputs[row][:written]:  # (unless the model closed it itself)
                assert outputs[row][written:written + 2] == END, (budgets[row], opened[row], outputs[row])


# ----------------------------------------------------------------------------- real decoders


@pytest.mark.parametrize("arch", ["llama", "gpt_oss"])
def test_tiny_decoder_greedy_tokens_equal_reference_pipeline(arch):
    vocab, width, eos = 1000, 1024, 2
    model = tiny_decoder(arch, vocab_size=width)
    ids = random_ids(3, 5, vocab)
    t = nc.transform(GreedyStep(model), (ids,), dynamic_shapes=({0: BATCH_DIM},), vocab_size=vocab, processors=ALL)
    with torch.no_grad():
        raw = model(input_ids=ids, use_cache=False).logits[:, -1]
    first = raw[:, :vocab].argmax(-1).tolist()
    requests = [
        [RequestParams(min_tokens=2, stop_token_ids=[first[0]], min_p=0.9), ids[0].tolist(), []],
        [RequestParams(logit_bias={7: 40.0, first[1]: -1.0}, temperature=0.1), ids[1].tolist(), []],
        [RequestParams(repetition_penalty=3.0, frequency_penalty=1.0, presence_penalty=0.5), ids[2].tolist(), []],
    ]
    state = ProcessorState.for_model(t, 4, eos_token_id=eos)
    assert "min_p" not in state.inputs() and "temperature" not in state.inputs()  # pruned: greedy graph
    state.update(BatchUpdate(3, added=[(i, p, prompt) for i, (p, prompt, _) in enumerate(requests)]))
    generator = torch.Generator().manual_seed(0)
    changed = False
    for _ in range(3):
        allowed = torch.rand(3, vocab, generator=generator) < 0.5
        allowed[:, [eos, 7]] = True
        with torch.no_grad():
            raw = model(input_ids=ids, use_cache=False).logits[:, -1]
            tokens = t(ids, logit_mask=pack_bool_mask(allowed), **state.inputs())
        want = [
            argmax(reference_row(raw[r].tolist(), allowed[r].tolist(), p, prompt, out, eos=eos, vocab=vocab))
            for r, (p, prompt, out) in enumerate(requests)
        ]
        assert tokens.tolist() == want
        plain = raw[:, :vocab].masked_fill(~allowed, NEG_INF).argmax(-1)
        changed |= not torch.equal(tokens, plain)
        state.append_tokens(tokens)
        for r, token in enumerate(tokens.tolist()):
            requests[r][2].append(token)
        ids = torch.cat([ids[:, 1:], tokens[:, None]], 1)  # a sliding window: the export has a fixed length
    assert changed, "the processors never changed a token: the test proves nothing"


# ----------------------------------------------------------------------------- the pruning contract and order


def op_counts(program) -> collections.Counter:
    return collections.Counter(n.target for n in program.graph.nodes if n.op == "call_function")


def inserted(program, prefix) -> list[str]:
    return [n.name for n in program.graph.nodes if n.op == "call_function" and n.name.startswith(prefix)]


@functools.lru_cache(maxsize=None)
def llama_steps():
    model = tiny_decoder("llama", vocab_size=256, hidden_size=32)
    ids = random_ids(2, 4, 250)
    noise = torch.ones(2, 256)
    out = {}
    for kind, step, args in (("greedy", GreedyStep(model), (ids,)), ("sampling", SamplingStep(model), (ids, noise)),
                             ("topk", TopKMultinomialStep(model), (ids,))):
        with torch.no_grad():
            program = torch.export.export(step, args, dynamic_shapes=tuple({0: BATCH_DIM} for _ in args))
        out[kind] = (program, nc.transform(program, vocab_size=250), nc.transform(program, vocab_size=250, processors=ALL))
    return out


def test_pruning_contract_greedy_has_no_min_p_or_temperature():
    plain, masked, processed = llama_steps()["greedy"]
    before, after = op_counts(masked.program), op_counts(processed.program)
    added = after - before
    # min_p is amax + log + add + lt + masked_fill, temperature a div: none of them before argmax
    # (the one amax is the empty-row check after min_tokens)
    assert added[aten.log.default] == 0 and added[aten.amax.default] == 1
    assert not inserted(processed.program, "min_p") and not inserted(processed.program, "temperature")
    # min_tokens and logit_bias fused into one scatter-add (one copy of the logits), penalties the other,
    # thinking_budget a third (one column a row)
    assert added[aten.scatter_add.default] == 3 and added[aten.gather.default] == 1
    names = {i.name for i in processed.report.inputs_added}
    assert "min_p" not in names and "temperature" not in names
    [site] = processed.report["process_logits"].sites
    assert site["kind"] == "argmax"
    assert site["processors"] == ["min_tokens", "logit_bias", "penalties", "thinking_budget"]
    assert site["pruned"] == ["temperature", "min_p"]
    assert any("argmax-invariant" in note for note in processed.report["process_logits"].notes)


@pytest.mark.parametrize("kind", ["sampling", "topk"])
def test_pruning_contract_sampling_sites_get_min_p(kind):
    _, masked, processed = llama_steps()[kind]
    added = op_counts(processed.program) - op_counts(masked.program)
    assert added[aten.log.default] == 1 and added[aten.amax.default] == 2  # min_p's, and the empty-row check's
    assert inserted(processed.program, "min_p")
    report = processed.report["process_logits"]
    [site] = report.sites
    names = {i.name for i in report.inputs_added}
    if kind == "sampling":  # SamplingStep divides by its own temperature: no temperature input
        assert site["processors"] == ["min_tokens", "logit_bias", "penalties", "thinking_budget", "min_p"]
        assert "temperature" not in names and any("scales its logits itself" in n for n in report.notes)
    else:
        assert site["processors"] == ["min_tokens", "logit_bias", "penalties", "thinking_budget", "temperature", "min_p"]
        assert "temperature" in names and inserted(processed.program, "temperature")


def chain_back(node, stop: str) -> list[str]:
    """Node names from a sampling op back along its logits input to the node named ``stop``."""
    names = []
    while node.name != stop:  # follow the first [rows, V] float argument (not where's bool cond or a scalar)
        node = next(a for a in node.all_input_nodes if a.meta["val"].is_floating_point() and a.meta["val"].dim() == 2)
        names.append(node.name)
    return names


def prefixes(names) -> list[str]:
    order = []
    for name in names:
        for prefix in ("min_p", "temperature", "thinking_budget", "penalty", "logit_bias", "min_tokens", "logit_mask"):
            if name.startswith(prefix) and (not order or order[-1] != prefix):
                order.append(prefix)
    return order


def test_order_is_mask_min_tokens_bias_penalties_thinking_budget_temperature_min_p():
    _, _, processed = llama_steps()["topk"]
    topk = next(n for n in processed.program.graph.nodes if n.target == aten.topk.default)
    chain = chain_back(topk, "select")  # select: the last-position logits, the mask point
    # min_tokens and logit_bias run as one fused scatter-add (its nodes are named min_tokens_logit_bias_*)
    assert prefixes(chain) == ["min_p", "temperature", "thinking_budget", "penalty", "min_tokens", "logit_mask"]
    assert any(name.startswith("min_tokens_logit_bias") for name in chain)


@given(
    rows=st.integers(1, 3),
    width=st.integers(1, 40),
    data=st.data(),
)
def test_property_fused_min_tokens_and_logit_bias_equal_the_two_scatters(rows, width, data):
    """Bit for bit, -inf included: repeated ids, ids shared by both, padding, ids past the width."""
    ids = st.integers(-2, width + 1)
    stop_ids = torch.tensor(data.draw(st.lists(st.lists(ids, min_size=3, max_size=3), min_size=rows, max_size=rows)))
    bias_ids = torch.tensor(data.draw(st.lists(st.lists(ids, min_size=4, max_size=4), min_size=rows, max_size=rows)))
    values = torch.tensor(data.draw(st.lists(st.lists(st.floats(-8, 8, width=32) | st.just(NEG_INF), min_size=4,
                                                      max_size=4), min_size=rows, max_size=rows)))
    remaining = torch.tensor(data.draw(st.lists(st.integers(0, 2), min_size=rows, max_size=rows)), dtype=torch.int32)
    logits = torch.randn(rows, width, generator=torch.Generator().manual_seed(data.draw(st.integers(0, 99))))
    logits[:, 0] = NEG_INF if data.draw(st.booleans()) else logits[:, 0]  # a masked token stays masked
    two = apply_logit_bias(apply_min_tokens(logits, remaining, stop_ids), bias_ids, values)
    one = apply_min_tokens_and_logit_bias(logits, remaining, stop_ids, bias_ids, values)
    assert torch.equal(one, two)


def test_mixed_graph_only_the_sampling_path_gets_min_p():
    _, t = synthetic("both")
    graph = t.program.graph
    greedy = next(n for n in graph.nodes if n.target == aten.argmax.default and n.args[0].name.startswith(("logit_mask_empty", "thinking_budget")))
    softmax = next(n for n in graph.nodes if n.target in (aten._softmax.default, aten.softmax.int))
    assert prefixes([greedy.args[0].name]) == ["thinking_budget"]
    assert prefixes([softmax.args[0].name]) == ["min_p"]
    kinds = {s["kind"]: s for s in t.report["process_logits"].sites}
    assert kinds["argmax"]["pruned"] == ["temperature", "min_p"]
    assert kinds["softmax"]["processors"][-2:] == ["temperature", "min_p"]


# ----------------------------------------------------------------------------- empty rows


def test_min_tokens_masking_the_only_allowed_eos():
    allowed = torch.zeros(2, VOCAB, dtype=torch.bool)
    allowed[:, EOS] = True  # the grammar allows only EOS
    allowed[1, 10] = True
    ids, noise = torch.zeros(2, 3, dtype=torch.long), torch.ones(2, WIDTH)
    for kind in ("greedy", "race"):
        _, t = synthetic(kind)  # empty_row="flag"
        state = ProcessorState.for_model(t, 2, eos_token_id=EOS)
        state.update(BatchUpdate(2, added=[(0, RequestParams(min_tokens=3), []), (1, RequestParams(min_tokens=3), [])]))
        with pytest.raises(EmptyMaskRowError) as info:
            t(ids, noise, logit_mask=allowed, **state.inputs())
        assert info.value.rows == [0]
        assert t.report["process_logits"].outputs_added == []  # it extended the mask pass's flag
        # policy: empty_row=<eos> emits EOS in that row, in-graph
        _, t = synthetic(kind, empty_row=EOS)
        assert "logit_mask_empty" not in [o for r in t.report.passes.values() for o in r.outputs_added]
        state = ProcessorState.for_model(t, 2, eos_token_id=EOS)
        state.update(BatchUpdate(2, added=[(0, RequestParams(min_tokens=3), []), (1, RequestParams(min_tokens=3), [])]))
        assert t(ids, noise, logit_mask=allowed, **state.inputs()).tolist() == [EOS, 10]


def test_without_the_mask_pass_the_flag_is_added():
    module, t = synthetic("greedy", logit_mask=None)
    assert t.report["process_logits"].outputs_added == ["logit_mask_empty"]
    state = ProcessorState.for_model(t, 1, eos_token_id=EOS)
    state.update(BatchUpdate(1, added=[(0, RequestParams(logit_bias={EOS: 1.0}), [])]))
    ids, noise = torch.zeros(1, 3, dtype=torch.long), torch.ones(1, WIDTH)
    want = argmax(reference_row(module.logits(ids)[0].tolist(), [True] * VOCAB, RequestParams(logit_bias={EOS: 1.0}),
                                [], [], eos=EOS, vocab=VOCAB))
    assert t(ids, noise, **state.inputs()).tolist() == [want]  # runs (no empty row) and the bias is applied
    state.update(BatchUpdate(1, removed=[0], added=[(0, RequestParams(logit_bias={EOS: 100.0}), [])]))
    assert t(ids, noise, **state.inputs()).tolist() == [EOS]
    state.update(BatchUpdate(1, removed=[0], added=[(0, RequestParams(min_tokens=1, logit_bias={EOS: 100.0}), [])]))
    assert t(ids, noise, **state.inputs()).tolist() != [EOS]  # min_tokens outranks the bias
    assert "logit_mask" not in {i.name for i in t.report.inputs_added}


# ----------------------------------------------------------------------------- custom processors


class BanToken(LogitsProcessor):
    """Test processor: ban one token per row (``extra={"ban": id}``)."""

    name = "ban"
    inputs = {"token": (torch.int64, (), -1)}

    def apply(self, logits, token):
        columns = torch.arange(logits.shape[-1], device=logits.device)
        return logits.masked_fill(columns == token.unsqueeze(-1), float("-inf"))

    def row(self, params):
        return {"token": params.extra["ban"]} if "ban" in params.extra else None


class NotAProcessor:
    pass


def test_custom_processor_by_qualname_runs_in_graph():
    spec = f"{__name__}:BanToken"
    module = Synthetic("greedy")
    args = (torch.zeros(2, 3, dtype=torch.long), torch.ones(2, WIDTH))
    t = nc.transform(module, args, dynamic_shapes=({0: BATCH_DIM}, {0: BATCH_DIM}), vocab_size=VOCAB,
                     processors=["min_tokens", spec])
    assert [i.name for i in t.report.inputs_added][-1] == "ban_token"
    assert t.report["process_logits"].sites[0]["processors"] == ["min_tokens", "ban"]
    ids = random_ids(2, 3, VOCAB, seed=3)
    first = module.logits(ids)[:, :VOCAB].argmax(-1)
    state = ProcessorState.for_model(t, 2, processors=["min_tokens", spec], eos_token_id=EOS)
    state.update(BatchUpdate(2, added=[(0, RequestParams(extra={"ban": int(first[0])}), []), (1, RequestParams(), [])]))
    tokens = t(ids, args[1], **state.inputs())
    assert int(tokens[0]) != int(first[0]) and int(tokens[1]) == int(first[1])
    with pytest.raises(ProcessorError, match="do not feed; pass the processors list given to transform"):
        ProcessorState.for_model(t, 2)


def test_custom_processor_from_entry_point(tmp_path, monkeypatch):
    dist = tmp_path / "nc_test_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: nc-test-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\nban = {__name__}:BanToken\nbroken = {__name__}:NotAProcessor\n"
        f"missing = no_such_module_xyz:Thing\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    [ban] = resolve_processors(["ban"])
    assert isinstance(ban, BanToken)
    with pytest.raises(ProcessorError, match="'broken' is .*NotAProcessor.*, not a LogitsProcessor"):
        resolve_processors(["broken"])
    with pytest.raises(ProcessorError, match="entry point 'missing' does not load"):
        resolve_processors(["missing"])


def test_bad_processor_names_raise_at_start_up():
    with pytest.raises(ProcessorError, match="unknown logits processor 'min_q'"):
        resolve_processors(["min_q"])
    with pytest.raises(ProcessorError, match=r"'no_such_module_xyz:Thing' does not load \(ModuleNotFoundError"):
        resolve_processors(["no_such_module_xyz:Thing"])
    with pytest.raises(ProcessorError, match=r"does not load \(AttributeError"):
        resolve_processors([f"{__name__}:Missing"])
    with pytest.raises(ProcessorError, match="not a LogitsProcessor"):
        resolve_processors([f"{__name__}:NotAProcessor"])
    with pytest.raises(ProcessorError, match=r"\['min_p'\] named twice"):
        resolve_processors(["min_p", "min_p"])
    # at transform time, as a TransformError naming the same problem
    program = llama_steps()["greedy"][0]
    with pytest.raises(TransformError, match="unknown logits processor 'min_q'"):
        nc.transform(program, processors=["min_q"])
    with pytest.raises(TransformError, match=r"speculative decoding \(num_speculative_tokens=2\) keeps only min_tokens"):
        nc.transform(program, processors=ALL, num_speculative_tokens=2)
    spec = nc.transform(program, processors=["min_tokens"], num_speculative_tokens=2)
    assert {i.name for i in spec.report["process_logits"].inputs_added} == {"min_tokens_remaining", "min_tokens_stop_ids"}


def test_second_application_and_bad_options_raise():
    program, _, processed = llama_steps()["greedy"]
    with pytest.raises(TransformError, match="applied already"):
        process_logits_pass(processed.program)
    with pytest.raises(TransformError, match=r"max_bias_tokens=0: use an int >= 1"):
        process_logits_pass(program, max_bias_tokens=0)
    with pytest.raises(TransformError, match=r"vocab_size=300 is larger than the logits' width 256"):
        process_logits_pass(program, vocab_size=300)


def test_neutral_inputs_change_nothing_and_round_trip(tmp_path):
    program, masked, processed = llama_steps()["greedy"]
    ids = random_ids(3, 4, 250, seed=5)  # another batch size: the batch dim stayed dynamic
    assert torch.equal(processed(ids), masked(ids))
    path = tmp_path / "step.pt2"
    processed.save(path)
    loaded = torch.export.load(path).module()
    feeds = {i.name: torch.full(i.shape_for({s: 3 for s in _symbols(i)}), i.fill, dtype=i.dtype)
             for i in processed.report.inputs_added}
    out = loaded(ids, **feeds)
    assert torch.equal(out[0] if isinstance(out, tuple) else out, masked(ids))


def _symbols(info):
    import sympy

    return {d for d in info.shape if isinstance(d, sympy.Expr) and not isinstance(d, sympy.Integer)}


# ----------------------------------------------------------------------------- XLA


def test_one_xla_compilation_for_every_processor_state():
    torch_xla = require_torch_xla()
    import torch_xla.debug.metrics as met

    from neuron_constrain.decoding.xla import to_xla

    _, t = synthetic("both")
    on_xla, device = to_xla(t), torch_xla.device()
    state = ProcessorState.for_model(t, 3, eos_token_id=EOS)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (3, 3), generator=generator)
    noise = torch.empty(3, WIDTH).exponential_(generator=generator)
    allowed = torch.rand(3, VOCAB, generator=generator) < 0.5
    allowed[:, EOS] = True
    updates = [
        BatchUpdate(3, added=[(s, RequestParams(), []) for s in range(3)]),  # every processor off
        BatchUpdate(3, added=[(0, RequestParams(min_tokens=2, logit_bias={5: 30.0}), [1]),
                              (1, RequestParams(repetition_penalty=2.0, presence_penalty=1.0, min_p=0.2), [4, 5, 6]),
                              (2, RequestParams(temperature=0.3, min_p=0.5, frequency_penalty=0.5), [7])]),
        BatchUpdate(3, moved=[(0, 2, "swap")]),
    ]
    met.clear_all()
    with torch.no_grad():
        for update in updates:
            state.update(update)
            inputs = state.inputs()
            want = t(ids, noise, logit_mask=allowed, **inputs)
            got = on_xla(ids.to(device), noise.to(device), logit_mask=allowed.to(device),
                         **{k: v.to(device) for k, v in inputs.items()})
            assert [g.cpu().tolist() for g in got] == [w.tolist() for w in want]
            state.append_tokens(want[1])
    data = met.metric_data("CompileTime")
    assert (0 if data is None else data[0]) == 1, "expected one XLA compilation for every processor state"
