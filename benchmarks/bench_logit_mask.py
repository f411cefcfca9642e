"""Logit-mask pass cost: constrained / unconstrained step time, and transform wall time.

    .venv/bin/python benchmarks/bench_logit_mask.py [--quick] [--out PATH]

Both steps run the same exported program type (an unlifted graph module) on the
same inputs; repetitions are interleaved and the ratio of medians (and of minima)
is reported, so machine noise hits both sides alike. Transform time is measured
for 2, 4 and 8 layers to show it grows linearly with the graph.
"""
from __future__ import annotations

import argparse
import time

import torch

import neuron_constrain as nc
from neuron_constrain.kernels import pack_bool_mask
from neuron_constrain.testing import GreedyStep, random_ids, tiny_decoder
from timing import interleaved, median_ms, ratio, write_results

BATCH_DIM = torch.export.Dim("batch")


def export_step(**config):
    step = GreedyStep(tiny_decoder("llama", **config))
    ids = random_ids(8, 4, config["vocab_size"])
    with torch.no_grad():
        program = torch.export.export(step, (ids,), dynamic_shapes=({0: BATCH_DIM},))
    return program, ids


def step_ratio(name: str, reps: int, **config) -> dict:
    program, ids = export_step(**config)
    start = time.perf_counter()
    transformed = nc.transform(program)
    transform_s = time.perf_counter() - start
    plain = program.module()
    generator = torch.Generator().manual_seed(0)
    allowed = torch.rand(ids.shape[0], config["vocab_size"], generator=generator) < 0.05
    allowed[:, 0] = True
    mask = pack_bool_mask(allowed)
    runs = {"unconstrained": lambda: plain(ids), "constrained": lambda: transformed(ids, logit_mask=mask)}
    times = interleaved(runs, reps)
    ms = median_ms(times)
    return {
        "decoder": name,
        "config": config,
        "batch": ids.shape[0],
        "unconstrained_ms": ms["unconstrained"],
        "constrained_ms": ms["constrained"],
        **ratio(times, "constrained", "unconstrained"),
        "transform_s": transform_s,
        "mask_bytes_per_row": mask.shape[-1] * 4,
    }


def transform_scaling(layers_list=(2, 4, 8)) -> list[dict]:
    rows = []
    for layers in layers_list:
        program, _ = export_step(vocab_size=1024, hidden_size=64, layers=layers)
        start = time.perf_counter()
        nc.transform(program)
        rows.append({"layers": layers, "nodes": len(program.graph.nodes), "transform_s": time.perf_counter() - start})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--out", default="benchmarks/results/bench_logit_mask.json")
    args = parser.parse_args()
    reps = 5 if args.quick else 20
    results = {
        "steps": [
            step_ratio("small", reps * 2, vocab_size=1024, hidden_size=64, layers=2),
            step_ratio("medium", reps, vocab_size=128256, hidden_size=1024, layers=8, intermediate_size=2048),
        ],
        "transform_scaling": transform_scaling(),
    }
    print(f"{'decoder':8} {'batch':>5} {'uncon ms':>9} {'con ms':>9} {'ratio(med)':>10} {'ratio(min)':>10} {'transform s':>11}")
    for r in results["steps"]:
        print(
            f"{r['decoder']:8} {r['batch']:5d} {r['unconstrained_ms']:9.2f} {r['constrained_ms']:9.2f} "
            f"{r['ratio_median']:10.3f} {r['ratio_min']:10.3f} {r['transform_s']:11.3f}"
        )
    print("transform time vs layers:")
    for r in results["transform_scaling"]:
        print(f"  {r['layers']} layers, {r['nodes']} nodes: {r['transform_s']:.3f} s")
    write_results(results, args.out)


if __name__ == "__main__":
    main()
