"""vLLM's ``LogprobsTensors`` from the logprobs program's outputs, as vLLM's sampler builds them.

    k = logprobs_program_k(max_logprobs)          # the program's top-k width (--max-logprobs, bounded)
    tensors = logprobs_tensors(outputs, tokens, num_logprobs, token_ids_by_row)

The program returns, per row, the emitted token's logprob, the top ``k`` ids and logprobs,
the token's rank and the whole row of logprobs (vLLM's ``raw_logprobs``: the grammar-masked
logits' ``log_softmax``). Like ``vllm/v1/sample/sampler.py``: column 0 is the emitted token,
then the ``num_logprobs`` best (``logprobs=-1`` asks for the whole vocabulary: vLLM's input
batch passes it as the vocabulary size; more than the program's ``k`` are taken from the
whole row here). When any request of the step set ``logprob_token_ids``, every row gets
those ids' logprobs instead (vLLM prefers them for the whole step), padded with ``-inf``.
"""
from __future__ import annotations

import torch
from vllm.v1.outputs import LogprobsTensors

PROGRAM_K_LIMIT = 1024  # the program's top-k at most; a request asking more reads the whole row on the host


def logprobs_program_k(max_logprobs: int) -> int:
    """The logprobs program's top-k for ``--max-logprobs`` (-1: the whole vocabulary, served from
    the whole row)."""
    return min(max_logprobs, PROGRAM_K_LIMIT) if max_logprobs > 0 else 20


def logprobs_tensors(outputs, tokens: torch.Tensor, num_logprobs: int | None,
                     token_ids_by_row: dict[int, list[int]]) -> LogprobsTensors:
    """``outputs``: the program's (token logprob, top ids, top logprobs, rank, whole rows);
    ``tokens``: the emitted token per row; ``token_ids_by_row``: row -> its ``logprob_token_ids``."""
    token_logprob, top_ids, top_logprobs, rank, whole = outputs
    rows = tokens.shape[0]
    ranks = rank[:rows].clone()
    if token_ids_by_row:
        width = max(len(ids) for ids in token_ids_by_row.values())
        ids = torch.zeros(rows, width + 1, dtype=torch.int64)
        valid = torch.zeros(rows, width + 1, dtype=torch.bool)
        ids[:, 0], valid[:, 0] = tokens, True
        for row, wanted in token_ids_by_row.items():
            ids[row, 1:len(wanted) + 1] = torch.as_tensor(wanted, dtype=torch.int64)
            valid[row, 1:len(wanted) + 1] = True
        values = whole[:rows].gather(-1, ids).masked_fill(~valid, float("-inf"))
        return LogprobsTensors(ids.to(torch.int32), values, ranks)
    if num_logprobs > top_ids.shape[1]:
        top_logprobs, top_ids = whole[:rows].topk(num_logprobs, dim=-1)
    ids = torch.cat([tokens[:, None], top_ids[:rows, :num_logprobs]], dim=1).to(torch.int32)
    values = torch.cat([token_logprob[:rows, None], top_logprobs[:rows, :num_logprobs]], dim=1)
    return LogprobsTensors(ids, values, ranks)
