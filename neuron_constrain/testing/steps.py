"""Decode steps as accelerators compile them: over Hugging Face's static KV cache (the
ExecuTorch recipe), NxD-style token generation with explicit KV, a rank of a vocab-parallel
lm_head.

    step = CachedGreedyStep(model, batch_size=8)              # input_ids [B, 1], cache_position -> token
    step = VocabShardedGreedyStep(model, rank, world_size)    # one rank's (max, index) of its vocab shard
    step = TokenGenerationStep(model, bucket=32)              # explicit KV in/out, on-device sampler
"""
from __future__ import annotations

import torch

from neuron_constrain.testing.decoders import exponential_noise, random_ids, sample_race


class VocabShardedGreedyStep(torch.nn.Module):
    """One rank's greedy step with a vocab-parallel lm_head (NxD's ColumnParallel layout).

    Rank ``rank`` of ``world_size`` holds lm_head rows ``[rank * shard, (rank + 1) *
    shard)``, ``shard = ceil(V / world_size)``; the last shard is padded with zero rows.
    ``input_ids [B, S] -> (value [B], index [B])``: the max of this rank's shard of the
    last logits and its column within the shard (``max.dim``, the sampling site the
    mask-logits pass masks before). :func:`greedy_across_ranks` picks the token.

    Args:
        model: a ``*ForCausalLM``.
        rank: this rank.
        world_size: the ranks the vocabulary is split over.
    """

    def __init__(self, model: torch.nn.Module, rank: int, world_size: int):
        super().__init__()
        weight = model.lm_head.weight.detach()
        self.shard_width = -(-weight.shape[0] // world_size)
        rows = weight[rank * self.shard_width : (rank + 1) * self.shard_width]
        shard = weight.new_zeros(self.shard_width, weight.shape[1])
        shard[: rows.shape[0]] = rows
        self.body = model.model
        self.lm_head_shard = torch.nn.Parameter(shard, requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's greedy candidate.

        Args:
            input_ids: ``[B, S]``.

        Returns:
            ``(value [B], index [B])``: the max of this rank's shard of the last logits and its column in
            the shard.
        """
        hidden = self.body(input_ids=input_ids, use_cache=False).last_hidden_state
        logits = torch.nn.functional.linear(hidden, self.lm_head_shard)[:, -1]
        value, index = logits.max(-1)
        return value, index


def pick_across_ranks(values: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Greedy token from per-rank maxima: ``values, tokens [world, B]`` (global ids) -> ``[B]``.

    Ties go to the lowest rank, and so (each rank's index being its first max) to the
    lowest token id: the same token ``argmax`` of the gathered logits returns.

    Args:
        values: ``[world, B]``, each rank's best logit per row.
        tokens: ``[world, B]``, its token (a global id).

    Returns:
        ``[B]``: the greedy token.
    """
    best = values.argmax(0, keepdim=True)
    return tokens.gather(0, best).squeeze(0)


def greedy_across_ranks(value: torch.Tensor, index: torch.Tensor, rank: int, shard_width: int, group=None):
    """All-gather each rank's ``(max, index in shard)`` over ``torch.distributed`` and pick the token.

    Args:
        value: ``[B]``, this rank's best logit per row.
        index: ``[B]``, its index in this rank's shard.
        rank: this rank.
        shard_width: columns per rank.
        group: the process group (default: the world).

    Returns:
        ``[B]``: the greedy token, the same on every rank.
    """
    import torch.distributed as dist

    world = dist.get_world_size(group)
    token = index + rank * shard_width
    values = [torch.empty_like(value) for _ in range(world)]
    tokens = [torch.empty_like(token) for _ in range(world)]
    dist.all_gather(values, value, group=group)
    dist.all_gather(tokens, token, group=group)
    return pick_across_ranks(torch.stack(values), torch.stack(tokens))


class CachedGreedyStep(torch.nn.Module):
    """A 1-token decode step over Hugging Face's static KV cache, as accelerators compile it:
    ``input_ids [B, 1], cache_position [1] -> token [B]`` (argmax of the logits).

    The cache is HF's ExecuTorch recipe (``TorchExportableModuleWithStaticCache``, or
    ``...WithHybridCache`` for sliding-window configs such as GPT-OSS): StaticCache
    tensors registered as buffers and written in place at ``cache_position``. Export
    it strict (HF's default; non-strict lifts the cache as constants) and run it under
    ``no_grad``. The batch is fixed at ``batch_size``; feed a prompt one token a step.

    Args:
        model: a ``*ForCausalLM``.
        batch_size: the fixed batch.
        max_cache_len: cache slots a row.
    """

    def __init__(self, model: torch.nn.Module, *, batch_size: int, max_cache_len: int = 64):
        super().__init__()
        from transformers.integrations.executorch import (
            TorchExportableModuleWithHybridCache,
            TorchExportableModuleWithStaticCache,
        )

        model.generation_config.cache_implementation = "static"
        config = model.config
        hybrid = getattr(config, "layer_types", None) is not None and getattr(config, "sliding_window", None) is not None
        wrapper = TorchExportableModuleWithHybridCache if hybrid else TorchExportableModuleWithStaticCache
        self.cached = wrapper(model, batch_size=batch_size, max_cache_len=max_cache_len)
        self.batch_size, self.max_cache_len = batch_size, max_cache_len

    def logits(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        """The last logits of a step, its keys and values written into the cache.

        Args:
            input_ids: ``[B, 1]``.
            cache_position: ``[1]``: the slot the token is written at.

        Returns:
            ``[B, V]``.
        """
        return self.cached(input_ids=input_ids, cache_position=cache_position)[:, -1]

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        """One greedy step.

        Args:
            input_ids: ``[B, 1]``.
            cache_position: ``[1]``: the slot the token is written at.

        Returns:
            ``[B]``: the argmax of the logits.
        """
        return self.logits(input_ids, cache_position).argmax(-1)

    def example_inputs(self, vocab_size: int, *, seed: int = 0) -> tuple:
        """Inputs to export the step with.

        Args:
            vocab_size: token ids are below it.
            seed: the ids' seed.

        Returns:
            ``(input_ids [batch_size, 1], cache_position [0])``.
        """
        return random_ids(self.batch_size, 1, vocab_size, seed=seed), torch.tensor([0])


class CachedSamplingStep(CachedGreedyStep):
    """:class:`CachedGreedyStep` with ``SamplingStep``'s sampler (:func:`sample_race`):
    ``input_ids [B, 1], cache_position [1], noise [B, V] -> token [B]``.

    Args:
        model: a ``*ForCausalLM``.
        batch_size: the fixed batch.
        max_cache_len: cache slots a row.
        temperature: the sampler's temperature.
        top_k: its top-k.
        top_p: its top-p.
    """

    def __init__(self, model, *, batch_size: int, max_cache_len: int = 64,
                 temperature: float = 0.8, top_k: int = 50, top_p: float = 0.9):
        super().__init__(model, batch_size=batch_size, max_cache_len=max_cache_len)
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """One sampled step.

        Args:
            input_ids: ``[B, 1]``.
            cache_position: ``[1]``: the slot the token is written at.
            noise: ``[B, V]`` Exponential(1).

        Returns:
            ``[B]``: the tokens :func:`sample_race` picks.
        """
        logits = self.logits(input_ids, cache_position)
        return sample_race(logits, noise, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)

    def example_inputs(self, vocab_size: int, *, seed: int = 0) -> tuple:
        """Inputs to export the step with.

        Args:
            vocab_size: token ids are below it.
            seed: the ids' and the noise's seed.

        Returns:
            ``(input_ids, cache_position, noise [batch_size, the model's vocabulary])``.
        """
        width = self.cached.model.config.vocab_size
        return (*super().example_inputs(vocab_size, seed=seed), exponential_noise(self.batch_size, width, seed=seed))


def cache_state(program_or_module) -> dict[str, torch.Tensor]:
    """Copies of the KV-cache tensors (``*keys``/``*values`` buffers) of an exported
    program or a module, by name: compare two runs' caches after a decode.

    Args:
        program_or_module: an ``ExportedProgram`` or a module.

    Returns:
        Buffer name -> a copy of the tensor.
    """
    if isinstance(program_or_module, torch.export.ExportedProgram):
        named = {**program_or_module.state_dict, **program_or_module.constants}.items()
    else:
        named = program_or_module.named_buffers()
    return {n: t.detach().clone() for n, t in named if n.rsplit(".", 1)[-1].startswith(("key", "value"))}


def sample_top_k_top_p(logits: torch.Tensor, sampling_params: torch.Tensor, uniform: torch.Tensor, *,
                       global_top_k: int) -> torch.Tensor:
    """NxD's on-device sampler on ``logits [B, V]``: ``topk`` (``global_top_k`` wide), each
    row's own top-k, temperature, softmax, ``cumsum`` top-p, then the token whose
    cumulative probability first passes ``uniform [B, 1]`` (in ``[0, 1)``).
    ``sampling_params [B, 3]`` holds ``(top_k, top_p, temperature)`` per row.

    Args:
        logits: ``[B, V]``.
        sampling_params: ``[B, 3]``, ``(top_k, top_p, temperature)`` per row.
        uniform: ``[B, 1]`` in ``[0, 1)``.
        global_top_k: the first ``topk``'s width.

    Returns:
        ``[B]``: the sampled tokens.
    """
    top_k, top_p, temperature = sampling_params[:, 0:1], sampling_params[:, 1:2], sampling_params[:, 2:3]
    values, indices = logits.topk(global_top_k, dim=-1)
    rank = torch.arange(global_top_k, device=logits.device)
    values = values.masked_fill(rank >= top_k, float("-inf"))
    probs = (values / temperature).softmax(-1)
    cumulative = probs.cumsum(-1)
    probs = probs.masked_fill(cumulative - probs > top_p, 0.0)  # the first token always stays
    cdf = probs.cumsum(-1)
    choice = (cdf < uniform * cdf[:, -1:]).sum(-1, keepdim=True).clamp(max=global_top_k - 1)
    return indices.gather(-1, choice).squeeze(-1)


class TokenGenerationStep(torch.nn.Module):
    """An NxD-style token-generation step for one bucket, the KV cache explicit:
    ``input_ids [B, 1], position_ids [B, 1], sampling_params [B, 3], uniform [B, 1],
    cache -> (token [B], *new_cache)``.

    ``cache`` is a tuple of per-layer key and value tensors ``[B, kv_heads, bucket,
    head_dim]`` (``k0, v0, k1, v1, ...``), passed in and returned written at each row's
    ``position_ids`` (the runtime aliases them), as NxD's token-generation model does.
    Attention is NxD's: scores against the prior cache (``q @ K^T``, masked past each
    row's position) and against the active key, combined by a manual softmax (``max``,
    ``exp``, ``sum``); the sampler is :func:`sample_top_k_top_p`. The weights are a
    Llama-family ``*ForCausalLM``'s (llama, mistral, qwen2), so the logits equal the
    model's own. A bucket is one exported program per ``bucket`` length.

    Args:
        model: a ``*ForCausalLM``.
        batch_size: the fixed batch.
        bucket: the cache length of this bucket.
        global_top_k: the sampler's first ``topk`` width.

    Raises:
        ValueError: the model's attention has q/k norms (not Llama-family).
    """

    def __init__(self, model: torch.nn.Module, *, batch_size: int, bucket: int, global_top_k: int = 16):
        super().__init__()
        if any(hasattr(layer.self_attn, "q_norm") for layer in model.model.layers):
            raise ValueError("TokenGenerationStep runs Llama-family attention (no q/k norms); use llama, mistral or qwen2")
        self.model = model
        self.batch_size, self.bucket, self.global_top_k = batch_size, bucket, global_top_k
        attention = model.model.layers[0].self_attn
        self.kv_heads = model.config.num_key_value_heads
        self.head_dim = attention.head_dim

    def empty_cache(self) -> tuple[torch.Tensor, ...]:
        """A zero cache for the bucket.

        Returns:
            ``(k0, v0, k1, v1, ...)``, each ``[batch_size, kv_heads, bucket, head_dim]``.
        """
        shape = (self.batch_size, self.kv_heads, self.bucket, self.head_dim)
        return tuple(torch.zeros(shape) for _ in range(2 * len(self.model.model.layers)))

    def example_inputs(self, vocab_size: int, *, seed: int = 0) -> tuple:
        """Inputs to export the step with.

        Args:
            vocab_size: token ids are below it.
            seed: the ids' and the uniform draw's seed.

        Returns:
            ``(input_ids, position_ids (zeros), sampling_params (global_top_k, 0.9, 0.8), uniform, empty cache)``.
        """
        generator = torch.Generator().manual_seed(seed)
        batch = self.batch_size
        params = torch.tensor([[self.global_top_k, 0.9, 0.8]]).repeat(batch, 1)
        return (random_ids(batch, 1, vocab_size, seed=seed), torch.zeros(batch, 1, dtype=torch.long), params,
                torch.rand(batch, 1, generator=generator), self.empty_cache())

    def _attend(self, layer, x, position_ids, past_k, past_v):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

        attention = layer.self_attn
        batch = x.shape[0]
        q = attention.q_proj(x).view(batch, 1, -1, self.head_dim).transpose(1, 2)
        k = attention.k_proj(x).view(batch, 1, -1, self.head_dim).transpose(1, 2)
        v = attention.v_proj(x).view(batch, 1, -1, self.head_dim).transpose(1, 2)
        cos, sin = self.model.model.rotary_emb(x, position_ids)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        groups = attention.num_key_value_groups
        prior = q @ repeat_kv(past_k, groups).transpose(2, 3) * attention.scaling  # [B, H, 1, bucket]
        seen = torch.arange(self.bucket, device=x.device) < position_ids  # [B, bucket]: positions already cached
        prior = prior.masked_fill(~seen[:, None, None, :], torch.finfo(prior.dtype).min)
        active = q @ repeat_kv(k, groups).transpose(2, 3) * attention.scaling  # [B, H, 1, 1]
        top = torch.maximum(prior.max(-1, keepdim=True).values, active)  # NxD's manual softmax
        prior_exp, active_exp = (prior - top).exp(), (active - top).exp()
        total = prior_exp.sum(-1, keepdim=True) + active_exp
        out = (prior_exp / total) @ repeat_kv(past_v, groups) + (active_exp / total) @ repeat_kv(v, groups)
        out = attention.o_proj(out.transpose(1, 2).reshape(batch, 1, -1))
        where = position_ids[:, None, :, None].expand(batch, k.shape[1], 1, self.head_dim)
        return out, past_k.scatter(2, where, k), past_v.scatter(2, where, v)

    def logits(self, input_ids, position_ids, cache):
        """The step's last logits and the cache written at each row's position.

        Args:
            input_ids: ``[B, 1]``.
            position_ids: ``[B, 1]``.
            cache: ``(k0, v0, k1, v1, ...)``.

        Returns:
            ``(logits [B, V], new cache)``.
        """
        hidden = self.model.model.embed_tokens(input_ids)
        new_cache = []
        for index, layer in enumerate(self.model.model.layers):
            out, k, v = self._attend(layer, layer.input_layernorm(hidden), position_ids, cache[2 * index], cache[2 * index + 1])
            hidden = hidden + out
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
            new_cache += [k, v]
        return self.model.lm_head(self.model.model.norm(hidden))[:, -1], tuple(new_cache)

    def forward(self, input_ids, position_ids, sampling_params, uniform, cache):
        """One token-generation step.

        Args:
            input_ids: ``[B, 1]``.
            position_ids: ``[B, 1]``.
            sampling_params: ``[B, 3]``, ``(top_k, top_p, temperature)`` per row.
            uniform: ``[B, 1]`` in ``[0, 1)``.
            cache: ``(k0, v0, k1, v1, ...)``.

        Returns:
            ``(token [B], *new cache)``.
        """
        logits, new_cache = self.logits(input_ids, position_ids, cache)
        return (sample_top_k_top_p(logits, sampling_params, uniform, global_top_k=self.global_top_k), *new_cache)
