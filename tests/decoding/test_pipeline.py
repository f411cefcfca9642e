"""The pipelined step: the body runs (worker thread / XLA async dispatch) while the
host fills the grammar masks, then the head. Token-identical to the serial step over
a static-cache decode with real xgrammar fills, on CPU eager and torch-xla (one
compilation per half); a pipelined ``generate`` equals the serial one token for token;
the worker's thread budget is its own; errors in the body or the fill surface as
themselves, and a hung body times out (bounded waits, never a hang)."""
from __future__ import annotations

import gc
import threading
import time

import pytest
import torch

import neuron_constrain as nc
from neuron_constrain import structured as S
from neuron_constrain.decoding.pipeline import PipelinedStep, PipelineTimeout, split_step
from neuron_constrain.structured.runtime.structured_runtime import StructuredRuntime
from neuron_constrain.testing import CachedGreedyStep, GreedyStep, tiny_decoder, toy_tokenizer
from references import fresh
from conftest import require_torch_xla

BATCH, MODEL_VOCAB = 4, 768
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


@pytest.fixture(scope="module")
def vocab():
    return toy_tokenizer()


@pytest.fixture(scope="module")
def cached(vocab):
    model = tiny_decoder("llama", vocab_size=MODEL_VOCAB, seed=3)
    step = CachedGreedyStep(model, batch_size=BATCH, max_cache_len=32)
    return nc.transform(step, step.example_inputs(vocab.vocab_size), vocab_size=vocab.vocab_size)


CONSTRAINTS = [S.json_schema(SCHEMA), S.regex(r"(yes|no) [0-9]{2}"), None, S.choice(["red", "green", "blue"])]


class _Body(torch.nn.Module):
    """Stands in for a split's body module (an nn.Module attribute of ``Transformed``)."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


def decode(step_fn, vocab, steps: int) -> list[list[int]]:
    """A structured decode over the static cache: ``step_fn(ids, position, fill)`` per step,
    real xgrammar fills, requests started at different grammar states. xgrammar alone: ``auto``'s race
    would let the decodes' masks differ by when xgrammar's grammar was ready (the engines tokenize forced
    text differently; under CI load one decode was served by each)."""
    runtime = StructuredRuntime(vocab, max_rows=BATCH, engine="xgrammar")
    for request, constraint in enumerate(CONSTRAINTS):
        runtime.add(request, constraint)
    deadline = time.perf_counter() + 60
    while len(runtime.ready(list(range(BATCH)))) < BATCH and time.perf_counter() < deadline:
        runtime.wait(list(range(BATCH)), timeout=5)  # grammars compile in the runtime's pool
    runtime.accept(0, vocab.encode('{"name'))  # request 0 is inside its JSON object already
    batch = list(range(BATCH))
    ids = torch.tensor([[vocab.eos_id]] * BATCH)
    out = []
    for position in range(steps):
        tokens = step_fn(ids, torch.tensor([position]), lambda: {"logit_mask": runtime.step(batch)})
        finished = runtime.accept_rows(batch, tokens).finished
        out.append(tokens.tolist())
        for request in finished:  # finished rows keep decoding their stop token (the row allows only that)
            assert int(tokens[request]) in runtime.stop_token_ids
        ids = tokens[:, None]
    runtime.close()
    return out


def test_pipelined_decode_equals_serial_with_kv_cache_and_real_fills(cached, vocab):
    serial_step = fresh(cached)
    serial = decode(lambda ids, pos, fill: serial_step(ids, pos, **fill()), vocab, 12)
    split = split_step(fresh(cached))
    with PipelinedStep(split, body_threads=1, timeout=60) as step:
        pipelined = decode(lambda ids, pos, fill: step((ids, pos), fill=fill), vocab, 12)
        assert step.last_fill_seconds > 0 and step.last_body_seconds > 0
        assert step.worker_threads == 1
    assert pipelined == serial
    assert len({tuple(t) for t in serial}) > 3  # the tokens change: constrained rows follow their grammars


def test_pipelined_generate_equals_serial(vocab):
    model = tiny_decoder("llama", vocab_size=MODEL_VOCAB, seed=1)
    ids = torch.zeros(2, 8, dtype=torch.long)
    transformed = S.transform_decoder(GreedyStep(model), (ids,), vocab_size=vocab.vocab_size,
                                      dynamic_shapes=({0: torch.export.Dim("batch")},))
    prompts = ["user:", "pick:", "x", "say"]
    # one engine: auto's race may move a request at another token in each run (both answers valid, not identical)
    serial = S.generate(transformed, prompts, CONSTRAINTS, 24, tokenizer=vocab, engine="xgrammar")
    pipelined = S.generate(transformed, prompts, CONSTRAINTS, 24, tokenizer=vocab, pipelined=True, engine="xgrammar")
    assert [o.tokens for o in pipelined.outputs] == [o.tokens for o in serial.outputs]
    assert [o.finish_reason for o in pipelined.outputs] == [o.finish_reason for o in serial.outputs]
    assert any(o.finish_reason == "stop" for o in serial.outputs)  # a request finished (the batch shrank)


def test_the_body_thread_budget_is_its_own(cached):
    before = torch.get_num_threads()
    seen = {}
    split = split_step(fresh(cached))
    body = split.body.graph_module

    class Probe(torch.nn.Module):  # records the thread count where the body runs
        def forward(self, *args, **kwargs):
            seen["threads"], seen["thread"] = torch.get_num_threads(), threading.current_thread().name
            return body(*args, **kwargs)

    split.body.graph_module = Probe()
    with PipelinedStep(split, body_threads=1) as step:
        ids, position = cached.program.example_inputs[0]
        step((ids, position))
    assert seen == {"threads": 1, "thread": seen["thread"]} and seen["thread"] != threading.current_thread().name
    assert torch.get_num_threads() == before, "the worker's budget leaked into the caller's thread"


class Rendezvous:
    """Proof of overlap from events, not wall time: each side marks that it started, then
    waits (bounded) for the other to start. Both see the other only if each started
    before the other ended; run one after the other, the first side's wait times out."""

    def __init__(self, timeout: float = 10.0):
        self.timeout = timeout
        self.started = {"body": threading.Event(), "fill": threading.Event()}
        self.saw_other: dict[str, bool] = {}

    def arrive(self, side: str) -> None:
        other = "fill" if side == "body" else "body"
        self.started[side].set()
        self.saw_other[side] = self.started[other].wait(self.timeout)


def test_the_fill_overlaps_the_body(cached):
    split = split_step(fresh(cached))
    ids, position = cached.program.example_inputs[0]
    body = split.body.graph_module
    meeting: list[Rendezvous] = []  # armed for the measured call only

    def met_body(*args, **kwargs):
        for m in meeting:
            m.arrive("body")
        return body(*args, **kwargs)

    split.body.graph_module = _Body(met_body)
    with PipelinedStep(split, timeout=30) as step:
        step((ids, position))  # the worker starts
        meeting.append(Rendezvous())
        step((ids, position), fill=lambda: meeting[0].arrive("fill"))
    assert meeting[0].saw_other == {"body": True, "fill": True}, (
        f"the body and the fill did not run at the same time (each saw the other start: {meeting[0].saw_other})")
    assert step.last_fill_seconds > 0 and step.last_body_seconds > 0


# ----------------------------------------------------------------------------- errors


def test_a_body_error_surfaces_as_itself(cached):
    split = split_step(fresh(cached))
    ids, position = cached.program.example_inputs[0]
    filled = []
    with PipelinedStep(split, timeout=30) as step:
        start = time.perf_counter()
        with pytest.raises(IndexError, match="index out of range"):
            step((ids + 10_000, position), fill=lambda: filled.append(1))  # ids past the embedding
        assert time.perf_counter() - start < 30 and filled == [1]
        assert step((ids, position)).shape == (BATCH,)  # the step still works


def test_a_fill_error_surfaces_after_the_body_finished(cached):
    split = split_step(fresh(cached))
    ids, position = cached.program.example_inputs[0]
    done, fill_failing = threading.Event(), threading.Event()
    body = split.body.graph_module

    def slow_body(*args, **kwargs):  # still running when the fill raises: it waits for the fill's error
        assert fill_failing.wait(30), "the fill never ran"
        out = body(*args, **kwargs)
        done.set()
        return out

    split.body.graph_module = _Body(slow_body)

    def bad_fill():
        fill_failing.set()
        raise ValueError("grammar exploded")

    with PipelinedStep(split, timeout=30) as step:
        with pytest.raises(ValueError, match="grammar exploded"):
            step((ids, position), fill=bad_fill)
        assert done.is_set(), "the fill's error was raised while the body was still running"


def test_a_hung_body_times_out_and_the_step_refuses_after(cached):
    split = split_step(fresh(cached))
    ids, position = cached.program.example_inputs[0]
    release = threading.Event()
    split.body.graph_module = _Body(lambda *a, **k: release.wait(20))
    step = PipelinedStep(split, timeout=0.5)
    try:
        start = time.perf_counter()
        with pytest.raises(PipelineTimeout, match="did not finish within 0.5 s"):
            step((ids, position))
        assert time.perf_counter() - start < 5
        with pytest.raises(PipelineTimeout, match="unusable"):
            step((ids, position))
    finally:
        release.set()
        step.close()


# ----------------------------------------------------------------------------- XLA


def test_pipelined_on_xla_equals_serial_with_one_compilation_per_half(cached, vocab):
    torch_xla = require_torch_xla()
    import torch_xla.debug.metrics as met

    serial_step = fresh(cached)
    serial = decode(lambda ids, pos, fill: serial_step(ids, pos, **fill()), vocab, 6)
    on_xla = split_step(fresh(cached)).to()
    device = torch_xla.device()
    gc.collect()  # an earlier test's lazy tensors: freed, or synced here, before counting
    torch_xla.sync()
    met.clear_all()
    step = PipelinedStep(on_xla)
    pipelined = decode(lambda ids, pos, fill: step((ids.to(device), pos.to(device)), fill=fill).cpu(), vocab, 6)
    assert pipelined == serial
    assert met.metric_data("CompileTime")[0] == 2, "expected one compilation for the body and one for the head"


def test_on_xla_the_fill_runs_while_the_body_is_traced_and_its_error_surfaces(cached):
    torch_xla = require_torch_xla()
    on_xla = split_step(fresh(cached)).to()
    device = torch_xla.device()
    ids, position = (t.to(device) for t in cached.program.example_inputs[0])
    body = on_xla.body.graph_module
    traced_on = []
    meeting: list[Rendezvous] = []  # armed for the measured call only

    def traced(*args, **kwargs):  # host work while the body is traced
        traced_on.append(threading.current_thread())
        for m in meeting:
            m.arrive("body")
        return body(*args, **kwargs)

    on_xla.body.graph_module = _Body(traced)
    filled_on = []

    def fill():
        filled_on.append(threading.current_thread())
        meeting[0].arrive("fill")

    with PipelinedStep(on_xla, timeout=30) as step:
        step((ids, position)).cpu()  # compilations and the worker's start
        meeting.append(Rendezvous())
        step((ids, position), fill=fill).cpu()
        assert meeting[0].saw_other == {"body": True, "fill": True}, (
            f"tracing the body and the fill did not run at the same time (each saw the other start: "
            f"{meeting[0].saw_other})")
        assert traced_on[-1] is threading.main_thread() and filled_on[-1] is not threading.main_thread()
        assert step.last_fill_seconds > 0
        meeting.clear()

        def bad_fill():
            raise ValueError("grammar exploded")

        with pytest.raises(ValueError, match="grammar exploded"):
            step((ids, position), fill=bad_fill)
        assert step((ids, position)).cpu().shape == (BATCH,)  # the step still works
