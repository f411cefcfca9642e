"""Where each request's rows are in a step's head batch, and what a request's params give its rows.

    layout = BatchLayout(requests, spec_decode_metadata)      # 1 + d_i rows per request with speculation
    needs = request_needs(params, prompt_ids, head, thinking)  # its processor rows (processors/rows.py writes
                                                               # them), its program (narrow or wide), its bans
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch
from vllm.v1.outputs import LogprobsTensors

from neuron_constrain.core.processor_interface import Thinking
from neuron_constrain.processors.rows import RequestRows
from neuron_constrain.vllm.head import NO_TOKEN, HeadPrograms
from neuron_constrain.vllm.token_bans import TokenBans


class BatchLayout:
    """Where each head row comes from, this step: request ``req[r]``, draft position ``pos[r]``.

    Without drafts row ``r`` is request ``r``. With drafts request ``i`` owns rows
    ``start[i] .. start[i] + num_draft[i]`` (vLLM's logits order); ``draft[r]`` is the
    draft token row ``r`` verifies (-1 on a bonus row).
    """

    __slots__ = ("rows", "requests", "req", "pos", "start", "num_draft", "draft", "drafts_of")

    def __init__(self, requests: int, spec_decode_metadata=None):
        self.requests = requests
        if spec_decode_metadata is None:
            self.rows = requests
            self.req = np.arange(requests)
            self.pos = np.zeros(requests, dtype=np.int64)
            self.start = self.req
            self.num_draft = np.zeros(requests, dtype=np.int64)
            self.draft = None
            self.drafts_of = None
            return
        num_draft = np.asarray(spec_decode_metadata.num_draft_tokens, dtype=np.int64)
        per_request = 1 + num_draft
        self.start = np.concatenate([[0], np.cumsum(per_request)[:-1]])
        self.rows = int(per_request.sum())
        self.req = np.repeat(np.arange(requests), per_request)
        self.pos = np.arange(self.rows) - self.start[self.req]
        self.num_draft = num_draft
        flat = spec_decode_metadata.draft_token_ids.cpu().numpy().astype(np.int64)
        draft = np.full(self.rows, NO_TOKEN, dtype=np.int64)
        is_draft = self.pos < num_draft[self.req]
        # the flat draft index of row r (request i, position j < d_i) is r - i
        draft[is_draft] = flat[np.flatnonzero(is_draft) - self.req[is_draft]]
        self.draft = draft
        cu = np.concatenate([[0], np.cumsum(num_draft)])
        self.drafts_of = [flat[cu[i]:cu[i + 1]] for i in range(requests)]


def spread(logprobs: LogprobsTensors, layout: BatchLayout, width: int) -> LogprobsTensors:
    """Head rows' logprobs into vLLM's speculative layout: ``requests x width`` rows (request-major)."""
    at = torch.from_numpy(layout.req * width + layout.pos)
    total = layout.requests * width
    ids = torch.zeros(total, logprobs.logprob_token_ids.shape[1], dtype=logprobs.logprob_token_ids.dtype)
    values = torch.zeros(total, logprobs.logprobs.shape[1], dtype=logprobs.logprobs.dtype)
    ranks = torch.zeros(total, dtype=logprobs.selected_token_ranks.dtype)
    ids[at], values[at], ranks[at] = logprobs.logprob_token_ids, logprobs.logprobs, logprobs.selected_token_ranks
    return LogprobsTensors(ids, values, ranks)


@dataclasses.dataclass(frozen=True)
class RequestNeeds:
    """What one request's ``SamplingParams`` ask of the head, fixed for the request: its processor
    rows, whether it needs the wide program, and the tokens it bans through the mask."""

    rows: RequestRows
    wide: bool
    bans: TokenBans | None


def request_needs(params, prompt_token_ids, head: HeadPrograms, thinking: Thinking | None) -> RequestNeeds:
    """``params`` as the head reads them. ``thinking``: the server's thought markers (with
    ``--reasoning-parser``), which a ``thinking_token_budget`` counts against (vLLM's frontend
    refuses a budget without them)."""
    stops = sorted(params.all_stop_token_ids) if params.min_tokens else []
    bias = dict(params.logit_bias) if params.logit_bias else None
    top_k = params.top_k if 0 < params.top_k < head.vocab_size else 0
    rows = RequestRows(min_tokens=params.min_tokens, stop_ids=stops, logit_bias=bias, min_p=params.min_p,
                       penalties=(params.repetition_penalty, params.frequency_penalty, params.presence_penalty),
                       prompt=prompt_token_ids or (), thinking=thinking,
                       thinking_budget=getattr(params, "thinking_token_budget", None))
    wide = not head.fits(top_k=top_k, bias=len(bias or ()), stops=len(stops))
    return RequestNeeds(rows, wide, TokenBans.of(params, head.vocab_size))
