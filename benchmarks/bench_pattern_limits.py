"""What a regex costs each engine, beside what the default limits decide about it: the measurements
behind ``pattern_size``, ``repeat_nesting`` and ``varying_repeat`` (``schema/limits.py``).

    python benchmarks/bench_pattern_limits.py [--engines xgrammar llguidance] [--tokens 150]
        [--json benchmarks/results/bench_pattern_limits.json]

Each pattern is compiled as a regex constraint on SmolLM2's tokenizer (49,152 tokens) with the
limits raised out of the way, then teacher-forced with the tokens of ``abcd...z`` repeated (each
pattern matches its prefixes) for up to ``--tokens`` tokens or until a fill passes 1 s. Printed and
written: the default limits' verdict (the limit that refuses it, or ``admitted``) and the time the
check took; per engine the compile time and the worst fill (CPU time of the filling thread, so that a
busy host does not count) and the token it came at.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from neuron_constrain.structured import ConstraintError, regex
from neuron_constrain.structured import engines as E
from neuron_constrain.structured.schema import limits as L
from timing import write_results

ALPHABET = "(" + "|".join("abcdefghijklmnopqrstuvwxyz") + ")"
PATTERNS = [
    "[a-z]{1,60000}",
    "(abcdefghijklmnopqrstuvwxyz){1,2000}",
    "(" + "abcdefghij" * 100 + "){1,60}",
    "(" + "abcdefghij" * 100 + "){1,600}",
    "([a-z]{1,2}){1,16}",
    "([a-z]{1,3}){1,10}",
    "([a-z]{1,3}){1,16}",
    "([a-z]{0,3}){1,16}",
    "([a-z]{1,3}){1,30}",
    "([a-z]{1,3}){1,100}",
    "([a-z]{1,20}){1,20}",
    "([a-z]{1,32}){1,32}",
    "([a-z]{1,63}a){1,8}",
    ALPHABET + "{1,16}",
    ALPHABET + "{1,200}",
    "(([a-z]{1,3}){1,3}){1,3}",
    "((([a-z]{1,5}){1,5}){1,5}){1,5}",
    "((([a-z]{1,20}){1,20}){1,20}){1,5}",
]
RAISED = L.Limits(repeat=10 ** 9, pattern_chars=10 ** 6, spec_bytes=10 ** 8, pattern_size=10 ** 9,
                  repeat_nesting=100, varying_repeat=10 ** 9, compile_seconds=600, compile_memory_mb=16_384)


def verdict(pattern: str) -> tuple[str, float]:
    """The default limits' verdict on ``pattern`` and the seconds the check took."""
    start = time.perf_counter()
    try:
        L.check(regex(pattern))
        found = "admitted"
    except L.LimitError as error:
        found = f"{error.limit} ({error.value})"
    return found, time.perf_counter() - start


def measure(engine, tokenizer_ids: list[int], pattern: str, tokens: int) -> dict:
    """Compile ``pattern`` and teacher-force it, every fill timed in this thread's CPU time."""
    buffer = torch.zeros((1, engine.width), dtype=torch.int32)
    start = time.thread_time()
    try:
        compiled = engine.compile(regex(pattern))
    except ConstraintError as error:
        return {"error": str(error)[:200]}
    compile_ms = (time.thread_time() - start) * 1e3
    matcher = engine.matcher(compiled)
    fills = []
    for token in tokenizer_ids[:tokens]:
        start = time.thread_time()
        matcher.fill_next_token_bitmask(buffer, 0)
        fills.append((time.thread_time() - start) * 1e3)
        if fills[-1] > 1000 or not matcher.accept_token(token):
            break
    worst = max(fills)
    return {"compile_ms": round(compile_ms, 1), "worst_fill_ms": round(worst, 1), "at_token": fills.index(worst),
            "tokens": len(fills)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", nargs="+", default=["xgrammar", "llguidance"])
    parser.add_argument("--tokens", type=int, default=150)
    parser.add_argument("--json", default="benchmarks/results/bench_pattern_limits.json")
    args = parser.parse_args(argv)
    import transformers

    from neuron_constrain.models import smollm2_dir
    from neuron_constrain.structured import from_huggingface

    hf = transformers.AutoTokenizer.from_pretrained(smollm2_dir())
    tokenizer = from_huggingface(hf)
    ids = hf.encode("abcdefghijklmnopqrstuvwxyz" * 40)
    engines = {name: E.make_engine(name, tokenizer, limits=RAISED) for name in args.engines}
    rows = []
    print(f"{'pattern':40} {'default limits':28} {'check ms':>8}  " + "  ".join(
        f"{name + ' compile/worst fill ms (token)':>40}" for name in engines))
    for pattern in PATTERNS:
        found, seconds = verdict(pattern)
        row = {"pattern": pattern, "limits": found, "check_ms": round(seconds * 1e3, 2)}
        for name, engine in engines.items():
            row[name] = measure(engine, ids, pattern, args.tokens)
        rows.append(row)
        cells = [f"{r['compile_ms']:>10.1f} {r['worst_fill_ms']:>10.1f} ({r['at_token']:>3})" if "error" not in r
                 else r["error"][:40] for r in (row[name] for name in engines)]
        shown = pattern if len(pattern) <= 40 else pattern[:37] + "..."
        print(f"{shown:40} {found:28} {row['check_ms']:>8.2f}  " + "  ".join(f"{c:>40}" for c in cells), flush=True)
    for engine in engines.values():
        engine.close()
    results = {"vocabulary": tokenizer.info.vocab_size, "tokens": args.tokens, "rows": rows}
    write_results(results, args.json)
    return results


if __name__ == "__main__":
    sys.exit(main() and 0)
