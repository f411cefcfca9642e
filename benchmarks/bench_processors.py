"""Logits-processors cost: step time with all four processors active / without them.

    .venv/bin/python benchmarks/bench_processors.py [--quick] [--out PATH]

The medium CPU decoder of ``bench_logit_mask.py`` (Llama, 8 layers, hidden 1024,
vocab 128256, batch 8), two steps: greedy (argmax: min_p is pruned, so three
processors run) and top-k sampling (``TopKMultinomialStep``: all four plus the
per-row temperature). Candidates, all with the same packed grammar mask:

    none      transform(program)                       the logit-mask pass only
    all_four  transform(program, processors=[...4])    every row uses every processor
    neutral   the same program, processor inputs left to their neutral fills

Repetitions are interleaved (``timing.interleaved``); the ratio of medians
``all_four / none`` is the headline (target <= 1.10); the median of per-round
ratios (``ratio_paired_median``) is printed too, as it resists bursts of load on a
shared machine. The host side is timed on its
own: one ``append_tokens`` + ``inputs()`` per step for the batch.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import torch

import neuron_constrain as nc
from neuron_constrain.kernels import pack_bool_mask
from neuron_constrain.processors import BatchUpdate, ProcessorState, RequestParams
from neuron_constrain.testing import GreedyStep, TopKMultinomialStep, random_ids, tiny_decoder
from timing import interleaved, median_ms, ratio

MEDIUM = dict(vocab_size=128256, hidden_size=1024, layers=8, intermediate_size=2048)
SMALL = dict(vocab_size=1024, hidden_size=64, layers=2)
PROCESSORS = ["min_tokens", "logit_bias", "penalties", "min_p"]
BATCH, SEQ, EOS = 8, 4, 2
BATCH_DIM = torch.export.Dim("batch")


def busy_state(model: nc.Transformed, vocab: int) -> ProcessorState:
    """Every row uses every processor; 32 tokens already generated per row."""
    generator = torch.Generator().manual_seed(0)
    state = ProcessorState.for_model(model, BATCH, eos_token_id=EOS)
    added = []
    for slot in range(BATCH):
        ids = torch.randint(0, vocab, (16,), generator=generator).tolist()
        params = RequestParams(
            min_tokens=1000, stop_token_ids=[3, 4], logit_bias={t: 0.5 for t in ids},
            min_p=0.05, temperature=0.8, repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.2,
        )
        prompt = torch.randint(0, vocab, (64,), generator=generator).tolist()
        added.append((slot, params, prompt, torch.randint(0, vocab, (32,), generator=generator).tolist()))
    state.update(BatchUpdate(BATCH, added=added))
    return state


def measure(name: str, kind: str, reps: int, config: dict) -> dict:
    vocab = config["vocab_size"]
    model = tiny_decoder("llama", **config)
    step = GreedyStep(model) if kind == "greedy" else TopKMultinomialStep(model, top_k=50)
    ids = random_ids(BATCH, SEQ, vocab)
    with torch.no_grad():
        program = torch.export.export(step, (ids,), dynamic_shapes=({0: BATCH_DIM},))
    none = nc.transform(program)
    start = time.perf_counter()
    processed = nc.transform(program, processors=PROCESSORS)
    transform_s = time.perf_counter() - start
    state = busy_state(processed, vocab)
    generator = torch.Generator().manual_seed(1)
    allowed = torch.rand(BATCH, vocab, generator=generator) < 0.5
    allowed[:, EOS] = True
    mask = pack_bool_mask(allowed)
    inputs = state.inputs()
    runs = {
        "none": lambda: none(ids, logit_mask=mask),
        "all_four": lambda: processed(ids, logit_mask=mask, **inputs),
        "neutral": lambda: processed(ids, logit_mask=mask),
    }
    times = interleaved(runs, reps)
    host = []
    tokens = torch.randint(0, vocab, (BATCH,), generator=generator)
    for _ in range(50):
        t0 = time.perf_counter()
        state.append_tokens(tokens)
        state.inputs()
        host.append(time.perf_counter() - t0)
    ms = median_ms(times)
    site = processed.report["logits_processors"].sites[0]
    return {
        "decoder": name,
        "step": kind,
        "config": config,
        "batch": BATCH,
        "processors_in_graph": site["processors"],
        "pruned": site["pruned"],
        "none_ms": ms["none"],
        "all_four_ms": ms["all_four"],
        "neutral_ms": ms["neutral"],
        **ratio(times, "all_four", "none"),
        # per round: both candidates ran back to back, so a burst of load hits both
        "ratio_paired_median": statistics.median(a / b for a, b in zip(times["all_four"], times["none"])),
        "neutral_ratio_median": statistics.median(times["neutral"]) / statistics.median(times["none"]),
        "host_update_us": 1e6 * statistics.median(host),
        "transform_s": transform_s,
        "nodes_inserted": processed.report["logits_processors"].nodes_inserted,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--out", default="benchmarks/results/bench_processors.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    reps = 5 if args.quick else 20
    rows = [measure("small", kind, reps * 4, SMALL) for kind in ("greedy", "topk")]
    rows += [measure("medium", kind, reps, MEDIUM) for kind in ("greedy", "topk")]
    results = {"steps": rows, "target_ratio": 1.10, "torch": torch.__version__, "threads": torch.get_num_threads()}
    print(f"{'decoder':8} {'step':6} {'none ms':>9} {'4 on ms':>9} {'ratio(med)':>10} {'ratio(min)':>10} "
          f"{'paired':>7} {'neutral':>8} {'host us':>8}  in graph / pruned")
    for r in rows:
        print(
            f"{r['decoder']:8} {r['step']:6} {r['none_ms']:9.2f} {r['all_four_ms']:9.2f} {r['ratio_median']:10.3f} "
            f"{r['ratio_min']:10.3f} {r['ratio_paired_median']:7.3f} {r['neutral_ratio_median']:8.3f} {r['host_update_us']:8.0f}  "
            f"{','.join(r['processors_in_graph'])} / {','.join(r['pruned']) or '-'}"
        )
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
