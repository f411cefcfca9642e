"""Tiny real decoders for tests, benchmarks and the demo: Hugging Face architectures
built from small configs with random weights (nothing is downloaded), and the
decode-step wrappers an on-device sampler would compile.

    model = tiny_decoder("llama", vocab_size=1024)
    step = GreedyStep(model)                 # input_ids -> argmax of last logits
    step = SamplingStep(model, top_k=20)     # input_ids, noise -> token (top-k/top-p race)
    step = VocabShardedGreedyStep(model, rank, world_size)  # one rank's (max, index) of its vocab shard
    vocab = toy_tokenizer()                  # a byte-level test Vocabulary (xgrammar TokenizerInfo + encode)
"""
from __future__ import annotations

from typing import Sequence

import torch
import xgrammar as xgr

ARCHITECTURES = ("llama", "mixtral", "gpt_oss", "qwen3", "qwen2", "mistral")


def tiny_config(arch: str, *, vocab_size: int = 1000, hidden_size: int = 64, layers: int = 2, **overrides):
    """A small config of a real architecture (eager attention off: sdpa, as deployed)."""
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
    """``*ForCausalLM`` with random weights, in eval mode."""
    import transformers

    cfg = tiny_config(arch, **config)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()


class GreedyStep(torch.nn.Module):
    """One greedy decode step: ``input_ids [B, S] -> token [B]`` (argmax of the last logits)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=input_ids, use_cache=False).logits
        return logits[:, -1].argmax(-1)


class LogitsStep(torch.nn.Module):
    """The full-recompute step a host-side sampler runs: ``input_ids [B, S] -> logits [B, S, V]``."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


class SamplingStep(torch.nn.Module):
    """One sampling step with temperature, top-k and top-p, decided by an exponential race.

    ``noise`` is ``Exponential(1)`` of shape ``[B, V]`` supplied by the caller, so the
    step is deterministic given its inputs (how on-device samplers take randomness).
    The graph has the usual sampling ops: ``div`` (temperature), ``sort`` + ``cumsum``
    (top-k/top-p), ``softmax`` and ``argmax(probs / noise)``.
    """

    def __init__(self, model: torch.nn.Module, *, temperature: float = 0.8, top_k: int = 50, top_p: float = 0.9):
        super().__init__()
        self.model = model
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p

    def forward(self, input_ids: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
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
    """Sampling with ``topk`` + ``softmax`` + ``multinomial`` (random: seed before calling)."""

    def __init__(self, model: torch.nn.Module, *, top_k: int = 20):
        super().__init__()
        self.model = model
        self.top_k = top_k

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=input_ids, use_cache=False).logits[:, -1]
        values, indices = logits.topk(self.top_k, dim=-1)
        choice = torch.multinomial(values.softmax(-1), 1)
        return indices.gather(-1, choice).squeeze(-1)


def random_ids(batch: int, seq: int, vocab_size: int, *, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, seq), generator=generator)


def exponential_noise(batch: int, width: int, *, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.empty(batch, width).exponential_(generator=generator)


# ----------------------------------------------------------------------------- toy tokenizer

_JSON_PIECES = (
    '{"', '"}', '":', '",', '":"', '","', '"]', '["', '[{', '}]', '},', '},{', '{}', '[]', '":[', '":{',
    '": ', ', "', '\\"', '\\n', '  ', '    ', 'true', 'false', 'null', '.0', '.5', '-1', '0.', '1.',
)
_WORDS = (
    "name", "id", "age", "type", "value", "items", "tags", "city", "email", "count", "price", "score",
    "status", "title", "user", "users", "data", "description", "enabled", "location", "unit", "query",
    "arguments", "function", "parameters", "celsius", "fahrenheit", "yes", "no", "red", "green", "blue",
    "the", "and", "ing", "tion", "er", "on", "in", "at", "es", "ed", "or", "an", "is", "it", "to",
    "weather", "get", "search", "street", "zip", "country", "address", "active", "level", "mode",
    "min", "max", "first", "last", "date", "time", "size", "small", "large", "medium", "ok", "error",
)


class Vocabulary:
    """A byte-level vocabulary: xgrammar's ``TokenizerInfo`` plus greedy longest-match encoding.

    ``pieces[i]`` is the bytes of token ``i``; the stop token is ``b""`` (xgrammar
    reads an empty piece as special, so it never matches text). A real tokenizer's
    ``TokenizerInfo.from_huggingface`` plugs into :class:`StructuredRuntime` the same way.
    """

    def __init__(self, pieces: Sequence[bytes], *, eos_id: int):
        self.pieces = [bytes(p) for p in pieces]
        if not 0 <= eos_id < len(self.pieces):
            raise ValueError(f"eos_id={eos_id} is not a token of this {len(self.pieces)}-piece vocabulary")
        self.eos_id = eos_id
        self.vocab_size = len(self.pieces)
        self._ids: dict[bytes, int] = {}
        for i, piece in enumerate(self.pieces):
            if piece and piece in self._ids:
                raise ValueError(f"piece {piece!r} appears twice (ids {self._ids[piece]} and {i}); pieces must be unique")
            if piece:
                self._ids[piece] = i
        self._longest = max(len(p) for p in self.pieces)
        self.info = xgr.TokenizerInfo(
            self.pieces, xgr.VocabType.RAW, vocab_size=self.vocab_size, stop_token_ids=[eos_id]
        )

    def encode(self, text: str | bytes) -> list[int]:
        data = text.encode() if isinstance(text, str) else text
        ids, at = [], 0
        while at < len(data):
            for size in range(min(self._longest, len(data) - at), 0, -1):
                token = self._ids.get(data[at:at + size])
                if token is not None:
                    ids.append(token)
                    at += size
                    break
            else:
                raise ValueError(f"byte {data[at]:#x} at offset {at} has no token; a byte vocabulary needs all 256 single bytes")
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return b"".join(self.pieces[i] for i in ids if i != self.eos_id).decode("utf-8", errors="replace")


def toy_tokenizer(size: int | None = None):
    """A byte-level vocabulary written here, no download: all 256 single bytes, common
    JSON pieces (``{"``, ``":``, ``",``, ``true``, ...), two-digit numbers, words with
    and without a leading space or quote, then the stop token (an empty piece).

    ``size``: pad to exactly this many tokens with unique 4-letter filler words (stand-ins
    for a large BPE vocabulary, e.g. ``size=128256`` for Llama 3's). Returns a
    :class:`Vocabulary`; its ``eos_id`` is the stop token.
    """
    texts = list(_JSON_PIECES) + [f"{n:02d}" for n in range(100)]
    for word in _WORDS:
        texts += [word, " " + word, '"' + word, '"' + word + '"', word.capitalize()]
    pieces = [bytes([b]) for b in range(256)]
    seen = set(pieces)
    for text in texts:
        piece = text.encode()
        if piece not in seen:
            seen.add(piece)
            pieces.append(piece)
    eos_id = len(pieces)
    pieces.append(b"")
    if size is not None:
        if size < len(pieces):
            raise ValueError(f"the toy vocabulary has {len(pieces)} base tokens; size={size} cannot hold them")
        letters = "abcdefghijklmnopqrstuvwxyz"
        index = 0
        while len(pieces) < size:
            n, word = index, ""
            for _ in range(4):
                n, digit = divmod(n, 26)
                word += letters[digit]
            index += 1
            piece = word.encode()
            if piece not in seen:
                seen.add(piece)
                pieces.append(piece)
    return Vocabulary(pieces, eos_id=eos_id)


def force(engine, compiled, tokens: Sequence[int], *, buffer: torch.Tensor | None = None,
          times: list | None = None, stop: bool = True) -> bool:
    """Teacher forcing through a grammar engine: whether a fresh matcher of ``compiled``
    takes ``tokens`` and then a stop token (``stop=False``: whether they are a prefix),
    each one checked against the mask filled before it (the bit the graph reads) and by
    ``accept_token``. ``times``: per token taken, ``(fill + accept seconds, fill seconds)``
    is appended."""
    import time

    clock = time.perf_counter
    buffer = torch.zeros((1, engine.width), dtype=torch.int32) if buffer is None else buffer
    words = buffer.numpy()
    matcher = engine.matcher(compiled)
    tail = [engine.stop_token_ids[0]] if stop else []
    for token in list(tokens) + tail:
        start = clock()
        failures = engine.batch_fill([matcher], buffer, [0])
        fill = clock() - start
        if failures:
            raise failures[0][1]
        if not (int(words[0, token >> 5]) >> (token & 31)) & 1:
            return False
        start = clock()
        accepted = matcher.accept_token(token)
        if times is not None:
            times.append((fill + clock() - start, fill))
        if not accepted:
            return False
    return matcher.is_terminated() if stop else True


class ForcedStep(torch.nn.Module):
    """Greedy step with an additive ``bias [B, V]`` before the argmax: teacher forcing
    through a compiled graph. With ``bias = big * one_hot(token)`` the step returns
    ``token`` exactly when the logit mask allows it, so a wrong bit, row or reorder in
    the mask fed to the graph shows up as a different token."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=input_ids, use_cache=False).logits[:, -1]
        return (logits + bias).argmax(-1)


# ----------------------------------------------------------------------------- tensor parallel


class VocabShardedGreedyStep(torch.nn.Module):
    """One rank's greedy step with a vocab-parallel lm_head (NxD's ColumnParallel layout).

    Rank ``rank`` of ``world_size`` holds lm_head rows ``[rank * shard, (rank + 1) *
    shard)``, ``shard = ceil(V / world_size)``; the last shard is padded with zero rows.
    ``input_ids [B, S] -> (value [B], index [B])``: the max of this rank's shard of the
    last logits and its column within the shard (``max.dim``, the sampling site the
    logit-mask pass masks before). :func:`greedy_across_ranks` picks the token.
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
        hidden = self.body(input_ids=input_ids, use_cache=False).last_hidden_state
        logits = torch.nn.functional.linear(hidden, self.lm_head_shard)[:, -1]
        value, index = logits.max(-1)
        return value, index


def pick_across_ranks(values: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Greedy token from per-rank maxima: ``values, tokens [world, B]`` (global ids) -> ``[B]``.

    Ties go to the lowest rank, and so (each rank's index being its first max) to the
    lowest token id: the same token ``argmax`` of the gathered logits returns.
    """
    best = values.argmax(0, keepdim=True)
    return tokens.gather(0, best).squeeze(0)


def greedy_across_ranks(value: torch.Tensor, index: torch.Tensor, rank: int, shard_width: int, group=None):
    """All-gather each rank's ``(max, index in shard)`` over ``torch.distributed`` and pick the token."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    token = index + rank * shard_width
    values = [torch.empty_like(value) for _ in range(world)]
    tokens = [torch.empty_like(token) for _ in range(world)]
    dist.all_gather(values, value, group=group)
    dist.all_gather(tokens, token, group=group)
    return pick_across_ranks(torch.stack(values), torch.stack(tokens))


# ----------------------------------------------------------------------------- decode steps over a static KV cache


def sample_race(logits: torch.Tensor, noise: torch.Tensor, *, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """``SamplingStep``'s sampler on ``logits [B, V]``: temperature, top-k, top-p, exponential race."""
    scaled = logits / temperature
    ordered, order = scaled.sort(dim=-1, descending=True)
    probs = ordered.softmax(-1)
    before = probs.cumsum(-1) - probs
    rank = torch.arange(ordered.shape[-1], device=ordered.device)
    drop = (before > top_p) | (rank >= top_k)
    kept = ordered.masked_fill(drop, float("-inf")).softmax(-1)
    choice = (kept / noise.gather(-1, order)).argmax(-1, keepdim=True)
    return order.gather(-1, choice).squeeze(-1)


class CachedGreedyStep(torch.nn.Module):
    """A 1-token decode step over Hugging Face's static KV cache, as accelerators compile it:
    ``input_ids [B, 1], cache_position [1] -> token [B]`` (argmax of the logits).

    The cache is HF's ExecuTorch recipe (``TorchExportableModuleWithStaticCache``, or
    ``...WithHybridCache`` for sliding-window configs such as GPT-OSS): StaticCache
    tensors registered as buffers and written in place at ``cache_position``. Export
    it strict (HF's default; non-strict lifts the cache as constants) and run it under
    ``no_grad``. The batch is fixed at ``batch_size``; feed a prompt one token a step.
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
        return self.cached(input_ids=input_ids, cache_position=cache_position)[:, -1]

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        return self.logits(input_ids, cache_position).argmax(-1)

    def example_inputs(self, vocab_size: int, *, seed: int = 0) -> tuple:
        return random_ids(self.batch_size, 1, vocab_size, seed=seed), torch.tensor([0])


class CachedSamplingStep(CachedGreedyStep):
    """:class:`CachedGreedyStep` with ``SamplingStep``'s sampler (:func:`sample_race`):
    ``input_ids [B, 1], cache_position [1], noise [B, V] -> token [B]``."""

    def __init__(self, model, *, batch_size: int, max_cache_len: int = 64,
                 temperature: float = 0.8, top_k: int = 50, top_p: float = 0.9):
        super().__init__(model, batch_size=batch_size, max_cache_len=max_cache_len)
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        logits = self.logits(input_ids, cache_position)
        return sample_race(logits, noise, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)

    def example_inputs(self, vocab_size: int, *, seed: int = 0) -> tuple:
        width = self.cached.model.config.vocab_size
        return (*super().example_inputs(vocab_size, seed=seed), exponential_noise(self.batch_size, width, seed=seed))


def cache_state(program_or_module) -> dict[str, torch.Tensor]:
    """Copies of the KV-cache tensors (``*keys``/``*values`` buffers) of an exported
    program or a module, by name: compare two runs' caches after a decode."""
    if isinstance(program_or_module, torch.export.ExportedProgram):
        named = {**program_or_module.state_dict, **program_or_module.constants}.items()
    else:
        named = program_or_module.named_buffers()
    return {n: t.detach().clone() for n, t in named if n.rsplit(".", 1)[-1].startswith(("key", "value"))}


class DraftHeadStep(torch.nn.Module):
    """A greedy step with a second, Medusa/MTP-style head: ``input_ids -> (token, draft)``.

    The draft head is its own projection of the last hidden state (``draft_vocab``
    columns, default the model's vocabulary), followed by its own argmax.
    """

    def __init__(self, model: torch.nn.Module, draft_vocab: int | None = None, seed: int = 1):
        super().__init__()
        self.model = model
        config = model.config
        torch.manual_seed(seed)
        self.draft = torch.nn.Linear(config.hidden_size, draft_vocab or config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor):
        out = self.model(input_ids=input_ids, use_cache=False, output_hidden_states=True)
        hidden = out.hidden_states[-1][:, -1]
        return out.logits[:, -1].argmax(-1), self.draft(hidden).argmax(-1)


def weather_tool(max_location: int = 10, *, strict: bool = True) -> dict:
    """An OpenAI function tool (``get_weather(location, unit)``) for tests and the demo;
    ``max_location`` bounds the location string so a random model's answer ends."""
    parameters = {
        "type": "object",
        "properties": {"location": {"type": "string", "maxLength": max_location},
                       "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["location", "unit"],
    }
    if strict:
        parameters["additionalProperties"] = False
    return {"type": "function", "function": {"name": "get_weather", "parameters": parameters}}


# ----------------------------------------------------------------------------- NxD-style token generation


def sample_top_k_top_p(logits: torch.Tensor, sampling_params: torch.Tensor, uniform: torch.Tensor, *,
                       global_top_k: int) -> torch.Tensor:
    """NxD's on-device sampler on ``logits [B, V]``: ``topk`` (``global_top_k`` wide), each
    row's own top-k, temperature, softmax, ``cumsum`` top-p, then the token whose
    cumulative probability first passes ``uniform [B, 1]`` (in ``[0, 1)``).
    ``sampling_params [B, 3]`` holds ``(top_k, top_p, temperature)`` per row."""
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
        shape = (self.batch_size, self.kv_heads, self.bucket, self.head_dim)
        return tuple(torch.zeros(shape) for _ in range(2 * len(self.model.model.layers)))

    def example_inputs(self, vocab_size: int, *, seed: int = 0) -> tuple:
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
        hidden = self.model.model.embed_tokens(input_ids)
        new_cache = []
        for index, layer in enumerate(self.model.model.layers):
            out, k, v = self._attend(layer, layer.input_layernorm(hidden), position_ids, cache[2 * index], cache[2 * index + 1])
            hidden = hidden + out
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
            new_cache += [k, v]
        return self.model.lm_head(self.model.model.norm(hidden))[:, -1], tuple(new_cache)

    def forward(self, input_ids, position_ids, sampling_params, uniform, cache):
        logits, new_cache = self.logits(input_ids, position_ids, cache)
        return (sample_top_k_top_p(logits, sampling_params, uniform, global_top_k=self.global_top_k), *new_cache)
