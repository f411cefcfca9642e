"""Where each request's rows are in a step's head batch, and what a request's params give its rows.

    layout = BatchLayout(requests, spec_decode_metadata)   # 1 + d_i rows per request with speculation
    rows = request_rows(params, prompt_ids, stop_width)     # processors/rows.py writes them
"""
from __future__ import annotations

import logging

import numpy as np
import torch
from vllm.v1.outputs import LogprobsTensors

from neuron_constrain.processors.rows import RequestRows
from neuron_constrain.vllm import MAX_BIAS_TOKENS
from neuron_constrain.vllm.head import NO_TOKEN

log = logging.getLogger("vllm.neuron_constrain")


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


def request_rows(params, prompt_token_ids, stop_width: int, req_id: str = "?") -> RequestRows:
    """What the head's processor inputs need from a request's ``SamplingParams`` (fixed per request).

    ``stop_width`` is the program's stop-id width, sized from the model (the validator's
    limit on a request's own stop ids plus the model's EOS ids): every stop id fits.
    """
    stops = sorted(params.all_stop_token_ids) if params.min_tokens else []
    if len(stops) > stop_width:  # the validator and the sizing make this unreachable; never silent
        log.error("neuron_constrain: request %s has %d stop ids with min_tokens, more than the program's "
                  "%d: min_tokens masks only the first %d", req_id, len(stops), stop_width, stop_width)
        stops = stops[:stop_width]
    bias = dict(list(params.logit_bias.items())[:MAX_BIAS_TOKENS]) if params.logit_bias else None
    return RequestRows(min_tokens=params.min_tokens, stop_ids=stops, logit_bias=bias, min_p=params.min_p,
                       penalties=(params.repetition_penalty, params.frequency_penalty, params.presence_penalty),
                       prompt=prompt_token_ids or ())
