"""Real patterns through every engine: refused (by feature) or exact on strings that straddle them.

    python benchmarks/bench_patterns.py [--strings 24] [--json benchmarks/results/bench_patterns.json]

The patterns: ``tests/data/patterns/schemastore.json`` (85 patterns from the JSON Schema Store's
schemas, each with the file and JSON pointer it came from: every one that uses a refused feature,
the rest sampled by the features they use) and every pattern of the MaskBench development sample
(``../shared/data/maskbench-dev``, when present). Each is compiled as ``{"type": "string",
"pattern": P}`` on xgrammar, llguidance and auto (a byte-level vocabulary), and strings are
teacher-forced: matches hypothesis draws from Python's reading of the pattern, the same strings with
one character dropped, doubled or replaced, and a fixed list of straddling strings. The referee is
Python's ``re.search`` (what ``jsonschema`` runs). Printed and written: per engine, patterns compiled
and refused (counted by the feature named), strings accepted that the referee refuses (**unsound**:
must be 0), and strings the referee takes that the engine refused (over-restriction: the dialects'
intersection, e.g. ``\\w`` on ``é``).
"""
from __future__ import annotations

import argparse
import collections
import json
import pathlib
import re
import sys
import warnings

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from neuron_constrain.structured import ConstraintError, json_schema
from neuron_constrain.structured import engines as E
from neuron_constrain.structured.schema.keywords import pattern_sites
from neuron_constrain.testing import toy_tokenizer
from neuron_constrain.testing.schemas import PATTERN_STRINGS, readable
from neuron_constrain.testing.vocabulary import force
from timing import write_results

ROOT = pathlib.Path(__file__).resolve().parents[1]


def real_patterns(maskbench: pathlib.Path) -> list[dict]:
    found = json.loads((ROOT / "tests/data/patterns/schemastore.json").read_text())
    if maskbench.is_dir():
        seen = {p["pattern"] for p in found}
        for path in sorted(maskbench.rglob("*.json")):
            schema = json.loads(path.read_text()).get("schema")
            if isinstance(schema, dict):
                for pointer, _, _, source in pattern_sites(schema):
                    if source not in seen:
                        seen.add(source)
                        found.append({"pattern": source, "source": f"maskbench-dev {path.name} {pointer}",
                                      "class": "maskbench"})
    return found


def straddling(pattern: str, count: int) -> list[str]:
    """Matches of Python's reading, each mutated once, and the fixed straddling strings."""
    drawn: list[str] = []
    if readable(pattern):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            strategy = st.from_regex(pattern, fullmatch=False).filter(lambda t: "\x00" not in t and len(t) < 40)

            @settings(max_examples=count, derandomize=True, database=None, phases=[Phase.generate], deadline=None,
                      suppress_health_check=list(HealthCheck))
            @given(strategy)
            def collect(text):
                drawn.append(text)
            try:
                collect()
            except Exception:  # noqa: BLE001 - a pattern hypothesis cannot draw from: the fixed strings only
                pass
    mutated = []
    for i, text in enumerate(drawn[:count]):
        at = i % max(1, len(text))
        mutated += [text[:at] + text[at + 1:], text[:at] + text[at:at + 1] * 2 + text[at + 1:],
                    text[:at] + "-x\"1 "[i % 5] + text[at + 1:]]
    return list(dict.fromkeys(drawn[:count] + mutated + list(PATTERN_STRINGS)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strings", type=int, default=24, help="matches drawn per pattern (then mutated)")
    parser.add_argument("--maskbench", default=str(ROOT.parent / "shared/data/maskbench-dev"))
    parser.add_argument("--json", default="benchmarks/results/bench_patterns.json")
    args = parser.parse_args(argv)
    vocabulary = toy_tokenizer()
    engines = {name: E.make_engine(name, vocabulary) for name in E.ENGINE_CHOICES}
    patterns = real_patterns(pathlib.Path(args.maskbench))
    counts = {name: collections.Counter() for name in engines}
    refused = {name: collections.Counter() for name in engines}
    unsound = []
    for item in patterns:
        pattern = item["pattern"]
        strings = straddling(pattern, args.strings)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            referee = re.compile(pattern) if readable(pattern) else None
        for name, engine in engines.items():
            count = counts[name]
            try:
                compiled = engine.compile(json_schema({"type": "string", "pattern": pattern}))
            except ConstraintError as error:
                count["refused"] += 1
                feature = re.search(r"\((.+?) at offset", str(error))
                refused[name][feature.group(1) if feature else " ".join(str(error).split())[:60]] += 1
                continue
            count["compiled"] += 1
            if referee is None:  # ECMA syntax Python's re does not read (a named group): no referee to judge by
                count["unjudged"] += 1
                continue
            for text in strings:
                valid = referee.search(text) is not None
                accepted = force(engine, compiled, vocabulary.encode(json.dumps(text, ensure_ascii=False)))
                count["strings"] += 1
                if accepted and not valid:
                    count["unsound"] += 1
                    unsound.append({"engine": name, "pattern": pattern, "string": text, "source": item["source"]})
                elif valid and not accepted:
                    count["over_restricted"] += 1
                elif accepted:
                    count["accepted_valid"] += 1
    print(f"{len(patterns)} real patterns ({sum(p['class'] != 'maskbench' for p in patterns)} from the JSON Schema "
          f"Store, {sum(p['class'] == 'maskbench' for p in patterns)} from the MaskBench sample)")
    print(f"{'engine':<11} {'compiled':>8} {'unjudged':>8} {'refused':>8} {'strings':>8} {'unsound':>8} {'over':>6} "
          f"{'valid ok':>9}")
    for name, c in counts.items():
        print(f"{name:<11} {c['compiled']:>8} {c['unjudged']:>8} {c['refused']:>8} {c['strings']:>8} {c['unsound']:>8} "
              f"{c['over_restricted']:>6} {c['accepted_valid']:>9}")
        for why, n in refused[name].most_common():
            print(f"    refused {n:>3}: {why}")
    for case in unsound[:20]:
        print("  UNSOUND", json.dumps(case, ensure_ascii=False))
    write_results({"patterns": len(patterns), "counts": {n: dict(c) for n, c in counts.items()},
                   "refused": {n: dict(c) for n, c in refused.items()}, "unsound_cases": unsound}, args.json)
    return 1 if unsound else 0


if __name__ == "__main__":
    sys.exit(main())
