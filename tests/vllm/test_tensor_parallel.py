"""Tensor parallelism: ``--tensor-parallel-size 2`` on this 2-core machine (one core per rank, the
thread binding set by the launcher), the head program on every rank; greedy equals TP 1, no
program built after warm-up on either rank."""
from __future__ import annotations

import pytest

from checks import CHOICES, REGEX, SCHEMAS, check
from neuron_constrain.vllm.serve import environment, tensor_parallel_size, thread_binding
from traffic import assert_logprobs_match, choices, token_ids

TP2 = ["--tensor-parallel-size", "2"]


def test_launcher_binds_one_cpu_group_per_rank(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    assert tensor_parallel_size(TP2) == 2 and tensor_parallel_size(["-tp=4"]) == 4 and tensor_parallel_size([]) == 1
    assert thread_binding(2, [0, 1]) == "0|1"
    assert thread_binding(2, [0, 1, 2, 3]) == "0,1|2,3"
    env = environment({}, vllm_args=TP2)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == thread_binding(2)
    assert "VLLM_CPU_OMP_THREADS_BIND" not in environment({}, vllm_args=[])
    assert environment({"VLLM_CPU_OMP_THREADS_BIND": "nobind"}, vllm_args=TP2)["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    with pytest.raises(ValueError, match="needs at least 4 CPUs"):
        thread_binding(4, [0, 1])


@pytest.fixture(scope="module")
def tp2(start_server):
    return start_server("plugin-tp2", extra=TP2)


def _requests():
    msg = [{"role": "user", "content": "Answer."}]
    reqs = [("completion", dict(prompt=p, max_tokens=24, temperature=0))
            for p in ["Hello", "The capital of France is", "1, 2, 3,", "def f(x):"]]
    reqs += [
        ("chat", dict(messages=msg, max_tokens=48, temperature=0, response_format={"type": "json_schema", "json_schema": {
            "name": "point", "schema": SCHEMAS["point"]}})),
        ("chat", dict(messages=msg, max_tokens=32, temperature=0, extra_body={"structured_outputs": {"regex": REGEX}})),
        ("chat", dict(messages=msg, max_tokens=8, temperature=0, extra_body={"structured_outputs": {"choice": CHOICES}})),
        ("chat", dict(messages=msg, max_tokens=24, temperature=0, presence_penalty=0.5,
                      extra_body={"repetition_penalty": 1.2, "min_tokens": 6})),
    ]
    return reqs


def test_tp2_greedy_equals_tp1(tp2, plugin_server):
    reqs = _requests()
    expected, got = token_ids(plugin_server, reqs), token_ids(tp2, reqs)
    assert all(got)
    assert got == expected, [(i, e, g) for i, (e, g) in enumerate(zip(expected, got)) if e != g]
    for (kind, spec), choice in zip([("json", SCHEMAS["point"]), ("regex", REGEX), ("choice", CHOICES)],
                                    choices(tp2, reqs[4:7])):
        check(kind, spec, choice.message.content, choice.finish_reason)


def test_tp2_logprobs_equal_tp1(tp2, plugin_server):
    reqs = [("completion", dict(prompt="Once upon a time", max_tokens=12, temperature=0, logprobs=4))]
    assert assert_logprobs_match(choices(plugin_server, reqs)[0], choices(tp2, reqs)[0]) == 12


def test_every_rank_runs_the_head_without_recompiling(tp2):
    reqs = [("chat", dict(messages=[{"role": "user", "content": f"Request {i}"}], max_tokens=16, temperature=0.8,
                          top_p=0.9, extra_body={"structured_outputs": {"json": SCHEMAS["palette"]}}))
            for i in range(12)]
    for choice in choices(tp2, reqs):
        check("json", SCHEMAS["palette"], choice.message.content, choice.finish_reason)
    ranks = [tp2.metrics(), tp2.metrics(rank=1)]
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["tensor_parallel_size"] == 2 for r in ranks)
    for r in ranks:
        assert r["compilations_after_warmup"] == 0 and r["compilations"] == 2 * len(r["buckets"]), r
        assert r["constrained_rows"] > 0 and r["sampled_rows"] > 0
    assert ranks[0]["steps"] == ranks[1]["steps"] and ranks[0]["rows"] == ranks[1]["rows"]
    for group in thread_binding(2).split("|"):  # the launcher's binding: one CPU group per rank
        assert f"core ids={[int(c) for c in group.split(',')]}" in tp2.log()
