"""XLA compile-time cost of the rewrite: transformed / untransformed graph, measured side by side.

    PJRT_DEVICE=CPU .venv/bin/python benchmarks/bench_compile.py [--quick] [--out PATH]

Both programs (a Llama greedy step, and the same program after ``nc.transform``
with a packed logit mask) are moved to the XLA device and called once per
repetition; ``torch_xla.sync()`` compiles and runs the graph. Only XLA's compile
time is counted (torch-xla's ``CompileTime`` metric, not tracing or execution).
Each repetition uses a new batch size for both programs, so every call is a fresh
compilation (torch-xla caches graphs by shape) and both sides compile the same
shapes; the order alternates per repetition, and a first uncounted repetition
warms both up. Reported: the median of the per-repetition ratios (the target is
checked on it), the ratios of medians and of minima, and HLO instruction counts.
The seeds measured +3.4% on a NEFF (8,395 vs 8,117 ms); the target is <= 1.05.
Needs torch-xla (main lane).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import neuron_constrain as nc
from neuron_constrain.testing import GreedyStep, random_ids, tiny_decoder
from timing import write_results

TARGET = 1.05


def compile_ms(met) -> float:
    data = met.metric_data("CompileTime")
    return 0.0 if data is None else data[1] / 1e6


def hlo_instructions(text: str) -> int:
    return sum(1 for line in text.splitlines() if " = " in line and not line.lstrip().startswith("HloModule"))


def measure(name: str, reps: int, base_batch: int, **config) -> dict:
    import torch_xla
    import torch_xla.debug.metrics as met

    from neuron_constrain.decoding.xla import lower, to_xla

    device = torch_xla.device()
    vocab = config["vocab_size"]
    step = GreedyStep(tiny_decoder("llama", **config))
    ids = random_ids(2, 8, vocab)
    with torch.no_grad():
        plain = torch.export.export(step, (ids,), dynamic_shapes=({0: torch.export.Dim("batch")},))
    transformed = nc.transform(plain, vocab_size=vocab)
    width = transformed.report.inputs_added[0].shape[-1]
    modules = {"plain": to_xla(plain, device).module(), "transformed": to_xla(transformed.program, device).module()}
    sizes = {
        "plain": hlo_instructions(lower(plain).text),
        "transformed": hlo_instructions(lower(transformed).text),
    }
    times: dict[str, list[float]] = {k: [] for k in modules}
    cpu_times: dict[str, list[float]] = {k: [] for k in modules}
    for rep in range(-1, reps):  # rep -1 warms both sides up and is not counted
        batch = base_batch + 1 + rep  # a shape neither side has compiled yet
        ids = random_ids(batch, 8, vocab, seed=rep).to(device)
        mask = torch.full((batch, width), -1, dtype=torch.int32).to(device)
        order = list(modules) if rep % 2 == 0 else list(reversed(modules))
        for key in order:
            kwargs = {"logit_mask": mask} if key == "transformed" else {}
            with torch.no_grad():
                out = modules[key](ids, **kwargs)  # traced lazily: nothing compiled yet
            before, cpu_before = compile_ms(met), time.process_time()
            torch_xla.sync()  # compile (and run) the graph
            cpu = time.process_time() - cpu_before
            torch.utils._pytree.tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, out)
            if rep >= 0:
                times[key].append(compile_ms(met) - before)
                cpu_times[key].append(cpu * 1e3)
    ratios = [t / p for t, p in zip(times["transformed"], times["plain"])]
    med = {k: statistics.median(v) for k, v in times.items()}
    low = {k: min(v) for k, v in times.items()}
    return {
        "decoder": name,
        "config": config,
        "reps": reps,
        "plain_compile_ms": med["plain"],
        "transformed_compile_ms": med["transformed"],
        "ratio_median_of_ratios": statistics.median(ratios),
        "ratio_of_medians": med["transformed"] / med["plain"],
        "ratio_of_minima": low["transformed"] / low["plain"],
        # CPU time of the compiling sync, all threads: steadier than wall time on a busy machine
        "cpu_ratio_median_of_ratios": statistics.median(
            t / p for t, p in zip(cpu_times["transformed"], cpu_times["plain"])
        ),
        "plain_cpu_ms": statistics.median(cpu_times["plain"]),
        "transformed_cpu_ms": statistics.median(cpu_times["transformed"]),
        "ratios": ratios,
        "plain_samples_ms": times["plain"],
        "transformed_samples_ms": times["transformed"],
        "hlo_instructions_plain": sizes["plain"],
        "hlo_instructions_transformed": sizes["transformed"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller medium model, fewer repetitions")
    parser.add_argument("--out", default="benchmarks/results/bench_compile.json")
    args = parser.parse_args()
    try:
        import torch_xla
    except ImportError:
        print("bench_compile needs torch-xla (the main lane, .venv): nothing measured", file=sys.stderr)
        return 2
    reps = 5 if args.quick else 9
    medium = (
        dict(vocab_size=32000, hidden_size=256, layers=4, intermediate_size=688)
        if args.quick
        else dict(vocab_size=128256, hidden_size=1024, layers=8, intermediate_size=2816)
    )
    rows = [
        measure("tiny", reps, 2, vocab_size=1024, hidden_size=64, layers=2),
        measure("medium", reps, 2, **medium),
    ]
    results = {
        "rows": rows,
        "target_ratio": TARGET,
        "seeds_neff_ratio": 8395 / 8117,
        "torch_xla": torch_xla.__version__,
        "quick": args.quick,
    }
    print(f"{'decoder':8} {'reps':>4} {'plain ms':>9} {'rewritten ms':>12} {'ratio(med)':>10} {'ratio(of med)':>13} "
          f"{'ratio(min)':>10} {'cpu ratio':>9} {'HLO instrs':>15}")
    for r in rows:
        print(
            f"{r['decoder']:8} {r['reps']:4d} {r['plain_compile_ms']:9.1f} {r['transformed_compile_ms']:12.1f} "
            f"{r['ratio_median_of_ratios']:10.3f} {r['ratio_of_medians']:13.3f} {r['ratio_of_minima']:10.3f} {r['cpu_ratio_median_of_ratios']:9.3f} "
            f"{r['hlo_instructions_plain']:>7d}->{r['hlo_instructions_transformed']:<7d}"
        )
    worst = max(r["ratio_median_of_ratios"] for r in rows)
    print(f"target <= {TARGET}: {'met' if worst <= TARGET else 'NOT met'} (worst median ratio {worst:.3f}; "
          f"the seeds' NEFF: {8395 / 8117:.3f})")
    write_results(results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
