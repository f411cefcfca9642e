"""The attention the step programs trace: SDPA with each key/value head's query heads stacked.

    with grouped_attention(model):      # an sdpa model exports with grouped_sdpa as its attention
        step = transform(CachedStep(model, cache), ...)

Hugging Face's sdpa path copies every key/value head ``heads / kv_heads`` times (``repeat_kv``)
whenever it is traced: under export, a copy of the whole attention window per layer and step
(more than half a SmolLM2 step). Stacking the queries instead (what HF does itself for one query
when not traced, ``pack_gqa``) reads the cache as it is.
"""
from __future__ import annotations

import contextlib

import torch

GROUPED_SDPA = "neuron_constrain_grouped_sdpa"  # the name it is registered under with transformers


def grouped_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """SDPA with each key/value head's query heads stacked as extra query rows (a transformers attention
    function). ``query [B, H, T, D]``, ``key/value [B, H_kv, S, D]``, ``attention_mask [B, 1, T, S]``
    additive -> ``[B, T, H, D]``."""
    batch, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    query = query.reshape(batch, kv_heads, groups * length, dim)  # head h = k * groups + g -> row g * T + t
    if attention_mask is not None and groups > 1:
        rows, size = attention_mask.shape[0], attention_mask.shape[-1]
        attention_mask = attention_mask[:, :, None].expand(-1, -1, groups, -1, -1).reshape(rows, 1, groups * length, size)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling
    )
    return out.reshape(batch, heads, length, dim).transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def grouped_attention(model):
    """``model`` traced with :func:`grouped_sdpa` as its attention inside the block (an sdpa model; any
    other runs its own), its configured implementation put back after."""
    config = model.config
    before = getattr(config, "_attn_implementation", None)
    if before != "sdpa":
        yield
        return
    from transformers import AttentionInterface

    AttentionInterface.register(GROUPED_SDPA, grouped_sdpa)
    config._attn_implementation = GROUPED_SDPA
    try:
        yield
    finally:
        config._attn_implementation = before
