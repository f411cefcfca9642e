"""Bitmask kernels against xgrammar's CPU kernel and plain argmax, measured side by side.

For batch in {1, 8, 64} and V in {128256 (Llama-3), 151936 (Qwen)}, fp32 logits and
a random packed mask (every bit random, bit 31 included), times:

    xgr        xgrammar.apply_token_bitmask_inplace (CPU kernel) on one buffer, re-applied:
               the kernel alone, the baseline (a)
    xgr+clone  the same on a fresh clone each call: what a functional apply pays
    eager      our apply_bitmask, eager (b)
    compiled   our apply_bitmask under torch.compile (inductor, CPU) (c)
    argmax / argmax_c            plain argmax, eager / compiled
    pick / pick_c                our masked_argmax, eager / compiled (d)

Each repetition runs every candidate once, in a shuffled order, so machine noise
hits all of them alike; the table shows medians and ratios of medians and of minima
(a shared machine's other load inflates medians; minima show the code's own cost): the
ratios compiled/xgr, eager/xgr, compiled/(xgr+clone), pick/argmax (eager) and
pick_c/argmax_c (compiled, the fair one). Targets: compiled/xgr <= 1 at every size;
pick_c/argmax_c <= 1.5 at batch 64. Bytes per row: packed mask ceil(V/32)*4 vs bool V.

    python benchmarks/bench_kernels.py [--quick] [--out PATH]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
from importlib.metadata import version
from pathlib import Path

import torch
import xgrammar

from neuron_constrain.kernels import apply_bitmask, masked_argmax, packed_width

BATCHES = (1, 8, 64)
VOCABS = (128256, 151936)
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "bench_kernels.json"
TARGET_APPLY = 1.0  # compiled / xgr
TARGET_PICK = 1.5  # pick_c / argmax_c at batch 64


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(-1)


def _candidates(logits: torch.Tensor, packed: torch.Tensor, vocab: int, compiled: dict):
    inplace_buf = logits.clone()
    return {
        "xgr": lambda: xgrammar.apply_token_bitmask_inplace(inplace_buf, packed, vocab_size=vocab),
        "xgr+clone": lambda: xgrammar.apply_token_bitmask_inplace(logits.clone(), packed, vocab_size=vocab),
        "eager": lambda: apply_bitmask(logits, packed, vocab),
        "compiled": lambda: compiled["apply"](logits, packed, vocab),
        "argmax": lambda: _argmax(logits),
        "argmax_c": lambda: compiled["argmax"](logits),
        "pick": lambda: masked_argmax(logits, packed, vocab),
        "pick_c": lambda: compiled["pick"](logits, packed, vocab),
    }


def _measure(candidates: dict, reps: int, rng: random.Random) -> dict[str, list[float]]:
    for fn in candidates.values():  # warm up (and compile) outside the timed loop
        fn()
        fn()
    times = {name: [] for name in candidates}
    names = list(candidates)
    gc.disable()
    try:
        for _ in range(reps):
            rng.shuffle(names)
            for name in names:
                fn = candidates[name]
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    finally:
        gc.enable()
    return times


def _check(logits, packed, vocab, compiled) -> None:
    """The candidates must compute the same thing before their times mean anything."""
    reference = logits.clone()
    xgrammar.apply_token_bitmask_inplace(reference, packed, vocab_size=vocab)
    for name, out in (("eager", apply_bitmask(logits, packed, vocab)),
                      ("compiled", compiled["apply"](logits, packed, vocab))):
        if not torch.equal(out, reference):
            raise AssertionError(f"{name} apply_bitmask disagrees with xgrammar at {tuple(logits.shape)}")
    want = reference.argmax(-1)
    for name, (tokens, _) in (("pick", masked_argmax(logits, packed, vocab)),
                              ("pick_c", compiled["pick"](logits, packed, vocab))):
        if not torch.equal(tokens, want):
            raise AssertionError(f"{name} masked_argmax disagrees with xgrammar+argmax at {tuple(logits.shape)}")


def ratios(times: dict[str, float]) -> dict[str, float]:
    """The reported ratios, from one statistic (median or minimum) per candidate."""
    return {
        "compiled/xgr": times["compiled"] / times["xgr"],
        "eager/xgr": times["eager"] / times["xgr"],
        "compiled/xgr+clone": times["compiled"] / times["xgr+clone"],
        "pick/argmax": times["pick"] / times["argmax"],
        "pick_c/argmax_c": times["pick_c"] / times["argmax_c"],
    }


def run(reps: int, batches, vocabs, seed: int = 0) -> dict:
    torch._dynamo.config.cache_size_limit = 64
    compiled = {
        "apply": torch.compile(apply_bitmask, dynamic=False),
        "pick": torch.compile(masked_argmax, dynamic=False),
        "argmax": torch.compile(_argmax, dynamic=False),
    }
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    rows = []
    for vocab in vocabs:
        for batch in batches:
            logits = torch.randn(batch, vocab, generator=gen)
            packed = torch.randint(-(2**31), 2**31, (batch, packed_width(vocab)), dtype=torch.int32, generator=gen)
            _check(logits, packed, vocab, compiled)
            times = _measure(_candidates(logits, packed, vocab, compiled), reps, rng)
            med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
            low = {k: min(v) * 1e6 for k, v in times.items()}
            rows.append({
                "batch": batch,
                "vocab": vocab,
                "median_us": med,
                "min_us": low,
                "ratios_median": ratios(med),
                "ratios_min": ratios(low),
                "mask_bytes_per_row": {"packed": packed_width(vocab) * 4, "bool": vocab},
            })
            _print_row(rows[-1], header=len(rows) == 1)
    return {
        "benchmark": "bench_kernels",
        "reps": reps,
        "env": {
            "torch": torch.__version__,
            "xgrammar": version("xgrammar"),
            "python": sys.version.split()[0],
            "torch_threads": torch.get_num_threads(),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
            "cpu_count": os.cpu_count(),
            "machine": platform.processor() or platform.machine(),
        },
        "logits_dtype": "float32",
        "mask": "uniformly random int32 words (bit 31 included)",
        "targets": _targets(rows),
        "rows": rows,
    }


def _targets(rows: list[dict]) -> dict[str, bool]:
    """Each target judged on ratios of medians and of minima (medians carry other processes' load)."""
    out = {}
    for stat in ("median", "min"):
        out[f"compiled/xgr <= {TARGET_APPLY} at every size ({stat})"] = all(
            r[f"ratios_{stat}"]["compiled/xgr"] <= TARGET_APPLY for r in rows
        )
        out[f"pick_c/argmax_c <= {TARGET_PICK} at batch 64 ({stat})"] = all(
            r[f"ratios_{stat}"]["pick_c/argmax_c"] <= TARGET_PICK for r in rows if r["batch"] == 64
        )
    return out


COLUMNS = ("xgr", "xgr+clone", "eager", "compiled", "argmax", "argmax_c", "pick", "pick_c")
RATIOS = ("compiled/xgr", "eager/xgr", "compiled/xgr+clone", "pick/argmax", "pick_c/argmax_c")


def _print_row(row: dict, header: bool) -> None:
    if header:
        print("µs per call (median over repetitions); ratios: of medians / of minima")
        print(f"{'B':>3} {'V':>7} " + " ".join(f"{c:>9}" for c in COLUMNS) + " | "
              + " ".join(f"{r:>20}" for r in RATIOS) + " | mask bytes/row packed vs bool")
    med, nbytes = row["median_us"], row["mask_bytes_per_row"]
    ratios = " ".join(
        f"{row['ratios_median'][r]:>10.3f}/{row['ratios_min'][r]:<9.3f}" for r in RATIOS
    )
    print(f"{row['batch']:>3} {row['vocab']:>7} " + " ".join(f"{med[c]:>9.1f}" for c in COLUMNS) + " | "
          + ratios + f" | {nbytes['packed']} vs {nbytes['bool']}", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (noisier numbers)")
    parser.add_argument("--reps", type=int, default=None, help="repetitions per candidate (default 60, quick 15)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads before timing (default: as found; xgrammar's CPU kernel is single-threaded)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON output (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    reps = args.reps or (15 if args.quick else 60)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    result = run(reps, BATCHES, VOCABS)
    for target, met in result["targets"].items():
        print(f"target {target}: {'met' if met else 'MISSED'}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
