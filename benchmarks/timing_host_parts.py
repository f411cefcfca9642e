"""Where the batch-1 host time between masks goes, part by part (benchmarks/RESULTS.md, grammar engines).

    python benchmarks/timing_host_parts.py [--engine auto xgrammar llguidance] [--reps 9] [--number 20000]

On real MaskBench schemas (``grammar_states.SCHEMAS``) with the Tekken tokenizer, a request is
walked a few tokens into a valid instance; then, at that fixed grammar state, each part of one
decode step's host path is timed alone (``timeit``, best of ``--reps`` runs of ``--number`` calls,
the parts interleaved run by run so machine noise hits each alike), in ns:

    library fill     the engine library's own fill call (xgrammar's matcher; llguidance's
                     unsafe_compute_mask_ptr), what no wrapper can remove
    check_rows       the contract's row check (engines/base.py), once per batch_fill
    stop bits        llguidance only: is_accepting + clearing the stop bits its accept would refuse
    batch_fill       engine.batch_fill([matcher], buffer, [0]): all of the above + dispatch
    accept           matcher.accept_token + rollback(1) (the rollback undoes it between calls)
    step host        runtime.step minus its fill: the step's own Python (plan reuse check, timers, view)
    accept host      runtime.accept_rows minus the engine's accept (+ rollback), as bench_schemas counts it
    perf_counter     one time.perf_counter() call (step and accept_rows take 6 between them)

Prints one line per schema and engine, then the median of each part over the schemas.
"""
from __future__ import annotations

import argparse
import json
import statistics
import timeit

import torch

from grammar_states import DATA, SCHEMAS, tekken
from neuron_constrain.structured import engines as E
from neuron_constrain.structured.constraints import ConstraintError, json_schema
from neuron_constrain.structured.engines.base import check_rows
from neuron_constrain.structured.runtime.structured_runtime import StructuredRuntime

WALK = 3  # tokens into the instance before timing (past the opening brace)


def parts(engine_name: str, tokenizer, constraint, tokens, reps: int, number: int) -> dict[str, float] | None:
    engine = E.make_engine(engine_name, tokenizer)
    runtime = StructuredRuntime(tokenizer, max_rows=1, engine=engine_name, fill_threads=1, compile_workers=1)
    try:
        try:
            compiled = engine.compile(constraint)
        except ConstraintError:
            return None
        matcher = engine.matcher(compiled)
        runtime.compiled.put(compiled)
        runtime.add("r", compiled.constraint)
        runtime.wait(["r"])
        for token in tokens[:WALK]:
            if not matcher.accept_token(token):
                return None
            runtime.step(["r"])
            runtime.accept_rows(["r"], [token])
        own = runtime.requests.states["r"].matcher
        nxt = tokens[WALK]
        if own is None or not matcher.accept_token(nxt):  # timed as accept + rollback(1): it must be taken
            return None
        matcher.rollback(1)
        buffer = torch.zeros((1, engine.width), dtype=torch.int32)
        width, batch, values = engine.width, ["r"], [nxt]
        inner = getattr(matcher, "inner", None)
        step_host, accept_host = [], []

        def step():
            runtime.step(batch)
            step_host.append(runtime.last_step_seconds - runtime.last_fill_seconds)

        def accept():
            runtime.accept_rows(batch, values)
            accept_host.append(runtime.last_accept_seconds - runtime.last_accept_engine_seconds)
            own.rollback(1)

        calls = {
            "library fill": (lambda: inner.unsafe_compute_mask_ptr(buffer.data_ptr(), width * 4)) if inner is not None
            else (lambda: matcher.fill_next_token_bitmask(buffer, 0)),
            "check_rows": lambda: check_rows(buffer, [0], width),
            "batch_fill": lambda: engine.batch_fill([matcher], buffer, [0]),
            "accept": lambda: (matcher.accept_token(nxt), matcher.rollback(1)),
            "step": step,
            "accept_rows": accept,
            "perf_counter": __import__("time").perf_counter,
        }
        if inner is not None:
            calls["stop bits"] = lambda: matcher.agree(buffer, 0)
        best = {name: float("inf") for name in calls}
        for rep in range(reps):
            names = list(calls)[rep % len(calls):] + list(calls)[:rep % len(calls)]
            for name in names:
                best[name] = min(best[name], timeit.timeit(calls[name], number=number) / number * 1e9)
        out = {k: best[k] for k in ("library fill", "check_rows", "stop bits", "batch_fill", "accept", "perf_counter")
               if k in best}
        out["step host"] = statistics.median(step_host) * 1e9
        out["accept host"] = statistics.median(accept_host) * 1e9
        return out
    finally:
        runtime.close()
        engine.close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engine", nargs="+", default=["auto", "xgrammar", "llguidance"], choices=E.ENGINE_CHOICES)
    parser.add_argument("--schemas", type=int, default=4)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--number", type=int, default=5000)
    args = parser.parse_args(argv)
    tokenizer = tekken()
    cases = []
    for name in SCHEMAS:
        if not (DATA / name).exists():  # not every named file is in every MaskBench sample
            continue
        doc = json.loads((DATA / name).read_text())
        valid = [t["data"] for t in doc["tests"] if t["valid"]]
        if valid:
            text = json.dumps(valid[0], separators=(",", ":"), ensure_ascii=False)
            cases.append((name, json_schema(doc["schema"], strict=False, whitespace="none"), tokenizer.encode(text)))
    for engine_name in args.engine:
        rows = []
        for name, constraint, tokens in cases:
            if len(rows) == args.schemas:
                break
            found = parts(engine_name, tokenizer, constraint, tokens, args.reps, args.number)
            if found is None:
                continue
            rows.append(found)
            print(f"{engine_name:10} {name[:34]:34} " + "  ".join(f"{k} {v:7.0f}" for k, v in found.items()), flush=True)
        if rows:
            keys = rows[0].keys()
            print(f"{engine_name:10} {'median (ns)':34} " + "  ".join(
                f"{k} {statistics.median(r[k] for r in rows):7.0f}" for k in keys), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
