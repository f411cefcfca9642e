"""Greedy outputs are token-identical to stock vLLM (same model, same requests, plugin off),
unconstrained and constrained."""
from __future__ import annotations

import asyncio

import pytest

from checks import CHOICES, REGEX, SCHEMAS, TOOLS

PROMPTS = ["Hello", "The capital of France is", "def fibonacci(n):", "1, 2, 3,", "Once upon a time",
           "JSON:", "<tool_call>", "Les"]


@pytest.fixture(scope="module")
def servers(start_server):
    return start_server("stock-equiv", plugin=False), start_server("plugin-equiv")


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
        ("chat", dict(messages=msg, max_tokens=64, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                      frequency_penalty=1.5)),
        ("chat", dict(messages=msg, max_tokens=24, presence_penalty=0.5, extra_body={"repetition_penalty": 1.2})),
        ("chat", dict(messages=msg, max_tokens=16, logit_bias={"1000": 5.0, "2000": 8.0},
                      extra_body={"min_tokens": 10})),
    ]
    return reqs


async def _token_ids(server, reqs):
    client = server.async_client()

    async def one(kind, kwargs):
        kwargs = {**kwargs, "temperature": 0}
        kwargs["extra_body"] = {**kwargs.get("extra_body", {}), "return_token_ids": True}
        if kind == "completion":
            r = await client.completions.create(model="tiny", **kwargs)
        else:
            r = await client.chat.completions.create(model="tiny", **kwargs)
        return r.choices[0].model_extra["token_ids"]

    try:  # concurrently: batches of several rows, as in serving
        return await asyncio.wait_for(asyncio.gather(*(one(k, kw) for k, kw in reqs)), timeout=600)
    finally:
        await client.close()


def test_greedy_token_identical_to_stock_vllm(servers):
    stock, plugin = servers
    reqs = _requests()
    expected = asyncio.run(_token_ids(stock, reqs))
    got = asyncio.run(_token_ids(plugin, reqs))
    assert all(expected) and all(got)
    mismatches = [(i, reqs[i][1].get("prompt") or reqs[i][1].get("extra_body") or reqs[i][1].get("response_format"),
                   e, g) for i, (e, g) in enumerate(zip(expected, got)) if e != g]
    assert not mismatches, mismatches
    assert plugin.metrics()["constrained_rows"] > 0  # the constrained half really went through the plugin's mask
