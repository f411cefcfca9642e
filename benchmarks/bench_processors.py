"""Logits-processors cost on a real decode step: all four processors on / mask only / none.

    .venv/bin/python benchmarks/bench_processors.py [--quick] [--backends eager,inductor] [--out PATH]

The step (``decode_steps.py``): one token per row over a static KV cache, Llama-3's
vocabulary (128256), hidden 1024, 8 layers, batch 8 and 64; greedy (argmax: min_p
is pruned, three processors run) and sampling (``SamplingStep``'s top-k/top-p race:
all four), eager and inductor. Candidates, on the same inputs, interleaved rep by rep:

    unconstrained  the exported step
    mask           transform(program): the logit-mask pass only, with one real decode
                   step's packed grammar masks (``grammar_states.grammar_masks``)
    all_four       transform(program, processors=[...4]), every row using every processor
    all_four_random  the same with a random mask, 50% of tokens allowed (the worst case
                   for eager CPU's per-element branching ``where``)

Headline: all_four / unconstrained (target <= 1.05), ratio of medians, of minima, and
the median of per-round ratios (``paired``, which resists bursts of load on a shared
machine). The host side is timed on its own: ``append_tokens`` + ``inputs()`` per step.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import neuron_constrain as nc
from neuron_constrain.processors import BatchUpdate, ProcessorState, RequestParams
from neuron_constrain.core.transform import strip_added_outputs
from decode_steps import LLAMA3, SMALL, compiled, decoder, export_decode_step
from grammar_states import grammar_masks, random_masks
from timing import interleaved, median_ms, ratio, write_results

PROCESSORS = ["min_tokens", "logit_bias", "penalties", "min_p"]
EOS = 2


def busy_state(model: nc.Transformed, batch: int, vocab: int) -> ProcessorState:
    """Every row uses every processor; 32 tokens already generated per row."""
    generator = torch.Generator().manual_seed(0)
    state = ProcessorState.for_model(model, batch, eos_token_id=EOS)
    added = []
    for slot in range(batch):
        ids = torch.randint(0, vocab, (16,), generator=generator).tolist()
        params = RequestParams(
            min_tokens=1000, stop_token_ids=[3, 4], logit_bias={t: 0.5 for t in ids},
            min_p=0.05, temperature=0.8, repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.2,
        )
        prompt = torch.randint(0, vocab, (64,), generator=generator).tolist()
        added.append((slot, params, prompt, torch.randint(0, vocab, (32,), generator=generator).tolist()))
    state.update(BatchUpdate(batch, added=added))
    return state


def measure(model, kind: str, batch: int, backend: str, reps: int, mask: torch.Tensor) -> dict:
    vocab = model.config.vocab_size
    program, args = export_decode_step(model, batch, sampling=kind == "sampling")
    masked = nc.transform(program, vocab_size=vocab)
    start = time.perf_counter()
    processed = nc.transform(program, vocab_size=vocab, processors=PROCESSORS)
    transform_s = time.perf_counter() - start
    state = busy_state(processed, batch, vocab)
    random_mask = random_masks(batch, vocab, always_allowed=EOS, seed=1)
    inputs = state.inputs()
    plain = compiled(program.module(), backend)
    mask_only, all_four = compiled(masked.graph_module, backend), compiled(processed.graph_module, backend)
    runs = {
        "unconstrained": lambda: plain(*args),
        "mask": lambda: strip_added_outputs(mask_only(*args, logit_mask=mask), masked.report),
        "all_four": lambda: strip_added_outputs(all_four(*args, logit_mask=mask, **inputs), processed.report),
        "all_four_random": lambda: strip_added_outputs(all_four(*args, logit_mask=random_mask, **inputs),
                                                       processed.report),
    }
    times = interleaved(runs, reps, warmup=2)
    host = []
    tokens = torch.randint(0, vocab, (batch,), generator=torch.Generator().manual_seed(1))
    for _ in range(50):
        t0 = time.perf_counter()
        state.append_tokens(tokens)
        state.inputs()
        host.append(time.perf_counter() - t0)
    site = processed.report["logits_processors"].sites[0]
    return {
        "step": kind, "batch": batch, "backend": backend,
        "processors_in_graph": site["processors"], "pruned": site["pruned"],
        "ms": median_ms(times),
        "all_four/unconstrained": ratio(times, "all_four", "unconstrained"),
        "all_four_random/unconstrained": ratio(times, "all_four_random", "unconstrained"),
        "all_four/mask": ratio(times, "all_four", "mask"),
        "mask/unconstrained": ratio(times, "mask", "unconstrained"),
        "host_update_us": 1e6 * statistics.median(host),
        "transform_s": transform_s,
        "nodes_inserted": processed.report["logits_processors"].nodes_inserted,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a 2-layer 1024-token model, fewer repetitions")
    parser.add_argument("--backends", default="eager,inductor")
    parser.add_argument("--steps", default="greedy,sampling")
    parser.add_argument("--batches", default="8,64")
    parser.add_argument("--out", default="benchmarks/results/bench_processors.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    config, reps = (SMALL, 10) if args.quick else (LLAMA3, 20)
    model = decoder("llama", **config)
    batches = list(map(int, args.batches.split(",")))
    masks = grammar_masks(max(batches), config["vocab_size"], always_allowed=EOS)
    rows = [measure(model, kind, batch, backend, reps, masks[:batch])
            for backend in args.backends.split(",") for kind in args.steps.split(",")
            for batch in batches]
    print(f"decode step: llama {config}, 1 token/row, static cache 128")
    print(f"{'backend':9} {'step':8} {'batch':>5} {'uncon ms':>9} {'mask ms':>8} {'4 on ms':>8} {'4/uncon med':>11} "
          f"{'min':>6} {'paired':>6} {'random':>6} {'paired':>6} {'4/mask':>6} {'host us':>8}  in graph / pruned")
    for r in rows:
        ms, a, q = r["ms"], r["all_four/unconstrained"], r["all_four_random/unconstrained"]
        print(f"{r['backend']:9} {r['step']:8} {r['batch']:5d} {ms['unconstrained']:9.2f} {ms['mask']:8.2f} "
              f"{ms['all_four']:8.2f} {a['ratio_median']:11.3f} {a['ratio_min']:6.3f} {a['paired']:6.3f} "
              f"{q['ratio_median']:6.3f} {q['paired']:6.3f} "
              f"{r['all_four/mask']['ratio_median']:6.3f} {r['host_update_us']:8.0f}  "
              f"{','.join(r['processors_in_graph'])} / {','.join(r['pruned']) or '-'}")
    write_results({"config": config, "steps": rows, "target_ratio": 1.05}, args.out)


if __name__ == "__main__":
    main()
