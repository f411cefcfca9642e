"""logprobs / top_logprobs from the plugin's logprobs program equal stock vLLM's (default
``--logprobs-mode raw_logprobs``: the grammar-masked logits before any processor), greedy,
constrained and unconstrained, chat and completions, mixed with requests that ask for none."""
from __future__ import annotations


from checks import CHOICES, REGEX, SCHEMAS
from traffic import MASKED, assert_logprobs_match, choices, logprob_rows

MSG = [{"role": "user", "content": "Answer."}]


def _requests():
    return [
        ("completion", dict(prompt="The capital of France is", max_tokens=16, temperature=0, logprobs=5)),
        ("completion", dict(prompt="1, 2, 3,", max_tokens=16, temperature=0, logprobs=0)),
        ("chat", dict(messages=MSG, max_tokens=16, temperature=0, logprobs=True, top_logprobs=20)),
        ("chat", dict(messages=MSG, max_tokens=24, temperature=0, logprobs=True, top_logprobs=3,
                      response_format={"type": "json_schema", "json_schema": {"name": "person",
                                                                             "schema": SCHEMAS["person"]}})),
        ("chat", dict(messages=MSG, max_tokens=8, temperature=0, logprobs=True, top_logprobs=4,
                      extra_body={"structured_outputs": {"choice": CHOICES}})),
        # processors do not change raw logprobs (vLLM reports them before min_tokens, bias, penalties)
        ("chat", dict(messages=MSG, max_tokens=12, temperature=0, logprobs=True, top_logprobs=2,
                      frequency_penalty=0.8, logit_bias={"1000": 3.0}, extra_body={"min_tokens": 6})),
        ("chat", dict(messages=MSG, max_tokens=16, temperature=0, extra_body={"structured_outputs": {"regex": REGEX}})),
    ]


def test_logprobs_match_stock_vllm(stock_server, plugin_server):
    reqs = _requests()
    before = plugin_server.metrics()
    expected, got = choices(stock_server, reqs), choices(plugin_server, reqs)
    rows = sum(assert_logprobs_match(e, g) for e, g in zip(expected[:-1], got[:-1]))
    assert rows >= 60
    assert got[-1].logprobs is None  # a request without logprobs gets none
    after = plugin_server.metrics()
    assert after["logprob_steps"] > before["logprob_steps"]
    assert after["compilations_after_warmup"] == 0


def test_constrained_logprobs_are_masked(plugin_server):
    """A choice constraint: raw_logprobs are masked logits' logprobs, so every finite top logprob
    of the first token is a token that starts one of the choices, and the others are -inf."""
    reqs = [("chat", dict(messages=MSG, max_tokens=4, temperature=0, logprobs=True, top_logprobs=5,
                          extra_body={"structured_outputs": {"choice": CHOICES}}))]
    (choice,) = choices(plugin_server, reqs)
    first = logprob_rows(choice)[0]
    starts = {c[:n] for c in CHOICES for n in range(1, len(c) + 1)}
    allowed = [t for t, v in zip(first[2], first[3]) if v > MASKED]
    assert allowed and all(t in starts for t in allowed), first


def test_sampled_logprobs_belong_to_the_emitted_token(plugin_server):
    reqs = [("completion", dict(prompt="Once", max_tokens=12, temperature=1.0, top_p=0.9, seed=5, logprobs=20))]
    (choice,) = choices(plugin_server, reqs)
    for token, value, top, values in logprob_rows(choice):
        assert value <= 0.0
        if token in top:  # the sampled token's logprob is the one in the top list
            assert abs(values[top.index(token)] - value) < 1e-6
