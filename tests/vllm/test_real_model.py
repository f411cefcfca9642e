"""The real model (SmolLM2-135M-Instruct, built by ``python -m neuron_constrain.models build``) served
by the plugin with this package's Hermes-style chat template, through the stock ``openai`` client:
a schema-valid JSON answer, tool calls with sensible arguments (``required`` and ``auto``),
and with ngram speculation drafts accepted and the greedy output of stock vLLM with the same
speculation and of the plugin without.
A few short requests: the model takes ~0.1-0.2 s a token on the shared 2-core machine."""
from __future__ import annotations

import json

import jsonschema
import pytest

from traffic import choices, token_ids

SPECULATION = ["--speculative-config", json.dumps(
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1})]
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"], "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris today? Answer in celsius."}]


@pytest.fixture(scope="module")
def smollm2(start_server):
    return start_server("smollm2-plugin", model="smollm2")


@pytest.fixture(scope="module")
def with_speculation(start_server):
    """The plugin and stock vLLM, both with ngram speculation (vLLM's frontend then refuses
    logit_bias and min_p itself, so the tool-call nudge runs on the server above)."""
    return (start_server("smollm2-plugin-spec", model="smollm2", extra=SPECULATION),
            start_server("smollm2-stock-spec", model="smollm2", plugin=False, extra=SPECULATION))


def test_json_answer_is_schema_valid(smollm2):
    (choice,) = choices(smollm2, [("chat", dict(
        messages=[{"role": "user", "content": "Ann Lee is 31 years old. Give her name and age as JSON."}],
        max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}))])
    answer = json.loads(choice.message.content)
    jsonschema.validate(answer, PERSON)
    assert choice.finish_reason == "stop"
    assert "Ann" in answer["name"] and answer["age"] == 31, answer


def _calls(choice):
    calls = choice.message.tool_calls or []
    for call in calls:
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    return [json.loads(c.function.arguments) for c in calls]


def test_tool_call_required_has_sensible_arguments(smollm2):
    # one call: with parallel calls allowed, the library's hermes grammar lets this 135M model repeat its call
    # until max_tokens (the cut last block makes vLLM's hermes parser return no calls)
    (choice,) = choices(smollm2, [("chat", dict(messages=ASK_WEATHER, tools=[WEATHER], tool_choice="required",
                                                 max_tokens=60, temperature=0, parallel_tool_calls=False))])
    calls = _calls(choice)
    assert calls and "paris" in calls[0]["city"].lower() and calls[0]["unit"] == "celsius", calls


def test_tool_call_auto_through_the_chat_template(smollm2):
    """``auto``: the template lists the tool; vLLM's hermes parser reads a <tool_call> the model opens,
    and the library's hermes grammar (free text, then calls; one call here, as in the required test) keeps it
    a valid call. This
    135M model answers weather questions in text under ``auto`` (tried: three prompts, three system
    prompts, a few-shot history): a logit_bias on its first token, "<", nudges it to open the call,
    and the call it then writes has the user's city. Without the nudge ``auto`` leaves it text."""
    nudged, plain = choices(smollm2, [
        ("chat", dict(messages=ASK_WEATHER, tools=[WEATHER], tool_choice="auto", max_tokens=60, temperature=0,
                      logit_bias={"44": 10}, parallel_tool_calls=False)),  # 44: "<", the first token of "<tool_call>"
        ("chat", dict(messages=ASK_WEATHER, tools=[WEATHER], tool_choice="auto", max_tokens=24, temperature=0)),
    ])
    calls = _calls(nudged)
    assert calls and "paris" in calls[0]["city"].lower(), (nudged.message.content, calls)
    assert nudged.finish_reason == "tool_calls"
    assert plain.message.content and not plain.message.tool_calls


def test_greedy_with_speculation_equals_stock_and_no_speculation(smollm2, with_speculation):
    plugin, stock = with_speculation
    accepted = plugin.prometheus("vllm:spec_decode_num_accepted_tokens_total")
    requests = [
        ("chat", dict(messages=[{"role": "user", "content": "List the numbers from 1 to 12, separated by commas."}],
                      max_tokens=40, temperature=0)),
        ("chat", dict(messages=[{"role": "user", "content": "Ann Lee is 31 years old. Give her name and age as JSON."}],
                      max_tokens=40, temperature=0,
                      response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})),
    ]
    got = token_ids(plugin, requests)
    assert got == token_ids(stock, requests)
    assert got == token_ids(smollm2, requests)
    assert plugin.prometheus("vllm:spec_decode_num_accepted_tokens_total") - accepted >= 5
    for server in (plugin, smollm2):
        assert server.metrics()["compilations_after_warmup"] == 0
    assert plugin.metrics()["drafts_accepted"] > 0
