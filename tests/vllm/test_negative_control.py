"""Negative control: the plugin feeding an all-allowed mask (its debug switch) lets the
model pick tokens the grammar forbids; vLLM, which re-checks every token against the
grammar, reports failed FSM advances. So it is the plugin's mask that enforces grammars."""
from __future__ import annotations


import openai
import pytest

from checks import CHOICES, REGEX, SCHEMAS, grammar_accepts
from neuron_constrain.vllm import ALL_ALLOWED_ENV


@pytest.fixture(scope="module")
def server(start_server):
    return start_server("all-allowed", env={ALL_ALLOWED_ENV: "1"})


def test_all_allowed_mask_breaks_the_grammar(server):
    assert server.metrics()["all_allowed_mask"] is True
    client = server.client()
    cases = [("json", SCHEMAS[name], {"response_format": {"type": "json_schema", "json_schema": {
        "name": name, "schema": SCHEMAS[name]}}}) for name in SCHEMAS]
    cases += [("regex", REGEX, {"extra_body": {"structured_outputs": {"regex": REGEX}}}),
              ("choice", CHOICES, {"extra_body": {"structured_outputs": {"choice": CHOICES}}})]
    valid = []
    for kind, spec, kwargs in cases:
        try:
            r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Answer."}],
                                               max_tokens=24, temperature=0, **kwargs)
            text = r.choices[0].message.content or ""
            valid.append(grammar_accepts(kind, spec, text)[0] and bool(text))
        except openai.APIError:
            valid.append(False)  # vLLM ended the request with an error: the grammar rejected a token
    log = server.log()
    assert "Failed to advance FSM" in log or "grammar rejected tokens" in log
    assert not all(valid), "with an all-allowed mask every output still satisfied its grammar"
    assert server.alive()
