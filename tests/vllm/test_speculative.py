"""ngram speculative decoding through the plugin: every draft position masked by its own grammar
row and verified in the head program. Greedy outputs equal stock vLLM with the same speculation
and the plugin without speculation, structured and unstructured mixed in one batch; vLLM's own
spec-decode counters show drafts were accepted (and some rejected); no program is built after
warm-up; logprobs match stock vLLM's with speculation too."""
from __future__ import annotations

import json

import pytest

from checks import CHOICES, REGEX, SCHEMAS, check
from traffic import assert_logprobs_match, choices, token_ids

SPECULATION = ["--speculative-config", json.dumps(
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1})]
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
DRAFTS = "vllm:spec_decode_num_draft_tokens_total"


@pytest.fixture(scope="module")
def servers(start_server):
    return start_server("stock-spec", plugin=False, extra=SPECULATION), start_server("plugin-spec", extra=SPECULATION)


def _chat(content, **kwargs):
    return ("chat", dict(messages=[{"role": "user", "content": content}], **{"temperature": 0, **kwargs}))


# Prompts that repeat themselves (ngram finds its drafts in them) and structured requests whose
# prompts spell out values the grammar forbids at that point ("purple" is not in the enum; the
# regex allows lower case only): ngram proposes them, and the grammar must win.
REQUESTS = [
    ("completion", dict(prompt="1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,", max_tokens=32, temperature=0)),
    ("completion", dict(prompt="Hello hello hello hello hello", max_tokens=32, temperature=0)),
    ("completion", dict(prompt="The cat sat on the mat. The cat sat on the", max_tokens=24, temperature=0,
                        frequency_penalty=0.4)),
    ("completion", dict(prompt="abc abc abc abc abc", max_tokens=24, temperature=0, extra_body={"min_tokens": 8})),
    _chat('{"color":"purple","tags":["dark","deep"]} {"color":"purple","tags":["dark","deep"]}', max_tokens=48,
          response_format={"type": "json_schema", "json_schema": {"name": "palette", "schema": SCHEMAS["palette"]}}),
    _chat('{"name":"Ann Lee 42","age":200} {"name":"Ann Lee 42","age":200}', max_tokens=48,
          extra_body={"structured_outputs": {"json": SCHEMAS["person"]}}),
    _chat("ABC@DEF.COM abc@def.com ABC@DEF.COM", max_tokens=24, extra_body={"structured_outputs": {"regex": REGEX}}),
    _chat("perhaps perhaps perhaps", max_tokens=8, extra_body={"structured_outputs": {"choice": CHOICES}}),
]
KINDS = [None, None, None, None, ("json", SCHEMAS["palette"]), ("json", SCHEMAS["person"]), ("regex", REGEX),
         ("choice", CHOICES)]


@pytest.fixture(scope="module")
def greedy_outputs(servers, plugin_server):
    stock, plugin = servers
    before = {"accepted": plugin.prometheus(ACCEPTED), "drafts": plugin.prometheus(DRAFTS), **plugin.metrics()}
    log_offset = len(plugin.log())
    outputs = {"stock": token_ids(stock, REQUESTS), "plugin": token_ids(plugin, REQUESTS),
               "plugin, no speculation": token_ids(plugin_server, REQUESTS)}
    return outputs, before, log_offset


def test_greedy_equals_stock_with_speculation_and_the_plugin_without(greedy_outputs):
    outputs, _, _ = greedy_outputs
    assert all(outputs["plugin"])
    for other in ("stock", "plugin, no speculation"):
        mismatches = [(i, REQUESTS[i][1].get("prompt") or REQUESTS[i][1]["messages"][0]["content"], e, g)
                      for i, (e, g) in enumerate(zip(outputs[other], outputs["plugin"])) if e != g]
        assert not mismatches, (other, mismatches)


def test_drafts_were_accepted_and_rejected(greedy_outputs, servers):
    _, before, _ = greedy_outputs
    _, plugin = servers
    after = plugin.metrics()
    accepted = plugin.prometheus(ACCEPTED) - before["accepted"]
    drafts = plugin.prometheus(DRAFTS) - before["drafts"]
    # vLLM's own counters (from the plugin's output) and the plugin's: drafts verified in the program
    assert accepted >= 10, (accepted, drafts)
    assert drafts > accepted  # some drafts were rejected (a grammar forbids them or the model disagrees)
    assert after["draft_rows"] - before["draft_rows"] == drafts
    assert after["drafts_accepted"] - before["drafts_accepted"] == accepted
    assert after["constrained_rows"] > before["constrained_rows"]


def test_structured_outputs_valid_and_grammar_state_kept(greedy_outputs, servers):
    """Rejected drafts left vLLM's grammar where the accepted tokens put it: every output is valid
    and vLLM, which advances the grammar by each emitted token, never refused one."""
    _, _, log_offset = greedy_outputs
    _, plugin = servers
    results = choices(plugin, REQUESTS)
    for constraint, choice in zip(KINDS, results):
        if constraint is not None:
            check(*constraint, choice.message.content, choice.finish_reason)
    log = plugin.log_since(log_offset)
    assert "Failed to advance FSM" not in log and "grammar rejected tokens" not in log
    assert "rejected draft token" not in log


def test_sampled_with_speculation(servers):
    """Sampled (temperature, top-p, top-k, seeds) with drafts: constrained outputs valid, a seeded
    request reproducible, and rejection sampling accepts some drafts."""
    _, plugin = servers
    accepted = plugin.prometheus(ACCEPTED)
    seeded = ("completion", dict(prompt="1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,", max_tokens=32, temperature=0.3, seed=11))
    requests = [seeded, seeded]
    for seed in range(4):
        requests.append(_chat('{"color":"red","tags":["a"]} {"color":"red","tags":["a"]}', max_tokens=48,
                              temperature=0.8, top_p=0.95, seed=seed,
                              extra_body={"top_k": 40, "structured_outputs": {"json": SCHEMAS["palette"]}}))
    requests.append(("completion", dict(prompt="go go go go go go go", max_tokens=32, temperature=0.2)))
    results = choices(plugin, requests)
    assert results[0].text == results[1].text and results[0].text
    for choice in results[2:6]:
        check("json", SCHEMAS["palette"], choice.message.content, choice.finish_reason)
    assert plugin.prometheus(ACCEPTED) > accepted


def test_logprobs_with_speculation_match_stock(servers):
    stock, plugin = servers
    requests = [
        ("completion", dict(prompt="1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,", max_tokens=16, temperature=0, logprobs=3)),
        _chat("perhaps yes perhaps", max_tokens=6, logprobs=True, top_logprobs=2,
              extra_body={"structured_outputs": {"choice": CHOICES}}),
    ]
    expected, got = choices(stock, requests), choices(plugin, requests)
    assert sum(assert_logprobs_match(e, g) for e, g in zip(expected, got)) >= 16


def test_no_program_built_after_warmup(greedy_outputs, servers):
    _, plugin = servers
    after = plugin.metrics()
    assert after["num_speculative_tokens"] == 3
    assert after["compilations_after_warmup"] == 0 and after["compilations"] == 2 * len(after["buckets"])
    assert after["buckets"][-1] == 8 * (1 + 3)  # max_num_seqs requests of 1 + 3 rows
    used = [b for b, n in after["calls_per_bucket"].items() if n]
    assert len(used) >= 3, after["calls_per_bucket"]
