"""The head programs offline (no server): draft verification with each position masked by its
own grammar row, rejection sampling, the emitted-token layout, and the logprobs program
against plain torch on the same masked logits."""
from __future__ import annotations

import pytest
import torch

from neuron_constrain.kernels import pack_bool_mask
from neuron_constrain.vllm.head import NO_TOKEN, HeadPrograms

V, H, B = 600, 48, 8


@pytest.fixture(scope="module")
def head():
    torch.manual_seed(0)
    weight = torch.randn(V, H)
    programs = HeadPrograms(weight, None, vocab_size=V, buckets=[B], eos_token_id=2, max_stop_tokens=4,
                            max_bias_tokens=4, max_penalty_tokens=32, logprobs_k=5)
    programs.warm_up()
    return programs, weight


def _step(head, hidden, allowed, draft, first_row, *, greedy=True, uniform=0.5, noise=None):
    programs, _ = head
    inputs = programs.inputs[B]
    inputs.hidden.copy_(hidden)
    inputs.logit_mask.copy_(pack_bool_mask(allowed))
    inputs.draft.copy_(torch.as_tensor(draft))
    inputs.first_row.copy_(torch.as_tensor(first_row))
    inputs.greedy.fill_(greedy)
    inputs.full.fill_(True)
    inputs.uniform.fill_(uniform)
    inputs.noise.copy_(torch.empty(B, V).exponential_() if noise is None else noise)
    if not greedy:  # the runner's contract: a sampled row's draft gets +inf noise (never its recovered token)
        for row, token in enumerate(draft):
            if token >= 0:
                inputs.noise[row, token] = float("inf")
    with torch.inference_mode():
        return programs.run(B).tolist()


def _masked_logits(head, hidden, allowed):
    _, weight = head
    return torch.where(allowed, hidden @ weight.T, float("-inf"))


def test_greedy_verification_per_position(head):
    torch.manual_seed(1)
    hidden = torch.randn(B, H)
    allowed = torch.rand(B, V) < 0.5
    best = _masked_logits(head, hidden, allowed).argmax(-1).tolist()
    # request 0: rows 0-3 (drafts: right, right, wrong; bonus row 3); request 1: row 4 (no draft);
    # request 2: rows 5-6 (one right draft, bonus); row 7: padding
    wrong = (best[2] + 1) % V
    draft = [best[0], best[1], wrong, -1, -1, best[5], -1, -1]
    out = _step(head, hidden, allowed, draft, [0, 0, 0, 0, 4, 5, 5, 7])
    assert out[:4] == [best[0], best[1], best[2], NO_TOKEN]  # accepted, accepted, the argmax at the rejection
    assert out[4] == best[4]
    assert out[5:7] == [best[5], best[6]]  # all drafts accepted: the bonus token too
    # without drafts every row emits its masked argmax
    assert _step(head, hidden, allowed, [-1] * B, list(range(B))) == best


def test_a_draft_the_grammar_forbids_is_rejected(head):
    """The raw argmax as draft, but its grammar row forbids it: rejected, the masked argmax instead."""
    torch.manual_seed(2)
    hidden = torch.randn(B, H)
    _, weight = head
    raw_best = (hidden @ weight.T).argmax(-1)
    allowed = torch.rand(B, V) < 0.5
    allowed[torch.arange(B), raw_best] = False
    best = _masked_logits(head, hidden, allowed).argmax(-1).tolist()
    draft = [int(raw_best[0]), int(raw_best[1]), -1, -1, -1, -1, -1, -1]
    out = _step(head, hidden, allowed, draft, [0, 0, 0, 3, 4, 5, 6, 7])
    assert out[0] == best[0] != draft[0]
    assert out[1:3] == [NO_TOKEN, NO_TOKEN]
    # sampled, uniform 0 (accepts any draft with probability > 0): still rejected, the draft's probability is 0
    out = _step(head, hidden, allowed, draft, [0, 0, 0, 3, 4, 5, 6, 7], greedy=False, uniform=0.0)
    assert out[0] != draft[0] and bool(allowed[0, out[0]])
    assert out[1:3] == [NO_TOKEN, NO_TOKEN]


def test_rejection_sampling_rule(head):
    """Sampled rows accept a draft when uniform < p(draft), else emit a token other than the draft."""
    torch.manual_seed(3)
    hidden = torch.randn(B, H) * 0.05  # a flat distribution: every allowed token has p > 0
    allowed = torch.ones(B, V, dtype=torch.bool)
    p = _masked_logits(head, hidden, allowed).softmax(-1)
    draft = [7, -1, 9, -1, 11, -1, 13, -1]
    first = [0, 0, 2, 2, 4, 4, 6, 6]
    accept_all = _step(head, hidden, allowed, draft, first, greedy=False, uniform=0.0)
    assert [accept_all[i] for i in (0, 2, 4, 6)] == [7, 9, 11, 13]
    threshold = max(float(p[i, draft[i]]) for i in (0, 2, 4, 6))
    reject_all = _step(head, hidden, allowed, draft, first, greedy=False, uniform=min(1.0, threshold * 1.01))
    for i in (0, 2, 4, 6):
        assert reject_all[i] != draft[i] and reject_all[i] >= 0  # the recovered token
        assert reject_all[i + 1] == NO_TOKEN


def test_logprobs_program_is_the_masked_log_softmax(head):
    programs, _ = head
    torch.manual_seed(4)
    hidden = torch.randn(B, H)
    allowed = torch.rand(B, V) < 0.3
    _step(head, hidden, allowed, [-1] * B, list(range(B)))
    reference = _masked_logits(head, hidden, allowed).log_softmax(-1)
    tokens = torch.tensor([int(torch.nonzero(allowed[i])[i % 3]) for i in range(B)])
    programs.logprob_tokens[B].copy_(tokens)
    with torch.inference_mode():
        token_logprob, top_ids, top_logprobs, rank = programs.run_logprobs(B)
    expected = reference.gather(-1, tokens[:, None]).squeeze(-1)
    assert torch.allclose(token_logprob, expected, atol=1e-5)
    best = reference.topk(programs.logprobs_k)
    assert torch.equal(top_ids, best.indices) and torch.allclose(top_logprobs, best.values, atol=1e-5)
    assert torch.equal(rank, (reference >= expected[:, None]).sum(-1))
    assert bool((top_ids[:, 0] == reference.argmax(-1)).all())
    assert all(bool(allowed[i, top_ids[i]].all()) for i in range(B))  # masked tokens never among the top
