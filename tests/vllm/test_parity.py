"""Every ``SamplingParams`` field of vLLM 0.32, one test each: served by the plugin as stock vLLM
serves it, or refused by both (the parity table of docs/guides/vllm.md is checked against
the class and against the cases here).

A field the OpenAI server takes is sent to the shared stock and plugin servers (tiny model) in one
greedy request (or sampled at temperature 0.01, the argmax with overwhelming probability, where the
field only acts on sampling): the same token ids, logprobs within 1e-4; a field refused is refused
by both with a 400. A field only the engine API takes (no OpenAI field sets it) is checked offline:
the plugin's validator admits it and nothing the head reads changes (vLLM's frontend, scheduler or
output processor acts on it, the same code with the plugin as without).
"""
from __future__ import annotations

import dataclasses
import re

import openai
import pytest

from checks import SCHEMAS
from conftest import ROOT
from traffic import assert_logprobs_match, choices

MSG = [{"role": "user", "content": "Answer."}]
# A sampling row (not vLLM's greedy path) whose draw is the argmax: vLLM raises a temperature below 0.01 to
# 0.01, where the smallest logit gap of this request's 7 greedy tokens (0.148) is a factor e^-14.8 in probability.
SAMPLED = dict(temperature=0.01, max_tokens=7)


@dataclasses.dataclass(frozen=True)
class Case:
    request: dict | None = None  # chat kwargs (greedy unless given); None: engine-only, checked offline
    refused: bool = False  # stock vLLM refuses it too (HTTP 400 from vLLM's own validation)
    logprobs: bool = False  # compare logprobs (within 1e-4), not only tokens
    engine: dict | None = None  # engine-only: SamplingParams keywords
    refused_here: bool = False  # served, but not by the shared servers' flags: both must answer 400 here
    counter: str | None = None  # a plugin counter this request must raise (the path it takes: wide, bans)


def chat(**kwargs) -> dict:
    return {"messages": MSG, "max_tokens": 12, "temperature": 0, **kwargs}


def sampled(**kwargs) -> dict:
    return chat(**SAMPLED, **kwargs)


CASES = {
    "n": Case(sampled(n=2)),  # vLLM refuses n > 1 when greedy
    "presence_penalty": Case(chat(presence_penalty=0.8)),
    "frequency_penalty": Case(chat(frequency_penalty=1.2)),
    "repetition_penalty": Case(chat(extra_body={"repetition_penalty": 1.3})),
    "temperature": Case(sampled()),
    "watermarking": Case(chat(extra_body={"watermarking": True})),  # no --watermark-config: a no-op in both
    "top_p": Case(sampled(top_p=0.5)),
    "top_k": Case(sampled(extra_body={"top_k": 1000}), counter="wide_steps"),  # past the program's 256
    "min_p": Case(sampled(extra_body={"min_p": 0.2})),
    "seed": Case(sampled(seed=7)),
    "stop": Case(chat(max_tokens=24, stop=["itself"])),
    "stop_token_ids": Case(chat(extra_body={"stop_token_ids": [21777]})),
    "ignore_eos": Case(chat(extra_body={"ignore_eos": True})),
    "max_tokens": Case(chat(max_tokens=3)),
    "min_tokens": Case(chat(extra_body={"min_tokens": 6, "stop_token_ids": list(range(500, 540))}),
                       counter="wide_steps"),  # 40 stop ids: past the program's 12
    "logprobs": Case(chat(logprobs=True, top_logprobs=5), logprobs=True),
    "prompt_logprobs": Case(chat(max_tokens=4, extra_body={"prompt_logprobs": 2}), logprobs=True),
    "prompt_logprob_token_ids": Case(engine=dict(prompt_logprob_token_ids=[[1, 2]]), refused=True),
    "prompt_logprob_start": Case(engine=dict(prompt_logprobs=1, prompt_logprob_start=2)),
    "logprob_token_ids": Case(chat(logprobs=True, top_logprobs=3, extra_body={"logprob_token_ids": [5, 6, 7]}),
                              logprobs=True),
    "flat_logprobs": Case(engine=dict(logprobs=2, flat_logprobs=True)),
    "detokenize": Case(engine=dict(detokenize=False)),
    "skip_special_tokens": Case(chat(extra_body={"skip_special_tokens": False})),
    "spaces_between_special_tokens": Case(chat(extra_body={"spaces_between_special_tokens": False})),
    "include_stop_str_in_output": Case(chat(max_tokens=24, stop=["itself"],
                                            extra_body={"include_stop_str_in_output": True})),
    "output_kind": Case(chat(stream=True)),  # the server sets it from `stream`
    "stream_interval": Case(chat(stream=True, extra_body={"stream_interval": 3})),
    "skip_clone": Case(engine=dict(skip_clone=True)),
    "output_text_buffer_length": Case(engine=dict(stop=["abc"])),  # set by vLLM from `stop`, never an input
    "structured_outputs": Case(chat(max_tokens=48, response_format={"type": "json_schema", "json_schema": {
        "name": "palette", "schema": SCHEMAS["palette"]}})),
    "logit_bias": Case(chat(logit_bias={str(i): -100 for i in range(28000, 28400)}), counter="wide_steps"),
    "allowed_token_ids": Case(chat(extra_body={"allowed_token_ids": [100, 200, 300, 28117, 2]}), counter="banned_rows"),
    "extra_args": Case(chat(extra_body={"vllm_xargs": {"note": "unused"}})),
    # "dismiss" (one token) starts the greedy answer, "Conne Conne" (two) follows it: both must bite
    "bad_words": Case(chat(max_tokens=16, extra_body={"bad_words": ["dismiss", "Conne Conne"]}), counter="banned_rows"),
    "skip_reading_prefix_cache": Case(engine=dict(skip_reading_prefix_cache=True)),
    # served with --reasoning-parser (test_reasoning.py); the shared servers have none: a 400 from both
    "thinking_token_budget": Case(chat(extra_body={"thinking_token_budget": 4}), refused_here=True),
    "repetition_detection": Case(chat(max_tokens=40, extra_body={"repetition_detection": {
        "max_pattern_size": 4, "min_pattern_size": 2, "min_count": 3}})),
    "routed_experts_prompt_start": Case(chat(extra_body={"routed_experts_prompt_start": 1})),
    "trace_decode_token_ids": Case(engine=dict(trace_decode_token_ids=[5, 6]), refused=True),
}


def public_fields() -> list[str]:
    from vllm import SamplingParams

    return [f for f in SamplingParams.__struct_fields__ if not f.startswith("_")]


def readme_rows() -> dict[str, str]:
    """The parity table of the serving guide: field -> its "served" / "refused" cell."""
    text = (ROOT / "docs" / "guides" / "vllm.md").read_text()
    table = text[text.index("## Parity with stock vLLM, field by field"):].split("\n\n")[2]
    return dict(re.findall(r"^\| `(\w+)` \| (served|refused) \|", table, flags=re.M))


def test_every_field_is_in_the_table_and_has_a_case():
    rows = readme_rows()
    assert sorted(rows) == sorted(public_fields()) == sorted(CASES)
    for field, case in CASES.items():
        assert rows[field] == ("refused" if case.refused else "served"), field


def _stream_text(server, request) -> str:
    kwargs = {k: v for k, v in request.items() if k != "stream"}
    parts = server.client().chat.completions.create(model=server.name, stream=True, **kwargs)
    return "".join(c.choices[0].delta.content or "" for c in parts if c.choices)


@pytest.mark.parametrize("field", [f for f, c in CASES.items() if c.request is not None])
def test_served_as_stock_serves_it(field, stock_server, plugin_server):
    case = CASES[field]
    request = case.request
    if case.refused or case.refused_here:
        for server in (stock_server, plugin_server):
            with pytest.raises(openai.BadRequestError):
                server.client().chat.completions.create(model=server.name, **request)
        return
    if request.get("stream"):
        assert _stream_text(plugin_server, request) == _stream_text(stock_server, request)
        return
    before = plugin_server.metrics() if case.counter else None
    (expected,), (got,) = choices(stock_server, [("chat", request)]), choices(plugin_server, [("chat", request)])
    assert got.model_extra["token_ids"] == expected.model_extra["token_ids"]
    if case.counter:
        assert plugin_server.metrics()[case.counter] > before[case.counter], case.counter
    if field in ("allowed_token_ids", "bad_words"):
        _assert_banned(field, request, got.model_extra["token_ids"], plugin_server)
    assert (got.message.content, got.finish_reason) == (expected.message.content, expected.finish_reason)
    if case.logprobs and got.logprobs is not None:
        assert assert_logprobs_match(expected, got) > 0
    if "prompt_logprobs" in request.get("extra_body", {}):
        _prompt_logprobs_match(stock_server, plugin_server, request)
    if request.get("n"):
        full = [server.client().chat.completions.create(model=server.name, **request)
                for server in (stock_server, plugin_server)]
        assert [c.message.content for c in full[1].choices] == [c.message.content for c in full[0].choices]


def _assert_banned(field, request, ids, server) -> None:
    """The bans acted: only allowed ids; no bad word completed, and the answer differs from the unbanned one."""
    if field == "allowed_token_ids":
        assert set(ids) <= set(request["extra_body"]["allowed_token_ids"]), ids
        return
    plain = {k: v for k, v in request.items() if k != "extra_body"}
    (unbanned,) = choices(server, [("chat", plain)])
    assert unbanned.model_extra["token_ids"][:1] == [12983] and ids != unbanned.model_extra["token_ids"]
    assert 12983 not in ids and all(ids[i:i + 2] != [8771, 8771] for i in range(len(ids) - 1)), ids


def _prompt_logprobs_match(stock, plugin, request) -> None:
    rows = [server.client().chat.completions.create(model=server.name, **request).model_extra["prompt_logprobs"]
            for server in (stock, plugin)]
    assert len(rows[0]) == len(rows[1]) > 1
    for e, g in zip(*rows):
        assert (e is None) == (g is None)
        if e is not None:
            assert e.keys() == g.keys()
            assert all(abs(e[k]["logprob"] - g[k]["logprob"]) <= 1e-4 for k in e)


@pytest.mark.parametrize("field", [f for f, c in CASES.items() if c.request is None])
def test_engine_only_fields(field, monkeypatch):
    """Admitted by the plugin's validator, and invisible to the head: the request's needs (processor
    rows, program, bans) equal a plain request's. The two refused need vLLM's V2 model runner, which
    stock vLLM's own checks ask for and the plugin (a V1 runner) refuses at start."""
    import types

    from vllm import SamplingParams

    from neuron_constrain.vllm.validate import RequestValidator

    case = CASES[field]
    params = SamplingParams(**case.engine)
    if case.refused:
        from vllm.config import VllmConfig
        from vllm.exceptions import VLLMValidationError
        from vllm.v1.engine.input_processor import InputProcessor

        from neuron_constrain.vllm.config import ConfigError, check_config

        with pytest.raises(ConfigError, match="VLLM_USE_V2_MODEL_RUNNER=0"):
            check_config(types.SimpleNamespace(speculative_config=None, use_v2_model_runner=True,
                                               parallel_config=types.SimpleNamespace(pipeline_parallel_size=1)))
        v1 = types.SimpleNamespace(use_v2_model_runner=False, model_config=types.SimpleNamespace(
            enable_trace_replay=True))
        if field == "trace_decode_token_ids":  # --enable-trace-replay, which the request needs, on V1
            with pytest.raises(ValueError, match="trace replay requires Model Runner V2"):
                VllmConfig._verify_trace_replay_config(v1)
        else:  # vLLM's admission check itself (its generic params.verify skipped: not what is tested)
            monkeypatch.setattr(SamplingParams, "verify", lambda *args, **kwargs: None)
            with pytest.raises(VLLMValidationError, match="requires the V2 model runner"):
                InputProcessor._validate_params(types.SimpleNamespace(vllm_config=v1, model_config=None,
                    speculative_config=None, structured_outputs_config=None, tokenizer=None), params, ("generate",))
        return
    RequestValidator.validate_params(params)
    plain = SamplingParams(**{k: v for k, v in case.engine.items() if k == "stop"})
    assert _needs(params) == _needs(plain)


def _needs(params) -> tuple:
    import torch

    from neuron_constrain.vllm.batch_layout import request_needs
    from neuron_constrain.vllm.head import HeadPrograms

    head = HeadPrograms(torch.zeros(64, 4), None, vocab_size=64, buckets=[1], eos_token_id=2, max_stop_tokens=4,
                        max_bias_tokens=4, max_penalty_tokens=8)
    needs = request_needs(params, [1, 2, 3], head, None)
    rows = needs.rows
    return (needs.wide, needs.bans, rows.min_tokens, rows.stops, rows.bias_ids, rows.min_p, rows.temperature,
            rows.penalties, rows.thinking_budget)
