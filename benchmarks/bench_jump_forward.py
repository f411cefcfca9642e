"""Jump-forward on real schemas: forward passes and wall time with and without it.

    python benchmarks/bench_jump_forward.py --data ../shared/data/maskbench-dev --engine llguidance \
        --mode canonical [--model real|tiny] [--limit N | --sample N] [--max-tokens 192] --json OUT

Per MaskBench file (``{"schema": ..., "tests": [...]}``): the model (SmolLM2-135M-Instruct,
``--model real``; or the tiny random decoder) is asked for one JSON instance of the schema
and decodes it greedily at batch 1 through the KV-cached programs, once step by step and
once with jump-forward (``generate(..., jump_forward=mode)``: the tokens the grammar
forces go through the verify program as drafts it cannot reject). Both runs share one
decoder (one export, verify buckets of 1, 3 and 7 drafts) and one runtime (each grammar
compiled once, before either clock starts); the two runs of a file are timed back to
back, in alternating order.

JSON: ``{"files": [{"file", "status": "compiled"|"refused", "output_tokens",
"forward_passes", "forward_passes_without", "forced_tokens", "valid", "identical",
"seconds", "seconds_without"}], "totals": {...}}``; ``identical`` is null in canonical
mode (its tokens may differ from step-by-step decoding; they stay grammar-valid).
Totals: forward passes per output token with and without, the share of output tokens
forced, files valid, identical, wall time ratio (with / without).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

BUCKETS = (1, 2, 4, 8)  # tokens a row of each step program takes: decode, and 1, 3, 7 drafts


def prompt_for(schema: dict) -> str:
    return ("Reply with one JSON value that is valid against this JSON schema, and nothing else.\n"
            f"Schema: {json.dumps(schema, separators=(',', ':'))[:1500]}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", required=True, help="folder of MaskBench .json files")
    parser.add_argument("--engine", default="llguidance", choices=("xgrammar", "llguidance", "auto"))
    parser.add_argument("--mode", default="canonical", choices=("exact", "canonical"))
    parser.add_argument("--model", default="real", choices=("real", "tiny"))
    parser.add_argument("--limit", type=int, help="first N files only")
    parser.add_argument("--sample", type=int, help="N files spread over the set (every k-th, sorted by name)")
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--compile-timeout", type=float, default=30.0)
    parser.add_argument("--json", help="write the records and totals here")
    parser.add_argument("--compile", default="inductor", choices=("inductor", "none"),
                        help="the programs as AOTInductor packages (default; compiled once into build/packages) or eager")
    args = parser.parse_args(argv)

    import torch

    from neuron_constrain import models
    from neuron_constrain.structured import StructuredRuntime, json_schema, validate_output
    from neuron_constrain.structured import generate
    from timing import write_results

    torch.manual_seed(0)
    files = sorted(pathlib.Path(args.data).glob("*.json"))[: args.limit]
    if args.sample:
        files = files[:: max(1, len(files) // args.sample)][: args.sample]
    if not files:
        raise SystemExit(f"no .json files in {args.data}")
    loaded = models.load_model("smollm2" if args.model == "real" else "tiny")
    tokenizer = loaded.tokenizer
    start = time.perf_counter()
    decoder = models.export(loaded, max_batch=1, max_len=2048, new_tokens=BUCKETS,
                            compile=None if args.compile == "none" else args.compile)
    print(f"exported the prefill and {len(decoder.steps)} step programs in {time.perf_counter() - start:.0f} s "
          f"(compile {args.compile})", flush=True)
    records = []
    with StructuredRuntime.for_model(decoder, tokenizer, max_rows=max(BUCKETS), engine=args.engine) as runtime:
        for index, path in enumerate(files):
            data = json.loads(path.read_text())
            constraint = json_schema(data["schema"], strict=False)
            record = {"file": path.name, "status": "compiled"}
            runtime.add("probe", constraint, timeout=args.compile_timeout)
            runtime.wait(["probe"])
            error = runtime.error("probe")
            runtime.remove("probe")
            if error is not None:
                record.update(status="refused", error=" ".join(str(error).split())[:200])
                records.append(record)
                print(f"{path.name[:60]:60} refused", flush=True)
                continue
            prompt = models.prompt_ids(loaded, prompt_for(data["schema"]))
            runs = {}
            for mode in ((None, args.mode) if index % 2 == 0 else (args.mode, None)):
                runs[mode] = generate(decoder, [prompt], [constraint], args.max_tokens, tokenizer=tokenizer,
                                      runtime=runtime, jump_forward=mode).outputs[0]
            plain, fast = runs[None], runs[args.mode]
            record.update(
                output_tokens=len(fast.tokens), output_tokens_without=len(plain.tokens),
                forward_passes=fast.forward_passes, forward_passes_without=plain.forward_passes,
                forced_tokens=fast.forced_tokens, forced_seconds=fast.forced_seconds,
                finish_reason=fast.finish_reason, finish_reason_without=plain.finish_reason,
                valid=fast.finish_reason == "stop" and validate_output(constraint, fast.text) is None,
                valid_without=plain.finish_reason == "stop" and validate_output(constraint, plain.text) is None,
                identical=(fast.tokens == plain.tokens) if args.mode == "exact" else None,
                seconds=fast.seconds, seconds_without=plain.seconds,
            )
            records.append(record)
            print(f"{path.name[:60]:60} tokens {len(fast.tokens):4} passes {fast.forward_passes:4} / "
                  f"{plain.forward_passes:4} forced {fast.forced_tokens:4} valid {record['valid']!s:5} "
                  f"identical {record['identical']!s:5} {fast.seconds:6.2f} s / {plain.seconds:6.2f} s", flush=True)
    totals = summarize(records)
    totals.update(engine=args.engine, mode=args.mode, model=args.model, max_tokens=args.max_tokens)
    print(json.dumps(totals, indent=1))
    if args.json:
        write_results({"files": records, "totals": totals}, args.json)
    return 0


def summarize(records: list[dict]) -> dict:
    ran = [r for r in records if r["status"] == "compiled"]
    tokens = sum(r["output_tokens"] for r in ran)
    tokens_without = sum(r["output_tokens_without"] for r in ran)
    passes, passes_without = sum(r["forward_passes"] for r in ran), sum(r["forward_passes_without"] for r in ran)
    seconds, seconds_without = sum(r["seconds"] for r in ran), sum(r["seconds_without"] for r in ran)
    identical = [r["identical"] for r in ran if r["identical"] is not None]
    return {
        "files": len(records), "compiled": len(ran), "refused": len(records) - len(ran),
        "output_tokens": tokens, "forward_passes": passes, "forward_passes_without": passes_without,
        "passes_per_token": passes / tokens if tokens else None,
        "passes_per_token_without": passes_without / tokens_without if tokens_without else None,
        "forced_tokens": sum(r["forced_tokens"] for r in ran),
        "forced_share": sum(r["forced_tokens"] for r in ran) / tokens if tokens else None,
        "forced_seconds": sum(r["forced_seconds"] for r in ran),
        "valid": sum(r["valid"] for r in ran), "valid_without": sum(r["valid_without"] for r in ran),
        "finished": sum(r["finish_reason"] == "stop" for r in ran),
        "finished_without": sum(r.get("finish_reason_without") == "stop" for r in ran),
        "identical": sum(identical) if identical else None, "identical_of": len(identical) if identical else None,
        "seconds": seconds, "seconds_without": seconds_without,
        "seconds_ratio": seconds / seconds_without if seconds_without else None,
        "seconds_per_token_ratio": (seconds / tokens) / (seconds_without / tokens_without)
        if tokens and tokens_without and seconds_without else None,
    }


if __name__ == "__main__":
    sys.exit(main())
