"""JSON Schema draft 2020-12 conformance per keyword area, scored the JSONSchemaBench way.

    python benchmarks/bench_conformance.py [--engines auto,xgrammar,llguidance] [--areas type,ref,...]
        [--tokenizer toy|smollm2] [--strict off|on] [--json benchmarks/results/bench_conformance.json]

The cases (``benchmarks/data/conformance/draft2020-12/<area>.json``, one file per keyword area of
the standard test suite's draft2020-12 directory): groups of a schema, valid instances and invalid
instances, written from the specification's text, each verdict jsonschema's
(``tests/structured/test_conformance_data.py``; ``format`` is an annotation, as 2020-12 has it by default).

Per engine, a group counts when its schema compiles (``json_schema(schema, strict=False)`` through
``engine.compile``: the path of ``testing.schemas.differential``; ``--strict on``: ``strict=True``, the
library's default, where properties and array items a schema does not list are refused: a valid instance
that holds some, invalid against the schema closed that way (:func:`closed`), is left out of the score and
counted apart as ``strict_refused``) and, teacher-forced (``json.dumps``
text in the tokenizer's own encoding, then a stop token), every valid instance is accepted and
every invalid one rejected. The verdicts are the stored ones, not ``differential``'s judge (which
asserts formats). ``auto``'s race (both engines exact: llguidance's grammar serves the first masks, xgrammar's
from when it is ready) is judged on the grammar its requests end on: the bench waits for xgrammar's compile
(llguidance spells integers plainly, so ``1.0`` would pass or fail by timing otherwise). Scoring rule for refusals: a refused group fails, except a group marked
``refusal_ok``, which also counts when refused with a ``ConstraintError``: ``remote`` (a ``$ref``
to a document the schema does not hold: nothing is fetched, so refusing is the only right answer)
and ``unsatisfiable`` (no value is valid: nothing to generate). Area score: groups counted / groups;
the headline is the mean over areas; ``oracle`` counts a group when any engine run gets it.
Reported besides: invalid instances accepted (soundness holes; the target is 0, printed loudly),
valid instances rejected, refusals by the keyword that stopped them, and the groups that both
xgrammar and llguidance refuse (what no engine enforces). A measurement: the exit status is 0.
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import json
import pathlib
import sys
import time

from neuron_constrain.structured import engines as E
from neuron_constrain.structured.constraints import ConstraintError, json_schema
from neuron_constrain.structured.schema.rewrite import FAMILIES
from neuron_constrain.testing import force
from timing import write_results

DATA = pathlib.Path(__file__).resolve().parent / "data" / "conformance" / "draft2020-12"
# One file per area of the standard test suite's tests/draft2020-12/ (the list: tests/structured/test_conformance_data.py).
AREAS = tuple(sorted(path.stem for path in DATA.glob("*.json")))
TOKENIZERS = ("toy", "smollm2")


def load(areas=AREAS) -> dict[str, list[dict]]:
    """The groups of each area in ``areas``, read from :data:`DATA`."""
    unknown = [a for a in areas if a not in AREAS]
    if unknown:
        raise SystemExit(f"--areas: unknown {', '.join(unknown)}; pick from {', '.join(AREAS)}")
    return {area: json.loads((DATA / f"{area}.json").read_text(encoding="utf-8"))["groups"] for area in areas}


def load_tokenizer(name: str):
    """The byte-level toy vocabulary, or SmolLM2's tokenizer from ``build/smollm2`` (converted on first use)."""
    if name == "toy":
        from neuron_constrain.testing import toy_tokenizer

        return toy_tokenizer()
    if name == "smollm2":
        import transformers

        from neuron_constrain.models import smollm2_dir
        from neuron_constrain.structured import from_huggingface

        return from_huggingface(transformers.AutoTokenizer.from_pretrained(smollm2_dir()))
    raise SystemExit(f"--tokenizer {name!r}: pick one of {', '.join(TOKENIZERS)}")


@dataclasses.dataclass
class Outcome:
    """One group on one engine."""

    passed: bool
    refused: str | None = None  # the keyword that stopped the compile ("compile error" when none is named)
    reason: str = ""
    invalid_accepted: list = dataclasses.field(default_factory=list)  # JSON texts
    valid_rejected: list = dataclasses.field(default_factory=list)
    strict_refused: list = dataclasses.field(default_factory=list)  # valid, but holding what strict refuses
    error: str | None = None  # anything but a ConstraintError: a bug, counted as a failure


UNNAMED = ("compile error", "false schema")  # refusals that name no keyword


def stopped_by(error: ConstraintError) -> str:
    """The keyword a refusal names (``keywords.Unenforced``), else one of :data:`UNNAMED`."""
    unenforced = getattr(error, "unenforced", None)
    if unenforced is not None:
        return unenforced.keyword
    return UNNAMED[1] if "the schema is `false`" in str(error) else UNNAMED[0]


def run_group(engine, group: dict, encode, strict: bool = False) -> Outcome:
    try:
        compiled = engine.compile(json_schema(group["schema"], strict=strict))
        if getattr(compiled, "successor", None) is not None:
            concurrent.futures.wait([compiled.successor])  # auto's race: judged on the grammar it ends on (the docstring)
    except ConstraintError as error:
        return Outcome(bool(group.get("refusal_ok")), stopped_by(error), " ".join(str(error).split()))
    except Exception as error:  # noqa: BLE001 - reported with the group, never hidden
        return Outcome(False, error=f"compile: {type(error).__name__}: {error}")
    outcome = Outcome(False)
    try:
        for expected, instances in ((True, group["valid"]), (False, group["invalid"])):
            for instance in instances:
                text = json.dumps(instance, ensure_ascii=False)
                accepted = force(engine, compiled, encode(text))
                if accepted and not expected:
                    outcome.invalid_accepted.append(text)
                elif expected and not accepted:
                    closed_out = strict and not _admits(closed(group["schema"]), instance)
                    (outcome.strict_refused if closed_out else outcome.valid_rejected).append(text)
    except Exception as error:  # noqa: BLE001
        outcome.error = f"force: {type(error).__name__}: {error}"
    outcome.passed = outcome.error is None and not outcome.invalid_accepted and not outcome.valid_rejected
    return outcome


def closed(schema):
    """``schema`` as ``strict=True`` reads it: every object schema (typed ``object`` or holding a keyword of
    objects) without ``additionalProperties`` / ``patternProperties`` / ``unevaluatedProperties`` takes no property
    it does not list, every array schema (typed ``array`` or holding a keyword of arrays) without ``items`` /
    ``unevaluatedItems`` no item past its ``prefixItems``."""
    if isinstance(schema, list):
        return [closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in ("enum", "const", "default", "examples", "required") else closed(v) for k, v in schema.items()}
    kinds = out.get("type") if isinstance(out.get("type"), list) else [out.get("type")]
    if ("object" in kinds or FAMILIES["object"] & set(out)) and not {
            "additionalProperties", "patternProperties", "unevaluatedProperties"} & set(out):
        out["additionalProperties"] = False
    if ("array" in kinds or FAMILIES["array"] & set(out)) and not {"items", "unevaluatedItems"} & set(out):
        out["items"] = False
    return out


def _admits(schema, instance) -> bool:
    """Whether ``jsonschema`` (2020-12) finds ``instance`` valid of ``schema``; True where it cannot judge (a
    reference it does not hold): the instance then still counts."""
    import jsonschema

    try:
        return jsonschema.Draft202012Validator(schema).is_valid(instance)
    except Exception:  # noqa: BLE001 - an unresolvable reference: scored as if admitted
        return True


def measure(engines: dict, groups: dict[str, list[dict]], encode, strict: bool = False) -> dict[str, dict[str, Outcome]]:
    """Per group id, per engine name, its :class:`Outcome` (``strict``: ``json_schema``'s)."""
    return {group["id"]: {name: run_group(engine, group, encode, strict) for name, engine in engines.items()}
            for area_groups in groups.values() for group in area_groups}


def summarize(groups: dict[str, list[dict]], outcomes: dict[str, dict[str, Outcome]], names: list[str]) -> dict:
    """Scores per area and their means (engines and oracle), totals, holes, refusals by keyword."""
    columns = names + ["oracle"]
    passed = {gid: {**{n: o.passed for n, o in per.items()}, "oracle": any(o.passed for o in per.values())}
              for gid, per in outcomes.items()}
    counts = {c: {area: sum(passed[g["id"]][c] for g in area_groups) for area, area_groups in groups.items()}
              for c in columns}
    scores = {c: {area: counts[c][area] / len(groups[area]) for area in groups} for c in columns}
    totals, holes, refusals = {}, {}, {}
    for name in names:
        per = {gid: o[name] for gid, o in outcomes.items()}
        totals[name] = {"groups": len(per), "passed": sum(o.passed for o in per.values()),
                        "strict_refused": sum(len(o.strict_refused) for o in per.values()),
                        "refused": sum(o.refused is not None and not o.passed for o in per.values()),
                        "invalid_accepted": sum(len(o.invalid_accepted) for o in per.values()),
                        "valid_rejected": sum(len(o.valid_rejected) for o in per.values()),
                        "errors": sum(o.error is not None for o in per.values())}
        holes[name] = [{"group": gid, "instances": o.invalid_accepted} for gid, o in per.items() if o.invalid_accepted]
        by_keyword = collections.defaultdict(list)
        for gid, o in per.items():
            if o.refused is not None and not o.passed:
                by_keyword[o.refused].append(gid)
        refusals[name] = dict(sorted(by_keyword.items(), key=lambda kv: (-len(kv[1]), kv[0])))
    both = collections.defaultdict(list)  # what neither engine takes, by the keyword llguidance (else xgrammar) named
    if {"xgrammar", "llguidance"} <= set(names):
        for gid, per in outcomes.items():
            x, g = per["xgrammar"], per["llguidance"]
            if x.refused is not None and g.refused is not None and not (x.passed or g.passed):
                named = [k for k in (g.refused, x.refused) if k not in UNNAMED]
                both[named[0] if named else g.refused].append({"group": gid, "llguidance": g.refused,
                                                                "xgrammar": x.refused})
    return {"passed": counts, "scores": scores, "means": {c: sum(s.values()) / len(s) for c, s in scores.items()}, "totals": totals,
            "invalid_accepted": holes, "refused_by_keyword": refusals,
            "refused_by_both": dict(sorted(both.items(), key=lambda kv: (-len(kv[1]), kv[0])))}


def report(groups: dict[str, list[dict]], summary: dict, names: list[str]) -> None:
    columns = names + ["oracle"]
    print(f"{'area':<24} {'groups':>6} " + " ".join(f"{c:>10}" for c in columns))
    for area, area_groups in groups.items():
        n = len(area_groups)
        cells = " ".join(f"{summary['passed'][c][area]:>6}/{n:<3}" for c in columns)
        print(f"{area:<24} {n:>6} {cells}")
    print(f"{'mean over areas':<31} " + " ".join(f"{summary['means'][c]:>10.3f}" for c in columns))
    for name in names:
        t = summary["totals"][name]
        print(f"{name}: {t['passed']}/{t['groups']} groups; refused {t['refused']}; invalid instances accepted "
              f"{t['invalid_accepted']}; valid instances rejected {t['valid_rejected']}; errors {t['errors']}"
              + (f"; valid instances strict refuses (left out) {t['strict_refused']}" if t["strict_refused"] else ""))
        print(f"  refused by keyword: " + ", ".join(f"{k} {len(v)}" for k, v in summary["refused_by_keyword"][name].items()))
    if summary["refused_by_both"]:
        print("refused by both xgrammar and llguidance (the keyword llguidance, else xgrammar, named): "
              + ", ".join(f"{k} {len(v)}" for k, v in summary["refused_by_both"].items()))
    for name in names:
        for hole in summary["invalid_accepted"][name]:
            print(f"!!! UNSOUND: {name} accepted invalid instances of {hole['group']}: {', '.join(hole['instances'])}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default=",".join(E.ENGINE_CHOICES), help="comma-separated engine choices")
    parser.add_argument("--areas", default=",".join(AREAS), help="comma-separated keyword areas")
    parser.add_argument("--tokenizer", default="toy", choices=TOKENIZERS)
    parser.add_argument("--strict", default="off", choices=("off", "on"),
                        help="json_schema(strict=...): on refuses properties/items the schema does not list")
    parser.add_argument("--json", default="benchmarks/results/bench_conformance.json")
    args = parser.parse_args(argv)
    names = [n for n in args.engines.split(",") if n]
    unknown = [n for n in names if n not in E.ENGINE_CHOICES]
    if unknown or not names:
        raise SystemExit(f"--engines: unknown {', '.join(unknown) or '(none given)'}; pick from {', '.join(E.ENGINE_CHOICES)}")
    groups = load([a for a in args.areas.split(",") if a])
    tokenizer = load_tokenizer(args.tokenizer)
    engines = {name: E.make_engine(name, tokenizer) for name in names}
    start = time.perf_counter()
    outcomes = measure(engines, groups, tokenizer.encode, args.strict == "on")
    summary = summarize(groups, outcomes, names)
    report(groups, summary, names)
    unsound = sum(summary["totals"][n]["invalid_accepted"] for n in names)
    if unsound:
        print(f"!!! {unsound} INVALID INSTANCES ACCEPTED (the target is 0): see the UNSOUND lines above")
    seconds = time.perf_counter() - start
    print(f"{len(outcomes)} groups in {len(groups)} areas, strict {args.strict}, {seconds:.0f} s")
    write_results({"tokenizer": args.tokenizer, "strict": args.strict, "engines": names, "areas": list(groups), **summary,
                   "groups": {gid: {n: dataclasses.asdict(o) for n, o in per.items()} for gid, per in outcomes.items()},
                   "seconds": seconds}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
