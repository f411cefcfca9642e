"""The decode loop, next to the decode programs: which requests run each step, their model
inputs (a window without a cache, a prefill into a free cache row, one-token or verify
steps) and their sampling noise. What the grammars do is not here: ``requests`` (the
structured runtime's bookkeeping, ``structured/runtime/generate.py``) masks, accepts and says
who is ready, through the methods below.

    recompute_loop(transformed, requests, max_new_tokens, pipelined=False, eos_id=eos)   # no KV cache
    cached_loop(decoder, requests, max_new_tokens, jump_forward=None)                    # CachedDecoder

``requests`` has ``sequences`` (prompt + generated, per request), ``generated``, ``errors``
(index -> why), ``ready(indices) -> (waiting, ready)``, ``wait(indices)``, ``mask(indices)``
(the mask of a step, for the pipelined step), ``step(indices, run)`` (mask, run, accept:
``run(mask_kwargs) -> (tokens, empty_rows)``), ``accept(indices, tokens, began)``,
``verify(indices, width_of, run)`` (a jump-forward step) and ``done(index)``.
"""
from __future__ import annotations

import time

import torch

from neuron_constrain.decoding.decoder import CachedDecoder
from neuron_constrain.decoding.pipeline import PipelinedStep, split_step
from neuron_constrain.core.transform import Transformed, transform

__all__ = ["cached_loop", "recompute_loop", "sampling_inputs", "transform_decoder", "verify_inputs"]


def transform_decoder(model, example_inputs, *, vocab_size: int, enable_structured_outputs: bool = True, **kwargs) -> Transformed:
    """``transform`` with the structured-outputs switch.

    Args:
        model: the decode step (``input_ids -> token``) to export and rewrite.
        example_inputs: its example inputs.
        vocab_size: the tokenizer's vocabulary.
        enable_structured_outputs: ``True``: the graph gains the packed ``logit_mask`` input
            (unconstrained traffic feeds ``-1`` rows through the same compiled graph, so the first
            constrained request costs no recompilation). ``False``: no mask input and no mask
            work; a :class:`StructuredRuntime` built for it refuses constrained requests.
        **kwargs: other keywords of :func:`neuron_constrain.transform`.

    Returns:
        The rewritten step (:class:`Transformed`).

    Raises:
        TransformError: as :func:`neuron_constrain.transform`.
    """
    if enable_structured_outputs:
        return transform(model, example_inputs, logit_mask="packed", vocab_size=vocab_size, **kwargs)
    return transform(model, example_inputs, logit_mask=None, **kwargs)


def sequence_length(transformed: Transformed) -> int | None:
    """The static token dimension of the graph's first input, or None if it is dynamic."""
    spec = transformed.program.graph_signature.user_inputs[0]
    node = next(n for n in transformed.program.graph.nodes if n.op == "placeholder" and n.name == spec)
    size = node.meta["val"].shape[-1]
    return size if isinstance(size, int) else None


def sampling_inputs(decoder: CachedDecoder, indices: list[int], generated: list[list[int]], width: int,
                    temperature: float | None, seed: int) -> dict:
    """``noise`` and ``temperature`` for a sampled decoder: the noise of request ``i``'s
    output token ``j`` is drawn from a generator seeded by ``(seed, i, j)``, so a token is
    the same whichever step (or verify position) samples it."""
    if not decoder.sampled:
        return {}
    if temperature is None:  # greedy on a sampled decoder: noise 1 makes the race an argmax
        shape = (len(indices), decoder.logits_width) if width == 1 else (len(indices), width, decoder.logits_width)
        return {"noise": torch.ones(shape), "temperature": torch.ones(len(indices))}
    rows = []
    for index in indices:
        first = len(generated[index])
        rows.append(torch.stack([
            torch.empty(decoder.logits_width).exponential_(
                generator=torch.Generator().manual_seed(hash((seed, index, first + t)) & 0x7FFFFFFF))
            for t in range(width)
        ]))
    noise = torch.stack(rows)
    return {"noise": noise[:, 0] if width == 1 else noise, "temperature": torch.full((len(indices),), float(temperature))}


def verify_inputs(decoder: CachedDecoder, sequences: list[list[int]], indices: list[int],
                  runs: list[list[int]], width: int) -> tuple[torch.Tensor, list[int]]:
    """A verify step's tokens ``[B, width]`` (each row's last token, then its forced run, then
    padding) and positions (the last token is not in the cache yet)."""
    tokens = torch.full((len(indices), width), decoder.pad_id, dtype=torch.long)
    for row, (index, run) in enumerate(zip(indices, runs)):
        tokens[row, : len(run) + 1] = torch.tensor([sequences[index][-1], *run])
    return tokens, [len(sequences[i]) - 1 for i in indices]


def recompute_loop(transformed: Transformed, requests, max_new_tokens: int, pipelined: bool, eos_id: int) -> None:
    """No KV cache: every step recomputes over the last tokens (a graph exported with a
    static sequence length sees a window of that many, left-padded with the stop token).

    Args:
        transformed: a rewritten ``input_ids -> token`` step.
        requests: the requests' state, updated in place.
        max_new_tokens: the most tokens an answer may have.
        pipelined: fill the masks while the step's body runs (the step cut at its mask).
        eos_id: the stop token (the window's left padding)."""
    window = sequence_length(transformed)
    step = PipelinedStep(split_step(transformed)) if pipelined else None
    try:
        waiting = list(range(len(requests.sequences)))  # not finished, not failed
        while waiting and max_new_tokens > 0:
            waiting, ready = requests.ready(waiting)
            active = [i for i in waiting if i in ready]
            if not active:
                if waiting:
                    requests.wait(waiting)
                continue
            length = window or max(len(requests.sequences[i]) for i in active)
            inputs = torch.tensor([([eos_id] * length + requests.sequences[i])[-length:] for i in active], dtype=torch.long)
            if step is not None:  # the fill runs while the body does
                began = time.perf_counter()
                tokens = step((inputs,), fill=lambda: {"logit_mask": requests.mask(active)})
                requests.accept(active, tokens, began)
            else:
                requests.step(active, lambda mask: transformed.run(inputs, **mask))
            waiting = [i for i in waiting if not requests.done(i)]
    finally:
        if step is not None:
            step.close()


def cached_loop(decoder: CachedDecoder, requests, max_new_tokens: int, jump_forward: str | None,
                temperature: float | None = None, seed: int = 0) -> None:
    """Prefill each request once into a free cache row, then one-token steps of every
    row (with ``jump_forward``: verify steps that also take each row's forced run); a
    request whose grammar is still compiling joins when it is ready (a row is free), a
    finished one leaves its row (the rows after it move down). What ``generate`` runs.

    Args:
        decoder: the cached decoder.
        requests: the requests' state as ``generate`` passes it (sequences, masks, accepts), updated in place.
        max_new_tokens: the most tokens an answer may have.
        jump_forward: ``None``, ``"exact"`` or ``"canonical"``.
        temperature: sample at this temperature (``None``: greedy).
        seed: the sampling noise's seed."""
    sequences = requests.sequences
    rows: list[int] = []  # the request in each cache row, in row order
    pending = list(range(len(sequences))) if max_new_tokens > 0 else []

    def sampling(indices, width):
        return sampling_inputs(decoder, indices, requests.generated, width, temperature, seed)

    def retire() -> None:
        keep = [r for r, i in enumerate(rows) if not requests.done(i) and len(sequences[i]) <= decoder.max_len]
        decoder.keep_rows(keep)
        rows[:] = [rows[r] for r in keep]

    def run_verify(indices, runs, width, mask):
        tokens, positions = verify_inputs(decoder, sequences, indices, runs, width)
        if mask is not None and width > 1:  # [B, k + 1, W]: one grammar row per position
            mask = mask.view(len(indices), width, -1)
        return decoder.run_step(tokens, positions, **({} if mask is None else {"logit_mask": mask}),
                                **sampling(indices, width))

    while pending or rows:
        pending, ready = requests.ready(pending)
        for index in pending:
            if len(sequences[index]) > decoder.max_len:
                requests.errors[index] = (f"the prompt has {len(sequences[index])} tokens but the decoder's cache holds "
                                          f"{decoder.max_len}; export it with max_len >= {len(sequences[index]) + 1}")
        pending = [i for i in pending if i not in requests.errors]
        joining = [i for i in pending if i in ready][: decoder.max_batch - len(rows)]
        if joining:
            pending = [i for i in pending if i not in joining]
            start = len(rows)
            rows += joining
            requests.step(joining, lambda mask: decoder.run_prefill(
                [sequences[i] for i in joining], range(start, start + len(joining)), **mask, **sampling(joining, 1)))
        retire()
        if not rows:
            if pending:
                requests.wait(pending)
            continue
        if jump_forward is not None and len(decoder.steps) > 1:
            requests.verify(list(rows), sorted(decoder.steps), run_verify)
        else:
            last = torch.tensor([[sequences[i][-1]] for i in rows], dtype=torch.long)
            positions = [len(sequences[i]) - 1 for i in rows]  # the last token is not in the cache yet
            requests.step(list(rows), lambda mask: decoder.run_step(last, positions, **mask, **sampling(rows, 1)))
        retire()
