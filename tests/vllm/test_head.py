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
        token_logprob, top_ids, top_logprobs, rank, whole = programs.run_logprobs(B)
    assert torch.allclose(whole, reference, atol=1e-5) and bool(whole[~allowed].isneginf().all())
    expected = reference.gather(-1, tokens[:, None]).squeeze(-1)
    assert torch.allclose(token_logprob, expected, atol=1e-5)
    best = reference.topk(programs.logprobs_k)
    assert torch.equal(top_ids, best.indices) and torch.allclose(top_logprobs, best.values, atol=1e-5)
    assert torch.equal(rank, (reference >= expected[:, None]).sum(-1))
    assert bool((top_ids[:, 0] == reference.argmax(-1)).all())
    assert all(bool(allowed[i, top_ids[i]].all()) for i in range(B))  # masked tokens never among the top


def test_wide_program_samples_past_the_narrow_candidates(head):
    """top_k above the program's max_top_k runs on the wide program: a token ranked past the narrow
    program's candidates (but within top_k) can win the race there, and only there."""
    programs, _ = head
    torch.manual_seed(5)
    hidden = torch.randn(B, H)
    allowed = torch.ones(B, V, dtype=torch.bool)
    order = _masked_logits(head, hidden, allowed).argsort(-1, descending=True)
    target = order[:, programs.max_top_k + 100]  # ranked past the narrow candidates
    for wide, top_k, wins in ((False, programs.max_top_k, False), (True, programs.max_top_k + 200, True),
                              (True, programs.max_top_k + 50, False)):
        inputs = programs.inputs_for(B, wide)
        inputs.hidden.copy_(hidden)
        inputs.logit_mask.fill_(-1)
        inputs.draft.fill_(NO_TOKEN)
        inputs.first_row.copy_(torch.arange(B))
        inputs.greedy.fill_(False)
        inputs.full.fill_(False)
        inputs.top_k.fill_(top_k)
        inputs.rank_noise.fill_(False)  # noise by token id: the target's tiny noise makes it win where it may
        inputs.noise.fill_(1e30)
        inputs.noise[torch.arange(B), target] = 1e-30
        with torch.inference_mode():
            out = programs.run(B, wide)
        assert (out == target).all().item() is wins, (wide, top_k)
    assert programs.wide_programs and programs.fits(top_k=programs.max_top_k) and not programs.fits(top_k=V - 1)


def test_thinking_budget_forces_the_end_token_on_every_path(head):
    """Rows whose budget is spent emit the end token, greedy or sampled; where the grammar masked it
    (the last row), the grammar wins."""
    programs, _ = head
    inputs = programs.inputs[B]
    torch.manual_seed(6)
    allowed = torch.rand(B, V) < 0.5
    allowed[:, 17] = True
    allowed[7, 17] = False
    left = torch.tensor([0, 1, -3, 0, 0, 2, 0, 0], dtype=torch.int32)
    end = torch.tensor([17, 17, 17, -1, 17, 17, 17, 17])
    inputs.processors["thinking_budget_left"].copy_(left)
    inputs.processors["thinking_end_id"].copy_(end)
    try:
        for greedy in (True, False):
            out = _step(head, torch.randn(B, H), allowed, [-1] * B, list(range(B)), greedy=greedy)
            forced = [(int(l) <= 0 and int(e) >= 0 and r != 7) for r, (l, e) in enumerate(zip(left, end))]
            assert [o == 17 for o in out] == forced, (greedy, out)
    finally:
        inputs.processors["thinking_budget_left"].fill_(0)
        inputs.processors["thinking_end_id"].fill_(-1)


def test_the_workers_noise_is_exponential_and_never_zero():
    """Unseeded rows' noise (worker._exponential: minus the log of uniform draws, faster than torch's
    exponential_): Exponential(1) by its tail at three points, mean and variance; never 0 (a 0 would
    make its token win the race whatever its logit)."""
    import math

    from neuron_constrain.vllm.worker import _exponential

    torch.manual_seed(0)
    noise = torch.empty(8, 32768)
    _exponential(noise)
    flat = noise.flatten()
    assert bool((flat > 0).all())
    assert abs(flat.mean().item() - 1) < 0.01 and abs(flat.var().item() - 1) < 0.03
    for x in (0.05, 1.0, 4.0):
        assert abs((flat > x).double().mean().item() - math.exp(-x)) < 0.005, x
    before = noise.clone()
    _exponential(noise[0, :256])  # a view of the program's input: written in place, nothing else
    assert not torch.equal(noise[0, :256], before[0, :256]) and torch.equal(noise[:, 256:], before[:, 256:])
