"""Logit-mask pass cost on a real decode step: constrained / unconstrained step time.

    .venv/bin/python benchmarks/bench_logit_mask.py [--quick] [--out PATH]

The step (``decode_steps.py``): one token per row over a static KV cache, Llama-3's
vocabulary (128256), hidden 1024, 8 layers, batch 8 and 64, greedy in-graph; run
eager and compiled with inductor. Candidates, all on the same inputs, interleaved
rep by rep (``timing.interleaved``), so machine noise hits them alike:

    unconstrained   the exported step
    constrained     the rewritten step with one real decode step's packed grammar masks
                    (``grammar_states.grammar_masks``: rows at different states of real
                    schemas on Tekken's vocabulary, its text tokens as the columns)
    random          the same step with a random mask, 50% of tokens allowed: the worst
                    case for eager CPU, whose ``where`` branches per element (measured:
                    3-5x slower on such a mask than on a grammar's long runs)
    split           the rewritten step cut at the mask (body, then head): split + compose

Reported: ratio of medians and of minima, and the median of per-round ratios
(``paired``), for constrained / unconstrained (target <= 1.02) and split /
constrained (target <= 1.01). ``--quick``: a 2-layer, 1024-token model, fewer reps.
"""
from __future__ import annotations

import argparse
import time

import torch

import neuron_constrain as nc
from neuron_constrain.kernels import unpack_bitmask
from neuron_constrain.decoding.pipeline import split_step
from neuron_constrain.core.transform import strip_added_outputs
from decode_steps import LLAMA3, SMALL, compiled, decoder, export_decode_step
from grammar_states import grammar_masks, random_masks
from timing import interleaved, median_ms, ratio, write_results


def measure(model, batch: int, backend: str, reps: int, mask: torch.Tensor) -> dict:
    vocab = model.config.vocab_size
    program, args = export_decode_step(model, batch)
    start = time.perf_counter()
    transformed = nc.transform(program, vocab_size=vocab)
    transform_s = time.perf_counter() - start
    split = split_step(transformed)
    random_mask = random_masks(batch, vocab)
    plain = compiled(program.module(), backend)
    rewritten = compiled(transformed.graph_module, backend)
    body, head = compiled(split.body.graph_module, backend), compiled(split.head.graph_module, backend)
    report = transformed.report

    def constrained():  # what Transformed does around the graph: the empty-row check included
        return strip_added_outputs(rewritten(*args, logit_mask=mask), report)

    def composed():
        return strip_added_outputs(head(*body(*args), logit_mask=mask), report)

    def random():
        return strip_added_outputs(rewritten(*args, logit_mask=random_mask), report)

    runs = {"unconstrained": lambda: plain(*args), "constrained": constrained, "random": random, "split": composed}
    times = interleaved(runs, reps, warmup=2)
    ms = median_ms(times)
    return {
        "batch": batch,
        "backend": backend,
        "unconstrained_ms": ms["unconstrained"],
        "constrained_ms": ms["constrained"],
        "random_ms": ms["random"],
        "mask_allowed_fraction": unpack_bitmask(mask, vocab).float().mean().item(),
        "split_ms": ms["split"],
        "constrained/unconstrained": ratio(times, "constrained", "unconstrained"),
        "random/unconstrained": ratio(times, "random", "unconstrained"),
        "split/constrained": ratio(times, "split", "constrained"),
        "transform_s": transform_s,
        "head_ops": split.report.head_ops,
        "head_bytes_in": split.report.head_bytes_in,
        "mask_bytes_per_row": mask.shape[-1] * 4,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a 2-layer 1024-token model, fewer repetitions")
    parser.add_argument("--backends", default="eager,inductor")
    parser.add_argument("--batches", default="8,64")
    parser.add_argument("--reps", type=int, default=None, help="rounds per candidate (default 20; --quick 10)")
    parser.add_argument("--out", default="benchmarks/results/bench_logit_mask.json")
    args = parser.parse_args()
    config, reps = (SMALL, 10) if args.quick else (LLAMA3, 20)
    reps = args.reps or reps
    torch.manual_seed(0)
    model = decoder("llama", **config)
    batches = list(map(int, args.batches.split(",")))
    masks = grammar_masks(max(batches), config["vocab_size"])
    rows = [measure(model, batch, backend, reps, masks[:batch]) for backend in args.backends.split(",")
            for batch in batches]
    print(f"decode step: llama {config}, 1 token/row, static cache 128")
    print(f"{'backend':9} {'batch':>5} {'uncon ms':>9} {'con ms':>9} {'con/uncon med':>13} {'min':>6} {'paired':>6}"
          f" {'random/uncon':>12} {'paired':>6} {'split ms':>9} {'split/con med':>13} {'paired':>6}")
    for r in rows:
        c, s, q = r["constrained/unconstrained"], r["split/constrained"], r["random/unconstrained"]
        print(f"{r['backend']:9} {r['batch']:5d} {r['unconstrained_ms']:9.2f} {r['constrained_ms']:9.2f} "
              f"{c['ratio_median']:13.3f} {c['ratio_min']:6.3f} {c['paired']:6.3f} "
              f"{q['ratio_median']:12.3f} {q['paired']:6.3f} {r['split_ms']:9.2f} "
              f"{s['ratio_median']:13.3f} {s['paired']:6.3f}")
    write_results({"config": config, "steps": rows, "targets": {"constrained/unconstrained": 1.02, "split/constrained": 1.01}},
                  args.out)


if __name__ == "__main__":
    main()
