"""Tiny real decoders (Hugging Face architectures from small configs, random weights: nothing
is downloaded) and the full-sequence steps an on-device sampler would compile.

    model = tiny_decoder("llama", vocab_size=1024)
    step = GreedyStep(model)                 # input_ids -> argmax of last logits
    step = SamplingStep(model, top_k=20)     # input_ids, noise -> token (top-k/top-p race)
    step = DraftHeadStep(model)              # a second, Medusa/MTP-style head
"""
from __future__ import annotations

import torch


ARCHITECTURES = ("llama", "mixtral", "gpt_oss", "qwen3", "qwen2", "mistral")


def tiny_config(arch: str, *, vocab_size: int = 1000, hidden_size: int = 64, layers: int = 2, **overrides):
    """A small config of a real architecture (eager attention off: sdpa, as deployed).

    Args:
        arch: one of ``ARCHITECTURES``.
        vocab_size: the model's vocabulary.
        hidden_size: its hidden size.
        layers: its decoder layers.
        **overrides: any other config field.

    Returns:
        The transformers config.

    Raises:
        ValueError: an unknown architecture.
    """
    import transformers

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    # MoE experts as dense batched matmuls: plain aten ops, static shapes (what an AOT
    # compiler wants); transformers' default under export is a custom grouped-mm op.
    moe = {"experts_implementation": "batched_mm"}
    if arch == "llama":
        cfg = transformers.LlamaConfig(**{**common, **overrides})
    elif arch == "qwen3":
        cfg = transformers.Qwen3Config(**{**common, "head_dim": hidden_size // 4, **overrides})
    elif arch == "mixtral":
        cfg = transformers.MixtralConfig(
            **{**common, **moe, "num_local_experts": 4, "num_experts_per_tok": 2, **overrides}
        )
    elif arch == "gpt_oss":
        cfg = transformers.GptOssConfig(
            **{
                **common,
                **moe,
                "num_local_experts": 4,
                "num_experts_per_tok": 2,
                "head_dim": hidden_size // 4,
                "layer_types": ["sliding_attention", "full_attention"] * (layers // 2) + ["full_attention"] * (layers % 2),
                "sliding_window": 16,
                "max_position_embeddings": 131072,  # YaRN's default scaling expects the long context
                **overrides,
            }
        )
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**{**common, **overrides})
    elif arch == "mistral":
        cfg = transformers.MistralConfig(**{**common, "head_dim": hidden_size // 4, **overrides})
    else:
        raise ValueError(f"unknown architecture {arch!r}; choose from {ARCHITECTURES}")
    return cfg


def tiny_decoder(arch: str = "llama", *, seed: int = 0, dtype=torch.float32, **config) -> torch.nn.Module:
    """``*ForCausalLM`` with random weights, in eval mode.

    Args:
        arch: one of ``ARCHITECTURES`` (``"llama"``, ``"mixtral"``, ``"gpt_oss"``, ``"qwen3"``, ...).
        seed: the weights.
        dtype: the weights' dtype.
        **config: keywords of :func:`tiny_config` (``vocab_size=1024``, ``layers=2``, overrides).

    Returns:
        The model (a Hugging Face module: export it, wrap it in a step).

    Raises:
        ValueError: an unknown architecture.
    """
    import transformers

    cfg = tiny_config(arch, **config)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()


class GreedyStep(torch.nn.Module):
    """One greedy decode step: ``input_ids [B, S] -> token [B]`` (argmax of the last logits).

    Args:
        model: a ``*ForCausalLM`` (e.g. :func:`tiny_decoder`'s).
    """

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """One greedy step over the whole sequence.

        Args:
            input_ids: ``[B, S]``.

        Returns:
            ``[B]``: the argmax of the last logits.
        """
        logits = self.model(input_ids=input_ids, use_cache=False).logits
        return logits[:, -1].argmax(-1)


class LogitsStep(torch.nn.Module):
    """The full-recompute step a host-side sampler runs: ``input_ids [B, S] -> logits [B, S, V]``.

    Args:
        model: a ``*ForCausalLM`` (e.g. :func:`tiny_decoder`'s).
    """

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The model's logits at every position.

        Args:
            input_ids: ``[B, S]``.

        Returns:
            ``[B, S, V]``.
        """
        return self.model(input_ids=input_ids, use_cache=False).logits


class SamplingStep(torch.nn.Module):
    """One sampling step with temperature, top-k and top-p, decided by an exponential race.

    ``noise`` is ``Exponential(1)`` of shape ``[B, V]`` supplied by the caller, so the
    step is deterministic given its inputs (how on-device samplers take randomness).
    The graph has the usual sampling ops: ``div`` (temperature), ``sort`` + ``cumsum``
    (top-k/top-p), ``softmax`` and ``argmax(probs / noise)``.

    Args:
        model: a ``*ForCausalLM``.
        temperature: the sampler's temperature.
        top_k: its top-k.
        top_p: its top-p.
    """

    def __init__(self, model: torch.nn.Module, *, temperature: float = 0.8, top_k: int = 50, top_p: float = 0.9):
        super().__init__()
        self.model = model
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p

    def forward(self, input_ids: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """One sampled step.

        Args:
            input_ids: ``[B, S]``.
            noise: ``[B, V]`` Exponential(1) (:func:`exponential_noise`).

        Returns:
            ``[B]``: the token of the race over the temperature-scaled, top-k and top-p kept probabilities.
        """
        logits = self.model(input_ids=input_ids, use_cache=False).logits[:, -1]
        scaled = logits / self.temperature
        ordered, order = scaled.sort(dim=-1, descending=True)
        probs = ordered.softmax(-1)
        before = probs.cumsum(-1) - probs
        rank = torch.arange(ordered.shape[-1], device=ordered.device)
        drop = (before > self.top_p) | (rank >= self.top_k)
        kept = ordered.masked_fill(drop, float("-inf")).softmax(-1)
        choice = (kept / noise.gather(-1, order)).argmax(-1, keepdim=True)
        return order.gather(-1, choice).squeeze(-1)


class TopKMultinomialStep(torch.nn.Module):
    """Sampling with ``topk`` + ``softmax`` + ``multinomial`` (random: seed before calling).

    Args:
        model: a ``*ForCausalLM``.
        top_k: the candidates ``multinomial`` draws from.
    """

    def __init__(self, model: torch.nn.Module, *, top_k: int = 20):
        super().__init__()
        self.model = model
        self.top_k = top_k

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """One step drawn by ``torch.multinomial`` among the top-k (torch's global generator).

        Args:
            input_ids: ``[B, S]``.

        Returns:
            ``[B]``: the drawn tokens.
        """
        logits = self.model(input_ids=input_ids, use_cache=False).logits[:, -1]
        values, indices = logits.topk(self.top_k, dim=-1)
        choice = torch.multinomial(values.softmax(-1), 1)
        return indices.gather(-1, choice).squeeze(-1)


def random_ids(batch: int, seq: int, vocab_size: int, *, seed: int = 0) -> torch.Tensor:
    """Seeded random token ids.

    Args:
        batch: rows.
        seq: tokens a row.
        vocab_size: ids are below it.
        seed: the generator's seed.

    Returns:
        int64 ``[batch, seq]``.
    """
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, seq), generator=generator)


def exponential_noise(batch: int, width: int, *, seed: int = 0) -> torch.Tensor:
    """Seeded Exponential(1) noise, the ``noise`` input of the sampling steps.

    Args:
        batch: rows.
        width: the logits' width.
        seed: the generator's seed.

    Returns:
        float32 ``[batch, width]``.
    """
    generator = torch.Generator().manual_seed(seed)
    return torch.empty(batch, width).exponential_(generator=generator)


class ForcedStep(torch.nn.Module):
    """Greedy step with an additive ``bias [B, V]`` before the argmax: teacher forcing
    through a compiled graph. With ``bias = big * one_hot(token)`` the step returns
    ``token`` exactly when the logit mask allows it, so a wrong bit, row or reorder in
    the mask fed to the graph shows up as a different token.

    Args:
        model: a ``*ForCausalLM``.
    """

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """One greedy step with a bias on the last logits.

        Args:
            input_ids: ``[B, S]``.
            bias: ``[B, V]``, added to the last logits.

        Returns:
            ``[B]``: the argmax of the biased logits.
        """
        logits = self.model(input_ids=input_ids, use_cache=False).logits[:, -1]
        return (logits + bias).argmax(-1)


def sample_race(logits: torch.Tensor, noise: torch.Tensor, *, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """``SamplingStep``'s sampler on ``logits [B, V]``: temperature, top-k, top-p, exponential race.

    Args:
        logits: ``[B, V]``.
        noise: ``[B, V]`` Exponential(1) (:func:`exponential_noise`).
        temperature: the temperature.
        top_k: the top-k.
        top_p: the top-p.

    Returns:
        ``[B]``: the sampled tokens.
    """
    scaled = logits / temperature
    ordered, order = scaled.sort(dim=-1, descending=True)
    probs = ordered.softmax(-1)
    before = probs.cumsum(-1) - probs
    rank = torch.arange(ordered.shape[-1], device=ordered.device)
    drop = (before > top_p) | (rank >= top_k)
    kept = ordered.masked_fill(drop, float("-inf")).softmax(-1)
    choice = (kept / noise.gather(-1, order)).argmax(-1, keepdim=True)
    return order.gather(-1, choice).squeeze(-1)


class DraftHeadStep(torch.nn.Module):
    """A greedy step with a second, Medusa/MTP-style head: ``input_ids -> (token, draft)``.

    The draft head is its own projection of the last hidden state (``draft_vocab``
    columns, default the model's vocabulary), followed by its own argmax.

    Args:
        model: a ``*ForCausalLM``.
        draft_vocab: the draft head's width (default: the model's vocabulary).
        seed: the draft head's random weights.
    """

    def __init__(self, model: torch.nn.Module, draft_vocab: int | None = None, seed: int = 1):
        super().__init__()
        self.model = model
        config = model.config
        torch.manual_seed(seed)
        self.draft = torch.nn.Linear(config.hidden_size, draft_vocab or config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor):
        """One greedy step of both heads.

        Args:
            input_ids: ``[B, S]``.

        Returns:
            ``(token [B], draft [B])``: the model's argmax and the draft head's.
        """
        out = self.model(input_ids=input_ids, use_cache=False, output_hidden_states=True)
        hidden = out.hidden_states[-1][:, -1]
        return out.logits[:, -1].argmax(-1), self.draft(hidden).argmax(-1)
