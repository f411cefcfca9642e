"""Real decode steps for the step-time benchmarks: one token per row over a static KV cache.

    model = decoder("llama", **LLAMA3)
    program, args = export_decode_step(model, batch=8, sampling=False)
    run = compiled(module, "inductor")        # or "eager"

A decode step computes ``[B, 1, V]`` logits (not the ``[B, S, V]`` of a full-sequence
forward, which multiplies the lm_head work and dilutes any overhead), attends over a
static cache of ``max_cache_len`` positions (HF's StaticCache as buffers), and samples
in-graph: greedy argmax, or ``SamplingStep``'s top-k/top-p race. The cache position
is fixed at ``position`` for every timed call (a static cache costs the same at every
position: attention always spans ``max_cache_len``).
"""
from __future__ import annotations

import torch

from neuron_constrain.testing import CachedGreedyStep, CachedSamplingStep, tiny_decoder

LLAMA3 = dict(vocab_size=128256, hidden_size=1024, layers=8, intermediate_size=2048)  # Llama-3's vocabulary
SMALL = dict(vocab_size=1024, hidden_size=64, layers=2)


def decoder(arch: str, seed: int = 0, **config) -> torch.nn.Module:
    """A random-weight ``*ForCausalLM`` (one per benchmark: the batch sizes share its weights)."""
    return tiny_decoder(arch, seed=seed, **config)


def export_decode_step(model, batch: int, *, sampling: bool = False, position: int = 16, max_cache_len: int = 128):
    """The exported step over a fresh cache (non-strict: fast to export; the cache is
    written in place) and its call arguments at ``position``."""
    cls = CachedSamplingStep if sampling else CachedGreedyStep
    step = cls(model, batch_size=batch, max_cache_len=max_cache_len)
    args = list(step.example_inputs(model.config.vocab_size))
    args[1] = torch.tensor([position])
    with torch.no_grad():
        program = torch.export.export(step, tuple(args))
    return program, tuple(args)


def compiled(fn, backend: str):
    """``fn`` itself ("eager") or ``torch.compile(fn)`` with inductor, warmed up by the caller."""
    if backend == "eager":
        return fn
    if backend == "inductor":
        return torch.compile(fn, backend="inductor", dynamic=False)
    raise ValueError(f"backend {backend!r}: use 'eager' or 'inductor'")
