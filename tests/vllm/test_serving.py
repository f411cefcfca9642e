"""Through the real ``openai`` client against vLLM's OpenAI server with the plugin:
structured outputs, tool calling, concurrent mixed traffic, rejected requests, and no
recompilation of the head program under load."""
from __future__ import annotations

import asyncio
import json

import pytest

from checks import CHOICES, GRAMMAR, REGEX, SCHEMAS, TOOLS, check, check_tool_calls

MODEL = "tiny"
MSG = [{"role": "user", "content": "Give me the answer."}]


@pytest.fixture(scope="module")
def server(plugin_server):
    return plugin_server


def chat(client, **kwargs):
    kwargs.setdefault("max_tokens", 64)
    kwargs.setdefault("temperature", 0)
    r = client.chat.completions.create(model=MODEL, messages=kwargs.pop("messages", MSG), **kwargs)
    return r.choices[0]


def test_head_program_serves_every_step(server):
    before = server.metrics()
    # a sampling and a logprobs program per bucket, all built at start
    assert before["compilations"] == 2 * len(before["buckets"]) and before["compilations_after_warmup"] == 0
    choice = chat(server.client(), max_tokens=8)
    after = server.metrics()
    assert after["steps"] >= before["steps"] + 1 and after["rows"] >= before["rows"] + 8 - 1
    assert choice.message.content


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_response_format_json_schema(server, name):
    choice = chat(server.client(), max_tokens=96, response_format={
        "type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}})
    check("json", SCHEMAS[name], choice.message.content, choice.finish_reason)


ITEM_SCHEMAS = {  # keywords vLLM's own xgrammar check refuses (a 400 before the plugin saw them); the library enforces
    "uniqueItems": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "uniqueItems": True,
                    "minItems": 2, "maxItems": 3},
    "contains": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "contains": {"const": 7},
                 "minItems": 1, "maxItems": 3},
    "pattern beside a length": {"type": "string", "pattern": "^[a-z]+$", "minLength": 2, "maxLength": 5},
}


@pytest.mark.parametrize("name", sorted(ITEM_SCHEMAS))
def test_the_plugin_admission_is_the_verdict_on_what_the_library_enforces(server, name):
    """Schemas with keywords vLLM's own front-end check refuses for its xgrammar backend are served: the plugin's
    admission is the one verdict for what the library enforces, and the answer is valid."""
    import jsonschema

    schema = ITEM_SCHEMAS[name]
    choice = chat(server.client(), max_tokens=48,
                  response_format={"type": "json_schema", "json_schema": {"name": "items", "schema": schema}})
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), schema)


@pytest.mark.parametrize("pattern", [r"(?=[a-z0-9]*[0-9])[a-z0-9]{4,8}",  # a lookahead vLLM's check refuses
                                     r"(?=[a-z0-9]*[0-9])(?=[a-z0-9]*[a-z])[a-z0-9]{8,64}"])  # deep: llguidance's
def test_a_lookaround_regex_the_library_builds_is_served_and_matched(server, pattern):
    """vLLM's own check refuses a regex with a lookahead (xgrammar's parser); the library builds its language
    exactly (the deep one on llguidance, ``Prepared.deep_languages``): served, and the answer fully matches."""
    import re

    choice = chat(server.client(), max_tokens=70, extra_body={"structured_outputs": {"regex": pattern}})
    assert choice.finish_reason == "stop" and re.fullmatch(pattern, choice.message.content), choice


@pytest.mark.parametrize("kind", ["json", "regex", "tools"])
def test_one_compile_per_constraint_per_server(server, kind):
    """The admission compiles a new constraint for the model's vocabulary in the API server; the engine core
    loads that grammar from the disk cache instead of compiling it again (its counters: ``compiled`` xgrammar
    compiles, ``loaded`` disk-cache hits). A tools request's grammar (control tokens by id) too."""
    import uuid

    fresh = uuid.uuid4().hex[:8]  # a constraint no other test sent
    request = {
        "json": dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {f"k{fresh}": {"type": "integer"}}, "required": [f"k{fresh}"],
            "additionalProperties": False}}}),
        "regex": dict(extra_body={"structured_outputs": {"regex": f"{fresh}[a-z]{{1,8}}"}}),
        "tools": dict(tools=[dict(TOOLS[0], function=dict(TOOLS[0]["function"], name=f"f{fresh}"))],
                      tool_choice="required"),
    }[kind]
    before = server.engine_metrics()
    chat(server.client(), max_tokens=8, **request)
    after = server.engine_metrics()
    assert after["xgrammar"] == before["xgrammar"] + 1, (before, after)
    assert after["compiled"] == before["compiled"] and after["loaded"] == before["loaded"] + 1, (before, after)


@pytest.mark.parametrize("kind, spec", [("regex", REGEX), ("choice", CHOICES), ("grammar", GRAMMAR)])
def test_structured_outputs_extra_body(server, kind, spec):
    choice = chat(server.client(), extra_body={"structured_outputs": {kind: spec}})
    check(kind, spec, choice.message.content, choice.finish_reason)
    assert choice.finish_reason == "stop"  # these grammars are short: they end well before max_tokens


def test_structured_outputs_sampled(server):
    """Constrained and sampled (temperature, top-p, top-k, seed): still valid."""
    client = server.client()
    for seed in range(3):
        choice = chat(client, temperature=1.0, top_p=0.9, seed=seed, max_tokens=96,
                      extra_body={"top_k": 50, "structured_outputs": {"json": SCHEMAS["palette"]}})
        check("json", SCHEMAS["palette"], choice.message.content, choice.finish_reason)


# The structural tag's JSON allows whitespace; the random model would repeat "\r" until
# max_tokens: a frequency penalty (in the head program too) steers it to close the call.
TOOL_SAMPLING = dict(frequency_penalty=1.5, max_tokens=96)


def test_tool_choice_required(server):
    choice = chat(server.client(), tools=TOOLS, tool_choice="required", parallel_tool_calls=False, **TOOL_SAMPLING)
    check_tool_calls(choice.message, choice.finish_reason)
    assert choice.finish_reason == "tool_calls"


def test_tool_choice_named(server):
    for name in ("get_weather", "search"):
        choice = chat(server.client(), tools=TOOLS, **TOOL_SAMPLING,
                      tool_choice={"type": "function", "function": {"name": name}})
        calls = check_tool_calls(choice.message, choice.finish_reason, names=[name])
        assert [c.function.name for c in calls] == [name]


def test_tool_choice_auto_hermes(server):
    """``auto`` with vLLM's hermes parser: the random model is nudged to open a call
    (logit_bias on the single ``<tool_call>`` token); from there the structural tag's
    grammar, enforced by the plugin's mask, must make it a declared, schema-valid call."""
    choice = chat(server.client(), tools=TOOLS, tool_choice="auto", parallel_tool_calls=False, **TOOL_SAMPLING,
                  logit_bias={"32000": 100})
    check_tool_calls(choice.message, choice.finish_reason)
    # without the nudge the model answers in text: auto leaves that to it
    plain = chat(server.client(), tools=TOOLS, tool_choice="auto", max_tokens=16)
    assert plain.message.content and not plain.message.tool_calls


def _mixed_requests(n: int):
    """(kwargs, kind, spec) for n chat requests mixing constraints and sampling parameters."""
    samplers = [
        dict(temperature=0),
        dict(temperature=0.8, top_p=0.9),
        dict(temperature=1.0, extra_body={"top_k": 20}),
        dict(temperature=0.7, extra_body={"min_p": 0.1}),
        dict(temperature=0.9, seed=7),
        dict(temperature=0, frequency_penalty=0.5, presence_penalty=0.3),
        dict(temperature=0, extra_body={"repetition_penalty": 1.3, "min_tokens": 6}),
    ]
    constraints = [
        (None, None, {}),
        ("json", SCHEMAS["person"], {"response_format": {"type": "json_schema", "json_schema": {
            "name": "person", "schema": SCHEMAS["person"]}}}),
        ("regex", REGEX, {"structured_outputs": {"regex": REGEX}}),
        ("choice", CHOICES, {"structured_outputs": {"choice": CHOICES}}),
        (None, None, {}),
        ("json", SCHEMAS["point"], {"structured_outputs": {"json": SCHEMAS["point"]}}),
        ("grammar", GRAMMAR, {"structured_outputs": {"grammar": GRAMMAR}}),
    ]
    out = []
    for i in range(n):
        kwargs = json.loads(json.dumps(samplers[i % len(samplers)]))
        kind, spec, extra = constraints[(i // len(samplers) + i) % len(constraints)]
        body = {**kwargs.pop("extra_body", {}), **{k: v for k, v in extra.items() if k == "structured_outputs"}}
        if "response_format" in extra:
            kwargs["response_format"] = extra["response_format"]
        if body:
            kwargs["extra_body"] = body
        kwargs["messages"] = [{"role": "user", "content": f"Request {i}: say something."}]
        kwargs["max_tokens"] = 48
        out.append((kwargs, kind, spec))
    return out


async def _run_all(server, requests):
    client = server.async_client()

    async def one(kwargs):
        r = await client.chat.completions.create(model=MODEL, **kwargs)
        return r.choices[0], r.usage

    try:
        return await asyncio.wait_for(asyncio.gather(*(one(k) for k, _, _ in requests)), timeout=600)
    finally:
        await client.close()


def _check_mixed(requests, results):
    for (kwargs, kind, spec), (choice, usage) in zip(requests, results):
        if kind is not None:
            check(kind, spec, choice.message.content, choice.finish_reason)
        else:
            assert choice.message.content is not None and choice.finish_reason in ("stop", "length")
        min_tokens = kwargs.get("extra_body", {}).get("min_tokens")
        if min_tokens and kind is None:  # a grammar that ends first wins (the head then emits EOS)
            assert usage.completion_tokens >= min_tokens


def test_concurrent_mixed_traffic(server):
    requests = _mixed_requests(21)
    # the same seeded request twice, in the same batch: identical samples
    seeded = dict(messages=[{"role": "user", "content": "Seeded."}], temperature=1.0, top_p=0.95, seed=1234,
                  max_tokens=24)
    requests += [(dict(seeded), None, None), (dict(seeded), None, None)]
    # a request with a huge logit_bias on one token emits only that token
    requests.append((dict(messages=MSG, temperature=0, max_tokens=6, logit_bias={"1000": 100},
                          extra_body={"return_token_ids": True}), None, None))
    results = asyncio.run(_run_all(server, requests))
    _check_mixed(requests[:-3], results[:-3])
    a, b = results[-3][0].message.content, results[-2][0].message.content
    assert a == b and a
    assert results[-1][0].model_extra["token_ids"] == [1000] * 6


def test_no_recompilation_under_mixed_load(server):
    before = server.metrics()
    requests = _mixed_requests(72)
    results = asyncio.run(_run_all(server, requests))
    _check_mixed(requests, results)
    # then one request alone and two at once (16 tokens each, EOS ignored): batches of one and of two rows
    # whatever the load's own timing made of its batches (under CI load it ran in batches of 4 and 8 only)
    alone = dict(messages=MSG, temperature=0, max_tokens=16, extra_body={"ignore_eos": True})
    for wave in ([alone], [alone, alone]):
        for _, usage in asyncio.run(_run_all(server, [(dict(r), None, None) for r in wave])):
            assert usage.completion_tokens == 16, usage
    after = server.metrics()
    assert after["compilations_after_warmup"] == 0, after
    assert after["compilations"] == before["compilations"] == 2 * len(after["buckets"])
    assert after["steps"] > before["steps"] + 40
    assert after["constrained_rows"] > before["constrained_rows"] and after["sampled_rows"] > before["sampled_rows"]
    used = [b for b, n in after["calls_per_bucket"].items() if n > before["calls_per_bucket"][b]]
    # batch sizes varied across buckets (one, two, and the largest under the load), no new program
    assert {"1", "2", max(after["calls_per_bucket"], key=int)} <= set(used), after["calls_per_bucket"]


def test_grammar_never_rejected_a_token(server):
    """vLLM re-checks every sampled token against the grammar: with the plugin's mask it never
    reports a failed FSM advance (the negative control shows it does without). The test sends
    its own constrained traffic, greedy and sampled, and reads only the log those requests wrote."""
    before = server.metrics()
    offset = len(server.log())
    requests = _mixed_requests(28)
    results = asyncio.run(_run_all(server, requests))
    _check_mixed(requests, results)
    after = server.metrics()
    assert after["constrained_rows"] - before["constrained_rows"] >= 50  # the grammars really ran through the mask
    assert after["sampled_rows"] > before["sampled_rows"]
    log = server.log_since(offset)
    assert "Failed to advance FSM" not in log and "grammar rejected tokens" not in log
