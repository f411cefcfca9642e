"""KV-cached decode programs for a Hugging Face ``*ForCausalLM``: a prefill program and an
n-token step program over one static cache, exported once and rewritten by the passes.

    decoder = export_decoder(model, max_batch=8, max_len=1024, vocab_size=tok.vocab_size)
    first = decoder.run_prefill([[1, 2, 3], [4, 5]], rows=[0, 1], logit_mask=m)  # token [B]
    nxt = decoder.run_step(first[:, None], positions=[3, 2], logit_mask=m)       # token [B]

The cache: one ``keys_i`` / ``values_i`` buffer per layer, ``[max_batch, kv_heads,
max_len, head_dim]``, read and written in place by both programs (the same tensors).
**A row's cache slot is its token's position**: the token at position ``p`` of the
request in cache row ``r`` lives in slot ``p`` of row ``r``. Whatever a slot held
before (a finished request, a prompt's right padding, a rejected draft) is masked,
or overwritten before any query may read it.

    prefill(input_ids [B, T], rows [B], last [B]) -> token [B]
        writes slots 0..T-1 of cache rows ``rows``, attends only its own T tokens
        (causally: a fresh, right-padded prompt), samples at position last[b]
    step(input_ids [B, n], position_ids [B, n], attention_mask [B, W]) -> token [B] (n = 1) or [B, n]
        writes slots position_ids[b] of cache rows 0..B-1; query (b, t) attends the slots
        j < W with attention_mask[b, j] and j <= position_ids[b, t] (and, on sliding-window
        layers, position_ids[b, t] - j < window); samples every position

``attention_mask`` says which slots hold the row's tokens and bounds the attention
window ``W`` (the host buckets it: ``window_bucket``), so a step costs what the
sequence needs, not the whole cache. ``n > 1`` (``new_tokens=``) is the verify step
of speculative or jump-forward decoding: a row with fewer drafts pads with any token
at later positions (later steps overwrite those slots) and may mark slots invalid.
Step rows are cache rows ``0..B-1``: a finished request leaves by moving the rows
after it down (:meth:`CachedDecoder.keep_rows`); a request that joins later is
prefilled into the next free row.

Exported non-strict by default (the cache writes stay in-place ``index_put_`` on the
buffers), the batch dimension dynamic up to ``max_batch``, the prefill length and the
window dynamic up to ``max_len``; on an AOT backend each (batch, length, window)
bucket compiles once, and new positions, rows or masks never recompile.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import torch

from neuron_constrain.decoding.attention import grouped_attention
from neuron_constrain.decoding.compiled import cache_names, compile_decoder, share_cache

__all__ = ["CachedDecoder", "KVCache", "PrefillStep", "CachedStep", "export_decoder"]


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _windows(config) -> dict[str, int | None]:
    """The attention window of each layer type (None: full attention); key ``"all"``: one for every layer.

    Models with ``layer_types`` take a mask per type (GPT-OSS, Qwen2/3: a dict); the
    others one mask, which replaces their own sliding-window mask (Mistral), so the
    window is applied here."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types and "sliding_attention" in types:
        return {"full_attention": None, "sliding_attention": window}
    return {"all": window if getattr(config, "use_sliding_window", True) else None}


class KVCache(torch.nn.Module):
    """The static cache: ``keys_i`` / ``values_i`` buffers, ``[max_batch, kv_heads, max_len + 1, head_dim]``.

    The slot past ``max_len`` is never written nor attended: with it every attention
    window is a strict prefix of the buffer, so export sees one case (a window equal
    to the whole buffer would be a contiguous view, and a guard on that size).

    Args:
        config: the model's transformers config (layers, key/value heads, head size).
        max_batch: rows.
        max_len: slots a row.
        dtype: the buffers' dtype.
    """

    def __init__(self, config, *, max_batch: int, max_len: int, dtype: torch.dtype):
        super().__init__()
        self.layers = config.num_hidden_layers
        self.max_batch, self.max_len = max_batch, max_len
        shape = (max_batch, config.num_key_value_heads, max_len + 1, _head_dim(config))
        for i in range(self.layers):
            self.register_buffer(f"keys_{i}", torch.zeros(shape, dtype=dtype))
            self.register_buffer(f"values_{i}", torch.zeros(shape, dtype=dtype))


class _Writes:
    """The ``past_key_values`` Hugging Face attention layers call ``update`` on: write the
    new keys/values at (row, slot), return what the layer attends to.

    Built inside ``forward`` from the cache module's buffers, so an export traces them
    as buffers mutated in place, never as constants.
    """

    def __init__(self, cache: KVCache, rows: torch.Tensor, slots: torch.Tensor, window: int | None):
        self.keys = [getattr(cache, f"keys_{i}") for i in range(cache.layers)]
        self.values = [getattr(cache, f"values_{i}") for i in range(cache.layers)]
        heads = torch.arange(self.keys[0].shape[1], device=rows.device)
        # broadcast to [B, kv_heads, n]: cache[rows[b], h, slots[b, t], :] = new[b, h, t, :]
        self.index = (rows[:, None, None], heads[None, :, None], slots[:, None, :])
        self.batch, self.window = rows.shape[0], window

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys.index_put_(self.index, key_states)
        values.index_put_(self.index, value_states)
        if self.window is None:  # a fresh prompt attends only its own tokens
            return key_states, value_states
        return keys[: self.batch, :, : self.window], values[: self.batch, :, : self.window]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


def _masks(windows: dict, query: torch.Tensor, key: torch.Tensor, valid: torch.Tensor | None, dtype):
    """Additive ``[B, 1, T, S]`` masks (what every attention implementation takes) from query
    positions ``[B, T, 1]``, key slots ``[1, 1, S]`` and valid slots ``[B, 1, S]``."""
    allowed = key <= query
    if valid is not None:
        allowed = allowed & valid
    zero = torch.zeros((), dtype=dtype, device=query.device)
    masks = {}
    for kind, window in windows.items():
        kept = allowed if window is None else allowed & (query - key < window)
        masks[kind] = torch.where(kept, zero, torch.finfo(dtype).min)[:, None]
    return masks["all"] if "all" in masks else masks


class _Program(torch.nn.Module):
    def __init__(self, model: torch.nn.Module, cache: KVCache):
        super().__init__()
        self.model, self.cache = model, cache
        self.windows = _windows(model.config)
        self.dtype = next(model.parameters()).dtype

    def _pick(self, hidden: torch.Tensor, noise: torch.Tensor | None, temperature: torch.Tensor | None) -> torch.Tensor:
        """Greedy, or with ``noise`` (Exponential(1), the logits' shape) and a per-row
        ``temperature [B]`` the exponential race ``argmax(softmax(logits / T) / noise)``: a
        sample from ``softmax(logits / T)``, the same token for the same noise whatever
        the batch. The mask pass masks the logits before the temperature."""
        logits = self.model.get_output_embeddings()(hidden)
        if noise is None:
            return logits.argmax(-1)
        scale = temperature.reshape(temperature.shape[0], *([1] * (logits.dim() - 1)))
        return (torch.softmax(logits.float() / scale, -1) / noise).argmax(-1)

    def _hidden(self, input_ids, position_ids, mask, writes) -> torch.Tensor:
        return self.model.get_decoder()(
            input_ids=input_ids, position_ids=position_ids, attention_mask=mask, past_key_values=writes, use_cache=True
        ).last_hidden_state


class PrefillStep(_Program):
    """``(input_ids [B, T], rows [B], last [B][, noise [B, V], temperature [B]]) -> token [B]``:
    greedy (or sampled) at ``last[b]``; the lm_head runs on those B hidden rows only."""

    def forward(self, input_ids: torch.Tensor, rows: torch.Tensor, last: torch.Tensor,
                noise: torch.Tensor | None = None, temperature: torch.Tensor | None = None) -> torch.Tensor:
        """Write the prompts' keys and values into their cache rows and pick each prompt's next token.

        Args:
            input_ids: ``[B, T]`` prompts, right-padded.
            rows: ``[B]``: each prompt's cache row.
            last: ``[B]``: each prompt's last position.
            noise: ``[B, V]`` Exponential(1) noise (sampled programs).
            temperature: ``[B]`` (sampled programs).

        Returns:
            ``[B]`` tokens.
        """
        batch, length = input_ids.shape
        positions = torch.arange(length, device=input_ids.device)
        writes = _Writes(self.cache, rows, positions[None, :].expand(batch, -1), window=None)
        mask = _masks(self.windows, positions[None, :, None], positions[None, None, :], None, self.dtype)
        hidden = self._hidden(input_ids, positions[None, :], mask, writes)
        hidden = hidden[torch.arange(batch, device=hidden.device), last]
        return self._pick(hidden, noise, temperature)


class CachedStep(_Program):
    """``(input_ids [B, n], position_ids [B, n], attention_mask [B, W][, noise [B(, n), V],
    temperature [B]]) -> token [B]`` (n = 1) or ``[B, n]``."""

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor,
                noise: torch.Tensor | None = None, temperature: torch.Tensor | None = None) -> torch.Tensor:
        """One decode (or verify) step over cache rows ``0..B-1``, writing its keys and values.

        Args:
            input_ids: ``[B, n]`` tokens.
            position_ids: ``[B, n]`` their positions.
            attention_mask: ``[B, W]``: the cache slots each row attends (the window ``W``).
            noise: ``[B(, n), V]`` Exponential(1) noise (sampled programs).
            temperature: ``[B]`` (sampled programs).

        Returns:
            ``[B]`` tokens (n = 1) or ``[B, n]``.
        """
        batch, window = input_ids.shape[0], attention_mask.shape[1]
        rows = torch.arange(batch, device=input_ids.device)
        writes = _Writes(self.cache, rows, position_ids, window=window)
        slots = torch.arange(window, device=input_ids.device)[None, None, :]
        mask = _masks(self.windows, position_ids[:, :, None], slots, attention_mask[:, None, :], self.dtype)
        hidden = self._hidden(input_ids, position_ids, mask, writes)
        if hidden.shape[1] == 1:
            hidden = hidden[:, 0]
        return self._pick(hidden, noise, temperature)


def _round_up(value: int, step: int, limit: int) -> int:
    return min(limit, -(-value // step) * step)


@dataclasses.dataclass
class CachedDecoder:
    """The prefill and step programs of one model over one cache (see the module docstring).

    ``run_*`` return ``(tokens, empty_rows)`` as ``Transformed.run`` does (extra keywords
    such as ``logit_mask=`` pass through). Built by :func:`export_decoder`.

    Attributes:
        prefill: the prefill program (a :class:`~neuron_constrain.core.transform.Transformed`).
        steps: the step programs, keyed by the tokens a row they take (1 for decoding, k + 1 to
            verify k drafts).
        cache: the tensors they all read and write in place.
        max_batch: cache rows.
        max_len: cache slots a row.
        length_bucket: the prefill length is rounded up to a multiple of it (the shapes an AOT
            backend compiles once each); ``window_bucket`` likewise for the attention window.
        sampled: the programs take noise and temperature.
        compiled: ``None`` (eager), ``"inductor"`` or ``"xla"``.
        packages: with ``"inductor"``, program name -> its package (``.pt2``).
        eager: a compiled decoder's eager twin (the reference).
    """

    prefill: object
    steps: dict
    cache: list
    max_batch: int
    max_len: int
    export_seconds: float
    pad_id: int = 0
    length_bucket: int = 8
    window_bucket: int = 64
    sampled: bool = False  # the programs take noise and temperature (export_decoder(sampled=True))
    logits_width: int = 0  # the lm_head's columns (the noise's last dimension)
    compiled: str | None = None  # None: the programs run eagerly; "inductor" / "xla": decoding.compiled
    compile_seconds: float = 0.0
    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))  # the programs' inputs go here
    packages: dict = dataclasses.field(default_factory=dict)  # "inductor": program name -> its package (.pt2)
    packages_built: int = 0  # "inductor": packages compiled by this call (the others came from the cache)
    eager: "CachedDecoder | None" = None  # a compiled decoder's eager twin (the reference)
    embedding_rows: int = 0  # token ids run 0..embedding_rows - 1 (0: not checked)

    @property
    def step(self):
        """The one-token step program."""
        return self.steps[min(self.steps)]

    @property
    def report(self):
        """The one-token step's :class:`TransformReport` (what ``StructuredRuntime.for_model`` reads)."""
        return self.step.report

    def run_prefill(self, prompts: Sequence[Sequence[int]], rows: Sequence[int], **extra):
        """Prefill prompts into cache rows.

        Args:
            prompts: the prompts' token ids (padded to a length bucket).
            rows: each prompt's cache row, distinct.
            **extra: the program's other inputs (``logit_mask=``, ``noise=``...), moved to its device.

        Returns:
            ``(tokens [B], empty_rows)`` as ``Transformed.run`` returns them: the token after each prompt.

        Raises:
            ValueError: not one row per prompt, more prompts than cache rows, an empty prompt or one past
                ``max_len``, a row out of range or taken twice, a token id past the embedding; before any
                program runs.
        """
        if not prompts or len(prompts) != len(rows) or len(prompts) > self.max_batch:
            raise ValueError(f"{len(prompts)} prompts for {len(rows)} rows: pass one row each, at most {self.max_batch}")
        shortest, longest = min(len(p) for p in prompts), max(len(p) for p in prompts)
        if shortest < 1 or longest > self.max_len:
            raise ValueError(f"prompts of {shortest}..{longest} tokens: each needs 1 to max_len={self.max_len}")
        length = _round_up(longest, self.length_bucket, self.max_len)
        ids = torch.full((len(prompts), length), self.pad_id, dtype=torch.long)
        for i, prompt in enumerate(prompts):
            ids[i, : len(prompt)] = torch.as_tensor(list(prompt), dtype=torch.long)
        last = torch.tensor([len(p) - 1 for p in prompts], dtype=torch.long)
        rows = torch.as_tensor(list(rows), dtype=torch.long)
        if int(rows.min()) < 0 or int(rows.max()) >= self.max_batch or len(set(rows.tolist())) < len(rows):
            raise ValueError(f"rows {rows.tolist()}: each prompt takes its own cache row, 0..{self.max_batch - 1}")
        self._check_ids(ids)
        with torch.no_grad():  # with grad on, every write would chain the cache into an ever-growing autograd graph
            return self._synced(self.prefill.run(*self._moved((ids, rows, last)), **self._moved(extra)))

    def run_step(self, tokens, positions: Sequence[int], **extra):
        """One step of cache rows ``0..B-1``.

        Args:
            tokens: ``[B, n]``: each row's next token (n = 1), or the tokens a verify step checks.
            positions: each row's position of its first token (its tokens at ``positions[b] + 0..n-1``).
            **extra: the program's other inputs (``logit_mask=``, ``noise=``...), moved to its device.

        Returns:
            ``(tokens, empty_rows)`` as ``Transformed.run`` returns them: ``[B]`` (n = 1) or ``[B, n]``.

        Raises:
            ValueError: no step program takes ``n`` tokens a row, more rows than the cache's, positions
                past ``max_len``, a token id past the embedding; before any program runs.
        """
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        batch, n = tokens.shape
        if n not in self.steps:
            raise ValueError(f"{n} tokens a row, but the step programs take {sorted(self.steps)}")
        if batch > self.max_batch:
            raise ValueError(f"{batch} rows, but the cache has {self.max_batch}")
        self._check_ids(tokens)
        position_ids = torch.as_tensor(list(positions), dtype=torch.long)[:, None] + torch.arange(n)
        end = int(position_ids.max()) + 1
        if end > self.max_len or int(position_ids.min()) < 0:
            raise ValueError(f"positions up to {end - 1}: the cache holds positions 0..{self.max_len - 1}")
        window = _round_up(end, self.window_bucket, self.max_len)
        attention_mask = torch.arange(window)[None, :] <= position_ids[:, -1:]
        with torch.no_grad():
            return self._synced(self.steps[n].run(*self._moved((tokens, position_ids, attention_mask)), **self._moved(extra)))

    def _check_ids(self, ids: torch.Tensor) -> None:
        """Token ids index the embedding: checked here, since a compiled program does not
        (decoding.compiled: Inductor's index asserts are off) and would read past it."""
        if self.embedding_rows and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.embedding_rows):
            bad = ids[(ids < 0) | (ids >= self.embedding_rows)][0]
            raise ValueError(f"token id {int(bad)}: the model's embedding has ids 0..{self.embedding_rows - 1} "
                             "(a tokenizer of another model?)")

    def _moved(self, values):
        """A tuple or dict of host-made inputs, on the programs' device (on the XLA device
        each one is device data, a parameter of the graph: new values never recompile)."""
        if self.device.type == "cpu":
            return values
        move = lambda value: value.to(self.device) if isinstance(value, torch.Tensor) else value  # noqa: E731
        return {k: move(v) for k, v in values.items()} if isinstance(values, dict) else tuple(move(v) for v in values)

    def _synced(self, result):
        """On the XLA device, run what is pending now, the cache writes with the outputs: one
        graph a call (left pending, the writes would join the next call's graph, a new one
        every step)."""
        if self.device.type == "xla":
            import torch_xla

            torch_xla.sync()
        return result

    @torch.no_grad()
    def keep_rows(self, rows: Sequence[int]) -> None:
        """Move cache rows to the front (finished requests leave).

        Args:
            rows: the rows to keep, ascending; they become rows ``0..len(rows)-1``.
        """
        if list(rows) == list(range(len(rows))):
            return
        if self.device.type != "cpu":  # one gather of every row (its order as device data): one graph for any rows
            order = torch.tensor([*rows, *(r for r in range(self.max_batch) if r not in set(rows))], device=self.device)
            for tensor in self.cache:
                tensor.copy_(tensor.index_select(0, order))
            self._synced(None)
            return
        for new, old in enumerate(rows):
            if new != old:
                for tensor in self.cache:
                    tensor[new].copy_(tensor[old])

    def save_cache(self, path) -> None:
        """Write the KV cache as it is (``torch.save``, named as the ``"inductor"`` packages' constants):
        what a plain-torch user loads into a package to go on from here.

        Args:
            path: the file to write.
        """
        torch.save({k: v.cpu() for k, v in cache_names(self.prefill.program, self.cache).items()}, path)


def export_decoder(model, *, max_batch: int, max_len: int, vocab_size: int, new_tokens: int | Sequence[int] = 1,
                   strict: bool = False, pad_id: int = 0, sampled: bool = False, compile: str | None = None,
                   package_dir=None, **transform_options) -> CachedDecoder:
    """Export ``model``'s prefill and step programs over one static cache and run the passes.

    Args:
        model: a Hugging Face ``*ForCausalLM`` (or a module built like one).
        max_batch: cache rows: the most requests decoded at once.
        max_len: cache slots a row: prompt plus answer.
        vocab_size: the tokenizer's vocabulary (the mask width).
        new_tokens: the tokens a row of each step program takes (``(1, 2, 4, 8)``: decode plus
            verify steps for 1, 3 and 7 drafts); one export each.
        strict: ``torch.export``'s strict mode.
        pad_id: the token right-padding a prompt (never attended by real tokens).
        sampled: every program also takes ``noise`` (Exponential(1), the logits' shape) and
            ``temperature [B]`` and samples by the exponential race instead of the argmax.
        compile: ``"inductor"`` (AOTInductor packages, kept in ``package_dir``) or ``"xla"`` runs
            the programs compiled (the eager ones stay as ``decoder.eager``); ``None`` runs them
            eagerly; ``"auto"``: compiled where every package is built already, eagerly otherwise.
        package_dir: where AOTInductor packages are kept and found again.
        **transform_options: keywords of :func:`neuron_constrain.transform` (e.g. ``logit_mask=None``).

    Returns:
        The decoder: ``generate(decoder, ...)`` runs it.

    Raises:
        ValueError: a cache without a row or two slots, or a step wider than the cache.
        TransformError: as :func:`neuron_constrain.transform`.
    """
    from torch.export import Dim

    from neuron_constrain.core.transform import transform

    sizes = sorted({new_tokens} if isinstance(new_tokens, int) else set(new_tokens))
    if max_batch < 1 or max_len < 2:
        raise ValueError(f"max_batch={max_batch}, max_len={max_len}: a cache needs at least one row and two slots")
    if not sizes or not all(isinstance(n, int) and 1 <= n < max_len for n in sizes):
        raise ValueError(f"new_tokens={new_tokens!r}: each step writes 1 to max_len - 1 tokens a row")
    start = time.perf_counter()
    cache = KVCache(model.config, max_batch=max_batch, max_len=max_len, dtype=next(model.parameters()).dtype)
    batch = Dim("batch", min=1, max=max_batch) if max_batch > 1 else Dim.STATIC  # one row: a static batch
    example = min(2, max_batch)
    options = dict(vocab_size=vocab_size, strict=strict, **transform_options)
    width = model.get_output_embeddings().weight.shape[0]

    def sampling(*shape):  # the noise and temperature example inputs and their dynamic batch dim
        if not sampled:
            return (), ()
        return (torch.ones(*shape, width), torch.ones(shape[0])), ({0: batch}, {0: batch})

    args, dims = sampling(example)
    prefill = transform(
        PrefillStep(model, cache),
        (torch.zeros(example, 8, dtype=torch.long), torch.arange(example), torch.zeros(example, dtype=torch.long), *args),
        dynamic_shapes=({0: batch, 1: Dim("length", min=1, max=max_len)}, {0: batch}, {0: batch}, *dims), **options,
    )
    steps = {}
    window = Dim("window", min=1, max=max_len)
    with grouped_attention(model):
        for n in sizes:
            ids = torch.zeros(example, n, dtype=torch.long)
            args, dims = sampling(example, n) if n > 1 else sampling(example)
            steps[n] = transform(
                CachedStep(model, cache),
                (ids, ids + torch.arange(n), torch.ones(example, min(max(16, n), max_len), dtype=torch.bool), *args),
                dynamic_shapes=({0: batch}, {0: batch}, {0: batch, 1: window}, *dims), **options,
            )
    tensors = share_cache([prefill, *steps.values()])
    decoder = CachedDecoder(prefill, steps, tensors, max_batch, max_len, time.perf_counter() - start, pad_id,
                            sampled=sampled, logits_width=width,
                            embedding_rows=model.get_input_embeddings().weight.shape[0])
    return decoder if compile is None else compile_decoder(decoder, compile, cache_dir=package_dir)
