"""Reasoning models through the plugin (issue 45): ``--reasoning-parser`` with structured outputs
and tool calls, ``thinking_token_budget`` forced by the head program, ``enable_in_reasoning``.

On the tiny reasoning checkpoint (``<think>`` / ``</think>`` added; its chat template opens the
thought): a budget of N gives exactly N thought tokens, then ``</think>``, then an answer valid
under the constraint (the grammar starts after the thought); a thought the model ends early is
constrained from there; tool calls (required, auto) are valid after the thought. Every greedy
output is token-identical to stock vLLM with the same parser, and ``reasoning`` / ``content``
split the same. A third server (the plugin with ngram speculation, vLLM's ``qwen3`` parser and
``enable_in_reasoning``) shows the budget counted on draft rows and the grammar applied from the
first token when asked.
"""
from __future__ import annotations

import json

import pytest

from checks import CHOICES, REGEX, SCHEMAS, TOOLS, check, check_tool_calls
from traffic import choices

END = 32003  # </think> in the tiny reasoning checkpoint
BIAS_TOOL_CALL = {"32000": 100}  # <tool_call>: nudges the random model to open a call (auto)
MSG = [{"role": "user", "content": "Answer."}]
R1 = ["--reasoning-parser", "deepseek_r1"]
SPECULATION_QWEN3 = ["--reasoning-parser", "qwen3", "--speculative-config", json.dumps(
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}),
    "--structured-outputs-config", json.dumps({"backend": "xgrammar", "disable_any_whitespace": True,
                                               "enable_in_reasoning": True})]


@pytest.fixture(scope="module")
def servers(start_server):
    """Plugin and stock vLLM with deepseek_r1's parser, started side by side."""
    plugin = start_server("plugin-reasoning", model="tiny-think", extra=R1, wait=False)
    stock = start_server("stock-reasoning", model="tiny-think", plugin=False, extra=R1, wait=False)
    plugin.wait()
    stock.wait()
    return stock, plugin


def _chat(budget=None, messages=MSG, **kwargs):
    extra = dict(kwargs.pop("extra_body", {}))
    if budget is not None:
        extra["thinking_token_budget"] = budget
    return ("chat", dict(messages=messages, temperature=0, extra_body=extra, **kwargs))


def _both(servers, requests):
    """The first choice of each request from stock and from the plugin (sent together), after checking
    they are token-identical and split reasoning / content / tool calls the same."""
    stock, plugin = servers
    expected, got = choices(stock, requests), choices(plugin, requests)
    for e, g in zip(expected, got):
        assert g.model_extra["token_ids"] == e.model_extra["token_ids"]
        assert (g.message.model_dump(exclude={"tool_calls"}), g.finish_reason) == \
            (e.message.model_dump(exclude={"tool_calls"}), e.finish_reason)
        assert [c.function.model_dump() for c in g.message.tool_calls or []] == \
            [c.function.model_dump() for c in e.message.tool_calls or []]
    return got


def _thought(choice) -> list[int]:
    ids = choice.model_extra["token_ids"]
    assert END in ids, f"the thought never ended: {ids}"
    return ids[:ids.index(END)]


CONSTRAINED = [
    ("json", SCHEMAS["palette"], 5, dict(max_tokens=48, response_format={"type": "json_schema", "json_schema": {
        "name": "palette", "schema": SCHEMAS["palette"]}})),
    ("regex", REGEX, 3, dict(max_tokens=32, extra_body={"structured_outputs": {"regex": REGEX}})),
    ("choice", CHOICES, 4, dict(max_tokens=16, extra_body={"structured_outputs": {"choice": CHOICES}})),
]


def test_budget_then_an_answer_valid_under_the_constraint(servers):
    """Exactly N thought tokens (the random model never ends a thought itself), ``</think>``, then an
    answer its constraint accepts; reasoning / content split as stock vLLM splits them."""
    requests = [_chat(budget, **kwargs) for _, _, budget, kwargs in CONSTRAINED]
    requests.append(_chat(0, max_tokens=8))  # budget 0: the first token closes the thought
    got = _both(servers, requests)
    for (kind, spec, budget, _), choice in zip(CONSTRAINED, got):
        assert len(_thought(choice)) == budget, (kind, choice.model_extra["token_ids"])
        check(kind, spec, choice.message.content, choice.finish_reason)
        assert choice.finish_reason == "stop" and choice.message.reasoning
    assert got[-1].model_extra["token_ids"][0] == END and got[-1].message.content


def test_without_a_budget_the_thought_runs_unconstrained(servers):
    """No budget, a short max_tokens: the whole output is thought (the grammar never started), in
    ``reasoning`` with no content, as stock vLLM answers."""
    (choice,) = _both(servers, [_chat(max_tokens=12, extra_body={"structured_outputs": {"choice": CHOICES}})])
    assert END not in choice.model_extra["token_ids"] and choice.finish_reason == "length"
    assert choice.message.reasoning and not choice.message.content


def test_a_thought_ended_early_is_constrained_from_there(servers):
    """A bias on ``</think>`` ends the thought before the budget; the answer from there is valid."""
    palette = CONSTRAINED[0][3]
    requests = [_chat(8, logit_bias={str(END): bias}, **palette) for bias in (18.0, 100.0)]
    got = _both(servers, requests)
    lengths = [len(_thought(choice)) for choice in got]
    assert 0 < lengths[0] < 8 and lengths[1] == 0, lengths  # ended early by the model, and at once
    for choice in got:
        check("json", SCHEMAS["palette"], choice.message.content, choice.finish_reason)


# The structural tag's JSON allows whitespace; a frequency penalty steers the random model to close the call.
TOOL_SAMPLING = dict(frequency_penalty=1.5, max_tokens=96, tools=TOOLS, parallel_tool_calls=False)


def test_tool_calls_required_and_auto_after_the_thought(servers):
    """Not token-identical to stock: the plugin's ``required`` grammar is the library's hermes family
    (``<tool_call>`` matched as the token, then the call), stock's is vLLM's tag (``<tool_call>\n{...``)."""
    requests = [_chat(3, tool_choice="required", **TOOL_SAMPLING),
                _chat(2, tool_choice="auto", logit_bias=BIAS_TOOL_CALL, **TOOL_SAMPLING)]
    got = choices(servers[1], requests)
    for budget, choice in zip((3, 2), got):
        assert len(_thought(choice)) == budget
        check_tool_calls(choice.message, choice.finish_reason)
        assert choice.finish_reason == "tool_calls"


def test_streamed_reasoning_and_content_split_as_stock(servers):
    stock, plugin = servers

    def stream(server):
        reasoning, content = [], []
        for chunk in server.client().chat.completions.create(
                model="tiny", messages=MSG, temperature=0, max_tokens=16, stream=True,
                extra_body={"thinking_token_budget": 4, "structured_outputs": {"choice": CHOICES}}):
            delta = chunk.choices[0].delta if chunk.choices else None
            if delta is not None:
                reasoning.append(getattr(delta, "reasoning", None) or "")
                content.append(delta.content or "")
        return "".join(reasoning), "".join(content)

    got = stream(plugin)
    assert got == stream(stock) and got[1] in CHOICES and got[0]


@pytest.fixture(scope="module")
def speculating(start_server):
    return start_server("plugin-reasoning-spec", model="tiny-think", extra=SPECULATION_QWEN3)


# prompts whose greedy thought repeats itself (ngram drafts it), and budgets ending it inside the repetition
DRAFTED = [("1 2 1 2 1 2 1 2", 3), ("1 2 1 2 1 2 1 2", 5), ("abc abc abc abc abc abc", 14)]


def test_budget_counts_draft_rows_and_the_grammar_applies_in_the_thought_when_asked(servers, speculating):
    """With ngram drafts, a budget still gives exactly N thought tokens: the greedy tokens equal the
    plugin's without speculation (a draft row's budget counts the drafts before it), and vLLM's
    qwen3 parser splits them as deepseek_r1's does. With ``enable_in_reasoning`` the grammar holds
    from the first token: the whole output is the answer."""
    _, plugin = servers
    requests = [_chat(budget, messages=[{"role": "user", "content": text}], max_tokens=budget + 6)
                for text, budget in DRAFTED]
    without = choices(plugin, requests)
    before = speculating.prometheus("vllm:spec_decode_num_draft_tokens_total")
    with_drafts = choices(speculating, requests)
    for (_, budget), a, b in zip(DRAFTED, without, with_drafts):
        assert b.model_extra["token_ids"] == a.model_extra["token_ids"]
        assert len(_thought(b)) == budget
        assert (b.message.reasoning, b.message.content) == (a.message.reasoning, a.message.content)
    assert speculating.prometheus("vllm:spec_decode_num_draft_tokens_total") > before
    (choice,) = choices(speculating, [_chat(max_tokens=48, response_format={"type": "json_schema", "json_schema": {
        "name": "palette", "schema": SCHEMAS["palette"]}})])
    text = "".join(filter(None, (choice.message.reasoning, choice.message.content)))
    assert END not in choice.model_extra["token_ids"]
    check("json", SCHEMAS["palette"], text, choice.finish_reason)
