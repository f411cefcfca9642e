"""MaskBench on our engines: coverage, validation / invalidation errors, mask timings.

    python benchmarks/bench_schemas.py --data ../shared/data/maskbench-dev --engine auto|xgrammar|llguidance \
        [--tokenizer tekken] [--json OUT] [--timeout 60] [--unenforced refuse|allow] [--limit N]
    python benchmarks/bench_schemas.py --data ../shared/data/maskbench-dev --engines auto,llguidance,xgrammar

``--engines``: several engines in one run, each file through each engine in turn (its own worker process),
so that the machine's load falls on all alike; prints each engine's totals and ``auto``'s ratios to each
engine alone: time to first mask p50 and p90 against llguidance's (over the files both compiled), time
between masks p50 against xgrammar's (the median of per-file p50s over the files xgrammar alone compiled).

Each file is ``{"schema": ..., "tests": [{"valid": bool, "data": ...}]}``. Per file, in a
worker process (killed after ``--timeout`` seconds: status ``timeout``):

    compile     json_schema(schema, strict=False) (JSON Schema's own semantics) through the
                engine with the keyword policy: ``compiled``, ``refused`` (the unenforced
                keywords; the file is then also run with unenforced="allow" so its errors are
                counted, on a refused schema) or ``compile_error``
    feed        every test instance as compact JSON, tokenized by the real tokenizer, through a
                fresh matcher: each token must be allowed by the mask filled before it and
                accepted, then a stop token. Valid and rejected: a validation error; invalid
                and accepted to the end: an invalidation error, *silent* unless the file was
                refused or lists unenforced keywords.
    time        ttfm (time to first mask: compile + matcher + first fill, ms); tbm (time between
                masks: fill + accept per token through engines.py, us) p50 / p99; host (our part,
                batch 1: StructuredRuntime.step + accept_rows minus the engine's fill + accept, on
                the first valid instance, us) p50; wrapper (engines.py's layer: our fill minus the
                engine library's own fill call on the same state, us) p50.

Prints a table and the totals; ``--json`` writes ``{"files": [...], "totals": {...}}``.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import pathlib
import statistics
import sys
import time

import torch

from neuron_constrain.structured import engines as E
from neuron_constrain.structured.schema import keywords as K
from neuron_constrain.structured.constraints import ConstraintError, json_schema
from neuron_constrain.testing import force
from timing import write_results


def load_tokenizer(name: str):
    if name == "tekken":
        from neuron_constrain.structured.tokenizers import from_mistral, mistral_data_file

        return from_mistral(mistral_data_file("tekken_240911.json"))
    if name == "toy":
        from neuron_constrain.testing import toy_tokenizer

        return toy_tokenizer()
    raise SystemExit(f"--tokenizer {name!r}: pick tekken or toy")


def _percentile(values, q):
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _raw_fill_seconds(engine, matcher, buffer) -> float:
    """The engine's own fill call on ``matcher``'s state, without our layer."""
    start = time.perf_counter()
    if isinstance(matcher, E.LLGuidanceMatcher):
        matcher.inner.unsafe_compute_mask_ptr(buffer.data_ptr(), buffer.shape[-1] * 4)
    else:  # xgrammar's matcher is the engine's own
        matcher.fill_next_token_bitmask(buffer, 0)
    return time.perf_counter() - start


def _host_us(engine, compiled, tokens, buffer) -> list[float]:
    """Per token: our fill minus the engine's (same state, interleaved), in us."""
    matcher, out = engine.matcher(compiled), []
    for token in tokens:
        raw = _raw_fill_seconds(engine, matcher, buffer)
        start = time.perf_counter()
        engine.batch_fill([matcher], buffer, [0])
        ours = time.perf_counter() - start
        out.append(max(0.0, ours - raw) * 1e6)
        if not matcher.accept_token(token):
            break
    return out


_RUNTIME = []  # one StructuredRuntime per worker process (its compile threads do not survive a fork)


def _runtime_host_us(engine, tokenizer, compiled, tokens) -> list[float]:
    """Per token, batch 1: StructuredRuntime.step + accept_rows minus the engine's fill + accept, in us."""
    from neuron_constrain.structured.runtime.structured_runtime import StructuredRuntime

    if not _RUNTIME:
        _RUNTIME.append(StructuredRuntime(tokenizer, max_rows=1, engine=engine.name, fill_threads=1, compile_workers=1))
    runtime, out = _RUNTIME[0], []
    runtime.compiled.put(compiled)  # compiled once, by evaluate()
    runtime.add("bench", compiled.constraint)
    try:
        runtime.wait(["bench"])
        for token in tokens:
            runtime.step(["bench"])
            step = runtime.last_step_seconds - runtime.last_fill_seconds
            runtime.accept_rows(["bench"], [token])
            out.append((step + runtime.last_accept_seconds - runtime.last_accept_engine_seconds) * 1e6)
    finally:
        runtime.remove("bench")
    return out


def evaluate(engine, tokenizer, path: pathlib.Path, policy: str) -> dict:
    """One MaskBench file through ``engine``: the record of the module docstring."""
    data = json.loads(path.read_text())
    record = {"file": path.name, "status": "compiled", "unenforced": [], "validation_errors": 0,
              "invalidation_errors": 0, "silent_invalidation_errors": 0, "valid": 0, "invalid": 0,
              "ttfm_ms": None, "tbm_us_p50": None, "tbm_us_p99": None, "host_us_p50": None, "wrapper_us_p50": None,
              "error": ""}
    buffer = torch.zeros((1, engine.width), dtype=torch.int32)
    start = time.perf_counter()
    try:
        compiled = engine.compile(json_schema(data["schema"], strict=False, whitespace="none", unenforced=policy))
    except ConstraintError as error:
        record["error"] = str(error)[:300]
        item = getattr(error, "unenforced", None)
        if item is None:
            record["status"] = "compile_error"
            return record
        record["status"] = "refused"
        try:  # what the refusal prevented: the same schema, accepted
            compiled = engine.compile(json_schema(data["schema"], strict=False, whitespace="none", unenforced="allow"))
        except ConstraintError as second:
            record["unenforced"] = [item.describe()]
            record["error"] += f" | allowed: {str(second)[:200]}"
            return record
    engine.batch_fill([engine.matcher(compiled)], buffer, [0])
    record["ttfm_ms"] = (time.perf_counter() - start) * 1e3
    record["unenforced"] = [u.describe() for u in compiled.unenforced]
    record["engine"] = "+".join(compiled.engines)  # with --engine auto: the engine(s) that took this schema
    if compiled.successor is not None:  # auto's race: the masks while it runs, then once xgrammar's grammar is ready
        _race(engine, tokenizer, compiled, data, buffer, record, start)
    flagged = record["status"] == "refused" or bool(compiled.unenforced)
    tbm, host, wrapper, failures = [], [], [], []
    for index, test in enumerate(data.get("tests", [])):
        text = json.dumps(test["data"], separators=(",", ":"), ensure_ascii=False)
        tokens = tokenizer.encode(text)
        times = []
        accepted = force(engine, compiled, tokens, buffer=buffer, times=times)
        tbm.extend(t * 1e6 for t, _ in times)
        if test["valid"]:
            record["valid"] += 1
            if not accepted:
                record["validation_errors"] += 1
                failures.append(f"valid #{index} rejected: {text[:80]}")
            elif not host and record["status"] == "compiled":
                wrapper = _host_us(engine, compiled, tokens, buffer)
                host = _runtime_host_us(engine, tokenizer, compiled, tokens)
        else:
            record["invalid"] += 1
            if accepted:
                record["invalidation_errors"] += 1
                record["silent_invalidation_errors"] += 0 if flagged else 1
                failures.append(f"invalid #{index} accepted: {text[:80]}")
    record["tbm_us_p50"], record["tbm_us_p99"] = _percentile(tbm, 0.5), _percentile(tbm, 0.99)
    record["host_us_p50"], record["wrapper_us_p50"] = _percentile(host, 0.5), _percentile(wrapper, 0.5)
    record["failures"] = failures[:6]
    return record


def _race(engine, tokenizer, compiled, data, buffer, record, start) -> None:
    """``tbm_racing_us_p50``: the first instance fed at once, while xgrammar compiles (llguidance's masks until the
    move); then waits for xgrammar's grammar (``race_ready_ms`` after the compile began, or ``race`` failed), so the
    instances timed below start on it, as every request does whose decode outlasts the compile."""
    first = next((test for test in data.get("tests", []) if test["valid"]), None)
    if first is not None:
        times: list = []
        force(engine, compiled, tokenizer.encode(json.dumps(first["data"], separators=(",", ":"), ensure_ascii=False)),
              buffer=buffer, times=times)
        record["tbm_racing_us_p50"] = _percentile([t * 1e6 for t, _ in times], 0.5)
    try:
        compiled.successor.result()
        record["race"], record["race_ready_ms"] = "xgrammar ready", (time.perf_counter() - start) * 1e3
    except Exception as error:  # noqa: BLE001 - a limit or refusal: the requests stay on llguidance
        record["race"] = f"xgrammar failed: {type(error).__name__}"


def _worker(connection, engine, tokenizer, policy):
    while True:
        path = connection.recv()
        if path is None:
            return
        try:
            connection.send(evaluate(engine, tokenizer, pathlib.Path(path), policy))
        except Exception as error:  # one bad file must not end the run
            connection.send({"file": pathlib.Path(path).name, "status": "compile_error", "unenforced": [],
                             "error": f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"})


class _Pool:
    """One forked worker (inherits the built engine); killed and re-forked on a timeout."""

    def __init__(self, engine, tokenizer, policy):
        self.args = (engine, tokenizer, policy)
        self.process = None

    def run(self, path: pathlib.Path, timeout: float) -> dict | None:
        if self.process is None:
            context = multiprocessing.get_context("fork")
            self.parent, child = context.Pipe()
            self.process = context.Process(target=_worker, args=(child, *self.args), daemon=True)
            self.process.start()
        self.parent.send(str(path))
        if self.parent.poll(timeout):
            return self.parent.recv()
        self.process.kill()
        self.process.join()
        self.process = None
        return None

    def close(self):
        if self.process is not None:
            self.parent.send(None)
            self.process.join(5)


def _timed_out(path: pathlib.Path, args, engine: str) -> dict:
    """A file whose worker ran past the limit: ``refused`` if the policy refuses it (the limit was hit
    compiling it with unenforced="allow", to count what the refusal prevented), else ``timeout``."""
    judge = "llguidance" if engine == "auto" else engine  # auto refuses what llguidance (its fallback) does
    schema = json.loads(path.read_text())["schema"]
    found = K.find(K.prepare(schema, judge), judge) if args.unenforced == "refuse" and isinstance(schema, dict) else []
    if found:
        return {"file": path.name, "status": "refused", "unenforced": [u.describe() for u in found],
                "error": f"refused; compiling it anyway (unenforced='allow') ran over {args.timeout:.0f} s"}
    return {"file": path.name, "status": "timeout", "unenforced": [], "error": f"over {args.timeout:.0f} s"}


def totals(records: list[dict]) -> dict:
    count = {s: sum(r["status"] == s for r in records) for s in ("compiled", "refused", "compile_error", "timeout")}
    valid = sum(r.get("valid", 0) for r in records)
    compiled = [r for r in records if r["status"] == "compiled"]
    out = {
        "files": len(records), **count,
        "coverage": count["compiled"] / len(records) if records else 0.0,
        "valid_instances": valid, "invalid_instances": sum(r.get("invalid", 0) for r in records),
        "validation_errors": sum(r.get("validation_errors", 0) for r in records),
        "validation_errors_compiled": sum(r.get("validation_errors", 0) for r in compiled),
        "valid_instances_compiled": sum(r.get("valid", 0) for r in compiled),
        "invalidation_errors": sum(r.get("invalidation_errors", 0) for r in records),
        "invalidation_errors_on_refused_or_reported": sum(
            r.get("invalidation_errors", 0) - r.get("silent_invalidation_errors", 0) for r in records),
        "silent_invalidation_errors": sum(r.get("silent_invalidation_errors", 0) for r in records),
        "passing_files": sum(r["status"] == "compiled" and r["validation_errors"] == 0 and r["invalidation_errors"] == 0
                             for r in records),
    }
    for key in ("ttfm_ms", "tbm_us_p50", "host_us_p50", "wrapper_us_p50", "tbm_racing_us_p50", "race_ready_ms"):
        values = [r[key] for r in compiled if r.get(key) is not None]
        out[f"{key}_median"] = statistics.median(values) if values else None
    out["compiled_by"] = {e: sum(r.get("engine") == e for r in compiled)  # auto's split; + : raced
                          for e in sorted({r.get("engine") for r in compiled} - {None})}
    values = [r["tbm_us_p99"] for r in compiled if r.get("tbm_us_p99") is not None]
    out["tbm_us_p99_median"] = statistics.median(values) if values else None
    if out["host_us_p50_median"] and out["tbm_us_p50_median"]:
        out["host_over_tbm_p50"] = out["host_us_p50_median"] / out["tbm_us_p50_median"]
    return out


def ratios(records: dict[str, list[dict]]) -> dict:
    """``auto``'s figures over each engine alone's, on the files both compiled (``--engines``)."""
    by_file = {name: {r["file"]: r for r in rs if r["status"] == "compiled"} for name, rs in records.items()}
    out = {}

    def over(key, other, q, files=None, their_key=None):
        their_key = their_key or key
        both = sorted(set(by_file["auto"]) & set(by_file[other]) if files is None else files)
        pairs = [(by_file["auto"][f].get(key), by_file[other][f].get(their_key)) for f in both]
        ours = [a for a, b in pairs if a is not None and b is not None]
        theirs = [b for a, b in pairs if a is not None and b is not None]
        if not ours:
            return None
        return {"auto": _percentile(ours, q), other: _percentile(theirs, q),
                "ratio": _percentile(ours, q) / _percentile(theirs, q), "files": len(ours)}

    if "auto" in by_file and "llguidance" in by_file:
        out["ttfm_p50_auto_over_llguidance"] = over("ttfm_ms", "llguidance", 0.5)
        out["ttfm_p90_auto_over_llguidance"] = over("ttfm_ms", "llguidance", 0.9)
    if "auto" in by_file and "xgrammar" in by_file:
        xgrammar_files = [f for f in by_file["xgrammar"] if f in by_file["auto"]]
        out["tbm_p50_auto_over_xgrammar"] = over("tbm_us_p50", "xgrammar", 0.5, xgrammar_files)
        out["tbm_racing_p50_auto_over_xgrammar"] = over("tbm_racing_us_p50", "xgrammar", 0.5, xgrammar_files,
                                                       "tbm_us_p50")
        out["ttfm_p90_auto_over_xgrammar"] = over("ttfm_ms", "xgrammar", 0.9)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", required=True, help="folder of MaskBench .json files")
    parser.add_argument("--engine", choices=E.ENGINE_CHOICES, help="one engine")
    parser.add_argument("--engines", help="several, comma-separated, in one run (e.g. auto,llguidance,xgrammar)")
    parser.add_argument("--tokenizer", default="tekken", choices=("tekken", "toy"))
    parser.add_argument("--json", help="write the records and totals here")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per file (compile + all instances)")
    parser.add_argument("--unenforced", default="refuse", choices=("refuse", "allow"), help="the keyword policy")
    parser.add_argument("--limit", type=int, help="first N files only")
    args = parser.parse_args(argv)
    files = sorted(p for p in pathlib.Path(args.data).glob("*.json"))
    if args.limit:
        files = files[: args.limit]
    if not files:
        raise SystemExit(f"no .json files in {args.data}")
    names = args.engines.split(",") if args.engines else [args.engine]
    if not all(names) or set(names) - set(E.ENGINE_CHOICES):
        raise SystemExit(f"pass --engine or --engines, from {', '.join(E.ENGINE_CHOICES)}")
    wall = time.perf_counter()
    tokenizer = load_tokenizer(args.tokenizer)
    pools = {name: _Pool(E.make_engine(name, tokenizer), tokenizer, args.unenforced) for name in names}
    records: dict[str, list[dict]] = {name: [] for name in names}
    print(f"{'file':48} {'engine':10} {'status':13} {'val':>4} {'inv':>4} {'ttfm ms':>8} {'tbm p50':>8} {'p99':>8}  "
          "unenforced")
    for path in files:
        for name, pool in pools.items():
            record = pool.run(path, args.timeout) or _timed_out(path, args, name)
            records[name].append(record)
            fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
            print(f"{path.name[:48]:48} {name:10} {record['status']:13} {record.get('validation_errors', 0):4} "
                  f"{record.get('invalidation_errors', 0):4} {fmt(record.get('ttfm_ms'), '8.1f')} "
                  f"{fmt(record.get('tbm_us_p50'), '8.1f')} {fmt(record.get('tbm_us_p99'), '8.0f')}  "
                  f"{', '.join(record['unenforced'])[:60]}", flush=True)
    for pool in pools.values():
        pool.close()
    from importlib.metadata import version

    summaries = {}
    for name in names:
        summaries[name] = totals(records[name])
        summaries[name].update(engine=name, tokenizer=args.tokenizer, policy=args.unenforced,
                               versions={"xgrammar": version("xgrammar"), "llguidance": version("llguidance")},
                               wall_s=time.perf_counter() - wall)
        print(f"{name}:", json.dumps(summaries[name], indent=1))
    if len(names) == 1:
        result = {"files": records[names[0]], "totals": summaries[names[0]]}
    else:
        result = {"engines": {n: {"files": records[n], "totals": summaries[n]} for n in names},
                  "ratios": ratios(records)}
        print("ratios:", json.dumps(result["ratios"], indent=1))
    if args.json:
        write_results(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
