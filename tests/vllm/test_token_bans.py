"""allowed_token_ids and bad_words through the mask (``token_bans.py``), offline, against vLLM's own
ops on logits (``vllm/v1/sample/ops/bad_words.py``) and the allowed-ids rule."""
from __future__ import annotations

import types

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.v1.sample.ops.bad_words import apply_bad_words

from neuron_constrain.kernels import pack_bool_mask, unpack_bitmask
from neuron_constrain.vllm.token_bans import TokenBans

V = 70
tokens = st.integers(0, V - 1)


@settings(deadline=None)
@given(allowed=st.one_of(st.none(), st.lists(tokens, min_size=1, max_size=8)),
       words=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=3), max_size=4),
       output=st.lists(st.integers(0, 5), max_size=6), drafts=st.lists(st.integers(0, 5), max_size=2),
       grammar=st.one_of(st.none(), st.lists(st.booleans(), min_size=V, max_size=V)))
def test_bans_equal_vllm_on_logits(allowed, words, output, drafts, grammar):
    """The row the plugin feeds allows exactly what vLLM leaves finite: the grammar's row (or all),
    then allowed_token_ids, then the bad words completed by the output and drafts so far."""
    params = types.SimpleNamespace(allowed_token_ids=allowed, bad_words=["w"] * len(words) or None,
                                   bad_words_token_ids=words)
    bans = TokenBans.of(params, V)
    grammar_row = torch.tensor(grammar) if grammar is not None else torch.ones(V, dtype=torch.bool)
    row = pack_bool_mask(grammar_row[None]) if grammar is not None else torch.full((1, (V + 31) // 32), -1,
                                                                                    dtype=torch.int32)
    if bans is not None:
        bans.apply(row.numpy()[0], output, drafts)
    got = unpack_bitmask(row, V)[0]
    logits = torch.where(grammar_row, 0.0, float("-inf"))[None].clone()
    if allowed:
        keep = torch.zeros(V, dtype=torch.bool)
        keep[allowed] = True
        logits[0, ~keep] = float("-inf")
    if words:
        apply_bad_words(logits, {0: words}, [list(output) + list(drafts)])
    assert torch.equal(got, logits[0].isfinite())
    assert (bans is None) == (not allowed and not words)
