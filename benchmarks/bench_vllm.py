"""Output tokens/s of one request mix through vLLM's OpenAI server: the plugin vs stock
vLLM CPU (plugin off), unstructured and structured, measured side by side in one run.

    .venv-vllm/bin/python benchmarks/bench_vllm.py [--rounds 3] [--requests 32]

Both servers run at once on the tiny model (same flags); rounds interleave the four
cells (stock/plugin x unstructured/structured) so machine noise hits all alike. Prints
the table and writes benchmarks/results/bench_vllm.json.
"""
from __future__ import annotations

import argparse
import asyncio
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


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench_vllm_"))
    servers = {}
    try:
        servers["stock"] = Server("stock", plugin=False, tmp=tmp)
        servers["plugin"] = Server("plugin", tmp=tmp)
        cells = {(s, st): [] for s in servers for st in ("unstructured", "structured")}
        for (s, st) in cells:  # warm-up round (grammar compilation caches, first batches)
            asyncio.run(run(servers[s], mix(8, st == "structured", 16)))
        for _ in range(args.rounds):
            for (s, st) in cells:
                tokens, seconds = asyncio.run(run(servers[s], mix(args.requests, st == "structured", args.max_tokens)))
                cells[(s, st)].append(tokens / seconds)
        metrics = servers["plugin"].metrics()
    finally:
        for server in servers.values():
            server.stop()
    tps = {f"{s}/{st}": statistics.median(v) for (s, st), v in cells.items()}
    results = {
        "output_tokens_per_s": tps,
        "all_rounds": {f"{s}/{st}": v for (s, st), v in cells.items()},
        "plugin_over_stock_unstructured": tps["plugin/unstructured"] / tps["stock/unstructured"],
        "plugin_over_stock_structured": tps["plugin/structured"] / tps["stock/structured"],
        "plugin_structured_over_unstructured": tps["plugin/structured"] / tps["plugin/unstructured"],
        "target_plugin_over_stock": 0.95,
        "plugin_compilations_after_warmup": metrics["compilations_after_warmup"],
        "requests_per_round": args.requests, "max_tokens": args.max_tokens, "rounds": args.rounds,
        "max_num_seqs": 8,
    }
    for name, value in tps.items():
        print(f"{name:24s} {value:8.1f} output tokens/s")
    for key in ("plugin_over_stock_unstructured", "plugin_over_stock_structured", "plugin_structured_over_unstructured"):
        print(f"{key:36s} {results[key]:.3f}")
    write_results(results, str(ROOT / "benchmarks" / "results" / "bench_vllm.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
