"""Output tokens/s of one request mix through vLLM's OpenAI server: the plugin vs stock
vLLM CPU (plugin off), unstructured and structured, measured side by side in one run.

    .venv-vllm/bin/python benchmarks/bench_vllm.py [--rounds 20] [--requests 32] [--max-tokens 64]
                                                   [--structured-repeat 3]

Both servers run for the whole benchmark on the tiny model (same flags), but only one is
driven at a time. A server that just finished a cell is not idle at once: vLLM's worker
busy-polls its shared-memory queue for 1 s after its last message (``SpinCondition``,
``busy_loop_s=1``), a whole core on this 2-core machine. So before each cell the bench
waits until the server measured last has gone quiet (``settle``); the CPU the other
server still uses during a cell is reported as ``idle_server_cpu_fraction``. Each round
runs the four cells (stock/plugin x unstructured/structured) with stock and plugin back
to back per structure, alternating which goes first (ABBA), so a noise burst hits one
round's pair alike. Structured outputs are short (a choice is 1-2 tokens): a structured
cell sends the same mix ``--structured-repeat`` times as many requests so that it lasts
seconds, not one. Reported: the median of each cell over rounds, the ratio of those
medians, and the median of the per-round paired ratios with its quartiles — the paired
median is the robust number on a noisy machine. Prints the table and writes
benchmarks/results/bench_vllm.json. The default takes ~8-10 minutes on 2 cores.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "vllm"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from conftest import Server  # noqa: E402  (the tests' server fixture helper)
from checks import CHOICES, REGEX, SCHEMAS  # noqa: E402
from timing import write_results  # noqa: E402

STRUCTURES = ("unstructured", "structured")


def mix(n: int, structured: bool, max_tokens: int):
    samplers = [dict(temperature=0), dict(temperature=0.8, top_p=0.9), dict(temperature=1.0, extra_body={"top_k": 40}),
                dict(temperature=0, frequency_penalty=0.5)]
    constraints = [{"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMAS["person"]}}},
                   {"extra_body": {"structured_outputs": {"regex": REGEX}}},
                   {"extra_body": {"structured_outputs": {"json": SCHEMAS["palette"]}}},
                   {"extra_body": {"structured_outputs": {"choice": CHOICES}}}]
    out = []
    for i in range(n):
        kw = {k: (dict(v) if isinstance(v, dict) else v) for k, v in samplers[i % len(samplers)].items()}
        body = kw.pop("extra_body", {})
        if structured:
            c = constraints[(i // len(samplers)) % len(constraints)]
            body = {**body, **c.get("extra_body", {})}
            if "response_format" in c:
                kw["response_format"] = c["response_format"]
        else:
            body = {**body, "ignore_eos": True}
        kw.update(messages=[{"role": "user", "content": f"Request {i}."}], max_tokens=max_tokens, extra_body=body)
        out.append(kw)
    return out


async def run(server, requests) -> tuple[int, float]:
    client = server.async_client()
    start = time.perf_counter()
    try:
        results = await asyncio.gather(*(client.chat.completions.create(model="tiny", **kw) for kw in requests))
    finally:
        await client.close()
    return sum(r.usage.completion_tokens for r in results), time.perf_counter() - start


def group_cpu_seconds(pgid: int) -> float:
    """CPU seconds (user + system) used so far by the processes of one server's process group."""
    total = 0
    for proc in pathlib.Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def settle(server, *, quiet: float = 0.05, window: float = 0.25, limit: float = 10.0) -> float:
    """Wait until ``server`` uses under ``quiet`` of a core over a ``window``; returns seconds waited."""
    start = time.perf_counter()
    while time.perf_counter() - start < limit:
        cpu = group_cpu_seconds(server.proc.pid)
        time.sleep(window)
        if group_cpu_seconds(server.proc.pid) - cpu < quiet * window:
            break
    return time.perf_counter() - start


def quartiles(values: list[float]) -> list[float]:
    if len(values) < 2:
        return [values[0]] * 3
    q = statistics.quantiles(values, n=4, method="inclusive")
    return [q[0], q[1], q[2]]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--structured-repeat", type=int, default=3,
                        help="a structured cell sends this many times --requests (the same mix, repeated)")
    args = parser.parse_args()
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench_vllm_"))
    servers = {}
    began = time.perf_counter()
    try:
        servers["stock"] = Server("stock", plugin=False, tmp=tmp)
        servers["plugin"] = Server("plugin", tmp=tmp)
        cells = {(s, st): [] for s in servers for st in STRUCTURES}
        tokens_per_cell = {key: [] for key in cells}
        idle_cpu = {s: [0.0, 0.0] for s in servers}  # CPU seconds of the idle server, wall seconds
        settle_seconds = []
        n_requests = {"unstructured": args.requests, "structured": args.requests * args.structured_repeat}
        for (s, st) in cells:  # warm-up (grammar compilation caches, first batches of every bucket)
            for _ in range(2):
                asyncio.run(run(servers[s], mix(args.requests, st == "structured", 16)))
        metrics_before = servers["plugin"].metrics()
        loadavg = []
        last = "plugin"
        for r in range(args.rounds):
            order = ("stock", "plugin") if r % 2 == 0 else ("plugin", "stock")
            for st in STRUCTURES:
                for s in order:
                    other = "plugin" if s == "stock" else "stock"
                    if last != s:  # the server measured before is still busy-polling: wait it out
                        settle_seconds.append(settle(servers[last]))
                    last = s
                    cpu0 = group_cpu_seconds(servers[other].proc.pid)
                    tokens, seconds = asyncio.run(run(servers[s], mix(n_requests[st], st == "structured",
                                                                      args.max_tokens)))
                    idle_cpu[other][0] += group_cpu_seconds(servers[other].proc.pid) - cpu0
                    idle_cpu[other][1] += seconds
                    cells[(s, st)].append(tokens / seconds)
                    tokens_per_cell[(s, st)].append(tokens)
            loadavg.append(os.getloadavg()[0])
            print(f"round {r + 1}/{args.rounds}: " + "  ".join(
                f"{s}/{st} {cells[(s, st)][-1]:6.1f}" for (s, st) in cells), flush=True)
        metrics = servers["plugin"].metrics()
    finally:
        for server in servers.values():
            server.stop()
    tps = {f"{s}/{st}": statistics.median(v) for (s, st), v in cells.items()}
    paired = {
        "plugin_over_stock_unstructured": [p / q for p, q in zip(cells[("plugin", "unstructured")],
                                                                 cells[("stock", "unstructured")])],
        "plugin_over_stock_structured": [p / q for p, q in zip(cells[("plugin", "structured")],
                                                               cells[("stock", "structured")])],
        "plugin_structured_over_unstructured": [p / q for p, q in zip(cells[("plugin", "structured")],
                                                                      cells[("plugin", "unstructured")])],
    }
    steps = metrics["steps"] - metrics_before["steps"]
    results = {
        "output_tokens_per_s": tps,
        "all_rounds": {f"{s}/{st}": v for (s, st), v in cells.items()},
        "plugin_over_stock_unstructured": tps["plugin/unstructured"] / tps["stock/unstructured"],
        "plugin_over_stock_structured": tps["plugin/structured"] / tps["stock/structured"],
        "plugin_structured_over_unstructured": tps["plugin/structured"] / tps["plugin/unstructured"],
        "paired_median": {k: statistics.median(v) for k, v in paired.items()},
        "paired_quartiles": {k: quartiles(v) for k, v in paired.items()},
        "paired_all_rounds": paired,
        "output_tokens_per_cell_median": {f"{s}/{st}": statistics.median(v) for (s, st), v in tokens_per_cell.items()},
        "target_plugin_over_stock": 0.95,
        "plugin_compilations_after_warmup": metrics["compilations_after_warmup"],
        "plugin_host_ms_per_step": {
            part: 1e3 * (metrics.get(key, 0.0) - metrics_before.get(key, 0.0)) / max(steps, 1)
            for part, key in (("fill_inputs", "fill_seconds"), ("head_program", "head_seconds"))
        },
        "idle_server_cpu_fraction": {s: c / w if w else 0.0 for s, (c, w) in idle_cpu.items()},
        "loadavg_1min_per_round": loadavg,
        "settle_seconds_median": statistics.median(settle_seconds) if settle_seconds else 0.0,
        "requests_per_round": args.requests, "max_tokens": args.max_tokens, "rounds": args.rounds,
        "requests_per_cell": n_requests,
        "order": "per round and structure, stock and plugin back to back, first one alternating (ABBA)",
        "one_server_driven_at_a_time": True,
        "max_num_seqs": 8,
        "wall_seconds": time.perf_counter() - began,
    }
    print(f"{'cell':24s} {'median tok/s':>12s}   rounds: {args.rounds}")
    for name, value in tps.items():
        print(f"{name:24s} {value:12.1f}")
    print(f"{'ratio':36s} {'of medians':>10s} {'paired median':>14s} {'paired q1..q3':>16s}")
    for key in paired:
        q = results["paired_quartiles"][key]
        print(f"{key:36s} {results[key]:10.3f} {results['paired_median'][key]:14.3f}   {q[0]:.3f}..{q[2]:.3f}")
    host = results["plugin_host_ms_per_step"]
    print(f"plugin host ms/step: fill inputs {host['fill_inputs']:.3f}, head program {host['head_program']:.3f}; "
          f"idle server CPU {', '.join(f'{s} {v:.1%}' for s, v in results['idle_server_cpu_fraction'].items())}")
    write_results(results, str(ROOT / "benchmarks" / "results" / "bench_vllm.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
