"""Large and hostile constraints against the plugin's vLLM server while ordinary requests flow.

    .venv-vllm/bin/python benchmarks/bench_hostile.py [--rounds 2] [--ordinary 16] [--model tiny] [--raised]

One plugin server (the tiny model unless ``--model smollm2``). Per round: ordinary requests
alone (``--ordinary`` of them, two at a time, each with a new small schema, so each needs its
own verdict and grammar), then the storm: every class of ``neuron_constrain.testing.hostile``
sent at once, with this file's ``EXTRA`` classes (nested bounded repetitions as a regex and as a JSON
``pattern``, a large alternation of literals), while the ordinary flow goes on until the last
hostile answer. Reported: each
hostile request's outcome (a 4xx and its message, or the answer and whether its constraint
accepts it) and seconds; ordinary requests' worst latency alone and during the storm and their
ratio (the bar: storm <= 2 x alone + 1 s); the first structured request after the start (the bar:
<= 1 s); the server's memory (the proportional set size of
its process group) before, at the storm's peak and after (the bar: growth <= 512 MiB); and, once the server is stopped,
any process of its group still alive (the bar: none). Round 2 sends the same hostile requests
again: their verdicts are cached, so it shows the steady state. ``--raised`` starts the server
with the structural limits raised past every class (``RAISED``), so the hostile constraints
reach the compilations: what it shows is the second line, the time and memory limits (a
compilation killed at ``compile_seconds``: a 400 at admission, or the request failed alone in
the engine core), and ordinary traffic beside it; its hostile outcomes are reported, not judged.

Prints a table and writes benchmarks/results/bench_hostile.json.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "vllm"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from conftest import Server  # noqa: E402  (the tests' server helper)
from storm import group_memory_mb, group_processes, judge, ordinary_alone, storm  # noqa: E402
from timing import write_results  # noqa: E402

from neuron_constrain.testing.hostile import hostile_constraints  # noqa: E402

RAISED = ("spec_bytes=10000000,nodes=100000,enum_values=100000,properties=10000,branches=1000,repeat=10000000,"
          "pattern_chars=300000,number_digits=400,answer_chars=100000000")
ANSWER_BOUND = 5.0  # seconds: every hostile request answered within this
MEMORY_BOUND = 512.0  # MiB: the server's memory growth over a round
FIRST_BOUND = 1.0  # seconds: the first structured request after the server starts
NESTED = "((([a-z]{1,20}){1,20}){1,20}){1,5}"  # passed every limit once: one xgrammar fill 9.9 s
# Classes beside neuron_constrain.testing.hostile's: nested bounded repetitions (a regex, a JSON pattern)
# and a large alternation of literals within pattern_chars (admitted: it must answer, valid).
EXTRA = {
    "nested_bounded_repeats": ("regex", NESTED),
    "nested_pattern": ("json", json.dumps({"type": "object", "properties": {"code": {"type": "string",
                                           "pattern": f"^{NESTED}$"}}, "required": ["code"]})),
    "literal_alternation": ("regex", "(" + "|".join(f"w{i:03d}x" for i in range(680)) + ")"),
}
RATIO_BOUND = 2.0  # ordinary worst during the storm <= RATIO_BOUND x alone + SLACK
SLACK = 1.0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--ordinary", type=int, default=16, help="ordinary requests measured alone per round")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--raised", action="store_true", help="structural limits raised past every class")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_hostile.json"))
    args = parser.parse_args(argv)
    constraints = {**hostile_constraints(), **EXTRA}
    folder = pathlib.Path(tempfile.mkdtemp(prefix="bench-hostile-"))
    env = {"NEURON_CONSTRAIN_LIMITS": RAISED} if args.raised else None
    server = Server("hostile", tmp=folder, model=args.model, env=env)
    pgid = server.proc.pid
    rounds, ok = [], True
    try:
        warm = ordinary_alone(server, 4, start=-1000)  # warm: the first requests of a fresh server pay its start-up
        first = warm[0].seconds
        for index in range(args.rounds):
            before = group_memory_mb(pgid)
            alone = ordinary_alone(server, args.ordinary, start=index * 100_000)
            result = storm(server, constraints, start=index * 100_000 + 50_000, sample=lambda: group_memory_mb(pgid))
            time.sleep(2)
            after = group_memory_mb(pgid)
            row = summarize(index, constraints, alone, result, before, after, judged=not args.raised)
            rounds.append(row)
            ok &= row["pass"]
        server_alive = server.alive()
    finally:
        server.stop()
    time.sleep(1)
    left = group_processes(pgid)
    ok &= server_alive and not left and first <= FIRST_BOUND
    results = {"model": args.model, "raised": args.raised, "classes": len(constraints), "rounds": rounds,
               "first_request_s": round(first, 3), "first_bound_s": FIRST_BOUND, "memory_bound_mb": MEMORY_BOUND,
               "server_alive": server_alive, "processes_left_after_stop": left, "answer_bound_s": ANSWER_BOUND, "ratio_bound": RATIO_BOUND,
               "slack_s": SLACK, "pass": ok}
    report(results)
    write_results(results, args.out)
    return 0 if ok else 1


def summarize(index, constraints, alone, result, before, after, judged: bool = True) -> dict:
    hostile = {}
    for name, outcome in result.hostile.items():
        why = judge(*constraints[name], outcome)
        hostile[name] = {"status": outcome.status, "seconds": round(outcome.seconds, 3),
                         "finish_reason": outcome.finish_reason, "ok": why is None and outcome.seconds <= ANSWER_BOUND,
                         "why": why, "message": outcome.message[-240:] if outcome.message else outcome.text[:120]}
    alone_worst = max(o.seconds for o in alone)
    storm_worst = max((o.seconds for o in result.ordinary), default=0.0)
    failed_ordinary = [o.message[:200] for o in alone + result.ordinary if o.status != 200]
    row = {
        "round": index, "hostile": hostile, "storm_seconds": round(result.seconds, 3),
        "ordinary_alone_worst_s": round(alone_worst, 3), "ordinary_storm_worst_s": round(storm_worst, 3),
        "ordinary_ratio": round(storm_worst / alone_worst, 3), "ordinary_during_storm": len(result.ordinary),
        "ordinary_failed": failed_ordinary, "memory_before_mb": round(before, 1),
        "memory_peak_mb": round(result.peak_memory_mb, 1), "memory_after_mb": round(after, 1),
        "memory_growth_mb": round(after - before, 1), "memory_peak_growth_mb": round(result.peak_memory_mb - before, 1),
    }
    row["pass"] = ((all(h["ok"] for h in hostile.values()) or not judged) and not failed_ordinary
                   and storm_worst <= RATIO_BOUND * alone_worst + SLACK and row["memory_growth_mb"] <= MEMORY_BOUND)
    return row


def report(results: dict) -> None:
    for row in results["rounds"]:
        print(f"round {row['round']}: storm {row['storm_seconds']:.1f} s")
        print(f"  {'class':22s} {'status':>6s} {'seconds':>8s}  outcome")
        for name, h in row["hostile"].items():
            what = "ok" if h["ok"] else f"FAILED: {h['why']}"
            print(f"  {name:22s} {h['status']:>6d} {h['seconds']:8.2f}  {what}  {h['message'][:110]!r}")
        print(f"  ordinary worst: alone {row['ordinary_alone_worst_s']:.2f} s, storm {row['ordinary_storm_worst_s']:.2f} "
              f"s ({row['ordinary_during_storm']} requests), ratio {row['ordinary_ratio']:.2f} (bar: <= "
              f"{results['ratio_bound']:g} x alone + {results['slack_s']:g} s); failed: {len(row['ordinary_failed'])}")
        print(f"  memory (PSS of the server's processes): before {row['memory_before_mb']:.0f} MiB, peak "
              f"{row['memory_peak_mb']:.0f}, after {row['memory_after_mb']:.0f} (growth {row['memory_growth_mb']:+.0f}, "
              f"peak {row['memory_peak_growth_mb']:+.0f})")
    print(f"first structured request after start: {results['first_request_s']:.2f} s (bar: <= "
          f"{results['first_bound_s']:g} s); memory growth bar: <= {results['memory_bound_mb']:g} MiB")
    print(f"server alive after the storms: {results['server_alive']}; processes left after stop: "
          f"{results['processes_left_after_stop'] or 'none'}; pass: {results['pass']}")


if __name__ == "__main__":
    sys.exit(main())
