"""Replacement-tap cost on a real GPT-OSS decode step (router taps on every layer).

    .venv/bin/python benchmarks/bench_taps.py [--quick] [--backends eager,inductor] [--out PATH]

The step (``decode_steps.py``): one token per row over a static KV cache (HF's hybrid
cache for GPT-OSS's sliding layers), Llama-3's vocabulary (128256), hidden 1024, 8
layers (4 small experts: ``batched_mm`` gathers one expert weight copy per token),
greedy in-graph, batch 8 and 64, eager and inductor. Three candidates on the same
inputs, interleaved rep by rep: the untransformed step, the tapped step with every
tap off, and with every row of every tap replaced (a context of reference router
logits, as ``TensorReplacer.build_context`` makes). Also timed: feeding that context
(the host part of a tapped call), as a fraction of the step.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import neuron_constrain as nc
from neuron_constrain.replacement import active_context
from neuron_constrain.testing import CachedGreedyStep
from neuron_constrain.core.transform import strip_added_outputs
from decode_steps import SMALL, compiled, decoder
from timing import interleaved, median_ms, ratio, write_results

ROUTER = "model.layers.*.mlp.router"
MOE = dict(vocab_size=128256, hidden_size=1024, layers=8, intermediate_size=256, num_local_experts=4)
QUICK = dict(SMALL, intermediate_size=64)


def measure(model, batch: int, backend: str, reps: int) -> dict:
    step = CachedGreedyStep(model, batch_size=batch, max_cache_len=128)
    args = (step.example_inputs(model.config.vocab_size)[0], torch.tensor([16]))
    with torch.no_grad():
        program = torch.export.export(step, args)
    tapped = nc.transform(step, args, logit_mask=None, taps=[ROUTER])
    sites = tapped.report["taps"].sites
    experts = model.config.num_local_experts
    generator = torch.Generator().manual_seed(0)
    context = {s["tap"]: torch.randn(batch, experts, generator=generator) for s in sites}
    plain = compiled(program.module(), backend)
    graph = compiled(tapped.graph_module, backend)

    def taps(ctx):
        def run():
            with active_context(ctx):
                kwargs = tapped._with_added_inputs(args, {})  # feeds the tap inputs from the context
                return strip_added_outputs(graph(*args, **kwargs), tapped.report)
        return run

    with active_context(context):
        fed = tapped._with_added_inputs(args, {})
    flags = [v for v in fed.values() if isinstance(v, torch.Tensor) and v.dtype == torch.bool]
    if len(flags) != len(sites) or not all(bool(f.all()) for f in flags):
        raise RuntimeError("the context does not enable every tap: the taps_on candidate would measure taps off")
    runs = {"untransformed": lambda: plain(*args), "taps_off": taps(None), "taps_on": taps(context)}
    times = interleaved(runs, reps, warmup=2)
    feed = []
    for _ in range(reps):
        start = time.perf_counter()
        with active_context(context):
            tapped._with_added_inputs(args, {})
        feed.append(time.perf_counter() - start)
    ms = median_ms(times)
    return {
        "batch": batch, "backend": backend, "taps": len(sites), "ms": ms,
        "taps_off/untransformed": ratio(times, "taps_off", "untransformed"),
        "taps_on/untransformed": ratio(times, "taps_on", "untransformed"),
        "feed_context_ms": 1e3 * statistics.median(feed),
        "feed_context/step": 1e3 * statistics.median(feed) / ms["taps_on"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a 2-layer 1024-token model, fewer repetitions")
    parser.add_argument("--backends", default="eager,inductor")
    parser.add_argument("--out", default="benchmarks/results/bench_taps.json")
    args = parser.parse_args()
    config, reps = (QUICK, 10) if args.quick else (MOE, 20)
    model = decoder("gpt_oss", **config)
    rows = [measure(model, batch, backend, reps) for backend in args.backends.split(",") for batch in (8, 64)]
    print(f"GPT-OSS decode step {config}, router taps on every layer, 1 token/row, static cache 128")
    print(f"{'backend':9} {'batch':>5} {'untr ms':>8} {'off ms':>8} {'on ms':>8} {'off/untr':>8} {'paired':>6} "
          f"{'on/untr':>8} {'paired':>6} {'feed ms':>7}")
    for r in rows:
        ms, off, on = r["ms"], r["taps_off/untransformed"], r["taps_on/untransformed"]
        print(f"{r['backend']:9} {r['batch']:5d} {ms['untransformed']:8.2f} {ms['taps_off']:8.2f} {ms['taps_on']:8.2f} "
              f"{off['ratio_median']:8.3f} {off['paired']:6.3f} {on['ratio_median']:8.3f} {on['paired']:6.3f} "
              f"{r['feed_context_ms']:7.3f}")
    write_results({"config": config, "steps": rows}, args.out)


if __name__ == "__main__":
    main()
