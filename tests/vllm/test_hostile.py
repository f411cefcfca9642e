"""Bounded work per request through the plugin's server: a storm of large and hostile constraints
(``neuron_constrain.testing.hostile``, 17 classes) sent at once while ordinary requests flow, on the
shared plugin server. Each hostile request is answered within 30 s, with a 400 that names the limit
(and the ``--limit`` flag that raises it) or the problem, or with an answer its constraint accepts;
every ordinary request is answered and valid; no compilation is left running afterwards. The
latency ratio and memory are ``benchmarks/bench_hostile.py``'s to measure (printed here)."""
from __future__ import annotations

import json
import time

import pytest

from storm import (HOSTILE_MAX_TOKENS, ORDINARY_MAX_TOKENS, Outcome, body, group_memory_mb, group_processes, judge,
                   ordinary_alone, storm)

from neuron_constrain.testing.hostile import hostile_constraints, ordinary_schema
from neuron_constrain.vllm import policy

ANSWER_BOUND = 30.0
AMBIGUOUS = 'root ::= s\ns ::= s s | s s s | "a" | "aa" | ""\n'


def _compile_workers(pgid: int) -> dict[int, float]:
    """The server's fork-server processes (the compile workers and their fork servers): pid -> CPU seconds."""
    out = {}
    for pid in group_processes(pgid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                if b"multiprocessing.forkserver" not in cmdline.read():
                    continue
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            out[pid] = (int(fields[11]) + int(fields[12])) / 100
        except OSError:
            continue
    return out


def test_a_storm_of_hostile_constraints_is_answered_while_ordinary_traffic_flows(plugin_server):
    server, constraints = plugin_server, hostile_constraints()
    assert len(constraints) >= 12
    pgid = server.proc.pid
    alone = ordinary_alone(server, 6, start=-500)
    before = group_memory_mb(pgid)
    result = storm(server, constraints, sample=lambda: group_memory_mb(pgid))
    problems = {name: judge(*constraints[name], outcome) for name, outcome in result.hostile.items()}
    assert not {n: p for n, p in problems.items() if p}, problems
    slow = {n: round(o.seconds, 1) for n, o in result.hostile.items() if o.seconds > ANSWER_BOUND}
    assert not slow, slow
    refused = {n: o.message for n, o in result.hostile.items() if o.status == 400}
    assert "--limit depth=N" in refused["deep_object"] and "--limit branches=N" in refused["wide_any_of"]
    assert "cycle with no base case" in refused["ref_cycle"] and "admits no value" in refused["contradictory_bounds"]
    # no answer fits the request's max_tokens: refused, not cut
    for name in ("long_min_length", "many_min_items", "long_regex_match"):
        assert f"max_tokens={HOSTILE_MAX_TOKENS} cannot hold any answer" in refused[name], refused.get(name)
    for outcome in alone + result.ordinary:  # every ordinary request answered, and valid
        assert outcome.status == 200, outcome.message
    assert result.ordinary, "no ordinary request went through during the storm"
    worst_alone, worst_storm = max(o.seconds for o in alone), max(o.seconds for o in result.ordinary)
    print(f"\nordinary worst: alone {worst_alone:.2f} s, during the storm {worst_storm:.2f} s "
          f"({len(result.ordinary)} requests); memory {before:.0f} -> peak {result.peak_memory_mb:.0f} MiB")
    # nothing left running: every compile worker is idle (a killed one is gone, none still compiles)
    first = _compile_workers(pgid)
    time.sleep(2)
    busy = {pid: cpu - first[pid] for pid, cpu in _compile_workers(pgid).items() if pid in first and cpu - first[pid] > 0.5}
    assert not busy, busy
    assert len(first) <= 2 + 2 * policy.VERDICT_PROCESSES, first  # fork servers and workers (API server, engine)
    assert server.alive()


def test_a_fill_past_its_per_token_budget_ends_that_request_alone(plugin_server):
    """An ambiguous grammar steered down its costliest path (logit_bias on "a"): its fill grows with
    every token until it passes the server's budget (fill_ms, 50 ms, on 3 tokens in a row); the request ends there,
    where the grammar may end, with an answer it accepts; an ordinary request beside it is served."""
    server = plugin_server
    client = server.client()
    from transformers import AutoTokenizer

    a = AutoTokenizer.from_pretrained(server.model).convert_tokens_to_ids("a")
    before = server.engine_metrics().get("budget_ended", 0)
    r = client.completions.create(model=server.name, prompt="Answer:", max_tokens=400, temperature=0,
                                  logit_bias={str(a): 100}, extra_body=body("grammar", AMBIGUOUS))
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and r.usage.completion_tokens < 400, (choice, r.usage)
    assert policy.violation(policy.from_vllm("grammar", AMBIGUOUS), choice.text) is None
    assert server.engine_metrics()["budget_ended"] == before + 1
    ordinary = client.completions.create(model=server.name, prompt="Answer:", max_tokens=ORDINARY_MAX_TOKENS,
                                         temperature=0, extra_body=body("json", json.dumps(ordinary_schema(3))))
    assert ordinary.choices[0].finish_reason in ("stop", "length")


def test_the_verdict_names_the_limit_and_never_recurses():
    """The frontend's checks with no server: a schema 10,000 levels deep (as a dict, vLLM's form) and
    each kind past a limit get a 400 naming it; nothing raises RecursionError."""
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import StructuredOutputsParams

    from neuron_constrain.vllm.admission import verdict

    deep: dict = {"type": "integer"}
    for _ in range(10_000):
        deep = {"type": "object", "properties": {"a": deep}}
    limits = policy.server_limits()
    for so, limit in [(StructuredOutputsParams(json=deep), "depth"),
                      (StructuredOutputsParams(json='{"items":' * 10_000 + "{}" + "}" * 10_000), "depth"),
                      (StructuredOutputsParams(choice=[f"c{i}" for i in range(5000)]), "enum_values"),
                      (StructuredOutputsParams(regex="a{1,9}" * 1000), "pattern_chars")]:
        with pytest.raises(VLLMValidationError) as info:
            verdict(so, limits)
        assert f"--limit {limit}=N" in str(info.value), str(info.value)


def test_launcher_limit_flags_reach_the_server_environment():
    from neuron_constrain.vllm.serve import limits_environment

    env = limits_environment(["enum_values=10000", "fill_ms=80"])
    assert policy.LIMITS_ENV in env
    with pytest.raises(SystemExit, match="name one of"):
        limits_environment(["enums=3"])


def test_outcomes_are_judged_strictly():
    kind, spec = "json", json.dumps(ordinary_schema(0))
    assert judge(kind, spec, Outcome(200, 0.1, '{"name0":"ab","count":3}', finish_reason="stop")) is None
    assert judge(kind, spec, Outcome(200, 0.1, '{"name0":"ab"', finish_reason="length"))
    assert judge(kind, spec, Outcome(400, 0.1, message="Bad Request")) is not None  # names nothing
    assert judge(kind, spec, Outcome(500, 0.1, message="Internal server error"))
