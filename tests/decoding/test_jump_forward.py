"""Jump-forward through the verify programs: forced tokens decoded as drafts that cannot be
rejected, on the tiny KV-cached decoder (the real model: tests/models/test_models_smollm2.py,
benchmarks/bench_jump_forward.py)."""
from __future__ import annotations

import pytest
import torch
from conftest import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from neuron_constrain import models
from neuron_constrain.structured import StructuredRuntime, choice, ebnf, json_schema, regex, validate_output
from neuron_constrain.structured import generate
from neuron_constrain.structured.engines import ENGINES

BUCKETS = (1, 2, 4, 8)
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 99},
                                      "ok": {"type": "boolean"}}, "required": ["name", "age", "ok"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
     "required": ["color", "tags"], "additionalProperties": False},
    {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9}},
                                "required": ["id"]}, "minItems": 1, "maxItems": 2},
    {"enum": ["alpha", "beta", "gamma"]},
]
OTHERS = [regex(r"ab[0-9]{2}cd"), regex(r"(yes|no)-[a-c]{1,3}"), choice(["alpha", "alphabet", "beta"]),
          ebnf('root ::= "(" [0-9] ("," [0-9])? ")"'), None]


@pytest.fixture(scope="module")
def tiny():
    loaded = models.load_model("tiny")
    return loaded, models.export(loaded, max_batch=4, max_len=256, new_tokens=BUCKETS)


@pytest.fixture(scope="module")
def sampled(tiny):
    loaded, _ = tiny
    return models.export(loaded, max_batch=4, max_len=256, new_tokens=BUCKETS, sampled=True)


@pytest.fixture(scope="module")
def runtimes(tiny):
    loaded, decoder = tiny
    made = {e: StructuredRuntime.for_model(decoder, loaded.tokenizer, max_rows=4 * max(BUCKETS), engine=e) for e in ENGINES}
    yield made
    for runtime in made.values():
        runtime.close()


def _constraint(data, index):
    kind = data.draw(st.integers(0, len(SCHEMAS) + len(OTHERS) - 1), label=f"constraint {index}")
    return json_schema(SCHEMAS[kind]) if kind < len(SCHEMAS) else OTHERS[kind - len(SCHEMAS)]


@settings(max_examples=examples(12), deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_property_exact_jump_forward_is_token_identical_to_step_by_step(tiny, sampled, runtimes, data):
    """Over grammars (JSON schemas, regex, choice, EBNF, none) x greedy / sampled x batch 1 / 4 x
    both engines: the same tokens, finish reasons and texts, in fewer forward passes wherever
    something was forced (a one-token mask leaves a sampler nothing to choose)."""
    loaded, decoder = tiny
    temperature = data.draw(st.sampled_from([None, 0.8, 1.5]), label="temperature")
    sampling = {} if temperature is None else {"temperature": temperature, "seed": data.draw(st.integers(0, 9))}
    decoder = decoder if temperature is None else sampled
    engine = data.draw(st.sampled_from(ENGINES), label="engine")
    batch = data.draw(st.sampled_from([1, 4]), label="batch")
    constraints = [_constraint(data, i) for i in range(batch)]
    prompts = [data.draw(st.text("abcdefgh {}", min_size=1, max_size=6), label=f"prompt {i}") for i in range(batch)]
    limit = data.draw(st.integers(3, 40), label="max_new_tokens")
    runtime = runtimes[engine]
    step = generate(decoder, prompts, constraints, limit, tokenizer=loaded.tokenizer, runtime=runtime, **sampling)
    fast = generate(decoder, prompts, constraints, limit, tokenizer=loaded.tokenizer, runtime=runtime, jump_forward="exact",
                    **sampling)
    for constraint, a, b in zip(constraints, step.outputs, fast.outputs):
        assert (b.tokens, b.finish_reason, b.text) == (a.tokens, a.finish_reason, a.text), (engine, constraint)
        assert len(b.tokens) <= limit  # a run never crosses the token limit
        assert b.forward_passes == a.forward_passes - b.forced_tokens  # each forced token saved one pass
        if constraint is None:
            assert b.forced_tokens == 0
        if b.finish_reason == "stop" and constraint is not None:
            assert validate_output(constraint, b.text) is None


def test_sampling_depends_on_the_seed_and_not_on_the_batch(tiny, sampled, runtimes):
    loaded, _ = tiny
    prompts, constraints = ["a", "b"], [None, json_schema(SCHEMAS[0])]
    runs = [generate(sampled, prompts, constraints, 12, tokenizer=loaded.tokenizer, runtime=runtimes["xgrammar"],
                     temperature=1.0, seed=seed).outputs for seed in (1, 1, 2)]
    assert [o.tokens for o in runs[0]] == [o.tokens for o in runs[1]]
    assert runs[0][0].tokens != runs[2][0].tokens  # another seed, another sample (free text: 732 tokens)
    alone = generate(sampled, prompts[:1], constraints[:1], 12, tokenizer=loaded.tokenizer,
                     runtime=runtimes["xgrammar"], temperature=1.0, seed=1).outputs[0]
    assert alone.tokens == runs[0][0].tokens
    greedy = generate(sampled, prompts, constraints, 12, tokenizer=loaded.tokenizer, runtime=runtimes["xgrammar"])
    assert all(validate_output(c, o.text) is None for c, o in zip(constraints[1:], greedy.outputs[1:]) if o.finish_reason == "stop")


@pytest.mark.parametrize("engine", ENGINES)
def test_canonical_outputs_are_grammar_and_schema_valid(tiny, runtimes, engine):
    loaded, decoder = tiny
    constraints = [json_schema(s) for s in SCHEMAS] + [c for c in OTHERS if c is not None]
    result = generate(decoder, ["q"] * len(constraints), constraints, 60, tokenizer=loaded.tokenizer,
                      runtime=runtimes[engine], jump_forward="canonical")
    forced = 0
    for constraint, out in zip(constraints, result.outputs):
        assert out.finish_reason == "stop", (engine, constraint.describe(), out.text)
        assert validate_output(constraint, out.text) is None, (engine, constraint.describe(), out.text)
        assert out.forward_passes == len(out.tokens) - out.forced_tokens
        forced += out.forced_tokens
    assert forced > 0


@pytest.mark.parametrize("mode", ["exact", "canonical"])
def test_runs_stop_at_the_token_limit_and_a_forced_end_finishes(tiny, runtimes, mode):
    loaded, decoder = tiny
    tok = loaded.tokenizer
    schema = json_schema({"type": "object", "properties": {"abcdefghij": {"type": "boolean"}}, "required": ["abcdefghij"]})
    for limit in (1, 2, 3, 5):  # the run plus the token after it never pass the limit
        out = generate(decoder, ["x"], [schema], limit, tokenizer=tok, runtime=runtimes["llguidance"], jump_forward=mode)
        assert len(out.outputs[0].tokens) == limit and out.outputs[0].finish_reason == "length"
    out = generate(decoder, ["x"], [choice(["x"])], 10, tokenizer=tok, runtime=runtimes["xgrammar"], jump_forward="exact")
    only = out.outputs[0]
    # "x" then the stop token, both forced: "x" comes out of the prefill; the forced stop ends the
    # request and needs no model output, so no second pass runs
    assert (only.text, only.finish_reason, only.tokens[-1]) == ("x", "stop", tok.eos_id)
    assert only.forward_passes == 1 and only.forced_tokens == 1


def test_verify_programs_see_only_bucketed_shapes(tiny, runtimes):
    """After one warm-up call, a second generate feeds no program a shape it was not fed
    before: on an AOT backend (one compilation per shape) nothing recompiles."""
    loaded, decoder = tiny
    seen = set()
    originals = {n: program.run for n, program in decoder.steps.items()}

    def recording(n):
        def run(tokens, position_ids, attention_mask, **extra):
            seen.add((n, tuple(tokens.shape), tuple(attention_mask.shape),
                      tuple(extra["logit_mask"].shape) if "logit_mask" in extra else None))
            return originals[n](tokens, position_ids, attention_mask, **extra)
        return run

    constraints = [json_schema(SCHEMAS[0]), regex(r"ab[0-9]{2}cd"), None, json_schema(SCHEMAS[1])]
    try:
        for n in decoder.steps:
            decoder.steps[n].run = recording(n)
        generate(decoder, ["a", "b", "c", "d"], constraints, 30, tokenizer=loaded.tokenizer,
                 runtime=runtimes["llguidance"], jump_forward="exact")
        warm = set(seen)
        generate(decoder, ["a", "b", "c", "d"], constraints, 30, tokenizer=loaded.tokenizer,
                 runtime=runtimes["llguidance"], jump_forward="exact")
    finally:
        for n in decoder.steps:
            del decoder.steps[n].run
    assert seen == warm, seen - warm
    assert {n for n, *_ in seen} - {1} and all(shape[1] in BUCKETS for _, shape, _, _ in seen)
    assert all(window % decoder.window_bucket == 0 or window == decoder.max_len for _, _, (_, window), _ in seen)


def test_jump_forward_needs_verify_programs(tiny):
    loaded, _ = tiny
    single = models.export(loaded, max_batch=1, max_len=64)
    with pytest.raises(ValueError, match="new_tokens=\\(1, 2, 4, 8\\)"):
        generate(single, ["a"], [None], 4, tokenizer=loaded.tokenizer, jump_forward="exact")
    assert torch.is_tensor(single.cache[0])


def test_bench_jump_forward_writes_the_issue_schema(tmp_path):
    """benchmarks/bench_jump_forward.py end to end on the tiny decoder and 3 vendored MaskBench
    files: every field the JSON promises, forced tokens counted, and passes = tokens - forced."""
    import json
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[2]
    data = tmp_path / "data"
    data.mkdir()
    for name in ("BFCL_simple_9.json", "Handwritten---pp3.json", "Github_easy---o9953.json"):
        (data / name).write_text((root / "tests" / "data" / "maskbench" / name).read_text())
    out = tmp_path / "jf.json"
    subprocess.run([sys.executable, str(root / "benchmarks" / "bench_jump_forward.py"), "--data", str(data), "--model",
                    "tiny", "--mode", "exact", "--engine", "xgrammar", "--max-tokens", "24", "--json", str(out),
                    "--compile", "none"],  # the JSON it writes; compiled jump-forward: tests/decoding/test_compiled.py
                   check=True, capture_output=True, text=True, timeout=600)
    result = json.loads(out.read_text())
    fields = {"file", "status", "output_tokens", "forward_passes", "forward_passes_without", "forced_tokens", "valid",
              "identical", "seconds", "seconds_without"}
    compiled = [r for r in result["files"] if r["status"] == "compiled"]
    assert compiled and all(fields <= set(r) for r in compiled)
    for record in compiled:
        assert record["identical"] is True  # exact mode: the same tokens as step by step
        assert record["forward_passes"] == record["forward_passes_without"] - record["forced_tokens"]
    totals = result["totals"]
    assert totals["compiled"] == len(compiled) and totals["identical"] == len(compiled) and totals["forced_tokens"] > 0
