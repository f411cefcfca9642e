"""Tool-call grammars: ours (``tool_constraint``) against xgrammar's own built-in structural tag for the same
family, same tools, same vocabulary, side by side in one run.

    .venv/bin/python benchmarks/bench_tools.py [--files N] [--out PATH]

Tools: each BFCL file of the MaskBench development sample (``/work/shared/data/maskbench-dev/BFCL_*``) is one
tool (its schema as the parameters), taken in groups of three as a tool set; ``tool_choice="required"``.
Vocabulary: Tekken (mistral-common's files). Measured per family: compile time (xgrammar's
``GrammarCompiler`` on our EBNF / on ``get_model_structural_tag``) and the time of the first mask fill.
Reported: p50 of each, and their ratio (target <= 1.2). A tool set one side refuses is counted apart.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import time

import xgrammar as xgr

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from neuron_constrain.structured import ConstraintError, tool_constraint  # noqa: E402
from neuron_constrain.structured.engines.xgrammar.grammars import xgrammar_info  # noqa: E402
from neuron_constrain.structured.tokenizers import from_mistral, mistral_data_file  # noqa: E402
from timing import write_results  # noqa: E402

TARGET = 1.2
FAMILIES = {"hermes": "qwen_3", "qwen3_coder": "qwen_3_coder", "llama3_json": "llama"}  # ours -> xgrammar's


def tool_sets(count: int) -> list[list[dict]]:
    files = sorted(glob.glob("/work/shared/data/maskbench-dev/BFCL_*.json"))[:count]
    tools = []
    for index, path in enumerate(files):
        schema = json.load(open(path))["schema"]
        if isinstance(schema, dict) and schema.get("type") == "object":
            tools.append({"type": "function", "function": {"name": f"tool_{index}", "parameters": schema}})
    return [tools[i:i + 3] for i in range(0, len(tools), 3)]


def timed(compiler, build, size: int) -> tuple[float, float]:
    start = time.perf_counter()
    compiled = build(compiler)
    compile_s = time.perf_counter() - start
    matcher, mask = xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, size)
    start = time.perf_counter()
    matcher.fill_next_token_bitmask(mask)
    return compile_s, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--files", type=int, default=24)
    parser.add_argument("--out", default="benchmarks/results/bench_tools.json")
    args = parser.parse_args()
    tok = from_mistral(mistral_data_file("tekken_240911.json"))
    info = xgrammar_info(tok.info)
    results = {}
    for ours, theirs in FAMILIES.items():
        rows, refused = [], {"ours": 0, "xgrammar": 0}
        for tools in tool_sets(args.files):
            try:
                constraint = tool_constraint(tools, "required", format=ours, tokenizer=tok)
            except ConstraintError:
                refused["ours"] += 1
                continue
            try:
                tag = xgr.get_model_structural_tag(theirs, tools=tools, tool_choice="required", reasoning="disabled")
            except Exception:  # noqa: BLE001 - counted as its refusal
                refused["xgrammar"] += 1
                continue
            compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)  # no cache between sides
            a = timed(compiler, lambda c: c.compile_grammar(constraint.spec), info.vocab_size)
            b = timed(compiler, lambda c: c.compile_structural_tag(tag), info.vocab_size)
            rows.append((a, b))
        if not rows:
            results[ours] = {"refused": refused}
            continue
        p50 = {side: [statistics.median(r[i][j] for r in rows) for j in (0, 1)] for i, side in enumerate(("ours", "xgrammar"))}
        results[ours] = {"tool_sets": len(rows), "refused": refused,
                         "compile_ms_p50": {s: round(v[0] * 1e3, 2) for s, v in p50.items()},
                         "first_mask_us_p50": {s: round(v[1] * 1e6, 1) for s, v in p50.items()},
                         "compile_ratio": round(p50["ours"][0] / p50["xgrammar"][0], 3),
                         "mask_ratio": round(p50["ours"][1] / p50["xgrammar"][1], 3)}
        print(ours, "vs", theirs, json.dumps(results[ours]))
    write_results({"target": TARGET, "families": results}, args.out)


if __name__ == "__main__":
    main()
