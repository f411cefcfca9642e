"""What checking the passes' contracts costs ``transform()``: checks on against off, side by side.

    .venv/bin/python benchmarks/bench_contracts.py [--model smollm2|tiny] [--reps N] [--out PATH]

The programs: a KV-cached decoder's prefill and 1-token step (``export_decoder``, SmolLM2-135M
from ``build/smollm2`` by default, or the tiny random-weight Llama), exported once without
passes. Each is rewritten by ``nc.transform`` as ``export_decoder`` does (a packed mask over the
tokenizer's vocabulary) and with the four built-in processors too, with ``check_contracts``
on and off, interleaved rep by rep (``timing.interleaved``): the export is not timed, only
the passes (and their checks). Also timed alone: each pass's ``requires`` and ``ensures``
(``checks.check_contract``) on the programs it sees, which is what the switch turns off.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import neuron_constrain as nc
from neuron_constrain.core.checks import check_contract
from neuron_constrain.models import export, load_model
from neuron_constrain.core.pass_manager import PassManager
from neuron_constrain.core.transform import PASSES
from timing import interleaved, median_ms, ratio, write_results

PROCESSORS = ["min_tokens", "logit_bias", "penalties", "min_p"]


def passless_programs(name: str) -> tuple[dict, int]:
    """The decoder's prefill and step programs as exported, before any pass; the mask width."""
    loaded = load_model(name)
    decoder = export(loaded, max_batch=8, max_len=256, logit_mask=None)  # every pass switched off
    assert not decoder.prefill.report.passes and not decoder.steps[1].report.passes
    return {"prefill": decoder.prefill.program, "step": decoder.steps[1].program}, loaded.tokenizer.vocab_size


def check_seconds(program, options: dict, reps: int) -> dict[str, float]:
    """Median seconds of each contract check transform() runs on ``program`` with ``options``."""
    out = {}
    switches = {"taps": None, "mask_format": "packed", "processors": None, **options}  # transform()'s defaults
    for run in PassManager(PASSES).passes:
        contract = run.contract
        if switches[contract.switch] is None:
            continue
        after = run(program, **{o: options[o] for o in contract.options if o in options}).program
        for stage, on in (("requires", program), ("ensures", after)):
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                assert check_contract(on, contract, stage) == []
                times.append(time.perf_counter() - start)
            out[f"{contract.name}.{stage}"] = 1e3 * statistics.median(times)
        program = after
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2", choices=("smollm2", "tiny"))
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--out", default="benchmarks/results/bench_contracts.json")
    args = parser.parse_args()
    programs, vocab = passless_programs(args.model)
    configs = {"mask": {"vocab_size": vocab}, "mask+processors": {"vocab_size": vocab, "processors": PROCESSORS}}
    results = {"model": args.model, "reps": args.reps, "programs": {}}
    for name, program in programs.items():
        nodes = sum(1 for _ in program.graph.nodes)
        for config, options in configs.items():
            runs = {check: (lambda on=check == "checks_on": nc.transform(program, check_contracts=on, **options))
                    for check in ("checks_on", "checks_off")}
            times = interleaved(runs, args.reps, warmup=1)
            row = {"graph_nodes": nodes, "median_ms": median_ms(times), **ratio(times, "checks_on", "checks_off"),
                   "check_ms": check_seconds(program, options, args.reps)}
            row["added_ms"] = row["median_ms"]["checks_on"] - row["median_ms"]["checks_off"]
            results["programs"][f"{name} / {config}"] = row
            print(f"{args.model} {name:7s} {config:16s} {nodes:5d} nodes: on {row['median_ms']['checks_on']:8.1f} ms, "
                  f"off {row['median_ms']['checks_off']:8.1f} ms, paired on/off {row['paired']:.3f}, "
                  f"checks alone {sum(row['check_ms'].values()):7.1f} ms "
                  + ", ".join(f"{k} {v:.1f}" for k, v in row["check_ms"].items()), flush=True)
    write_results(results, args.out)


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
