"""The differential soundness check of tests/structured/test_soundness.py, run longer, with the counts.

    python benchmarks/bench_soundness.py [--examples 300] [--regions typed,untyped,...,regex] [--strict both]

Per region of JSON Schema's vocabulary (``neuron_constrain.testing.schemas.REGIONS``, plus
``regex``: ``regex(...)`` constraints drawn from the same pattern grammar, judged by
``re.fullmatch``; ``lookaround``: patterns with lookarounds, ``\\b``/``\\B`` and anchors inside them
(``testing/lookaround_patterns.py``), each as a JSON-schema ``pattern`` and as a ``regex(...)``), per engine (xgrammar, llguidance, auto; a byte-level vocabulary) and per
``strict`` setting: schemas compiled and refused, instances accepted that the referee calls
invalid (**unsound**: must be 0; raw spellings and random walks through the masks included),
valid instances rejected (over-restriction: the documented narrowings), valid instances
accepted. Examples are random (a fresh seed each run unless ``--seed``); an unsound case is
printed with its schema.
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
from neuron_constrain.testing.lookaround_patterns import lookaround_cases
from neuron_constrain.testing.schemas import (PATTERNS_DRAWN, REGIONS, differential, pattern_strings,
                                              regex_differential, schema_and_instances)
from timing import write_results


def _regex_cases():
    return PATTERNS_DRAWN.flatmap(lambda p: pattern_strings(p).map(lambda strings: (p, strings)))


def _count(count: collections.Counter, verdict, name: str, unsound: list) -> None:
    count["schemas"] += 1
    count["refused" if verdict.refused else "compiled"] += 1
    count["unsound"] += len(verdict.unsound)
    count["over_restricted"] += len(verdict.over_restricted)
    count["accepted_valid"] += verdict.accepted_valid
    if verdict.unsound and len(unsound) < 10:
        unsound.append({"engine": name, "schema": verdict.schema, "instances": verdict.unsound[:3]})


def run_region(region: str, engines: dict, examples: int, random_seed: int | None, strict: bool) -> dict:
    counts = {name: collections.Counter() for name in engines}
    unsound = []

    cases = {"regex": _regex_cases, "lookaround": lookaround_cases}.get(region, lambda: schema_and_instances(region))

    @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(cases())
    def check(case):
        schema, instances = case
        for name, engine in engines.items():
            verdicts = ([regex_differential(engine, schema, instances)] if region == "regex" else
                        [differential(engine, schema, instances, strict=strict)] if region != "lookaround" else
                        [regex_differential(engine, schema, instances),
                         differential(engine, {"type": "string", "pattern": schema}, instances, strict=strict)])
            for verdict in verdicts:
                _count(counts[name], verdict, name, unsound)
    if random_seed is not None:
        check = seed(random_seed)(check)
    check()
    return {"counts": {name: dict(c) for name, c in counts.items()}, "unsound_cases": unsound}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=300, help="schemas per region")
    parser.add_argument("--regions", default=",".join((*REGIONS, "regex", "lookaround")))
    parser.add_argument("--strict", choices=("false", "true", "both"), default="both",
                        help="json_schema(strict=...) for the schema regions")
    parser.add_argument("--seed", type=int, help="hypothesis seed (default: random)")
    parser.add_argument("--json", default="benchmarks/results/bench_soundness.json")
    args = parser.parse_args(argv)
    vocabulary = toy_tokenizer()
    engines = {name: E.make_engine(name, vocabulary) for name in E.ENGINE_CHOICES}
    results, start = {"examples": args.examples, "regions": {}}, time.perf_counter()
    stricts = {"false": (False,), "true": (True,), "both": (False, True)}[args.strict]
    print(f"{'region':<12} {'strict':<6} {'engine':<11} {'compiled':>8} {'refused':>8} {'unsound':>8} {'over':>6} "
          f"{'valid ok':>9}")
    for region in args.regions.split(","):
        for strict in stricts if region not in ("regex", "lookaround") else (False,):
            key = region if region in ("regex", "lookaround") or len(stricts) == 1 else f"{region}/strict={strict}"
            results["regions"][key] = found = run_region(region, engines, args.examples, args.seed, strict)
            for name, c in found["counts"].items():
                print(f"{region:<12} {str(strict):<6} {name:<11} {c.get('compiled', 0):>8} {c.get('refused', 0):>8} "
                      f"{c.get('unsound', 0):>8} {c.get('over_restricted', 0):>6} {c.get('accepted_valid', 0):>9}")
            for case in found["unsound_cases"]:
                print("  UNSOUND", case["engine"], json.dumps(case["schema"]), case["instances"])
    total = sum(c.get("unsound", 0) for r in results["regions"].values() for c in r["counts"].values())
    results["unsound_total"], results["seconds"] = total, time.perf_counter() - start
    print(f"unsound instances in all: {total} ({results['seconds']:.0f} s)")
    write_results(results, args.json)
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
