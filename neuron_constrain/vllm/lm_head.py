"""The lm_head the head program runs: found in the model, gathered from its vocab-parallel shards.

    weight, bias = find_lm_head(model)                # ConfigError for a model without lm_head.weight
    weight, bias = gather_vocab_shards(weight, bias, tp_size)   # once at load, on every rank
"""
from __future__ import annotations

import time

import torch

from neuron_constrain.vllm.config import ConfigError


def find_lm_head(model) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The lm_head weight (and bias) of a vLLM ``*ForCausalLM``, or a clear error."""
    head = getattr(model, "lm_head", None)
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.numel() == 0:
        raise ConfigError(
            f"neuron_constrain's vLLM plugin found no lm_head weight on {type(model).__name__} "
            "(it reads model.lm_head.weight, a [vocab, hidden] matrix): this model is not supported"
        )
    processor = getattr(model, "logits_processor", None)
    scale = getattr(processor, "scale", 1.0)
    soft_cap = getattr(processor, "soft_cap", None)
    if scale != 1.0 or soft_cap is not None:
        raise ConfigError(
            f"{type(model).__name__} scales (scale={scale}) or soft-caps (soft_cap={soft_cap}) its logits; "
            "the plugin's head does not (yet): this model is not supported"
        )
    bias = getattr(head, "bias", None)
    return weight, bias if isinstance(bias, torch.Tensor) else None


def gather_vocab_shards(weight: torch.Tensor, bias: torch.Tensor | None, tp_size: int):
    """The full lm_head from this rank's vocab-parallel shard (all ranks' shards concatenated, once at load)."""
    if tp_size == 1:
        return weight, bias
    from vllm.distributed import tensor_model_parallel_all_gather

    weight = tensor_model_parallel_all_gather(weight.detach().contiguous(), dim=0)
    if bias is not None:
        bias = tensor_model_parallel_all_gather(bias.detach().contiguous(), dim=0)
    return weight, bias


def tensor_parallel_rank() -> int:
    from vllm.distributed import get_tensor_model_parallel_rank

    try:
        return get_tensor_model_parallel_rank()
    except AssertionError:  # no distributed group (a runner built outside a worker)
        return 0


def time_all_gathers(rows: int, vocab: int, candidates: int, repeats: int = 30) -> dict[str, float]:
    """Milliseconds per vLLM tensor-parallel all-gather, measured once at start: of what a
    vocab-parallel head would gather per step (each rank's ``candidates`` values and ids per
    row) against the whole logits (each rank's ``vocab / tp`` columns). Reported in the
    counters; the serving guide's choice of strategy (docs/guides/vllm.md) rests on them."""
    from vllm.distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_gather

    tp = get_tensor_model_parallel_world_size()
    shapes = {"candidates": (rows, 2 * candidates), "logits": (rows, -(-vocab // tp))}
    out = {}
    for name, shape in shapes.items():
        x = torch.zeros(shape)
        tensor_model_parallel_all_gather(x, dim=-1)  # first call sets buffers up
        start = time.perf_counter()
        for _ in range(repeats):
            tensor_model_parallel_all_gather(x, dim=-1)
        out[name] = 1e3 * (time.perf_counter() - start) / repeats
    return out
