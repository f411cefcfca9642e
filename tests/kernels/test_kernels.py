"""Bitmask kernels: numerics against xgrammar and a plain reference, errors, export, XLA.

The plain reference reads the format's definition directly (token ``t`` allowed iff
bit ``t % 32`` of word ``t // 32`` is 1, LSB first) through an *unsigned* view of the
words, so it shares no code or bit trick with the kernels (which AND with powers of
two on int32). xgrammar's own CPU kernel (``apply_token_bitmask_inplace``) and its
C++ token lister are the second reference. xgrammar with ``vocab_size`` leaves
logits columns at or past it untouched, where ours disallows them: comparisons are on
``[:vocab_size]`` and the rest is asserted ``-inf``.
"""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import xgrammar
import xgrammar.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from neuron_constrain.kernels import (
    ALL_ALLOWED_WORD,
    allowed_columns,
    apply_bitmask,
    empty_rows,
    masked_argmax,
    pack_bool_mask,
    packed_width,
    unpack_bitmask,
)
from conftest import examples, require_torch_xla

aten = torch.ops.aten
NEG_INF = float("-inf")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SIGN_BIT = -(2**31)  # bit 31 as an int32 word

# Kept small: these run on a shared 2-core machine, on two lanes (examples() scales them for the long profile).
FEW = settings(max_examples=examples(25), deadline=None)
SOME = settings(max_examples=examples(60), deadline=None)


# ----------------------------------------------------------------------------- references


def ref_allowed(packed: torch.Tensor, vocab_size: int) -> np.ndarray:
    """bool [rows, vocab_size] straight from the format's definition (unsigned words)."""
    words = packed.numpy().view(np.uint32)
    t = np.arange(vocab_size)
    return ((words[:, t // 32] >> (t % 32).astype(np.uint32)) & np.uint32(1)).astype(bool)


def ref_pack(allowed: np.ndarray) -> torch.Tensor:
    """bool [rows, V] -> int32 words, bits past V zero, built from the definition."""
    rows, vocab = allowed.shape
    width = packed_width(vocab)
    words = np.zeros((rows, width), dtype=np.uint32)
    for t in range(vocab):
        words[:, t // 32] |= allowed[:, t].astype(np.uint32) << np.uint32(t % 32)
    return torch.from_numpy(words.view(np.int32).copy())


def ref_apply(logits: torch.Tensor, allowed: np.ndarray) -> torch.Tensor:
    """Logits [rows, width] with -inf where ``allowed`` [rows, V<=width] is False or past V."""
    rows, width = logits.shape
    keep = np.zeros((rows, width), dtype=bool)
    keep[:, : allowed.shape[1]] = allowed
    return torch.where(torch.from_numpy(keep), logits, torch.tensor(NEG_INF, dtype=logits.dtype))


def xgrammar_apply(logits: torch.Tensor, packed: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """xgrammar's CPU kernel on a copy; returns only ``[:, :vocab_size]``.

    xgrammar 0.2.8's CPU kernel writes ``-inf`` past ``vocab_size`` where the last
    word's (unreliable) bits past it are 0, up to the word boundary, whatever the
    logits' width: on logits narrower than ``32 * ceil(V/32)`` that lands in the next
    row, or past the buffer ("double free or corruption"). So it gets a buffer padded
    to whole words, and only the columns below ``vocab_size`` are compared.
    """
    rows, width = logits.shape
    buf = torch.zeros(rows, max(width, 32 * packed.shape[-1]) + 32, dtype=logits.dtype)
    buf[:, :width] = logits
    xgrammar.apply_token_bitmask_inplace(buf, packed, vocab_size=vocab_size)
    return buf[:, :vocab_size]


# ----------------------------------------------------------------------------- strategies


@st.composite
def vocab_sizes(draw, high: int = 700) -> int:
    """Multiples of 32 and not, with the edges 1, 31, 32, 33 likely."""
    return draw(
        st.one_of(
            st.sampled_from([1, 31, 32, 33, 63, 64, 65]),
            st.integers(1, high // 32).map(lambda k: 32 * k),
            st.integers(1, high),
        )
    )


@st.composite
def masks(draw, max_batch: int = 64, vocab: int | None = None):
    """(packed int32 [B, ceil(V/32)], V): random bits with bit 31 forced on in some words,
    garbage bits past V in the last word, and some all-allowed / all-disallowed rows."""
    vocab = draw(vocab_sizes()) if vocab is None else vocab
    batch = draw(st.integers(1, max_batch))
    seed = draw(st.integers(0, 2**32 - 1))
    density = draw(st.sampled_from([0.0, 0.02, 0.5, 0.98, 1.0]))
    rng = np.random.default_rng(seed)
    width = packed_width(vocab)
    bits = rng.random((batch, width * 32)) < density
    words = np.zeros((batch, width), dtype=np.uint32)
    for k in range(32):
        words |= bits[:, k::32].astype(np.uint32) << np.uint32(k)
    if draw(st.booleans()):  # bit 31 on in a random half of the words: int32 -2**31 .. -1
        words |= (rng.random((batch, width)) < 0.5).astype(np.uint32) << np.uint32(31)
    packed = torch.from_numpy(words.view(np.int32).copy())
    row_kind = rng.integers(0, 4, size=batch)  # 0: all allowed, 1: all disallowed, else random
    packed[torch.from_numpy(row_kind == 0)] = ALL_ALLOWED_WORD
    packed[torch.from_numpy(row_kind == 1)] = 0
    if draw(st.booleans()) and vocab % 32:  # xgrammar: bits past V are not reliable
        tail = ~np.uint32((1 << (vocab % 32)) - 1)
        packed[:, -1] |= torch.tensor(int(tail.view(np.int32)), dtype=torch.int32)
    return packed, vocab


@st.composite
def logits_and_masks(draw, max_extra: int = 70):
    packed, vocab = draw(masks())
    width = vocab + draw(st.sampled_from([0, 0, 1, 7, 32, max_extra]))  # padded lm_head
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(packed.shape[0], width, generator=gen) * 4).to(dtype)
    return logits, packed, vocab


# ----------------------------------------------------------------------------- numerics


@SOME
@given(masks())
def test_unpack_matches_the_bit_definition(case):
    packed, vocab = case
    got = unpack_bitmask(packed, vocab)
    assert got.dtype == torch.bool and got.shape == (packed.shape[0], vocab)
    np.testing.assert_array_equal(got.numpy(), ref_allowed(packed, vocab))


@FEW
@given(masks(max_batch=4))
def test_unpack_matches_xgrammar_token_lister(case):
    packed, vocab = case
    got = unpack_bitmask(packed, vocab)
    for row in range(packed.shape[0]):
        # xgrammar 0.2.8's lister reads the whole last word, past vocab_size: drop those.
        rejected = [t for t in xgrammar.testing._get_masked_tokens_from_bitmask(packed, vocab, row) if t < vocab]
        assert sorted(rejected) == torch.nonzero(~got[row]).flatten().tolist()


@SOME
@given(logits_and_masks())
def test_apply_bitmask_matches_xgrammar_and_reference(case):
    logits, packed, vocab = case
    before = logits.clone()
    got = apply_bitmask(logits, packed, vocab)
    assert torch.equal(logits, before), "apply_bitmask wrote into its input"
    assert got.dtype == logits.dtype and got.shape == logits.shape
    assert torch.equal(got[:, :vocab], xgrammar_apply(logits, packed, vocab))
    assert bool((got[:, vocab:] == NEG_INF).all()), "columns at or past vocab_size must be disallowed"
    assert torch.equal(got, ref_apply(logits, ref_allowed(packed, vocab)))


@FEW
@given(logits_and_masks())
def test_apply_bitmask_takes_a_bool_mask_too(case):
    logits, packed, vocab = case
    bool_mask = torch.from_numpy(ref_allowed(packed, vocab))
    got = apply_bitmask(logits, bool_mask, vocab)
    assert torch.equal(got, apply_bitmask(logits, packed, vocab))
    assert torch.equal(got[:, :vocab], xgrammar_apply(logits, packed, vocab))


@SOME
@given(logits_and_masks())
def test_masked_argmax_picks_the_best_allowed_token_and_flags_empty_rows(case):
    logits, packed, vocab = case
    tokens, empty = masked_argmax(logits, packed, vocab)
    allowed = ref_allowed(packed, vocab)
    assert tokens.dtype == torch.int64 and empty.dtype == torch.bool
    np.testing.assert_array_equal(empty.numpy(), ~allowed.any(-1))
    want = xgrammar_apply(logits, packed, vocab).argmax(-1)
    live = ~empty
    assert torch.equal(tokens[live], want[live])
    for row in torch.nonzero(live).flatten().tolist():
        tok = int(tokens[row])
        assert tok < vocab and allowed[row, tok], f"row {row} picked disallowed token {tok}"
        best = logits[row, :vocab][torch.from_numpy(allowed[row])].max()
        assert logits[row, tok] == best


@SOME
@given(masks())
def test_empty_rows_packed_and_bool_agree_with_reference(case):
    packed, vocab = case
    want = ~ref_allowed(packed, vocab).any(-1)
    np.testing.assert_array_equal(empty_rows(packed, vocab).numpy(), want)
    bool_mask = torch.from_numpy(ref_allowed(packed, vocab))
    np.testing.assert_array_equal(empty_rows(bool_mask, vocab).numpy(), want)


def test_empty_rows_ignores_garbage_bits_past_vocab():
    # V=34: word 1 holds tokens 32, 33; bits 2..31 of it are garbage (-4 sets exactly those).
    packed = torch.tensor([[0, -4], [0, -4 | (1 << 1)]], dtype=torch.int32)
    assert empty_rows(packed, 34).tolist() == [True, False]
    tokens, empty = masked_argmax(torch.arange(40.0).expand(2, 40), packed, 34)
    assert empty.tolist() == [True, False]
    assert tokens[1].item() == 33


@SOME
@given(masks())
def test_pack_round_trips_and_matches_reference_packing(case):
    packed, vocab = case
    allowed = ref_allowed(packed, vocab)
    repacked = pack_bool_mask(torch.from_numpy(allowed))
    assert repacked.dtype == torch.int32 and repacked.shape == packed.shape
    assert torch.equal(repacked, ref_pack(allowed))  # bits past V are 0
    np.testing.assert_array_equal(unpack_bitmask(repacked, vocab).numpy(), allowed)
    # xgrammar's own packer pads past V with 1s: equal on every valid bit.
    theirs = xgrammar.testing.bool_mask_to_bitmask(torch.from_numpy(allowed))
    np.testing.assert_array_equal(ref_allowed(theirs, vocab), allowed)


def test_bit_31_is_token_31_not_a_sign_extension():
    packed = torch.tensor([[SIGN_BIT, 1, SIGN_BIT | 1]], dtype=torch.int32)
    got = torch.nonzero(unpack_bitmask(packed, 96)[0]).flatten().tolist()
    assert got == [31, 32, 64, 95]
    assert pack_bool_mask(unpack_bitmask(packed, 96)).tolist() == packed.tolist()
    out = apply_bitmask(torch.zeros(1, 96), packed, 96)
    assert torch.nonzero(out[0] == 0).flatten().tolist() == [31, 32, 64, 95]
    tokens, empty = masked_argmax(torch.arange(96.0).unsqueeze(0), packed, 96)
    assert tokens.tolist() == [95] and empty.tolist() == [False]


def test_all_allowed_rows_are_minus_one():
    assert torch.full((2, packed_width(64)), ALL_ALLOWED_WORD, dtype=torch.int32).tolist() == [[-1, -1], [-1, -1]]
    assert pack_bool_mask(torch.ones(3, 128, dtype=torch.bool)).eq(ALL_ALLOWED_WORD).all()
    assert unpack_bitmask(torch.full((1, packed_width(100)), ALL_ALLOWED_WORD, dtype=torch.int32), 100).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab,width", [(151669, 151936), (128256, 128256), (32011, 32064)])
def test_real_vocabularies_with_padded_lm_head(vocab, width, dtype):
    """Qwen3 (151669 tokens, 151936 logits), Llama-3, Phi-3 (32011 vs 32064)."""
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(3, width, generator=gen).to(dtype)
    packed = torch.randint(-(2**31), 2**31, (3, packed_width(vocab)), dtype=torch.int32, generator=gen)
    packed[1] = 0
    last_bit = (vocab - 1) % 32  # Llama-3's last token is bit 31: the word is -2**31
    packed[1, -1] = SIGN_BIT if last_bit == 31 else 1 << last_bit  # only the last real token
    got = apply_bitmask(logits, packed, vocab)
    assert torch.equal(got[:, :vocab], xgrammar_apply(logits, packed, vocab))
    assert bool((got[:, vocab:] == NEG_INF).all())
    tokens, empty = masked_argmax(logits, packed, vocab)
    assert tokens[1].item() == vocab - 1 and not empty.any()
    assert torch.equal(tokens, got.argmax(-1))


# ----------------------------------------------------------------------------- errors


def test_wrong_dtype_names_int32_and_the_fix():
    with pytest.raises(TypeError, match=r"must be int32.*got torch\.int64.*pack_bool_mask"):
        unpack_bitmask(torch.zeros(1, 4, dtype=torch.int64), 100)
    with pytest.raises(TypeError, match=r"must be int32.*got torch\.uint8"):
        apply_bitmask(torch.zeros(1, 100), torch.zeros(1, 4, dtype=torch.uint8), 100)
    with pytest.raises(TypeError, match=r"wants a bool mask, got torch\.int32"):
        pack_bool_mask(torch.zeros(1, 4, dtype=torch.int32))


def test_wrong_packed_width_names_both_widths():
    message = re.escape("packed bitmask has 5 words per row but vocab_size=200 needs ceil(200/32) = 7")
    with pytest.raises(ValueError, match=message + r".*pass a mask of width 7"):
        unpack_bitmask(torch.zeros(2, 5, dtype=torch.int32), 200)
    with pytest.raises(ValueError, match=message):
        apply_bitmask(torch.zeros(2, 224), torch.zeros(2, 5, dtype=torch.int32), 200)
    with pytest.raises(ValueError, match=message):
        masked_argmax(torch.zeros(2, 224), torch.zeros(2, 5, dtype=torch.int32), 200)
    with pytest.raises(ValueError, match=message):
        empty_rows(torch.zeros(2, 5, dtype=torch.int32), 200)


def test_logits_narrower_than_packed_mask_without_vocab_size_is_an_error():
    # 90 logits columns, a mask built for 128 tokens: the default vocab_size (90) needs 3 words.
    with pytest.raises(ValueError, match=r"has 4 words per row but vocab_size=90 needs ceil\(90/32\) = 3"):
        apply_bitmask(torch.zeros(1, 90), torch.zeros(1, 4, dtype=torch.int32))


def test_vocab_size_wider_than_logits_names_both_widths():
    with pytest.raises(ValueError, match=r"logits have 100 columns but the mask covers vocab_size=128.*vocab_size<=100"):
        apply_bitmask(torch.zeros(1, 100), torch.zeros(1, 4, dtype=torch.int32), 128)
    with pytest.raises(ValueError, match=r"logits have 100 columns but the mask covers vocab_size=128"):
        masked_argmax(torch.zeros(1, 100), torch.zeros(1, 4, dtype=torch.int32), 128)
    with pytest.raises(ValueError, match=r"logits have 100 columns but the mask covers vocab_size=128"):
        apply_bitmask(torch.zeros(1, 100), torch.ones(1, 128, dtype=torch.bool), 128)


def test_bool_mask_of_wrong_width_names_both_widths():
    with pytest.raises(ValueError, match=r"bool logit mask has 90 columns but vocab_size=100"):
        apply_bitmask(torch.zeros(1, 128), torch.ones(1, 90, dtype=torch.bool), 100)


def test_non_positive_vocab_size():
    with pytest.raises(ValueError, match="vocab_size must be positive, got 0"):
        packed_width(0)


# ----------------------------------------------------------------------------- torch.export

VOCAB, WIDTH = 1000, 1024  # not a multiple of 32, padded lm_head


class Kernels(torch.nn.Module):
    def forward(self, logits, packed):
        tokens, empty = masked_argmax(logits, packed, VOCAB)
        return apply_bitmask(logits, packed, VOCAB), tokens, empty


def _export(dynamic: bool):
    logits = torch.randn(4, WIDTH)
    packed = torch.randint(-(2**31), 2**31, (4, packed_width(VOCAB)), dtype=torch.int32)
    shapes = None
    if dynamic:
        batch = torch.export.Dim("batch", min=1, max=1024)
        shapes = {"logits": {0: batch}, "packed": {0: batch}}
    return torch.export.export(Kernels(), (logits, packed), dynamic_shapes=shapes)


def _ops(ep) -> list:
    return [n.target for n in ep.graph.nodes if n.op == "call_function"]


def test_export_keeps_only_plain_aten_ops_with_a_symbolic_batch():
    ep = _export(dynamic=True)
    ops = _ops(ep)
    custom = [t for t in ops if not (isinstance(t, torch._ops.OpOverload) and t.namespace == "aten")]
    assert not custom, f"non-aten ops in the exported graph: {custom}"
    names = {t.name() for t in ops}
    # op contract: one where(allowed, logits, -inf) per apply (applied twice) and no negated
    # mask, AND-based bit tests, no shifts of data, cat (not constant_pad_nd) for the padded
    # lm_head columns, one argmax.
    assert sum(t is aten.where.ScalarOther for t in ops) == 2
    assert not any(t.overloadpacket in (aten.masked_fill, aten.logical_not, aten.bitwise_not) for t in ops)
    assert sum(t.overloadpacket is aten.argmax for t in ops) == 1
    assert "aten::bitwise_and.Tensor" in names
    assert "aten::cat" in names
    assert not any("right_shift" in n or "rshift" in n for n in names), names
    assert not any("constant_pad_nd" in n or "pad" in n.split("::")[1] for n in names), names
    # the batch stays symbolic in and out
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"]
    outputs = next(n for n in ep.graph.nodes if n.op == "output").args[0]
    for node in [*placeholders, *outputs]:
        assert isinstance(node.meta["val"].shape[0], torch.SymInt), f"{node.name} has a static batch"
    module = ep.module()
    for batch in (1, 3, 64):
        logits = torch.randn(batch, WIDTH)
        packed = torch.randint(-(2**31), 2**31, (batch, packed_width(VOCAB)), dtype=torch.int32)
        packed[0] = 0
        masked, tokens, empty = module(logits, packed)
        assert torch.equal(masked, apply_bitmask(logits, packed, VOCAB))
        want_tokens, want_empty = masked_argmax(logits, packed, VOCAB)
        assert torch.equal(tokens, want_tokens) and torch.equal(empty, want_empty)
        assert empty[0].item()


def test_export_round_trips_through_save_and_load(tmp_path):
    ep = _export(dynamic=True)
    path = tmp_path / "kernels.pt2"
    torch.export.save(ep, path)
    loaded = torch.export.load(path)
    logits = torch.randn(5, WIDTH)
    packed = torch.randint(-(2**31), 2**31, (5, packed_width(VOCAB)), dtype=torch.int32)
    for got, want in zip(loaded.module()(logits, packed), Kernels()(logits, packed)):
        assert torch.equal(got, want)


def test_kernels_trace_on_symbolic_fake_tensors_without_specialising_the_batch():
    """What the pass does: make_fx on the program's fake tensors (symbolic batch) adds no guard."""
    from torch.fx.experimental.proxy_tensor import make_fx

    ep = _export(dynamic=True)
    logits_val, packed_val = [n.meta["val"] for n in ep.graph.nodes if n.op == "placeholder"]
    fake_mode = torch._guards.detect_fake_mode([logits_val, packed_val])
    before = dict(fake_mode.shape_env.replacements)

    def kernels(logits, packed):
        tokens, empty = masked_argmax(logits, packed, VOCAB)
        return apply_bitmask(logits, packed, VOCAB), allowed_columns(packed, WIDTH, VOCAB), tokens, empty

    with fake_mode:
        traced = make_fx(kernels, tracing_mode="real")(logits_val, packed_val)
    assert fake_mode.shape_env.replacements == before, "a kernel specialised the symbolic batch"
    outputs = next(n for n in traced.graph.nodes if n.op == "output").args[0]
    for node in outputs:
        assert isinstance(node.meta["val"].shape[0], torch.SymInt), f"{node.name} lost the symbolic batch"


# ----------------------------------------------------------------------------- torch-xla


def test_xla_lowering_compiles_once_for_changing_mask_contents():
    torch_xla = require_torch_xla()
    import torch_xla.debug.metrics as met

    device = torch_xla.device()

    def step(logits, packed):
        tokens, empty = masked_argmax(logits, packed, VOCAB)
        return apply_bitmask(logits, packed, VOCAB), tokens, empty

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(8, WIDTH, generator=gen)
    cases = [
        torch.full((8, packed_width(VOCAB)), ALL_ALLOWED_WORD, dtype=torch.int32),
        torch.randint(-(2**31), 2**31, (8, packed_width(VOCAB)), dtype=torch.int32, generator=gen),
        torch.full((8, packed_width(VOCAB)), SIGN_BIT, dtype=torch.int32),
        torch.zeros(8, packed_width(VOCAB), dtype=torch.int32),
    ]
    met.clear_all()
    for packed in cases:
        outs = step(logits.to(device), packed.to(device))
        torch_xla.sync()
        got = [o.cpu() for o in outs]
        want = step(logits, packed)
        for g, w in zip(got, want):
            assert torch.equal(g, w)
    compiles = met.metric_data("CompileTime")
    assert compiles is not None and compiles[0] == 1, f"expected one XLA compilation, got {compiles and compiles[0]}"
    assert got[2].all(), "the all-zero mask must flag every row on XLA too"
