"""Issue 36: every schema the server accepts is enforced by the library's engines and policy, or
refused with a 400 naming the keyword and its JSON pointer; finished answers are checked.

Through the real ``openai`` client against the shared plugin server (tiny model): the bounded
string that vLLM's xgrammar backend let a raw control character into, the library's ``auto``
choosing llguidance per request, the 400s, and a bounded load test mixing everything.
"""
from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.request

import jsonschema
import openai
import pytest

from checks import CHOICES, REGEX, SCHEMAS, TOOL_SCHEMAS, TOOLS, grammar_accepts

MODEL = "tiny"
MSG = [{"role": "user", "content": "Give me the answer."}]

# The issue's schema: a length-bounded string (xgrammar 0.2.8 compiles its characters as a class that
# admits raw control characters) beside an integer.
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                         "population": {"type": "integer", "minimum": 0}},
        "required": ["city", "population"], "additionalProperties": False}
# xgrammar does not enforce patternProperties (keywords.py); llguidance does: the library's auto picks it.
PATTERN = {"type": "object", "patternProperties": {"^x[a-z]{0,5}$": {"type": "integer", "minimum": 0, "maximum": 9}},
           "additionalProperties": False}
# No engine enforces these (xgrammar ignores them, llguidance refuses them); vLLM's own validation lets them through.
UNENFORCEABLE = [  # forms the schema algebra cannot rewrite either (a format has no positive complement)
    ({"type": "object", "properties": {"a": {"type": "string", "not": {"format": "email"}}}, "required": ["a"]},
     "not", "#/properties/a/not"),
    ({"type": "object", "properties": {"n": {"type": "string"}}, "required": ["n"],
      "if": {"properties": {"n": {"format": "email"}}}, "then": {"properties": {"n": {"maxLength": 3}}}}, "if", "#/if"),
    ({"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}},
      "dependentSchemas": {"a": {"properties": {"b": {"not": {"format": "email"}}}}}}, "dependentSchemas", "#/dependentSchemas"),
]


@pytest.fixture(scope="module")
def server(plugin_server):
    return plugin_server


@pytest.fixture(scope="module")
def control_token():
    """The byte-fallback token of ESC (0x1B) in the tiny model's sentencepiece vocabulary."""
    from transformers import AutoTokenizer

    from conftest import ROOT

    tokenizer = AutoTokenizer.from_pretrained(str(ROOT / "build" / "tiny-llama"))
    token = tokenizer.convert_tokens_to_ids("<0x1B>")
    assert isinstance(token, int) and token != tokenizer.unk_token_id
    return token


def raw_control(text: str) -> list[str]:
    """Raw control characters in a JSON text produced without whitespace (none is ever valid)."""
    return [c for c in text if ord(c) < 0x20]


def assert_valid_json(schema, text: str, finish_reason: str) -> None:
    """Strictly valid: never a raw control character; complete JSON valid against ``schema`` at
    ``stop``; at ``length`` a prefix the grammar accepts."""
    assert text is not None
    assert not raw_control(text), f"raw control characters {raw_control(text)!r} in {text!r}"
    if finish_reason == "length":
        if schema is not PATTERN:  # xgrammar (the prefix checker) refuses some valid patternProperties keys
            assert grammar_accepts("json", schema, text)[0], text
        return
    assert finish_reason in ("stop", "tool_calls"), (finish_reason, text)
    jsonschema.validate(json.loads(text), schema)


def engine_counters(server) -> dict:
    return server.engine_metrics()


def test_bounded_string_takes_no_control_character(server, control_token):
    """The issue's reproduction, made deterministic: greedy, with the ESC byte token pushed up by a
    logit bias. vLLM's xgrammar grammar for ``maxLength`` admits ESC inside the string, so the
    answer was ``{"city":"\\x1b\\x1b...`` and finished as ``stop`` with invalid JSON; the library's
    grammar takes JSON's string characters only."""
    client = server.client()
    answers = []
    for bias in (100, 30, 10):
        r = client.chat.completions.create(
            model=MODEL, messages=MSG, max_tokens=48, temperature=0, logit_bias={str(control_token): bias},
            response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}})
        answers.append((r.choices[0].message.content, r.choices[0].finish_reason))
    for text, finish in answers:
        assert_valid_json(CITY, text, finish)
    after = engine_counters(server)
    assert after["xgrammar"] >= 1  # the library compiled it (on xgrammar, its string class fixed)
    assert after["invalid_outputs"] == 0, after["violations"]


def test_auto_picks_llguidance_for_what_xgrammar_would_not_enforce(server):
    from neuron_constrain.vllm import policy

    assert policy.admit(policy.from_vllm("json", json.dumps(PATTERN))) == "llguidance"  # the library's verdict
    before = engine_counters(server)
    answers = []
    for seed in range(3):
        r = server.client().chat.completions.create(
            model=MODEL, messages=MSG, max_tokens=32, temperature=1.0, seed=seed,
            extra_body={"structured_outputs": {"json": PATTERN}})
        answers.append((r.choices[0].message.content, r.choices[0].finish_reason))
    for text, finish in answers:
        assert_valid_json(PATTERN, text, finish)
    assert any(finish == "stop" for _, finish in answers), answers
    after = engine_counters(server)
    assert after["llguidance"] == before["llguidance"] + 3


@pytest.mark.parametrize("schema, keyword, pointer", UNENFORCEABLE, ids=[u[1] for u in UNENFORCEABLE])
def test_unenforceable_schema_refused_with_keyword_and_pointer(server, schema, keyword, pointer):
    before = server.metrics()["steps"]
    with pytest.raises(openai.BadRequestError) as info:
        server.client().chat.completions.create(
            model=MODEL, messages=MSG, max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    error = info.value
    assert error.status_code == 400
    body = error.body if isinstance(error.body, dict) else {}
    message = body.get("message", str(error))
    assert f"`{keyword}` at {pointer}" in message, message
    assert body.get("type") == "BadRequestError" and body.get("param") == "structured_outputs.json", body
    assert server.metrics()["steps"] == before  # refused before any token
    assert server.alive()


# --------------------------------------------------------------------------- the load test
LOAD_REQUESTS = 96
CONCURRENCY = 16
LOAD_TIMEOUT = 240  # seconds for the whole mix (~30-60 s on the idle 2-core machine)


def _load_mix(control_token: int):
    """(kind, spec, kwargs) for each request: constrained (schemas, regex, choice, tools), unconstrained,
    streamed, aborted (closed after the first chunk) and bad (a 4xx expected)."""
    schemas = [("json", SCHEMAS[n]) for n in sorted(SCHEMAS)] + [("json", CITY), ("json", PATTERN)]
    bad = [
        dict(response_format={"type": "json_schema", "json_schema": {"name": "b", "schema": {"type": 5}}}),
        dict(extra_body={"structured_outputs": {"regex": "[a-"}}),
        dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "no_such_tool"}}),
        dict(max_tokens=-1),
        dict(messages=[]),
        dict(response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": UNENFORCEABLE[0][0]}}),
    ]
    samplers = [dict(temperature=0), dict(temperature=1.0, top_p=0.9), dict(temperature=0.8, seed=11),
                dict(temperature=1.0, extra_body={"top_k": 20})]
    mix = []
    for i in range(LOAD_REQUESTS):
        sampler = json.loads(json.dumps(samplers[i % len(samplers)]))
        base = dict(messages=[{"role": "user", "content": f"Request {i}."}], max_tokens=40, **sampler)
        slot = i % 10
        if slot in (0, 1, 2):
            kind, schema = schemas[(i // 10 + slot) % len(schemas)]
            if i % 20 == 1:  # the issue's trap, sampled
                kind, schema = "json", CITY
                base["logit_bias"] = {str(control_token): 20}
            body = {**base.pop("extra_body", {}), "structured_outputs": {"json": schema}}
            mix.append(("json", schema, {**base, "extra_body": body}))
        elif slot == 3:
            body = {**base.pop("extra_body", {}), "structured_outputs": {"regex": REGEX}}
            mix.append(("regex", REGEX, {**base, "extra_body": body}))
        elif slot == 4:
            body = {**base.pop("extra_body", {}), "structured_outputs": {"choice": CHOICES}}
            mix.append(("choice", CHOICES, {**base, "extra_body": body}))
        elif slot == 5:
            name = TOOLS[i // 10 % 2]["function"]["name"]
            choice = "required" if i % 20 == 5 else {"type": "function", "function": {"name": name}}
            mix.append(("tool", name if isinstance(choice, dict) else None,
                        {**base, "tools": TOOLS, "tool_choice": choice, "parallel_tool_calls": False,
                         "frequency_penalty": 1.5, "max_tokens": 64}))
        elif slot == 6:
            mix.append(("free", None, base))
        elif slot == 7:
            body = {**base.pop("extra_body", {}), "structured_outputs": {"json": SCHEMAS["palette"]}}
            mix.append(("stream", SCHEMAS["palette"], {**base, "extra_body": body, "stream": True}))
        elif slot == 8:
            mix.append(("abort", None, {**base, "stream": True, "max_tokens": 64}))
        else:
            mix.append(("bad", None, {**base, **bad[i // 10 % len(bad)]}))
    return mix


async def _run_mix(server, mix):
    client = server.async_client()
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(kind, kwargs):
        async with gate:
            start = time.monotonic()
            try:
                if kind in ("stream", "abort"):
                    stream = await client.chat.completions.create(model=MODEL, **kwargs)
                    text, finish = "", None
                    async for chunk in stream:
                        if chunk.choices:
                            text += chunk.choices[0].delta.content or ""
                            finish = chunk.choices[0].finish_reason or finish
                        if kind == "abort":
                            await stream.close()  # the client goes away after its first chunk
                            return ("aborted", None, time.monotonic() - start)
                    return ("ok", (text, finish), time.monotonic() - start)
                r = await client.chat.completions.create(model=MODEL, **kwargs)
                return ("ok", r.choices[0], time.monotonic() - start)
            except openai.APIStatusError as error:
                return ("status", error.status_code, time.monotonic() - start)

    try:
        return await asyncio.wait_for(asyncio.gather(*(one(k, kw) for k, _, kw in mix)), timeout=LOAD_TIMEOUT)
    finally:
        await client.close()


def _prometheus_gauges(server) -> dict:
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        out[name] = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                        if line.startswith(name + "{") or line.startswith(name + " "))
    errors = [line for line in text.splitlines()
              if line.startswith("vllm:request_success_total{") and 'finished_reason="error"' in line]
    out["errors"] = sum(float(line.rsplit(" ", 1)[1]) for line in errors)
    return out


def test_load_mix_valid_refused_or_aborted_nothing_left(server, control_token):
    mix = _load_mix(control_token)
    before = engine_counters(server)
    errors_before = _prometheus_gauges(server)["errors"]
    start = time.monotonic()
    results = asyncio.run(_run_mix(server, mix))
    wall = time.monotonic() - start
    counts = {"valid": 0, "length": 0, "refused": 0, "aborted": 0, "free": 0}
    for (kind, spec, kwargs), (outcome, value, _) in zip(mix, results):
        if kind == "bad":
            assert outcome == "status" and 400 <= value < 500, (kwargs, outcome, value)
            counts["refused"] += 1
            continue
        if kind == "abort":
            assert outcome == "aborted", (outcome, value)
            counts["aborted"] += 1
            continue
        assert outcome == "ok", (kind, kwargs, outcome, value)
        if kind == "free":
            assert value.finish_reason in ("stop", "length")
            counts["free"] += 1
            continue
        if kind == "stream":
            text, finish = value
        elif kind == "tool":
            calls = value.message.tool_calls or []
            finish = value.finish_reason
            if finish == "length":  # cut mid-call: no call to check
                counts["length"] += 1
                continue
            assert calls and finish in ("stop", "tool_calls"), value
            for call in calls:
                assert spec is None or call.function.name == spec
                assert not raw_control(call.function.arguments), call.function.arguments
                jsonschema.validate(json.loads(call.function.arguments), TOOL_SCHEMAS[call.function.name])
            counts["valid"] += 1
            continue
        else:
            text, finish = value.message.content, value.finish_reason
        if kind in ("json", "stream"):
            assert_valid_json(spec, text, finish)
        else:
            prefix_ok, _ = grammar_accepts(kind, spec, text)
            assert prefix_ok and not raw_control(text), (kind, text)
            if finish == "stop":
                assert (re.fullmatch(spec, text) if kind == "regex" else text in spec), text
        counts["length" if finish == "length" else "valid"] += 1
    # nothing left running or waiting once the aborts have reached the engine (bounded poll)
    deadline = time.monotonic() + 30
    gauges = _prometheus_gauges(server)
    while time.monotonic() < deadline and (gauges["vllm:num_requests_running"] or gauges["vllm:num_requests_waiting"]):
        time.sleep(0.2)
        gauges = _prometheus_gauges(server)
    assert gauges["vllm:num_requests_running"] == 0 and gauges["vllm:num_requests_waiting"] == 0, gauges
    assert gauges["errors"] == errors_before  # no request ended in error (the last line of defence never fired)
    with urllib.request.urlopen(server.url + "/health", timeout=10) as r:
        assert r.status == 200
    after = engine_counters(server)
    assert after["invalid_outputs"] == 0, after["violations"]
    assert after["validated_outputs"] > before["validated_outputs"]
    assert after["llguidance"] > before["llguidance"] and after["xgrammar"] > before["xgrammar"]
    latencies = sorted(r[2] for r in results)
    print(f"\nload mix: {len(mix)} requests, {CONCURRENCY} at a time, {wall:.1f} s wall; {counts}; "
          f"latency p50 {latencies[len(latencies) // 2]:.2f} s, max {latencies[-1]:.2f} s; engine: "
          f"{after['xgrammar'] - before['xgrammar']} xgrammar / {after['llguidance'] - before['llguidance']} "
          f"llguidance grammars, {after['validated_outputs'] - before['validated_outputs']} answers validated, "
          f"{after['invalid_outputs']} invalid")
    assert counts["refused"] == LOAD_REQUESTS // 10 and counts["aborted"] == LOAD_REQUESTS // 10
    assert counts["valid"] >= LOAD_REQUESTS // 3
