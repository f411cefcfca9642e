"""A client of the vLLM plugin's OpenAI server: structured outputs and a tool call, each checked.

    make serve MODEL=tiny                                    # in another shell: the server, on 127.0.0.1:8000
    python examples/vllm_client.py [--base-url http://127.0.0.1:8000/v1]

Needs the ``openai`` and ``jsonschema`` packages (the vLLM lane's venv has both) and a running
server: ``make serve`` (SmolLM2-135M-Instruct) or ``make serve MODEL=tiny`` (a random-weight
Llama, built on first use, nothing downloaded). The base URL is ``--base-url``, else the
``OPENAI_BASE_URL`` environment variable (which the ``openai`` client reads too), else
``http://127.0.0.1:8000/v1``. Every token is sampled by the plugin's rewritten program, under
the mask of each request's grammar, so the answers are valid whatever the model's weights.

What it sends, each greedy: a JSON schema as ``response_format`` (OpenAI's), a choice and a regex
through vLLM's ``structured_outputs`` request field, and OpenAI ``tools`` with
``tool_choice="required"``; it validates every answer (``jsonschema``, ``re``, the tool's
parameters) and stops with an error (exit status 1) at the first that is not.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

import jsonschema
import openai

PLACE = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                   "population_millions": {"type": "integer", "minimum": 0, "maximum": 40},
                   "coastal": {"type": "boolean"}},
    "required": ["city", "population_millions", "coastal"],
    "additionalProperties": False,
}
CHOICES = ["yes", "no"]
EMAIL = r"[a-z]{3,8}@[a-z]{3,5}\.com"
# `enum` without a `type` beside it: the server builds a tool call's grammar as xgrammar's structural tag, and
# xgrammar compiles an `enum` alone (a sibling `type` dropped), so the plugin answers that pair with a 400 naming it
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 12},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}]


def ask(client: openai.OpenAI, model: str, question: str, **kwargs):
    answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                            temperature=0, **kwargs)
    return answer.choices[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1"))
    args = parser.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key=os.environ.get("OPENAI_API_KEY", "none"),
                           timeout=120, max_retries=0)
    model = client.models.list().data[0].id
    print(f"server {args.base_url}, model {model}")

    place = ask(client, model, "Which city is the Louvre in? Answer in JSON.", max_tokens=128, response_format={
        "type": "json_schema", "json_schema": {"name": "place", "schema": PLACE, "strict": True}})
    print(f"json_schema -> {place.message.content}")
    assert place.finish_reason == "stop", place.finish_reason
    jsonschema.validate(json.loads(place.message.content), PLACE)

    pick = ask(client, model, "Is the Louvre in Paris?", max_tokens=8,
               extra_body={"structured_outputs": {"choice": CHOICES}})
    print(f"choice -> {pick.message.content}")
    assert pick.message.content in CHOICES, pick.message.content

    email = ask(client, model, "Write an email address.", max_tokens=32,
                extra_body={"structured_outputs": {"regex": EMAIL}})
    print(f"regex -> {email.message.content}")
    assert re.fullmatch(EMAIL, email.message.content), email.message.content

    # a random-weight model may repeat whitespace inside the call; a frequency penalty steers it to close it
    call = ask(client, model, "What is the weather in Tokyo?", max_tokens=96, tools=TOOLS, tool_choice="required",
               parallel_tool_calls=False, frequency_penalty=1.5)
    assert call.finish_reason == "tool_calls" and len(call.message.tool_calls) == 1, call
    function = call.message.tool_calls[0].function
    print(f"tool call -> {function.name}({function.arguments})")
    assert function.name == "get_weather"
    jsonschema.validate(json.loads(function.arguments), TOOLS[0]["function"]["parameters"])
    print("every answer is valid")
    return 0


if __name__ == "__main__":
    sys.exit(main())
