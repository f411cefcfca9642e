"""Replacement-tap cost on a GPT-OSS decoder step (full recompute, router taps on every layer).

    .venv/bin/python benchmarks/bench_taps.py [--quick] [--out PATH]

Three candidates run the same exported program type on the same tokens, interleaved:
the untransformed program, the tapped program with every tap off, and with every row
replaced from a context built by ``TensorReplacer``. Also timed: building that
context on the host (``build_context``), as a fraction of the step.
"""
from __future__ import annotations

import argparse
import time

import torch

import neuron_constrain as nc
from neuron_constrain.replacement import TensorReplacer, active_context, capture
from neuron_constrain.testing import LogitsStep, random_ids, tiny_decoder
from timing import interleaved, median_ms, ratio, write_results

ROUTER = "model.layers.*.mlp.router"


def run(reps: int, batch: int, seq: int, **config) -> dict:
    model = tiny_decoder("gpt_oss", **config)
    ids = random_ids(batch, seq, config["vocab_size"])
    with torch.no_grad():
        program = torch.export.export(LogitsStep(model), (ids,))
    tapped = nc.transform(LogitsStep(model), (ids,), logit_mask=None, taps=[ROUTER])
    plain = program.module()
    prompts = ids.tolist()
    replacer = TensorReplacer(capture(LogitsStep(model), prompts, [ROUTER]), prompts)
    req_ids = [f"r{i}" for i in range(batch)]
    for req, prompt in zip(req_ids, prompts):
        replacer.register_request(req, prompt)
    positions = list(range(seq)) * batch
    context = replacer.build_context(req_ids, positions, tokens_per_req=seq)

    def replaced():
        with active_context(context):
            return tapped(ids)

    times = interleaved({"untransformed": lambda: plain(ids), "taps_off": lambda: tapped(ids), "taps_on": replaced}, reps)
    start = time.perf_counter()
    for _ in range(reps):
        replacer.build_context(req_ids, positions, tokens_per_req=seq)
    build_ms = 1e3 * (time.perf_counter() - start) / reps
    ms = median_ms(times)
    return {
        "config": config,
        "batch": batch,
        "seq": seq,
        "taps": len(tapped.report["taps"].sites),
        "ms": ms,
        "taps_off/untransformed": ratio(times, "taps_off", "untransformed"),
        "taps_on/untransformed": ratio(times, "taps_on", "untransformed"),
        "build_context_ms": build_ms,
        "build_context/step": build_ms / ms["taps_on"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--out", default="benchmarks/results/bench_taps.json")
    args = parser.parse_args()
    reps = 5 if args.quick else 20
    # batched_mm experts gather one weight copy per (token, expert): keep the MoE small
    result = run(reps, batch=4, seq=16, vocab_size=32000, hidden_size=256, layers=4, num_local_experts=4,
                 intermediate_size=256)
    ms = result["ms"]
    print(f"GPT-OSS step, {result['taps']} router taps, batch {result['batch']} x {result['seq']} tokens")
    print(f"  untransformed {ms['untransformed']:.2f} ms, taps off {ms['taps_off']:.2f} ms, taps on {ms['taps_on']:.2f} ms")
    for key in ("taps_off/untransformed", "taps_on/untransformed"):
        print(f"  {key}: {result[key]['ratio_median']:.3f} (median), {result[key]['ratio_min']:.3f} (min)")
    print(f"  build_context {result['build_context_ms']:.2f} ms = {result['build_context/step']:.3f} of a step")
    write_results(result, args.out)


if __name__ == "__main__":
    main()
