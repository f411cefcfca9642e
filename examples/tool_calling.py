"""Tool calling: OpenAI ``tools`` and ``tool_choice`` as a constraint, the calls parsed back.

    python examples/tool_calling.py

Runs in seconds on the CPU with no download: a tiny random-weight Llama and a toy byte-level
vocabulary from ``neuron_constrain.testing`` stand in for a real model and its tokenizer. The
model's weights are random, so which tool it calls and with what arguments is arbitrary; that
every call names a declared tool and has arguments valid against that tool's parameters is
not: the grammar decides it inside the graph. The tools bound their strings so that a call
ends well inside the token limit (``examples/tools.json``, the README's, leaves ``city``
unbounded, which a real model closes by itself and a random one may not).

What it shows: ``tool_choice="required"`` (one call of any tool, ``parallel_tool_calls=False``),
a named tool choice (a call of that tool), the Hermes format (``<tool_call>`` blocks), and
``S.parse_tool_calls``, which also lifts calls out of free text for ``tool_choice="auto"``.
"""
from __future__ import annotations

import jsonschema

from neuron_constrain import structured as S
from neuron_constrain.decoding import export_decoder
from neuron_constrain.testing import tiny_decoder, toy_tokenizer

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city.",
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string", "maxLength": 12},
                                      "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                       "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "search", "description": "Search the web.",
        "parameters": {"type": "object",
                       "properties": {"query": {"type": "string", "maxLength": 16},
                                      "limit": {"type": "integer", "minimum": 1, "maximum": 10}},
                       "required": ["query", "limit"], "additionalProperties": False}}},
]
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
SEARCH = {"type": "function", "function": {"name": "search"}}


def check_calls(calls: list, names: set[str]) -> None:
    assert calls, "no call"
    for call in calls:
        assert call.name in names, call.name
        jsonschema.validate(call.arguments, PARAMETERS[call.name])


def main() -> None:
    tok = toy_tokenizer()
    decoder = export_decoder(tiny_decoder("llama", vocab_size=tok.vocab_size), max_batch=3, max_len=320,
                             vocab_size=tok.vocab_size)
    requests = [  # (prompt, tool_choice, format)
        ("What is the weather in Tokyo?", "required", "json"),
        ("Find three pages about Lisbon.", SEARCH, "json"),
        ("What is the weather in Oslo?", "required", "hermes"),
    ]
    constraints = [S.tool_constraint(TOOLS, choice, format=fmt, parallel_tool_calls=False)
                   for _, choice, fmt in requests]
    result = S.generate(decoder, [prompt for prompt, _, _ in requests], constraints, 256, tokenizer=tok)

    for (prompt, choice, fmt), answer in zip(requests, result.outputs):
        assert answer.finish_reason == "stop", (answer.finish_reason, answer.text, answer.error)
        content, calls = S.parse_tool_calls(answer.text, TOOLS, choice, format=fmt)
        print(f"{prompt!r} ({fmt}) wrote {answer.text!r}")
        for call in calls:
            print(f"  -> {call.name}({call.arguments})")
        check_calls(calls, {choice["function"]["name"]} if isinstance(choice, dict) else set(PARAMETERS))
        assert len(calls) == 1 and not content  # one call, nothing around it

    # tool_choice="auto" leaves the text free (no constraint); calls are lifted out of it afterwards
    assert S.tool_constraint(TOOLS, "auto") is None
    text = 'Let me check. {"name": "get_weather", "arguments": {"city": "Lima", "unit": "celsius"}}'
    content, calls = S.parse_tool_calls(text, TOOLS, "auto")
    print(f"auto: content {content!r}, calls {[(c.name, c.arguments) for c in calls]}")
    assert content == "Let me check." and [c.name for c in calls] == ["get_weather"]
    print("every call names a declared tool, with valid arguments")


if __name__ == "__main__":
    main()
