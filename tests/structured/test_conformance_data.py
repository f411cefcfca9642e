"""The conformance cases of ``benchmarks/bench_conformance.py`` checked against their referee.

Every keyword area of the standard test suite's draft 2020-12 directory has its file of groups;
every stored verdict is ``jsonschema``'s (Draft202012Validator, format an annotation as 2020-12
has it by default, nothing fetched: a group marked ``refusal_ok: remote`` resolves only with its
area's ``remotes``, any other group with nothing but itself); and the benchmark runs end to end.
"""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import jsonschema
import pytest
import referencing
import referencing.exceptions
from referencing.jsonschema import DRAFT202012

# host-side, the same on every torch: one lane runs it, the latest (the shorter; see the torch_agnostic marker)
pytestmark = pytest.mark.torch_agnostic(lane="latest")

ROOT = pathlib.Path(__file__).resolve().parents[2]
DATA = ROOT / "benchmarks" / "data" / "conformance" / "draft2020-12"
REQUIRED_AREAS = (  # the JSON Schema test suite's tests/draft2020-12/*.json
    "additionalProperties", "allOf", "anchor", "anyOf", "boolean_schema", "const", "contains", "content",
    "default", "defs", "dependentRequired", "dependentSchemas", "dynamicRef", "enum", "exclusiveMaximum",
    "exclusiveMinimum", "format", "if-then-else", "infinite-loop-detection", "items", "maxContains", "maxItems",
    "maxLength", "maxProperties", "maximum", "minContains", "minItems", "minLength", "minProperties", "minimum",
    "multipleOf", "not", "oneOf", "pattern", "patternProperties", "prefixItems", "properties", "propertyNames",
    "ref", "refRemote", "required", "type", "unevaluatedItems", "unevaluatedProperties", "uniqueItems", "vocabulary",
)
# A few values of every type: a schema marked unsatisfiable must reject them all.
PROBES = (None, True, False, 0, 1, -1, 1.5, "", "a", [], [1], {}, {"a": 1})


def _areas():
    return {path.stem: json.loads(path.read_text(encoding="utf-8")) for path in sorted(DATA.glob("*.json"))}


AREAS = _areas()


def _refuse(uri):
    raise referencing.exceptions.NoSuchResource(uri)  # nothing is fetched, by the referee either


def _referee(schema, remotes: dict):
    registry = referencing.Registry(retrieve=_refuse).with_resources(
        (uri, DRAFT202012.create_resource(document)) for uri, document in remotes.items())
    return jsonschema.Draft202012Validator(schema, registry=registry)  # no format_checker: format annotates


def test_every_required_area_has_groups():
    assert sorted(AREAS) == sorted(REQUIRED_AREAS)
    ids = [group["id"] for data in AREAS.values() for group in data["groups"]]
    assert len(ids) == len(set(ids)), "group ids repeat"
    for area, data in AREAS.items():
        assert data["area"] == area and data["spec"], area
        assert 3 <= len(data["groups"]) <= 12, f"{area}: {len(data['groups'])} groups"
        for group in data["groups"]:
            assert group["id"].startswith(f"{area}/") and group["note"], group["id"]
            assert group["valid"] or group["invalid"], group["id"]
            assert group.get("refusal_ok") in (None, "unsatisfiable", "remote" if area == "refRemote" else None), group["id"]


@pytest.mark.parametrize("area", REQUIRED_AREAS)
def test_verdicts_are_jsonschemas(area):
    data = AREAS[area]
    remotes = data.get("remotes", {})
    for group in data["groups"]:
        schema = group["schema"]
        jsonschema.Draft202012Validator.check_schema(schema)
        needs_remotes = group.get("refusal_ok") == "remote"
        judge = _referee(schema, remotes if needs_remotes else {})
        for expected, instances in ((True, group["valid"]), (False, group["invalid"])):
            for instance in instances:
                assert judge.is_valid(instance) is expected, (
                    f"{group['id']}: jsonschema calls {json.dumps(instance)} {'in' if expected else ''}valid")
        if needs_remotes:  # the schema alone cannot be applied: the document is outside it
            with pytest.raises(referencing.exceptions.Unresolvable):
                _referee(schema, {}).is_valid((group["valid"] + group["invalid"])[0])
        if group.get("refusal_ok") == "unsatisfiable":
            assert not group["valid"] and not any(judge.is_valid(value) for value in PROBES), group["id"]


def test_benchmark_runs_on_two_areas(tmp_path):
    """The benchmark on two areas, every engine, the toy vocabulary: its JSON holds a score per area
    and engine that matches its groups' outcomes, and a refusal passes exactly the remote groups."""
    out = tmp_path / "conformance.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_conformance.py"), "--areas",
                          "refRemote,type", "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["areas"] == ["refRemote", "type"] and results["engines"] == ["auto", "xgrammar", "llguidance"]
    groups = {g["id"]: g for area in ("refRemote", "type") for g in AREAS[area]["groups"]}
    assert set(results["groups"]) == set(groups)
    for engine in ("auto", "xgrammar", "llguidance", "oracle"):
        for area in ("refRemote", "type"):
            ids = [g["id"] for g in AREAS[area]["groups"]]
            per_engine = [results["groups"][i] for i in ids]
            passed = [any(o["passed"] for o in p.values()) if engine == "oracle" else p[engine]["passed"]
                      for p in per_engine]
            assert results["scores"][engine][area] == pytest.approx(sum(passed) / len(ids))
    for gid, per in results["groups"].items():
        for engine, outcome in per.items():
            remote = groups[gid].get("refusal_ok") == "remote"
            if outcome["refused"] is not None:  # a clean refusal passes exactly the remote groups
                assert outcome["passed"] is remote, (gid, engine)
            else:
                assert outcome["passed"] is (not outcome["invalid_accepted"] and not outcome["valid_rejected"]
                                             and outcome["error"] is None), (gid, engine)
    assert "mean over areas" in run.stdout
