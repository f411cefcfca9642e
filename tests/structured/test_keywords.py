"""Never silently wrong: every keyword an engine does not enforce (off its allowlist, or where
its condition fails) is refused by default and, when accepted, listed on the result with the
output validated; each probe below is checked against the engines on every run (refused, and
really not enforced; or compiled and enforced), and a MaskBench sample has 0 silent
invalidation errors on both engines. ``test_soundness.py`` searches for holes itself."""
from __future__ import annotations

import json
import pathlib

import pytest
import torch

from neuron_constrain import structured as S
from neuron_constrain.structured import engines as E
from neuron_constrain.structured.schema import keywords as K
from neuron_constrain.testing import force

# host-side, the same on every torch: one lane runs it, the latest (the shorter; see the torch_agnostic marker)
pytestmark = pytest.mark.torch_agnostic(lane="latest")

MASKBENCH = pathlib.Path(__file__).parents[1] / "data" / "maskbench"
WINDOW = 48  # the copy decoder echoes the token WINDOW positions back

# keyword -> (schema, an instance that breaks only that keyword, a valid instance)
PROBES = {
    "patternProperties": ({"type": "object", "properties": {"k": {"type": "boolean"}},
                           "patternProperties": {".*": {"type": "boolean"}}}, {"k": True, "z": "s"}, {"k": True}),
    "oneOf": ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, 5, 2.5),
    "allOf": ({"allOf": [{"type": "integer", "minimum": 3}, {"maximum": 5}]}, 7, 4),
    "type": ({"type": "string", "anyOf": [{"maxLength": 2}, {"pattern": "^a"}]}, 5, "ab"),
    "required": ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]},
                 {"a": 1}, {"a": 1, "b": 2}),
    "minLength": ({"type": "string", "pattern": "^[a-z]+$", "minLength": 5}, "ab", "abcdef"),
    "maxLength": ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, "abcdef", "ab"),
    "maxLength-beside-$ref": ({"$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s", "maxLength": 2}, "abcd", "ab"),
    "format": ({"type": "string", "format": "regex"}, "(", "a+"),
    # keywords the schema algebra rewrites where it can (tests/structured/test_schema_algebra.py): probed here
    # where it cannot (a format has no positive complement), so the policy still names them
    "not": ({"type": "string", "not": {"format": "email"}}, "a@b.co", "ab"),
    "if": ({"type": "string", "if": {"format": "email"}, "then": {"maxLength": 5}}, "a@b.co", "ab"),
    "dependentSchemas": ({"type": "object", "dependentSchemas": {"a": {"properties": {"b": {
        "type": "string", "not": {"format": "email"}}}}}}, {"a": 1, "b": "x@y.z"}, {"a": 1, "b": "y"}),
    # the host's tracker takes uniqueItems where the schema fixes it (tests/structured/test_item_tracker.py);
    # not where it depends on the branch the engine follows
    "uniqueItems": ({"anyOf": [{"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, {"type": "array", "maxItems": 3}]}, [1, 1, 1, 1], [1, 2, 3, 4]),
    "contains": ({"anyOf": [{"type": "array", "contains": {"const": 5}},
                            {"type": "array", "items": {"type": "string"}, "maxItems": 40}]}, [1, 2], [5]),
    "unevaluatedProperties": ({"type": "object", "unevaluatedProperties": False,
                               "if": {"properties": {"a": {"format": "email"}}}, "then": {"properties": {"b": {}}}},
                              {"c": 1}, {"b": 1}),
    "propertyNames": ({"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}}, {"A1": 1}, {"ab": 1}),
}
PROBES.update({  # the classes issue 32 found: untyped assertions, a non-local $ref, unevaluatedItems
    "maxLength-untyped": ({"maxLength": 2}, "foo", "ab"),
    "$ref-remote": ({"$ref": "https://example.com/elsewhere.json"}, None, None),
    "unevaluatedItems": ({"type": "array", "prefixItems": [{"type": "integer"}], "unevaluatedItems": {"type": "string"}},
                         [1, 2], [1, "a"]),
})


def _keyword(probe: str) -> str:
    return probe.split("-")[0]


# llguidance lists oneOf and checks the branches itself: it refuses overlapping ones ("reported")
LLGUIDANCE_REFUSES_ITSELF = ("oneOf",)


def _refused(engine: str, probe: str) -> bool:
    if engine == "llguidance" and probe in LLGUIDANCE_REFUSES_ITSELF:
        return True
    schema = K.prepare(PROBES[probe][0], engine)
    return any(u.keyword == _keyword(probe) for u in K.find(schema, engine))


# (engine, probe) where the engine's allowlist refuses the probe's keyword; the rest it enforces
CASES = [(e, p) for p in PROBES for e in E.ENGINES if _refused(e, p)]
ENFORCED = [(e, p) for p in PROBES for e in E.ENGINES if not _refused(e, p)]


def _compact(value) -> str:
    """``value`` as json.dumps writes it: json_schema's default whitespace ("compact")."""
    return json.dumps(value, ensure_ascii=False)


class CopyDecoder(torch.nn.Module):
    """A decoder that emits the token ``WINDOW`` positions back, so the prompt is the script.

    Its lm_head is a real projection (3 -> V): logits_j = -(j - t)^2 from the hidden state
    [1, t, t^2] (float64: exact at V = 131072), so the mask pass finds it like any lm_head.
    """

    def __init__(self, vocab_size: int):
        super().__init__()
        j = torch.arange(vocab_size, dtype=torch.float64)
        self.lm_head = torch.nn.Linear(3, vocab_size, bias=False, dtype=torch.float64)
        with torch.no_grad():
            self.lm_head.weight.copy_(torch.stack([-j * j, 2 * j, -torch.ones_like(j)], dim=1))

    def forward(self, ids):
        t = ids[:, -WINDOW].to(torch.float64)
        hidden = torch.stack([torch.ones_like(t), t, t * t], dim=-1)
        return self.lm_head(hidden).argmax(-1)


@pytest.fixture(scope="module")
def copy_model(tekken):
    ids = torch.zeros(2, WINDOW + 2, dtype=torch.long)
    dims = ({0: torch.export.Dim("batch"), 1: torch.export.Dim("seq", min=WINDOW, max=4 * WINDOW)},)
    return S.transform_decoder(CopyDecoder(tekken.vocab_size), (ids,), vocab_size=tekken.vocab_size, dynamic_shapes=dims)


def _script(tekken, text: str) -> list[int]:
    tokens = tekken.encode(text) + [tekken.eos_id]
    assert len(tokens) <= WINDOW
    return tokens + [tekken.eos_id] * (WINDOW - len(tokens))


def test_every_vocabulary_keyword_off_a_list_is_refused_with_its_reason():
    """What an engine does not list is refused wherever it appears; what it lists has a condition in words."""
    for engine, lists in E.allowlists().items():
        assert lists.evidence
        for keyword in K.rewrite.VOCABULARY:
            entry = lists.entry(keyword)
            found = K.find({"type": "object", keyword: {}}, engine)
            if entry is None:
                assert any(u.keyword == keyword and u.path == f"#/{keyword}" for u in found), (engine, keyword)
            else:
                assert entry.where, (engine, keyword)


@pytest.mark.parametrize("engine, probe", ENFORCED, ids=[f"{e}-{p}" for e, p in ENFORCED])
def test_a_probe_an_engine_takes_is_enforced(engines, engine, probe):
    """The other half of each probe: where the list (after the rewrites that keep the meaning) says
    the engine enforces the keyword, its invalid instance is refused and its valid one taken."""
    schema, invalid, valid = PROBES[probe]
    compiled = engines[engine].compile(S.json_schema(schema, strict=False))
    assert not compiled.unenforced
    tokenizer = engines[engine].tokenizer
    assert not force(engines[engine], compiled, tokenizer.encode(_compact(invalid))), (engine, probe, invalid)
    assert force(engines[engine], compiled, tokenizer.encode(_compact(valid))), (engine, probe, valid)


@pytest.mark.parametrize("engine, probe", CASES, ids=[f"{e}-{p}" for e, p in CASES])
def test_policy_refuses_by_default_names_keyword_path_and_fix(engines, engine, probe):
    schema, keyword = PROBES[probe][0], _keyword(probe)
    with pytest.raises(S.ConstraintError) as info:
        engines[engine].compile(S.json_schema(schema, strict=False))
    message = str(info.value)
    item = info.value.unenforced
    assert item.keyword == keyword and item.path.startswith("#") and item.path.endswith(keyword.replace("/", "~1"))
    assert f"`{keyword}` at {item.path}" in message and "unenforced='allow'" in message and "\n" not in message
    for other in item.enforced_by:  # the engine it names does enforce it: its probe's invalid instance is refused
        assert other in message
        compiled = engines[other].compile(S.json_schema(schema, strict=False))
        assert not compiled.unenforced
        if PROBES[probe][1] is not None:
            invalid = engines[other].tokenizer.encode(_compact(PROBES[probe][1]))
            assert not force(engines[other], compiled, invalid)


ALLOWED = [(e, p) for e, p in CASES if PROBES[p][1] is not None]


@pytest.mark.parametrize("engine, probe", ALLOWED, ids=[f"{e}-{p}" for e, p in ALLOWED])
def test_allowed_keyword_is_reported_and_the_output_post_validated(copy_model, tekken, engine, probe):
    """Through generate(): the engine really lets the invalid instance through (the list is not
    too strict), the result lists the keyword, and the violation is reported, never passed as valid;
    the valid instance comes back clean. The default refuses the request with the same message."""
    (schema, invalid, valid), keyword = PROBES[probe], _keyword(probe)
    allow = S.json_schema(schema, strict=False, unenforced="allow")
    prompts = [_script(tekken, _compact(invalid)), _script(tekken, _compact(valid))]
    result = S.generate(copy_model, prompts, [allow, allow], WINDOW, tokenizer=tekken, engine=engine)
    bad, good = result.outputs
    assert bad.finish_reason == "stop" and bad.text == _compact(invalid), (bad.finish_reason, bad.text, bad.error)
    assert any(u.startswith(f"{keyword} at #") for u in bad.unenforced), bad.unenforced
    assert bad.violation is not None and "schema violation" in bad.violation, bad.violation
    assert good.finish_reason == "stop" and good.text == _compact(valid) and good.violation is None
    refused = S.generate(copy_model, prompts[:1], [S.json_schema(schema, strict=False)], WINDOW, tokenizer=tekken,
                         engine=engine).outputs[0]
    assert refused.finish_reason == "error" and f"`{keyword}` at #" in refused.error and not refused.tokens


def test_formats_outside_the_standard_are_annotations_not_refusals(engines, tekken):
    schema = {"type": "object", "properties": {"t": {"type": "string", "format": "flag-topic"}}, "required": ["t"]}
    for name, engine in engines.items():
        compiled = engine.compile(S.json_schema(schema, strict=False))
        assert not compiled.unenforced
        assert force(engine, compiled, tekken.encode('{"t": "anything"}')), name
    assert K.post_validate(schema, '{"t":"anything"}') is None


def test_post_validate_uses_the_declared_draft():
    draft4 = {"$schema": "http://json-schema.org/draft-04/schema#", "type": "number", "minimum": 5,
              "exclusiveMinimum": True}
    assert K.post_validate(draft4, "5") is not None and K.post_validate(draft4, "6") is None
    assert "format" in K.post_validate({"type": "string", "format": "ipv4"}, '"1.2.3"')
    assert K.post_validate({"type": "integer"}, "{") .startswith("not JSON")


def _maskbench_files():
    files = sorted(MASKBENCH.glob("*.json"))
    assert len(files) >= 50, f"tests/data/maskbench has {len(files)} files; it should vendor at least 50"
    return files


@pytest.fixture(scope="module")
def maskbench(tekken, engines):
    """Every vendored file through both engines with the default policy: compiled once per session."""
    records = {name: [] for name in engines}
    for path in _maskbench_files():
        data = json.loads(path.read_text())
        for name, engine in engines.items():
            record = {"file": path.name, "status": "compiled", "valid_errors": 0, "invalid_accepted": 0,
                      "flagged": False}
            try:
                compiled = engine.compile(S.json_schema(data["schema"], strict=False))
                record["flagged"] = bool(compiled.unenforced)
            except S.ConstraintError as error:
                if getattr(error, "unenforced", None) is None:
                    record["status"] = "compile_error"
                    records[name].append(record)
                    continue
                record["status"], record["flagged"] = "refused", True
                try:  # what the refusal prevented: the same schema, accepted
                    compiled = engine.compile(S.json_schema(data["schema"], strict=False, unenforced="allow"))
                except S.ConstraintError:
                    records[name].append(record)
                    continue
            for test in data["tests"]:
                accepted = force(engine, compiled, tekken.encode(_compact(test["data"])))
                if test["valid"] and not accepted and record["status"] == "compiled":
                    record["valid_errors"] += 1
                if not test["valid"] and accepted:
                    record["invalid_accepted"] += 1
            records[name].append(record)
    return records


# Measured on the vendored sample (70 schemas; Tekken; llguidance 1.9.1, xgrammar 0.2.8, default policy):
# schemas that compile. A drop is a regression; a rise means the table is stale: update it.
COMPILED = {"llguidance": 69, "xgrammar": 68}  # 59 and 55 before the schema algebra; llguidance 68 before o9817's oneOf;
# xgrammar 64 before patternProperties were written out (pattern_members.py) and bounded strings took their escapes


@pytest.mark.parametrize("engine", E.ENGINES)
def test_maskbench_sample_has_no_silent_invalidation_errors(maskbench, engine):
    records = maskbench[engine]
    silent = [(r["file"], r["invalid_accepted"]) for r in records if r["invalid_accepted"] and not r["flagged"]]
    assert not silent, f"{engine} accepted invalid instances of schemas it neither refused nor reported: {silent}"


@pytest.mark.parametrize("engine", E.ENGINES)
def test_maskbench_sample_compiles_as_many_schemas_as_measured(maskbench, engine):
    records = maskbench[engine]
    compiled = [r for r in records if r["status"] == "compiled"]
    others = sorted((r["status"], r["file"]) for r in records if r["status"] != "compiled")
    assert len(records) == 70, f"the vendored sample has {len(records)} schemas; COMPILED was measured on 70"
    assert len(compiled) == COMPILED[engine], (
        f"{engine} compiled {len(compiled)} of {len(records)} schemas, measured {COMPILED[engine]}; "
        f"not compiled: {others}")


@pytest.mark.parametrize("engine", E.ENGINES)
def test_maskbench_sample_rejects_no_valid_instance_of_a_compiled_schema(maskbench, engine):
    rejected = [(r["file"], r["valid_errors"]) for r in maskbench[engine] if r["valid_errors"]]
    assert not rejected, f"{engine} rejected valid instances (file, count) of schemas it compiled: {rejected}"


def test_the_sample_exercises_the_table(maskbench):
    """The vendored sample holds the measured evidence: the `patternProperties` schemas xgrammar refused (an
    additional key written as any string) compile there now, their regions written out (``pattern_members.py``),
    and refuse every invalid instance they hold; what xgrammar still refuses no rewrite reaches (o9817's oneOf
    branches overlap; pp3's regions pass the automata caps)."""
    files = {path.name: json.loads(path.read_text()) for path in _maskbench_files()}
    written = [r for r in maskbench["xgrammar"] if r["status"] == "compiled"
               and "patternProperties" in json.dumps(files[r["file"]]["schema"])]
    invalid = sum(not test["valid"] for r in written for test in files[r["file"]]["tests"])
    assert len(written) >= 4 and invalid >= 10 and not any(r["invalid_accepted"] for r in written), written
    refused = {r["file"] for r in maskbench["xgrammar"] if r["status"] == "refused"}
    assert refused == {"Github_trivial---o9817.json", "Handwritten---pp3.json"}, refused
    assert any(r["status"] != "compiled" for r in maskbench["llguidance"])  # refused or failed (pp3: its regexes)
