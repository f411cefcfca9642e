"""What constraining does to a real model's answers, and how fast: SmolLM2-135M-Instruct on
the task set in ``benchmarks/data/quality_tasks.json`` (extraction with known answers,
classification into an enum, lists of n items, nested objects, tool calls with known
arguments).

    python benchmarks/bench_quality.py --model smollm2 --json OUT.json [--plot OUT.png]
        [--max-tokens 160] [--batch 8] [--speed-tasks 16] [--limit N]

Every task runs unconstrained and constrained on each engine (xgrammar, llguidance) in
each whitespace mode (none, compact, bounded, any), greedy, through the KV-cached
``generate()`` at batch ``--batch``. JSON tasks ask in the prompt for JSON matching the
schema; tool tasks render the tools Hermes-style (tool_choice="required" when
constrained; unconstrained the calls are parsed out of the text, format="hermes"). Per
task and per mode:

    valid        schema-valid as returned (the text is the JSON / the tool calls and nothing else)
    valid_fence  schema-valid after pulling JSON out of a code fence or the surrounding text
                 (unconstrained tool tasks: calls lifted from free text)
    accuracy     exact-match accuracy per field of the expected answer (strings compared
                 case-folded and stripped; lists element by element, or as sets when unordered)
    tokens, seconds   output tokens; the request's own seconds (its prefill to its last step)

Totals per mode, and "compiled": the constrained requests whose grammar compiled (valid
is then measured over those). The anchor: the same tasks (the first ``--speed-tasks``)
through Hugging Face ``generate`` with xgrammar's own logits processor
(``xgrammar.contrib.hf``), constrained as ours is on xgrammar with json_schema's default
whitespace, at batch 1 and 8, side by side with ours: output tokens per second (prefill
included), and how many outputs are token-identical.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys
import time

import torch

from neuron_constrain import models as M
from neuron_constrain import structured as S
from neuron_constrain.models.answer import TOOL_FORMAT
from neuron_constrain.structured.constraints import WHITESPACE

TASKS = pathlib.Path(__file__).parent / "data" / "quality_tasks.json"
ENGINES = ("xgrammar", "llguidance")


def prompt_text(task: dict) -> str:
    if task["kind"] == "tool":
        return task["prompt"]
    return f"{task['prompt']}\nAnswer with JSON only, matching this JSON schema: {json.dumps(task['schema'])}"


def constraint_for(task: dict, tools: list, whitespace: str | None) -> S.Constraint | None:
    if whitespace is None:
        return None
    if task["kind"] == "tool":  # the tool-call format fixes its own whitespace (bounded: 2 a gap)
        return S.tool_constraint(tools, "required", format=TOOL_FORMAT, parallel_tool_calls=False)
    return S.json_schema(task["schema"], whitespace=whitespace)


# ----------------------------------------------------------------------------- scoring

_FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.S)


def extract_json(text: str):
    """The JSON value in ``text``: a fenced block's, else the first value starting at ``{`` or ``[``."""
    candidates = [m.group(1) for m in _FENCE.finditer(text)] + [text]
    decoder = json.JSONDecoder()
    for candidate in candidates:
        for start in [i for i, c in enumerate(candidate) if c in "{["][:20]:
            try:
                return decoder.raw_decode(candidate[start:])[0]
            except json.JSONDecodeError:
                continue
    raise ValueError("no JSON value in the text")


def _norm(value):
    if isinstance(value, str):
        return value.strip().strip(".").casefold()
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, (int, float)):
        return float(value)
    return value


def field_scores(expected, got, ordered: bool = True, path: str = "") -> dict[str, bool]:
    """One bool per field of ``expected`` (nested objects flattened, list elements counted)."""
    if isinstance(expected, dict):
        scores = {}
        for key, value in expected.items():
            child = got.get(key) if isinstance(got, dict) else None
            scores.update(field_scores(value, child, ordered, f"{path}.{key}"))
        return scores
    if isinstance(expected, list):
        items = got if isinstance(got, list) else []
        if ordered:
            return {f"{path}[{i}]": i < len(items) and _norm(items[i]) == _norm(e) for i, e in enumerate(expected)}
        pool = [_norm(i) for i in items]
        scores = {}
        for i, e in enumerate(expected):
            scores[f"{path}[{i}]"] = _norm(e) in pool
            if _norm(e) in pool:
                pool.remove(_norm(e))
        return scores
    return {path or ".": _norm(expected) == _norm(got)}


def score(task: dict, tools: list, text: str) -> dict:
    """valid (as returned), valid_fence, accuracy (fraction of fields right), fields."""
    if task["kind"] == "tool":
        check = S.tool_constraint(tools, "required", format=TOOL_FORMAT, parallel_tool_calls=False)
        valid = S.validate_output(check, text) is None
        try:
            _, calls = S.parse_tool_calls(text, tools, "auto", format=TOOL_FORMAT)
        except S.ConstraintError:
            calls = []
        if not calls:  # a bare {"name", "arguments"} object, fenced or not
            try:
                value = extract_json(text)
                _, calls = S.parse_tool_calls(json.dumps(value), tools, "auto", format="json")
            except (ValueError, S.ConstraintError):
                calls = []
        got = {"name": calls[0].name, "arguments": calls[0].arguments} if calls else None
        fenced = got is not None and _arguments_valid(tools, got)
    else:
        constraint = S.json_schema(task["schema"])
        valid = S.validate_output(constraint, text) is None
        try:
            got = extract_json(text)
            fenced = S.validate_output(constraint, json.dumps(got)) is None
        except ValueError:
            got, fenced = None, False
    fields = field_scores(task["expected"], got, task.get("ordered", True))
    return {"valid": valid, "valid_fence": valid or fenced, "accuracy": sum(fields.values()) / len(fields),
            "exact": all(fields.values())}


def _arguments_valid(tools: list, call: dict) -> bool:
    import jsonschema

    for tool in tools:
        if tool["function"]["name"] == call["name"]:
            return not list(jsonschema.Draft202012Validator(tool["function"]["parameters"]).iter_errors(call["arguments"]))
    return False


# ----------------------------------------------------------------------------- runs


def run_mode(decoder, loaded, tasks, tools, prompts, engine, whitespace, max_tokens, runtimes) -> tuple[list[dict], float]:
    constraints = [constraint_for(t, tools, whitespace) for t in tasks]
    runtime = runtimes.get(engine or "xgrammar")
    start = time.perf_counter()
    result = S.generate(decoder, prompts, constraints, max_tokens, tokenizer=loaded.tokenizer, runtime=runtime)
    wall = time.perf_counter() - start
    rows = []
    for task, constraint, out in zip(tasks, constraints, result.outputs):
        row = {"task": task["id"], "kind": task["kind"], "engine": engine or "none", "whitespace": whitespace or "none",
               "constrained": constraint is not None, "finish_reason": out.finish_reason, "error": out.error,
               "tokens": len(out.tokens), "seconds": round(out.seconds or 0.0, 3), "text": out.text,
               "compiled": out.finish_reason != "error"}
        row.update(score(task, tools, out.text))
        rows.append(row)
    print(f"  {engine or 'unconstrained':12s} {whitespace or '-':8s} {wall:7.1f} s  "
          f"valid {sum(r['valid'] for r in rows)}/{len(rows)}  fence {sum(r['valid_fence'] for r in rows)}/{len(rows)}  "
          f"accuracy {sum(r['accuracy'] for r in rows) / len(rows):.3f}", flush=True)
    return rows, wall


def totals(rows: list[dict], wall: float) -> dict:
    compiled = [r for r in rows if r["compiled"]]
    n = len(rows)
    tokens = sum(r["tokens"] for r in rows)
    return {
        "tasks": n, "compiled": len(compiled),
        "valid": sum(r["valid"] for r in rows) / n,
        "valid_of_compiled": sum(r["valid"] for r in compiled) / max(1, len(compiled)),
        "valid_fence": sum(r["valid_fence"] for r in rows) / n,
        "accuracy": sum(r["accuracy"] for r in rows) / n,
        "exact": sum(r["exact"] for r in rows) / n,
        "stopped": sum(r["finish_reason"] == "stop" for r in rows) / n,
        "tokens": tokens, "seconds": round(wall, 2), "tokens_per_second": tokens / wall,
        "by_kind": {k: sum(r["accuracy"] for r in rows if r["kind"] == k) / sum(r["kind"] == k for r in rows)
                    for k in sorted({r["kind"] for r in rows})},
    }


def hf_xgrammar(loaded, prompts, constraints, max_tokens, batch) -> tuple[list[list[int]], float]:
    """HF ``generate`` greedy with ``xgrammar.contrib.hf.LogitsProcessor``, ``batch`` prompts at a time (left-padded)."""
    from xgrammar.contrib.hf import LogitsProcessor

    from neuron_constrain.structured.engines import XGrammarEngine

    engine = XGrammarEngine(loaded.tokenizer)  # the grammars ours compiles (the same text for every task)
    try:
        grammars = [engine.compile(c).grammar for c in constraints]
    finally:
        engine.close()
    eos, outputs = loaded.tokenizer.eos_id, []
    start = time.perf_counter()
    for first in range(0, len(prompts), batch):
        group = prompts[first:first + batch]
        width = max(len(p) for p in group)
        ids = torch.tensor([[eos] * (width - len(p)) + p for p in group])
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        with torch.no_grad():
            out = loaded.model.generate(ids, attention_mask=attention, max_new_tokens=max_tokens, do_sample=False,
                                        pad_token_id=eos, logits_processor=[LogitsProcessor(grammars[first:first + batch])])
        for row in out[:, width:].tolist():
            outputs.append(row[: row.index(eos) + 1] if eos in row else row)
    return outputs, time.perf_counter() - start


def speed(loaded, decoders, tasks, tools, prompts, max_tokens) -> dict:
    """Ours (xgrammar, default whitespace) vs HF generate + xgrammar's processor, same requests, batch 1 and 8."""
    default = S.json_schema({}).whitespace
    constraints = [constraint_for(t, tools, default) for t in tasks]
    report = {}
    for batch, decoder in decoders.items():
        runtime = S.StructuredRuntime.for_model(decoder, loaded.tokenizer, max_rows=batch, engine="xgrammar")
        try:
            # warm: every grammar compiled (and cached) before the clock starts, as HF's are below
            S.generate(decoder, prompts, constraints, 1, tokenizer=loaded.tokenizer, runtime=runtime)
            runs = {}
            for name in (("ours", "hf") if batch == 1 else ("hf", "ours")):  # alternate which goes first
                if name == "ours":
                    start = time.perf_counter()
                    out = S.generate(decoder, prompts, constraints, max_tokens, tokenizer=loaded.tokenizer, runtime=runtime)
                    runs[name] = ([o.tokens for o in out.outputs], time.perf_counter() - start)
                else:
                    runs[name] = hf_xgrammar(loaded, prompts, constraints, max_tokens, batch)
        finally:
            runtime.close()
        line = {}
        for name, (tokens, seconds) in runs.items():
            count = sum(len(t) for t in tokens)
            line[name] = {"tokens": count, "seconds": round(seconds, 2), "tokens_per_second": count / seconds}
        line["ratio"] = line["ours"]["tokens_per_second"] / line["hf"]["tokens_per_second"]
        line["identical"] = sum(a == b for a, b in zip(runs["ours"][0], runs["hf"][0]))
        line["requests"] = len(prompts)
        report[str(batch)] = line
        print(f"  batch {batch}: ours {line['ours']['tokens_per_second']:.2f} tok/s, HF+xgrammar "
              f"{line['hf']['tokens_per_second']:.2f} tok/s, ratio {line['ratio']:.2f}, identical "
              f"{line['identical']}/{len(prompts)}", flush=True)
    return report


def memory_bandwidth(megabytes: int = 512, repeats: int = 8) -> dict:
    """This machine's memory bandwidth, bytes/s, over a ``megabytes`` tensor (far over any
    cache), the best of ``repeats``: ``"copy"`` counts the bytes read and written by a copy,
    ``"read"`` the bytes a sum reads (a decode step's GEMVs only read their weights)."""
    source = torch.rand(megabytes * 2**20 // 4)
    target = torch.empty_like(source)
    size = source.numel() * 4
    best = {"copy": float("inf"), "read": float("inf")}
    for _ in range(repeats):
        for name, run in (("copy", lambda: target.copy_(source)), ("read", source.sum)):
            start = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - start)
    return {"copy": 2 * size / best["copy"], "read": size / best["read"]}


def weight_bytes(model) -> int:
    """The bytes of weights one decode step reads: every parameter once (tied ones once)."""
    unique = {p.data_ptr(): p for p in model.parameters()}
    return sum(p.numel() * p.element_size() for p in unique.values())


def physical_limit(model, speed_report: dict) -> dict:
    """Batch-1 decode reads every weight once a token: the bound is bandwidth / weight bytes
    (with the copy's bandwidth, and with the read-only one)."""
    bandwidth = memory_bandwidth()
    size = weight_bytes(model)
    line = {"weight_bytes": size}
    for kind, value in bandwidth.items():
        bound = value / size
        line[kind] = {"bandwidth_bytes_per_second": value, "bound_tokens_per_second": bound}
        if "1" in speed_report:
            line[kind]["ours_fraction_of_bound"] = speed_report["1"]["ours"]["tokens_per_second"] / bound
            line[kind]["hf_fraction_of_bound"] = speed_report["1"]["hf"]["tokens_per_second"] / bound
        print(f"  physical limit ({kind}): {size / 1e6:.0f} MB of weights a step / {value / 1e9:.1f} GB/s = "
              f"{bound:.1f} tokens/s at batch 1; ours {line[kind].get('ours_fraction_of_bound', 0):.2f} of it, "
              f"HF {line[kind].get('hf_fraction_of_bound', 0):.2f}", flush=True)
    return line


def plot(summary: dict, path: str) -> None:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        print("(no matplotlib: --plot skipped)")
        return
    names = list(summary)
    figure = Figure(figsize=(max(8, len(names) * 0.9), 4.5))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    width = 0.27
    for offset, key in ((-width, "valid"), (0, "valid_fence"), (width, "accuracy")):
        axes.bar([i + offset for i in range(len(names))], [summary[n][key] for n in names], width, label=key)
    axes.set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize=8)
    axes.set_ylim(0, 1.05)
    axes.legend(fontsize=8)
    axes.set_title("SmolLM2-135M-Instruct: unconstrained vs constrained (engine / whitespace)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", choices=M.MODELS)
    parser.add_argument("--json", metavar="OUT")
    parser.add_argument("--plot", metavar="OUT.png")
    parser.add_argument("--tasks", default=str(TASKS))
    parser.add_argument("--limit", type=int, default=None, help="the first N tasks only")
    parser.add_argument("--sample", type=int, default=None, help="N tasks spread over the set (every k-th)")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--speed-tasks", type=int, default=16, help="tasks in the tokens/s comparison (0: skip it)")
    parser.add_argument("--modes", default="all", help="'all', or a comma list such as none,xgrammar:bounded")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--compile", default="inductor", choices=("inductor", "none"),
                        help="our programs as AOTInductor packages (default; compiled once, then cached) or eager")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="our model's weights (HF's stay float32: the identity column is then agreement)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    compile_with = None if args.compile == "none" else args.compile
    data = json.loads(pathlib.Path(args.tasks).read_text())
    tasks, tools = data["tasks"][: args.limit], data["tools"]
    if args.sample:
        tasks = tasks[:: max(1, len(tasks) // args.sample)][: args.sample]
    loaded = M.load_model(args.model)
    ours = loaded if args.dtype == "float32" else M.load_model(args.model, dtype=getattr(torch, args.dtype))
    prompts = [M.prompt_ids(loaded, prompt_text(t), tools=tools if t["kind"] == "tool" else None) for t in tasks]
    start = time.perf_counter()
    decoder = M.export(ours, max_batch=args.batch, max_len=1024, compile=compile_with)
    print(f"{args.model}: {len(tasks)} tasks, decoder (batch {args.batch}, {args.dtype}, compile {args.compile}) exported "
          f"in {time.perf_counter() - start:.1f} s; torch threads {torch.get_num_threads()}", flush=True)
    modes = [(None, None)] + [(e, w) for e in ENGINES for w in WHITESPACE]
    if args.modes != "all":
        wanted = {m.strip() for m in args.modes.split(",")}
        modes = [m for m in modes if (m[0] is None and "none" in wanted) or f"{m[0]}:{m[1]}" in wanted]
    report = {"model": args.model, "tasks": len(tasks), "max_tokens": args.max_tokens, "batch": args.batch,
              "threads": torch.get_num_threads(), "default_whitespace": S.json_schema({}).whitespace,
              "compile": args.compile, "dtype": args.dtype}
    if args.speed_tasks:  # first: the one number that needs both batch sizes
        start = time.perf_counter()
        decoders = {1: M.export(ours, max_batch=1, max_len=1024, compile=compile_with), 8: decoder if args.batch == 8
                    else M.export(ours, max_batch=8, max_len=1024, compile=compile_with)}
        print(f"speed: batch-1 decoder exported in {time.perf_counter() - start:.1f} s", flush=True)
        n = args.speed_tasks
        report["speed"] = speed(loaded, decoders, tasks[:n], tools, prompts[:n], args.max_tokens)
        report["physical_limit"] = physical_limit(ours.model, report["speed"])
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(report, indent=1))
    runtimes = {e: S.StructuredRuntime.for_model(decoder, loaded.tokenizer, max_rows=args.batch, engine=e) for e in ENGINES}
    rows, summary = [], {}
    report.update(totals=summary, rows=rows)
    try:
        for engine, whitespace in modes:
            mode_rows, wall = run_mode(decoder, loaded, tasks, tools, prompts, engine, whitespace, args.max_tokens, runtimes)
            rows += mode_rows
            summary["unconstrained" if engine is None else f"{engine}/{whitespace}"] = totals(mode_rows, wall)
            if args.json:  # after every mode: a long run's partial results survive
                pathlib.Path(args.json).write_text(json.dumps(report, indent=1))
    finally:
        for runtime in runtimes.values():
            runtime.close()
    print(f"\n{'mode':22s} {'compiled':>8s} {'valid':>6s} {'fence':>6s} {'accuracy':>8s} {'exact':>6s} {'tokens':>7s} {'tok/s':>6s}")
    for name, t in summary.items():
        print(f"{name:22s} {t['compiled']:8d} {t['valid']:6.3f} {t['valid_fence']:6.3f} {t['accuracy']:8.3f} "
              f"{t['exact']:6.3f} {t['tokens']:7d} {t['tokens_per_second']:6.2f}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}")
    if args.plot:
        plot(summary, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
