"""The differential soundness check of tests/test_soundness.py, run longer, with the counts.

    python benchmarks/bench_soundness.py [--examples 300] [--regions typed,untyped,...] [--json OUT]

Per region of JSON Schema's vocabulary (``neuron_constrain.testing.schemas.REGIONS``) and per
engine (xgrammar, llguidance, auto; a byte-level vocabulary): schemas compiled and refused,
instances accepted that ``jsonschema`` calls invalid (**unsound**: must be 0), valid instances
rejected (over-restriction: the documented narrowings), valid instances accepted. Examples are
random (a fresh seed each run unless ``--seed``); an unsound case is printed with its schema.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import time

from hypothesis import HealthCheck, Phase, given, seed, settings

from neuron_constrain.structured import engines as E
from neuron_constrain.testing import toy_tokenizer
from neuron_constrain.testing.schemas import REGIONS, differential, schema_and_instances
from timing import write_results


def run_region(region: str, engines: dict, examples: int, random_seed: int | None) -> dict:
    counts = {name: collections.Counter() for name in engines}
    unsound = []

    @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(schema_and_instances(region))
    def check(case):
        schema, instances = case
        for name, engine in engines.items():
            verdict = differential(engine, schema, instances)
            count = counts[name]
            count["schemas"] += 1
            count["refused" if verdict.refused else "compiled"] += 1
            count["unsound"] += len(verdict.unsound)
            count["over_restricted"] += len(verdict.over_restricted)
            count["accepted_valid"] += verdict.accepted_valid
            if verdict.unsound and len(unsound) < 10:
                unsound.append({"engine": name, "schema": schema, "instances": verdict.unsound[:3]})
    if random_seed is not None:
        check = seed(random_seed)(check)
    check()
    return {"counts": {name: dict(c) for name, c in counts.items()}, "unsound_cases": unsound}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=300, help="schemas per region")
    parser.add_argument("--regions", default=",".join(REGIONS))
    parser.add_argument("--seed", type=int, help="hypothesis seed (default: random)")
    parser.add_argument("--json", default="benchmarks/results/bench_soundness.json")
    args = parser.parse_args(argv)
    vocabulary = toy_tokenizer()
    engines = {name: E.make_engine(name, vocabulary) for name in E.ENGINE_CHOICES}
    results, start = {"examples": args.examples, "regions": {}}, time.perf_counter()
    print(f"{'region':<12} {'engine':<11} {'compiled':>8} {'refused':>8} {'unsound':>8} {'over':>6} {'valid ok':>9}")
    for region in args.regions.split(","):
        results["regions"][region] = found = run_region(region, engines, args.examples, args.seed)
        for name, c in found["counts"].items():
            print(f"{region:<12} {name:<11} {c.get('compiled', 0):>8} {c.get('refused', 0):>8} {c.get('unsound', 0):>8} "
                  f"{c.get('over_restricted', 0):>6} {c.get('accepted_valid', 0):>9}")
        for case in found["unsound_cases"]:
            print("  UNSOUND", case["engine"], json.dumps(case["schema"]), case["instances"])
    total = sum(c.get("unsound", 0) for r in results["regions"].values() for c in r["counts"].values())
    results["unsound_total"], results["seconds"] = total, time.perf_counter() - start
    print(f"unsound instances in all: {total} ({results['seconds']:.0f} s)")
    write_results(results, args.json)
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
