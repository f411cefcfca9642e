"""The sampling head every token of the plugin comes from, and its per-bucket programs.

``SamplingHead`` is a plain ``nn.Module`` that starts where vLLM's ``compute_logits``
would: it takes the hidden rows vLLM selected for sampling and runs

    lm_head (F.linear with the model's weight) -> greedy argmax
                                               -> sort, top-k, top-p, softmax, exponential race

``neuron_constrain.transform`` then rewrites its exported program: the logit-mask pass
adds ``logit_mask`` (packed int32, ``-1`` rows = all allowed) in front of both sampling
sites, the logits-processors pass adds min_tokens, logit_bias and penalties after the
mask and a per-row temperature + min_p in front of the sort. One program per batch
bucket (static shapes, as on an accelerator); every input is fed every step, so any
mix of constrained / unconstrained rows and sampling parameters runs the same program.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time

import torch
import torch.nn.functional as F

__all__ = ["SamplingHead", "HeadPrograms", "HeadInputs", "PROCESSORS", "buckets_for"]

log = logging.getLogger("vllm.neuron_constrain")  # under vLLM's logger: its handlers print it

PROCESSORS = ["min_tokens", "logit_bias", "penalties", "min_p"]
TOP_P_OFF = 2.0  # top_p >= 1 means "off": a threshold the cumulative mass never reaches


class SamplingHead(torch.nn.Module):
    """Hidden rows -> next token.

    Greedy rows take the argmax. Sampled rows race ``probs / noise`` (the exponential
    race: the same draw as ``torch.multinomial``, deterministic given ``noise``): over
    the whole vocabulary when the row has neither top-k nor top-p (``full``), else over
    the ``max_top_k`` most likely tokens, where top-k and then top-p (on the
    renormalised top-k mass, as vLLM) cut the sorted candidates — the "global top-k"
    of accelerator samplers (Neuron's on-device sampling): top_k must be <= max_top_k
    and top-p's nucleus is taken within those candidates. ``noise`` (``[B, V]``) is
    Exponential(1), drawn by the caller: a full row races the whole vocabulary in token
    order; a cut row reads its candidates' entries by token id, or, where ``rank_noise``
    is set, its first ``max_top_k`` entries, one per candidate rank (i.i.d. noise, so the
    same distribution) — then the caller draws 256 numbers for it, not a vocabulary's
    worth. The plugin sets ``rank_noise`` for unseeded rows; a seeded row draws the whole
    row from its own generator in token order, as vLLM's sampler does.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, max_top_k: int = 256):
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", bias, persistent=False) if bias is not None else setattr(self, "bias", None)
        self.max_top_k = min(max_top_k, weight.shape[0])

    def forward(self, hidden, noise, greedy, full, top_k, top_p, rank_noise):
        logits = F.linear(hidden, self.weight, self.bias).float()
        greedy_token = logits.argmax(-1)
        # whole-vocabulary race
        full_token = (logits.softmax(-1) / noise).argmax(-1)
        # top-k / top-p race among the max_top_k best candidates (sorted, descending)
        values, ids = logits.topk(self.max_top_k, dim=-1)
        rank = torch.arange(self.max_top_k, device=values.device)
        values = values.masked_fill(rank >= top_k.unsqueeze(-1), float("-inf"))
        probs = values.softmax(-1)
        before = probs.cumsum(-1) - probs
        kept = values.masked_fill(before >= top_p.unsqueeze(-1), float("-inf")).softmax(-1)
        # a candidate's noise: by rank (the row's first max_top_k entries) or by token id
        cand_noise = torch.where(rank_noise.unsqueeze(-1), noise[:, : self.max_top_k], noise.gather(-1, ids))
        choice = (kept / cand_noise).argmax(-1, keepdim=True)
        cut_token = ids.gather(-1, choice).squeeze(-1)
        return torch.where(greedy, greedy_token, torch.where(full, full_token, cut_token))


def buckets_for(max_num_seqs: int) -> list[int]:
    """Powers of two up to ``max_num_seqs`` (and it): the batch sizes a program is built for."""
    out, b = [], 1
    while b < max_num_seqs:
        out.append(b)
        b *= 2
    out.append(max_num_seqs)
    return out


@dataclasses.dataclass
class HeadInputs:
    """Preallocated inputs of one bucket's program (filled in place every step)."""

    hidden: torch.Tensor
    noise: torch.Tensor
    greedy: torch.Tensor
    full: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    rank_noise: torch.Tensor
    processors: dict[str, torch.Tensor]
    logit_mask: torch.Tensor

    def call_args(self):
        return (self.hidden, self.noise, self.greedy, self.full, self.top_k, self.top_p, self.rank_noise), {
            "logit_mask": self.logit_mask, **self.processors}


class HeadPrograms:
    """One rewritten program per bucket, built once; ``compilations`` counts builds."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, *, vocab_size: int, buckets: list[int],
                 eos_token_id: int, max_stop_tokens: int, max_bias_tokens: int, max_penalty_tokens: int,
                 max_top_k: int = 256):
        if weight.dim() != 2 or weight.shape[0] < vocab_size:
            raise ValueError(f"lm_head weight {tuple(weight.shape)} does not cover vocab_size={vocab_size}")
        if weight.shape[0] != vocab_size:
            weight = weight[:vocab_size]
            bias = None if bias is None else bias[:vocab_size]
        self.head = SamplingHead(weight.detach(), None if bias is None else bias.detach(), max_top_k=max_top_k)
        self.max_top_k = self.head.max_top_k
        self.vocab_size = vocab_size
        self.hidden_size = weight.shape[1]
        self.dtype = weight.dtype
        self.buckets = sorted(buckets)
        self.options = dict(
            logit_mask="packed", vocab_size=vocab_size, processors=PROCESSORS, empty_row=eos_token_id,
            max_stop_tokens=max_stop_tokens, max_bias_tokens=max_bias_tokens, max_penalty_tokens=max_penalty_tokens,
        )
        self.sizes = {"S": max_stop_tokens, "K": max_bias_tokens, "L": max_penalty_tokens}
        self.programs: dict[int, object] = {}
        self.inputs: dict[int, HeadInputs] = {}
        self.compilations = 0
        self.build_seconds = 0.0
        self.calls = {b: 0 for b in self.buckets}

    def bucket(self, rows: int) -> int:
        for b in self.buckets:
            if b >= rows:
                return b
        raise ValueError(f"{rows} rows exceed the largest bucket {self.buckets[-1]}")

    def _example(self, b: int):
        return (
            torch.zeros(b, self.hidden_size, dtype=self.dtype),
            torch.ones(b, self.vocab_size),
            torch.ones(b, dtype=torch.bool),
            torch.ones(b, dtype=torch.bool),
            torch.full((b,), self.max_top_k, dtype=torch.int64),
            torch.full((b,), TOP_P_OFF),
            torch.ones(b, dtype=torch.bool),
        )

    def build(self, b: int):
        import neuron_constrain as nc

        start = time.perf_counter()
        program = nc.transform(self.head, self._example(b), **self.options)
        self.programs[b] = program
        self.compilations += 1
        seconds = time.perf_counter() - start
        self.build_seconds += seconds
        processors = {}
        for info in program.report.inputs_added:
            if info.name == "logit_mask":
                continue
            processors[info.name] = torch.full(info.shape_for({}), info.fill, dtype=info.dtype)
        self.inputs[b] = HeadInputs(
            *self._example(b), processors=processors,
            logit_mask=torch.full((b, math.ceil(self.vocab_size / 32)), -1, dtype=torch.int32),
        )
        log.info("neuron_constrain: built the head program for bucket %d in %.2fs (compilations=%d)",
                 b, seconds, self.compilations)
        return program

    def warm_up(self):
        for b in self.buckets:
            if b not in self.programs:
                self.build(b)
            args, kwargs = self.inputs[b].call_args()
            with torch.inference_mode():
                self.programs[b](*args, **kwargs)

    def program(self, b: int):
        program = self.programs.get(b)
        return program if program is not None else self.build(b)

    def run(self, b: int) -> torch.Tensor:
        args, kwargs = self.inputs[b].call_args()
        self.calls[b] += 1
        return self.program(b)(*args, **kwargs)
