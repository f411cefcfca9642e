"""Fuzzing the public call surface with hypothesis: whatever a caller feeds, the answer
is this library's documented error (``InputError``, ``EmptyMaskRowError``,
``ProcessorError``) with a message naming the input, or the correct result. Never a
raw torch / ``IndexError`` traceback, never a bad input silently taken.

- ``logit_mask``: random dtype, shape (rank, rows, width), device (cpu, meta, and
  the XLA device where torch-xla is installed), layout (non-contiguous), non-tensor
  values, fed to packed and bool graphs. The oracle: a valid mask gives the tokens
  of the untransformed decoder's eager logits masked by hand (or the rows that
  allow nothing, named); an invalid one an ``InputError`` stating what is wrong.
- ``RequestParams`` / ``BatchUpdate`` / ``append_tokens``: random (valid and
  invalid) processor parameters, slots, batch sizes, move kinds and sampled tokens
  on a step transformed with every built-in processor. A valid request's tokens
  equal the reference of ``test_processors``.

Example counts are set here (see ``MASK_EXAMPLES`` / ``PROCESSOR_EXAMPLES``: the counts
under the ci profile, above its default since the graphs are small synthetic decoders and a
case costs milliseconds); ``examples()`` scales them for the long profile.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math

import pytest
from conftest import LANE, examples
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

import neuron_constrain as nc
from neuron_constrain.core.errors import EmptyMaskRowError, InputError
from neuron_constrain.kernels import pack_bool_mask, packed_width, unpack_bitmask
from neuron_constrain.processors import BatchUpdate, ProcessorError, ProcessorState, RequestParams
from references import argmax, reference_row, reference_sample

VOCAB, WIDTH, EOS, SLOTS = 70, 80, 3, 4
PACKED = packed_width(VOCAB)  # 3 int32 words
BATCH_DIM = torch.export.Dim("batch", max=8)
MASK_EXAMPLES, PROCESSOR_EXAMPLES = examples(150), examples(100)
# The main lane always fuzzes the xla device (a broken torch-xla fails there, never drops out); others when installed.
HAS_XLA = LANE == "main" or importlib.util.find_spec("torch_xla") is not None
ALL = ["min_tokens", "logit_bias", "penalties", "min_p"]


class Decoder(torch.nn.Module):
    """Embedding -> MLP -> lm_head padded past the vocabulary, then greedy (argmax of
    the last position) or an exponential race (``softmax / noise``: a sampling site)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        torch.manual_seed(3)
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
        self.lm_head = torch.nn.Linear(16, WIDTH)
        with torch.no_grad():
            self.lm_head.weight.mul_(4)

    def logits(self, ids):
        return self.lm_head(self.body(self.embed(ids)))[:, -1]

    def forward(self, ids, noise):
        logits = self.logits(ids)
        return logits.argmax(-1) if self.kind == "greedy" else (logits.softmax(-1) / noise).argmax(-1)


@functools.lru_cache(maxsize=None)
def transformed(fmt: str, kind: str = "greedy", processors: tuple = ()):
    decoder = Decoder(kind)
    args = (torch.zeros(2, 3, dtype=torch.long), torch.ones(2, WIDTH))
    t = nc.transform(decoder, args, dynamic_shapes=({0: BATCH_DIM}, {0: BATCH_DIM}), logit_mask=fmt,
                     vocab_size=VOCAB, processors=list(processors) or None, max_stop_tokens=3, max_bias_tokens=4,
                     max_penalty_tokens=12)
    return decoder, t


def step_inputs(batch: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (batch, 3), generator=generator)
    return ids, torch.empty(batch, WIDTH).exponential_(generator=generator)


def reference(decoder: Decoder, ids, noise, allowed: torch.Tensor | None) -> torch.Tensor:
    """The untransformed decoder's eager logits, masked by hand, through its own sampler."""
    with torch.no_grad():
        logits = decoder.logits(ids)
    logits[:, VOCAB:] = float("-inf")
    if allowed is not None:
        logits[:, :VOCAB] = logits[:, :VOCAB].masked_fill(~allowed, float("-inf"))
    return logits.argmax(-1) if decoder.kind == "greedy" else (logits.softmax(-1) / noise).argmax(-1)


# ----------------------------------------------------------------------------- logit_mask

DTYPES = [torch.int32, torch.bool, torch.int64, torch.int16, torch.int8, torch.uint8, torch.float32,
          torch.float16, torch.bfloat16, torch.float64, torch.complex64]
DEVICES = ["cpu", "meta"] + (["xla"] if HAS_XLA else [])


ASPECTS = ["dtype", "rows", "width", "rank", "device", "type"]


@st.composite
def masks(draw, fmt: str, batch: int):
    """A logit_mask value: valid (random rows, some allowing nothing), omitted, or the
    valid spec with one to three aspects broken (dtype, rows, width, rank, device, type)."""
    mode = draw(st.sampled_from(["valid"] * 3 + ["omitted"] + ["broken"] * 4))
    if mode == "omitted":
        return None
    broken = draw(st.sets(st.sampled_from(ASPECTS), min_size=1, max_size=3)) if mode == "broken" else set()
    dtype, width = (torch.int32, PACKED) if fmt == "packed" else (torch.bool, VOCAB)
    rows = batch
    if "dtype" in broken:
        dtype = draw(st.sampled_from([d for d in DTYPES if d != dtype]))
    if "rows" in broken:
        rows = draw(st.sampled_from(sorted({batch + 1, batch - 1, 0} - {batch})))
    if "width" in broken:
        width = draw(st.sampled_from([w for w in (PACKED, VOCAB, WIDTH, PACKED + 1, VOCAB - 1, 1, 0, 32)
                                      if w != width]))
    shape = (rows, width)
    if "rank" in broken:
        shape = draw(st.sampled_from([(width,), (rows, 1, width), (rows, width, 1), ()]))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    density = draw(st.sampled_from([0.0, 0.02, 0.3, 1.0]))
    if dtype == torch.int32 and len(shape) == 2 and shape[1] == PACKED and not draw(st.booleans()):
        allowed = torch.rand(shape[0], VOCAB, generator=generator) < density
        value = pack_bool_mask(allowed)
        if draw(st.booleans()):  # bits at or past token 70 are set too: they must not count
            value[:, -1] |= -1 << (VOCAB % 32)
    elif dtype == torch.bool:
        value = torch.rand(shape, generator=generator) < density
    elif dtype == torch.complex64 or dtype.is_floating_point:
        value = (torch.rand(shape, generator=generator) < density).to(dtype)
    else:  # random words of the integer dtype
        info = torch.iinfo(dtype)
        value = torch.randint(max(info.min, -2**31), min(info.max, 2**31 - 1) + 1, shape, generator=generator,
                              dtype=torch.int64).to(dtype)
    for row in draw(st.sets(st.integers(0, max(shape[0] - 1, 0)), max_size=2)) if len(shape) == 2 else ():
        if row < shape[0]:
            value[row] = 0  # a row that allows nothing
    if "type" in broken:
        return draw(st.sampled_from([value.tolist(), (value.real if value.is_complex() else value).float().numpy(), 1, "all"]))
    if len(shape) == 2 and draw(st.booleans()):  # the same values, non-contiguous
        value = value.t().contiguous().t()
    if "device" in broken:
        device = draw(st.sampled_from(DEVICES[1:]))
        if device == "meta":
            value = value.to("meta")
        else:
            import torch_xla

            value = value.to(torch_xla.device())
    return value


def problems(value, fmt: str, batch: int) -> list[str]:
    """What is wrong with a mask value, each as a fragment the error message must hold."""
    if value is None:
        return []
    if not isinstance(value, torch.Tensor):
        return ["must be a tensor"]
    dtype, width = (torch.int32, PACKED) if fmt == "packed" else (torch.bool, VOCAB)
    found = []
    if value.dtype != dtype:
        found.append(f"dtype {value.dtype} but the graph takes {dtype}")
    if tuple(value.shape) != (batch, width):
        found.append(f"shape {tuple(value.shape)} but these inputs need {(batch, width)}")
    if value.device.type != "cpu":
        found.append(f"is on {value.device} but the model's inputs are on cpu")
    return found


@pytest.mark.parametrize("fmt, kind", [("packed", "greedy"), ("bool", "greedy"), ("packed", "race")])
@settings(max_examples=MASK_EXAMPLES)
@given(data=st.data(), batch=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_fuzz_logit_mask(fmt, kind, data, batch, seed):
    decoder, t = transformed(fmt, kind)
    ids, noise = step_inputs(batch, torch.Generator().manual_seed(seed))
    value = data.draw(masks(fmt, batch), label="logit_mask")
    wrong = problems(value, fmt, batch)
    kwargs = {} if value is None else {"logit_mask": value}
    if wrong:
        with pytest.raises(InputError) as info:
            t(ids, noise, **kwargs)
        message = str(info.value)
        assert message.startswith("logit_mask "), message
        assert any(w in message for w in wrong), (wrong, message)
        what = message.split()[1:3]  # "must be" / "has dtype" / "has shape" / "is on"
        if what == ["has", "dtype"] and fmt == "packed" and value.dtype == torch.bool:
            assert "pack_bool_mask" in message, message  # the fix for a bool mask, not .to(int32)
        if what == ["has", "shape"] and fmt == "packed":
            assert "ceil(70/32) = 3 int32 words" in message, message
        event("refused: " + " ".join(what))
        return
    allowed = None
    if value is not None:
        allowed = unpack_bitmask(value.contiguous(), VOCAB) if fmt == "packed" else value
    empty = [] if allowed is None else [r for r in range(batch) if not bool(allowed[r].any())]
    if empty:
        with pytest.raises(EmptyMaskRowError) as info:
            t(ids, noise, **kwargs)
        assert info.value.rows == empty
        assert "logit_mask allows no token in row(s)" in str(info.value)
        event("empty rows named")
        return
    tokens = t(ids, noise, **kwargs)
    event("tokens equal the reference" + (" (mask omitted)" if value is None else ""))
    assert torch.equal(tokens, reference(decoder, ids, noise, allowed)), (tokens, allowed)


def test_fuzz_mask_helpers_agree_with_the_graph():
    # the helpers the messages point to produce what the graph takes
    decoder, t = transformed("packed")
    ids, noise = step_inputs(3, torch.Generator().manual_seed(1))
    allowed = torch.rand(3, VOCAB, generator=torch.Generator().manual_seed(2)) < 0.3
    allowed[:, 5] = True
    assert torch.equal(t(ids, noise, logit_mask=pack_bool_mask(allowed)), reference(decoder, ids, noise, allowed))
    with pytest.raises(InputError, match="pack_bool_mask"):
        t(ids, noise, logit_mask=allowed)


@settings(max_examples=MASK_EXAMPLES)
@given(positional=st.integers(0, 3), keywords=st.sets(st.sampled_from(["ids", "noise", "logit_mask", "input_ids", "scael"])))
def test_fuzz_call_signature(positional, keywords):
    # inputs by position or by their exported names; a missing, doubled or unknown one is an InputError
    decoder, t = transformed("packed")
    ids, noise = step_inputs(2, torch.Generator().manual_seed(positional))
    values = {"ids": ids, "noise": noise, "logit_mask": torch.full((2, PACKED), -1, dtype=torch.int32),
              "input_ids": ids, "scael": 2.0}
    args = [ids, noise, noise][:positional]
    kwargs = {k: values[k] for k in keywords}
    names = ["ids", "noise"]
    valid = (positional <= 2 and all(n in keywords for n in names[positional:])
             and not any(n in keywords for n in names[:positional]) and not keywords & {"input_ids", "scael"})
    if valid:
        assert torch.equal(t(*args, **kwargs), reference(decoder, ids, noise, None))
        event("called")
        return
    with pytest.raises(InputError, match=r"this program takes 2 positional input\(s\) \(ids, noise\)") as info:
        t(*args, **kwargs)
    for unknown in sorted(keywords & {"input_ids", "scael"}):
        if positional <= 2:
            assert repr(unknown) in str(info.value), str(info.value)
    event("refused")


# ----------------------------------------------------------------------------- processors

TOKEN = st.integers(0, VOCAB - 1)
BAD_TOKEN = st.sampled_from([-1, VOCAB, 10**6, 2.5, True])
BAD_FLOAT = st.sampled_from([math.nan, math.inf, -math.inf])
BROKEN = ["batch", "slot", "min_tokens", "stop", "stop_count", "bias_id", "bias_value", "bias_count", "min_p",
          "temperature", "rep", "freq", "pres", "prompt", "prompt_count", "move_slot", "move_kind"]


@st.composite
def request_params(draw, broken: str | None) -> RequestParams:
    """Valid parameters, except the one field ``broken`` names (the oracle is params_problems)."""
    def pick(name, good, bad):
        return draw(bad if broken == name else good)

    stops = pick("stop", st.lists(TOKEN, max_size=2), st.lists(BAD_TOKEN, min_size=1, max_size=2))
    if broken == "stop_count":  # four stop ids with EOS: more than max_stop_tokens=3
        stops = draw(st.lists(st.integers(EOS + 1, VOCAB - 1), min_size=3, max_size=3, unique=True))
    bias = draw(st.one_of(st.none(), st.dictionaries(TOKEN, st.floats(-8, 8) | st.just(-math.inf), max_size=4)))
    if broken == "bias_id":
        bias = {**(bias or {}), draw(BAD_TOKEN): 1.0}
    elif broken == "bias_value":
        bias = {**(bias or {}), draw(TOKEN): draw(st.sampled_from([math.nan, math.inf, "1.0", None]))}
    elif broken == "bias_count":
        bias = {t: 1.0 for t in draw(st.lists(TOKEN, min_size=5, max_size=6, unique=True))}
    return RequestParams(
        min_tokens=pick("min_tokens", st.integers(0, 3), st.sampled_from([-1, 2.5, True]))
        if broken != "stop_count" else draw(st.integers(1, 3)),
        stop_token_ids=stops,
        logit_bias=bias,
        min_p=pick("min_p", st.sampled_from([0.0, 0.05, 0.3, 1.0]), st.sampled_from([-0.1, 1.5, math.nan])),
        temperature=pick("temperature", st.sampled_from([1.0, 0.5, 2.0]) | st.floats(0.2, 4),
                         st.sampled_from([0.0, -1.0, math.nan, math.inf])),
        repetition_penalty=pick("rep", st.sampled_from([1.0, 1.3, 0.7]), st.sampled_from([0.0, -1.0, math.inf, math.nan])),
        frequency_penalty=pick("freq", st.sampled_from([0.0, 0.5]) | st.floats(-2, 2), BAD_FLOAT),
        presence_penalty=pick("pres", st.sampled_from([0.0, -0.4, 1.0]) | st.floats(-2, 2), BAD_FLOAT),
    )


def params_problems(params: RequestParams, prompt: list, *, sampling: bool) -> list[str]:
    """Fragments the ProcessorError must hold (any one), from the documented constraints:
    every parameter is checked whichever processors the graph runs; the graph's fixed
    sizes (S=3 stop ids, K=4 biases, L=12 seen tokens) only where the request uses them."""
    found = []
    index = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
    outside = lambda ids: [i for i in ids if not index(i) or not 0 <= i < VOCAB]  # noqa: E731
    if not index(params.min_tokens) or params.min_tokens < 0:
        found.append(f"min_tokens={params.min_tokens!r}")
    elif params.min_tokens > 0 and len(dict.fromkeys([*params.stop_token_ids, EOS])) > 3:
        found.append("max_stop_tokens=3")
    if outside(params.stop_token_ids):
        found.append(f"stop_token_ids has ids {outside(params.stop_token_ids)}")
    if params.logit_bias:
        if len(params.logit_bias) > 4:
            found.append("max_bias_tokens=4")
        if outside(params.logit_bias):
            found.append(f"logit_bias has ids {outside(params.logit_bias)}")
        values = list(params.logit_bias.values())
        if not all(isinstance(v, (int, float)) for v in values):
            found.append("must be numbers")
        elif any(math.isnan(v) or v == math.inf for v in values):
            found.append("include NaN or +inf")
    rep, freq, pres = params.repetition_penalty, params.frequency_penalty, params.presence_penalty
    if not (0 < rep < math.inf) or not (math.isfinite(freq) and math.isfinite(pres)):
        found.append(f"repetition={rep}, frequency={freq}, presence={pres}")
    elif (rep, freq, pres) != (1.0, 0.0, 0.0) and len(set(prompt)) > 12:
        found.append("max_penalty_tokens=12")
    if outside(prompt):
        found.append(f"prompt/output token ids has ids {outside(prompt)}")
    temperature = params.temperature  # a sampling graph divides by it; a greedy one also takes 0
    temperature_ok = (0 < temperature if sampling else 0 <= temperature) and temperature < math.inf
    if not 0.0 <= params.min_p <= 1.0 or not temperature_ok:
        found.append(f"min_p={params.min_p}, temperature={params.temperature}")
    return found


@pytest.mark.parametrize("kind", ["greedy", "race"])
@settings(max_examples=PROCESSOR_EXAMPLES)
@given(data=st.data())
def test_fuzz_processor_state(kind, data):
    decoder, t = transformed("bool", kind, tuple(ALL))
    state = ProcessorState.for_model(t, SLOTS, eos_token_id=EOS)
    live: dict[int, list] = {}  # slot -> [params, prompt, outputs]
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    for _ in range(data.draw(st.integers(1, 3), label="steps")):
        broken = data.draw(st.sampled_from([None] * len(BROKEN) + BROKEN), label="broken")
        pick = lambda name, good, bad: data.draw(bad if broken == name else good, label=name)  # noqa: E731
        batch = pick("batch", st.sampled_from([1, 2, SLOTS, 0]), st.sampled_from([SLOTS + 1, -1, 1.5]))
        slot = pick("slot", st.integers(0, SLOTS - 1), st.sampled_from([SLOTS, -1, 1.5, True]))
        params = data.draw(request_params(broken), label="params")
        prompt = pick("prompt", st.lists(TOKEN, max_size=6), st.lists(BAD_TOKEN, min_size=1, max_size=2))
        if broken == "prompt_count":  # 13 distinct tokens seen, more than max_penalty_tokens=12, with a penalty on
            prompt = list(range(13))
            params = dataclasses.replace(params, presence_penalty=1.0)
        move = data.draw(st.sampled_from([(), ((0, 1, "swap"),), ((1, 0, "move"),)]), label="moved")
        if broken == "move_slot":
            move = ((0, SLOTS, "move"),)
        elif broken == "move_kind":
            move = ((0, 1, "copy"),)
        update = BatchUpdate(batch, removed=[slot] if slot in live else [], added=[(slot, params, prompt)], moved=move)
        wrong = []
        if not isinstance(batch, int) or not 0 <= batch <= SLOTS:
            wrong.append(f"batch_size={batch}")
        if not (isinstance(slot, int) and not isinstance(slot, bool)) or not 0 <= slot < SLOTS:
            wrong.append(f"batch slot {slot}")
        wrong += params_problems(params, prompt, sampling=kind != "greedy")
        if move and (move[0][1] >= SLOTS):
            wrong.append(f"batch slot {move[0][1]}")
        if move and move[0][2] not in ("move", "swap"):
            wrong.append("move kind 'copy'")
        if wrong:
            with pytest.raises(ProcessorError) as info:
                state.update(update)
            assert any(w in str(info.value) for w in wrong), (wrong, str(info.value))
            event("update refused")
            # the refused update may have applied its removals already: go on from a clean state
            state = ProcessorState.for_model(t, SLOTS, eos_token_id=EOS)
            live = {}
            continue
        state.update(update)
        live.pop(slot, None)
        live[slot] = [params, list(prompt), []]
        for a, b, how in move:
            ra, rb = live.pop(a, None), live.pop(b, None)
            if ra is not None:
                live[b] = ra
            if how == "swap" and rb is not None:
                live[a] = rb
        if batch == 0:
            continue
        ids, noise = step_inputs(batch, generator)
        allowed = torch.rand(batch, VOCAB, generator=generator) < 0.4
        allowed[:, EOS] = True
        raw = decoder.logits(ids).detach()
        rows = []
        for row in range(batch):
            p, pr, out = live.get(row, [RequestParams(), [], []])
            rows.append(reference_row(raw[row].tolist(), allowed[row].tolist(), p, pr, out, eos=EOS, vocab=VOCAB))
        empty = [r for r, x in enumerate(rows) if all(v == -math.inf for v in x[:VOCAB])]
        if empty:
            with pytest.raises(EmptyMaskRowError) as info:
                t(ids, noise, logit_mask=allowed, **state.inputs())
            assert info.value.rows == empty
            event("empty rows named")
            continue
        tokens = t(ids, noise, logit_mask=allowed, **state.inputs())
        event("tokens equal the reference")
        if kind == "greedy":
            want = [argmax(x) for x in rows]
        else:
            want = [reference_sample(x, live.get(r, [RequestParams()])[0], noise[r].tolist(),
                                     temperature=live.get(r, [RequestParams()])[0].temperature)
                    for r, x in enumerate(rows)]
        assert tokens.tolist() == want
        # append_tokens: a wrong row count or an out-of-vocabulary token is refused
        bad = data.draw(st.sampled_from([None, "rows", "token"]), label="append")
        if bad == "rows":
            with pytest.raises(ProcessorError, match=f"append_tokens got {batch + 1} rows but the batch has {batch}"):
                state.append_tokens(torch.cat([tokens, tokens[:1]]))
        elif bad == "token":  # refused whether or not a processor counts it, before any row changes
            before = {k: v.clone() for k, v in state.inputs().items()}
            with pytest.raises(ProcessorError, match=r"sampled tokens has ids \[70\] outside the vocabulary \[0, 70\)"):
                state.append_tokens(torch.cat([tokens[:-1], torch.tensor([VOCAB])]))
            assert all(torch.equal(v, state.inputs()[k]) for k, v in before.items())
        state.append_tokens(tokens)
        for row, token in enumerate(tokens.tolist()):
            if row in live:
                live[row][2].append(token)
