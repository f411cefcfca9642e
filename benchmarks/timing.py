"""Side-by-side timing for the benchmarks: candidates run interleaved, rep by rep, so
machine noise (2 shared cores) hits every candidate alike."""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def interleaved(runs: dict[str, Callable[[], object]], reps: int, warmup: int = 1) -> dict[str, list[float]]:
    """Seconds per call of each candidate, ``reps`` rounds; each round calls all of them
    once, in an order rotated by one each round, so no candidate always runs first or
    right after the same other one."""
    times = {name: [] for name in runs}
    names = list(runs)
    with torch.no_grad():
        for _ in range(warmup):
            for fn in runs.values():
                fn()
        for round_ in range(reps):
            shift = round_ % len(names)
            for name in names[shift:] + names[:shift]:
                start = time.perf_counter()
                runs[name]()
                times[name].append(time.perf_counter() - start)
    return times


def ratio(times: dict[str, list[float]], numerator: str, denominator: str) -> dict[str, float]:
    """Ratio of medians, ratio of minima, and the median of per-round ratios of two candidates."""
    return {
        "ratio_median": statistics.median(times[numerator]) / statistics.median(times[denominator]),
        "ratio_min": min(times[numerator]) / min(times[denominator]),
        "paired": paired(times, numerator, denominator),
    }


def paired(times: dict[str, list[float]], numerator: str, denominator: str) -> float:
    """Median of the per-round ratios (the two ran back to back each round: resists load bursts)."""
    return statistics.median(a / b for a, b in zip(times[numerator], times[denominator]))


def median_ms(times: dict[str, list[float]]) -> dict[str, float]:
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def write_results(results: dict, path: str) -> None:
    """Add the torch version and thread count, write JSON to ``path`` and say so."""
    import json
    import pathlib

    results = {**results, "torch": torch.__version__, "threads": torch.get_num_threads()}
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, default=str))
    print(f"wrote {out}")
