"""Greedy outputs are token-identical to stock vLLM (same model, same requests, plugin off),
unconstrained and constrained (on constraints the library compiles on xgrammar, as stock vLLM does:
the same grammar over vLLM's own token table; what the library sends to llguidance instead, such
as vLLM's ``tool_choice="required"`` schema, is checked for validity in test_serving/test_soundness). Tool calls
are not compared: the plugin writes them in the parser's family spelling (hermes: Qwen's ``<tool_call>\n{...}\n
</tool_call>``), where stock vLLM's grammar follows the tiny model's template (no newlines); test_tool_calls checks
them through the same server."""
from __future__ import annotations

import pytest

from checks import CHOICES, REGEX, SCHEMAS
from traffic import token_ids

PROMPTS = ["Hello", "The capital of France is", "def fibonacci(n):", "1, 2, 3,", "Once upon a time",
           "JSON:", "<tool_call>", "Les"]


@pytest.fixture(scope="module")
def servers(stock_server, plugin_server):
    return stock_server, plugin_server


def _requests():
    reqs = [("completion", dict(prompt=p, max_tokens=32)) for p in PROMPTS]
    msg = [{"role": "user", "content": "Answer."}]
    reqs += [
        ("chat", dict(messages=msg, max_tokens=48, response_format={"type": "json_schema", "json_schema": {
            "name": name, "schema": SCHEMAS[name]}})) for name in SCHEMAS
    ]
    reqs += [
        ("chat", dict(messages=msg, max_tokens=32, extra_body={"structured_outputs": {"regex": REGEX}})),
        ("chat", dict(messages=msg, max_tokens=8, extra_body={"structured_outputs": {"choice": CHOICES}})),
        ("chat", dict(messages=msg, max_tokens=24, presence_penalty=0.5, extra_body={"repetition_penalty": 1.2})),
        ("chat", dict(messages=msg, max_tokens=16, logit_bias={"1000": 5.0, "2000": 8.0},
                      extra_body={"min_tokens": 10})),
    ]
    return reqs


def test_greedy_token_identical_to_stock_vllm(servers):
    stock, plugin = servers
    reqs = _requests()
    before = plugin.metrics()
    expected = token_ids(stock, [(k, {**kw, "temperature": 0}) for k, kw in reqs])
    got = token_ids(plugin, [(k, {**kw, "temperature": 0}) for k, kw in reqs])
    assert all(expected) and all(got)
    mismatches = [(i, reqs[i][1].get("prompt") or reqs[i][1].get("extra_body") or reqs[i][1].get("response_format"),
                   e, g) for i, (e, g) in enumerate(zip(expected, got)) if e != g]
    assert not mismatches, mismatches
    # the constrained half really went through the plugin's mask
    assert plugin.metrics()["constrained_rows"] > before["constrained_rows"]
