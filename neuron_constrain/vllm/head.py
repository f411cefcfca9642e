"""The sampling head every token of the plugin comes from, and its per-bucket programs.

``SamplingHead`` is a plain ``nn.Module`` that starts where vLLM's ``compute_logits``
would: it takes the hidden rows vLLM selected for sampling (one per request, or with
speculative decoding one per draft position plus the bonus position) and runs

    lm_head (F.linear with the model's weight) -> greedy argmax
                                               -> whole-vocabulary exponential race
                                               -> top-k, top-p, softmax, exponential race
                                               -> verify the draft tokens (greedy / rejection sampling)

``neuron_constrain.transform`` then rewrites its exported program: the mask-logits pass
adds ``logit_mask`` (packed int32, ``-1`` rows = all allowed) in front of every sampling
site, so each draft position is masked with its own grammar row; the process-logits
pass adds min_tokens, logit_bias, penalties and the thinking budget after the mask and a
per-row temperature + min_p in front of the sampling sites. One program per batch bucket
(static shapes, as on an accelerator); every input is fed every step, so any mix of
constrained / unconstrained rows, sampling parameters and draft lengths runs the same
program. A request past the program's fixed widths (top_k above ``max_top_k``, more
logit_bias entries or min_tokens stop ids than it holds) runs its steps on the bucket's
*wide* program instead, built on first need: candidates, biases and stop ids over the
whole vocabulary (a sort of each row's logits instead of a top-256: slower, rarely used).

``LogprobHead`` is the logprobs program: the same lm_head, the mask-logits pass only (no
processors), then ``log_softmax``, the top ``k`` and the emitted token's logprob and rank,
and the whole row of logprobs (what ``logprob_token_ids`` and ``logprobs=-1`` read).
These are vLLM's default ``raw_logprobs``: vLLM applies the grammar bitmask to the
logits in place before its sampler and computes logprobs before any processor, so they
are the masked, unprocessed logits' logprobs. It runs only on steps where a request
asked for logprobs.
"""
from __future__ import annotations

import dataclasses
import logging
import time

import torch
import torch.nn.functional as F

from neuron_constrain.kernels import packed_width

__all__ = ["SamplingHead", "LogprobHead", "HeadPrograms", "HeadInputs", "PROCESSORS", "buckets_for", "NO_TOKEN"]

log = logging.getLogger("vllm.neuron_constrain")  # under vLLM's logger: its handlers print it

PROCESSORS = ["min_tokens", "logit_bias", "penalties", "thinking_budget", "min_p"]
TOP_P_OFF = 2.0  # top_p >= 1 means "off": a threshold the cumulative mass never reaches
NO_TOKEN = -1    # a row whose token is not emitted (a draft position after a rejection); vLLM's placeholder


class SamplingHead(torch.nn.Module):
    """Hidden rows -> the token each row emits (``NO_TOKEN`` where none).

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

    Speculative decoding (vLLM's layout: request ``i`` owns ``1 + d_i`` consecutive rows,
    one per draft token and the bonus row last). ``draft[r]`` is the draft token row
    ``r`` verifies (``-1`` on a bonus row and without speculation), ``first_row[r]`` the
    first row of its request. A row accepts its draft when greedy and the draft is the
    masked argmax, or when sampled with ``uniform[r] < p(draft)`` (vLLM's rule for
    draft-free proposers such as ngram: the draft's probability is 1); a rejected row
    emits the recovered token, a race over ``p`` with the draft removed (for a greedy row
    that is the argmax itself): among the cut candidates the program removes it; for a
    whole-vocabulary row the caller sets the draft's ``noise`` entry to ``+inf`` (a race
    term of 0), which costs the program no pass over the vocabulary. A row emits its token only when every earlier row of its
    request accepted its draft, so a request emits its accepted drafts, then the token
    at the first rejection or the bonus token, then ``NO_TOKEN``. Without drafts every
    row emits.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, max_top_k: int = 256):
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", bias, persistent=False) if bias is not None else setattr(self, "bias", None)
        self.max_top_k = min(max_top_k, weight.shape[0])

    def forward(self, hidden, noise, greedy, full, top_k, top_p, rank_noise, draft, first_row, uniform):
        logits = F.linear(hidden, self.weight, self.bias).float()
        greedy_token = logits.argmax(-1)
        has_draft = draft >= 0
        at_draft = draft.clamp(min=0).unsqueeze(-1)
        # whole-vocabulary race (the caller's noise is +inf at a sampled row's draft: never the recovered token)
        probs = logits.softmax(-1)
        full_draft_p = probs.gather(-1, at_draft).squeeze(-1)
        full_token = (probs / noise).argmax(-1)
        # top-k / top-p race among the max_top_k best candidates (sorted, descending)
        values, ids = logits.topk(self.max_top_k, dim=-1)
        rank = torch.arange(self.max_top_k, device=values.device)
        values = values.masked_fill(rank >= top_k.unsqueeze(-1), float("-inf"))
        cut_probs = values.softmax(-1)
        before = cut_probs.cumsum(-1) - cut_probs
        kept = values.masked_fill(before >= top_p.unsqueeze(-1), float("-inf")).softmax(-1)
        is_draft = ids == draft.unsqueeze(-1)  # a draft of -1 matches no candidate
        cut_draft_p = (kept * is_draft).sum(-1)
        # a candidate's noise: by rank (the row's first max_top_k entries) or by token id
        cand_noise = torch.where(rank_noise.unsqueeze(-1), noise[:, : self.max_top_k], noise.gather(-1, ids))
        choice = (kept.masked_fill(is_draft, 0.0) / cand_noise).argmax(-1, keepdim=True)
        cut_token = ids.gather(-1, choice).squeeze(-1)
        # verification: greedy rows accept a draft equal to the argmax; sampled rows accept with p(draft)
        draft_p = torch.where(full, full_draft_p, cut_draft_p)
        accepted = has_draft & torch.where(greedy, greedy_token == draft, uniform < draft_p)
        sampled_token = torch.where(accepted, draft, torch.where(full, full_token, cut_token))
        token = torch.where(greedy, greedy_token, sampled_token)
        # a row emits when no earlier row of its request rejected its draft
        rejected = (~accepted).to(torch.int64)
        rejected_before = rejected.cumsum(0) - rejected
        emitted = rejected_before == rejected_before.gather(0, first_row)
        return torch.where(emitted, token, NO_TOKEN)


class LogprobHead(torch.nn.Module):
    """Hidden rows and the token each row emitted -> its logprob, the ``k`` best and its rank.

    Rank as vLLM counts it: the number of tokens whose logprob is >= the token's.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, k: int = 20):
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", bias, persistent=False) if bias is not None else setattr(self, "bias", None)
        self.k = min(k, weight.shape[0])

    def forward(self, hidden, token):
        logprobs = F.linear(hidden, self.weight, self.bias).float().log_softmax(-1)
        top_logprobs, top_ids = logprobs.topk(self.k, dim=-1)
        token_logprob = logprobs.gather(-1, token.unsqueeze(-1))
        rank = (logprobs >= token_logprob).sum(-1)
        return token_logprob.squeeze(-1), top_ids, top_logprobs, rank, logprobs


def buckets_for(max_rows: int) -> list[int]:
    """The row counts a program is built for: powers of two up to ``max_rows`` (and it), with the
    midpoints from 12 up (12, 24, 48, ...). A step runs the smallest bucket that holds its rows, and
    pads the rest: with drafts (``1 + d`` rows a request) steps of 9-12 rows are common, and a
    16-row program does a third more work for them (each program is built once, ~0.2 s)."""
    out, b = [], 1
    while b < max_rows:
        out.append(b)
        if b >= 8 and b + b // 2 < max_rows:
            out.append(b + b // 2)
        b *= 2
    out.append(max_rows)
    return out


@dataclasses.dataclass
class HeadInputs:
    """Preallocated inputs of one bucket's programs (filled in place every step)."""

    hidden: torch.Tensor
    noise: torch.Tensor
    greedy: torch.Tensor
    full: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    rank_noise: torch.Tensor
    draft: torch.Tensor
    first_row: torch.Tensor
    uniform: torch.Tensor
    processors: dict[str, torch.Tensor]
    logit_mask: torch.Tensor

    def call_args(self):
        return (self.hidden, self.noise, self.greedy, self.full, self.top_k, self.top_p, self.rank_noise,
                self.draft, self.first_row, self.uniform), {"logit_mask": self.logit_mask, **self.processors}


class HeadPrograms:
    """One rewritten sampling program per bucket (and one logprobs program, when ``logprobs_k``),
    built once; ``compilations`` counts builds (``wide_compilations`` the wide programs')."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, *, vocab_size: int, buckets: list[int],
                 eos_token_id: int, max_stop_tokens: int, max_bias_tokens: int, max_penalty_tokens: int,
                 max_top_k: int = 256, logprobs_k: int = 0):
        if weight.dim() != 2 or weight.shape[0] < vocab_size:
            raise ValueError(f"lm_head weight {tuple(weight.shape)} does not cover vocab_size={vocab_size}")
        if weight.shape[0] != vocab_size:
            weight = weight[:vocab_size]
            bias = None if bias is None else bias[:vocab_size]
        weight = weight.detach()
        bias = None if bias is None else bias.detach()
        self.head = SamplingHead(weight, bias, max_top_k=max_top_k)
        self.wide_head = SamplingHead(weight, bias, max_top_k=vocab_size)
        self.logprob_head = LogprobHead(weight, bias, k=logprobs_k) if logprobs_k else None
        self.max_top_k = self.head.max_top_k
        self.logprobs_k = self.logprob_head.k if self.logprob_head is not None else 0
        self.vocab_size = vocab_size
        self.hidden_size = weight.shape[1]
        self.dtype = weight.dtype
        self.buckets = sorted(buckets)
        self.eos_token_id = eos_token_id
        self.options = dict(
            logit_mask="packed", vocab_size=vocab_size, processors=PROCESSORS, empty_row=eos_token_id,
            max_stop_tokens=max_stop_tokens, max_bias_tokens=max_bias_tokens, max_penalty_tokens=max_penalty_tokens,
        )
        self.sizes = {"S": max_stop_tokens, "K": max_bias_tokens, "L": max_penalty_tokens}
        # the wide programs' widths: every token a candidate, any number of biases and stop ids
        self.wide_options = dict(self.options, max_stop_tokens=vocab_size, max_bias_tokens=vocab_size)
        self.programs: dict[int, object] = {}
        self.wide_programs: dict[int, object] = {}
        self.logprob_programs: dict[int, object] = {}
        self.inputs: dict[int, HeadInputs] = {}
        self.wide_inputs: dict[int, HeadInputs] = {}
        self.logprob_tokens: dict[int, torch.Tensor] = {}
        self.compilations = 0
        self.wide_compilations = 0
        self.build_seconds = 0.0
        self.calls = {b: 0 for b in self.buckets}
        self.logprob_calls = {b: 0 for b in self.buckets}

    def bucket(self, rows: int) -> int:
        for b in self.buckets:
            if b >= rows:
                return b
        raise ValueError(f"{rows} rows exceed the largest bucket {self.buckets[-1]}")

    def fits(self, *, top_k: int = 0, bias: int = 0, stops: int = 0) -> bool:
        """Whether a request with these needs runs on the (narrow) program; else on the wide one."""
        return top_k <= self.max_top_k and bias <= self.sizes["K"] and stops <= self.sizes["S"]

    def _example(self, b: int, wide: bool = False):
        return (
            torch.zeros(b, self.hidden_size, dtype=self.dtype),
            torch.ones(b, self.vocab_size),
            torch.ones(b, dtype=torch.bool),
            torch.ones(b, dtype=torch.bool),
            torch.full((b,), self.vocab_size if wide else self.max_top_k, dtype=torch.int64),
            torch.full((b,), TOP_P_OFF),
            torch.ones(b, dtype=torch.bool),
            torch.full((b,), NO_TOKEN, dtype=torch.int64),
            torch.arange(b, dtype=torch.int64),
            torch.zeros(b),
        )

    def build(self, b: int, wide: bool = False):
        import neuron_constrain as nc

        start = time.perf_counter()
        program = nc.transform(self.wide_head if wide else self.head, self._example(b, wide),
                               **(self.wide_options if wide else self.options))
        (self.wide_programs if wide else self.programs)[b] = program
        if wide:
            self.wide_compilations += 1  # on first need, while serving (counted apart from the warm-up's)
        else:
            self.compilations += 1
        if self.logprob_head is not None and b not in self.logprob_programs:
            self.logprob_programs[b] = nc.transform(
                self.logprob_head, (self._example(b)[0], torch.zeros(b, dtype=torch.int64)),
                logit_mask="packed", vocab_size=self.vocab_size, empty_row=self.eos_token_id,
            )
            self.compilations += 1
            self.logprob_tokens[b] = torch.zeros(b, dtype=torch.int64)
        seconds = time.perf_counter() - start
        self.build_seconds += seconds
        processors = {}
        for info in program.report.inputs_added:
            if info.name == "logit_mask":
                continue
            processors[info.name] = torch.full(info.shape_for({}), info.fill, dtype=info.dtype)
        (self.wide_inputs if wide else self.inputs)[b] = HeadInputs(
            *self._example(b, wide), processors=processors,
            logit_mask=torch.full((b, packed_width(self.vocab_size)), -1, dtype=torch.int32),
        )
        log.info("neuron_constrain: built the %shead program(s) for bucket %d in %.2fs (compilations=%d)",
                 "wide " if wide else "", b, seconds, self.compilations)
        return program

    def inputs_for(self, b: int, wide: bool = False) -> HeadInputs:
        """The bucket's inputs (of its wide program when ``wide``: built now if it is not yet)."""
        if wide and b not in self.wide_programs:
            self.build(b, wide=True)
        return self.wide_inputs[b] if wide else self.inputs[b]

    def warm_up(self):
        for b in self.buckets:
            if b not in self.programs:
                self.build(b)
            with torch.inference_mode():
                self.run(b)
                if self.logprob_head is not None:
                    self.run_logprobs(b)
        self.calls = {b: 0 for b in self.buckets}
        self.logprob_calls = {b: 0 for b in self.buckets}

    def run(self, b: int, wide: bool = False) -> torch.Tensor:
        """The bucket's sampling program on its inputs: the token per row (``NO_TOKEN`` where none)."""
        args, kwargs = self.inputs_for(b, wide).call_args()
        self.calls[b] += 1
        return (self.wide_programs if wide else self.programs)[b](*args, **kwargs)

    def run_logprobs(self, b: int, wide: bool = False, mask: torch.Tensor | None = None):
        """The bucket's logprobs program for the tokens in ``logprob_tokens[b]``: the same hidden rows,
        and the same mask unless ``mask`` (the grammar's alone, when the step's also bans tokens)."""
        inputs = self.inputs_for(b, wide)
        self.logprob_calls[b] += 1
        return self.logprob_programs[b](inputs.hidden, self.logprob_tokens[b],
                                        logit_mask=inputs.logit_mask if mask is None else mask)
