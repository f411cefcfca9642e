"""Tool-call grammars: ours (``tool_constraint``) against xgrammar's own built-in structural tag for the same
family, same tools, same vocabulary, side by side in one run.

    .venv/bin/python benchmarks/bench_tools.py [--files N] [--out PATH]

Tools: each BFCL file of the MaskBench development sample (``/work/shared/data/maskbench-dev/BFCL_*``) is one
tool (its schema as the parameters), taken in groups of three as a tool set; ``tool_choice="required"``.
Vocabulary: Tekken (mistral-common's files). Measured per family: compile time (xgrammar's
``GrammarCompiler``, no cache, on our EBNF / on ``get_model_structural_tag``) and the time between masks
(each ``fill_next_token_bitmask`` along the same tokens on both sides: a seeded random walk through our
masks, the stop token taken when allowed, up to ``--steps`` tokens, replayed on xgrammar's grammar for as
long as it accepts them). Reported: p50 of each, and their ratio
(target <= 1.2 on both). A tool set one side refuses is counted apart. Ours runs ``required`` as written
(calls only); xgrammar's ``required`` for the Qwen / Llama formats lets text in between the calls.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import random
import statistics
import sys
import time

import numpy
import xgrammar as xgr

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from neuron_constrain.structured import ConstraintError, tool_constraint  # noqa: E402
from neuron_constrain.structured.engines.xgrammar.grammars import xgrammar_info  # noqa: E402
from neuron_constrain.structured.tokenizers import from_mistral, mistral_data_file  # noqa: E402
from timing import write_results  # noqa: E402

TARGET = 1.2
FAMILIES = {"hermes": "qwen_3", "qwen3_coder": "qwen_3_coder", "llama3_json": "llama", "deepseek_v3": "deepseek_v3_1",
            "kimi_k2": "kimi", "harmony": "harmony"}  # ours -> xgrammar's


def tool_sets(count: int) -> list[list[dict]]:
    files = sorted(glob.glob("/work/shared/data/maskbench-dev/BFCL_*.json"))[:count]
    tools = []
    for index, path in enumerate(files):
        schema = json.load(open(path))["schema"]
        if isinstance(schema, dict) and schema.get("type") == "object":
            tools.append({"type": "function", "function": {"name": f"tool_{index}", "parameters": schema}})
    return [tools[i:i + 3] for i in range(0, len(tools), 3)]


def walk(compiled, size: int, eos: int, steps: int, seed: int) -> list[int]:
    """A seeded random walk through the masks of ``compiled`` (the stop token taken when allowed)."""
    matcher, mask, rng, tokens = xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, size), random.Random(seed), []
    for _ in range(steps):
        if matcher.is_terminated():
            break
        matcher.fill_next_token_bitmask(mask)
        bits = numpy.unpackbits(mask[0].numpy().view(numpy.uint8), bitorder="little")[:size]
        allowed = numpy.flatnonzero(bits)
        token = eos if bits[eos] else int(allowed[rng.randrange(len(allowed))])
        if not len(allowed) or not matcher.accept_token(token):
            break
        tokens.append(token)
    return tokens


def fills(compiled, tokens: list[int], size: int) -> list[float]:
    """The seconds of each mask fill while ``tokens`` are accepted, up to the first one refused."""
    matcher, mask, times = xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, size), []
    for token in tokens:
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(mask)
        times.append(time.perf_counter() - start)
        if not matcher.accept_token(token):
            break
    return times


def compiled_in(compiler, build) -> tuple[float, object]:
    start = time.perf_counter()
    compiled = build(compiler)
    return time.perf_counter() - start, compiled


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--files", type=int, default=24)
    parser.add_argument("--steps", type=int, default=32)
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
            ours_s, ours_grammar = compiled_in(compiler, lambda c: c.compile_grammar(constraint.spec))
            theirs_s, theirs_grammar = compiled_in(compiler, lambda c: c.compile_structural_tag(tag))
            tokens = walk(ours_grammar, info.vocab_size, tok.eos_id, args.steps, len(rows))
            theirs_fills = fills(theirs_grammar, tokens, info.vocab_size)  # the same tokens, while theirs takes them
            ours_fills = fills(ours_grammar, tokens, info.vocab_size)[:len(theirs_fills)]
            rows.append(((ours_s, ours_fills), (theirs_s, theirs_fills)))
        if not rows:
            results[ours] = {"refused": refused}
            continue
        p50 = {side: (statistics.median(r[i][0] for r in rows),
                      statistics.median(fill for r in rows for fill in r[i][1]))
               for i, side in enumerate(("ours", "xgrammar"))}
        results[ours] = {"xgrammar": theirs, "tool_sets": len(rows), "refused": refused,
                         "fills_compared": sum(len(r[1][1]) for r in rows),
                         "compile_ms_p50": {s: round(v[0] * 1e3, 2) for s, v in p50.items()},
                         "between_masks_us_p50": {s: round(v[1] * 1e6, 1) for s, v in p50.items()},
                         "compile_ratio": round(p50["ours"][0] / p50["xgrammar"][0], 3),
                         "mask_ratio": round(p50["ours"][1] / p50["xgrammar"][1], 3)}
        print(ours, "vs", theirs, json.dumps(results[ours]))
    missed = [name for name, r in results.items() if max(r.get("compile_ratio", 0), r.get("mask_ratio", 0)) > TARGET]
    print(f"target <= {TARGET}x at p50: {'missed by ' + ', '.join(missed) if missed else 'met by every family'}")
    write_results({"target": TARGET, "files": args.files, "steps": args.steps, "families": results,
                   "missed": missed}, args.out)


if __name__ == "__main__":
    main()
