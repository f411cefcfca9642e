"""The library's policy as the server applies it (no server needed): which engine each vLLM request
kind goes to, what is refused with its keyword and JSON pointer, and the last line of defence
(a finished answer its constraint does not accept ends as an error, counted)."""
from __future__ import annotations

import json
import threading
import time
import types

import pytest
import torch

from neuron_constrain.structured import ConstraintError
from neuron_constrain.vllm import policy

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                         "population": {"type": "integer", "minimum": 0}},
        "required": ["city", "population"], "additionalProperties": False}
TOOL = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}


@pytest.mark.parametrize("kind, spec, engine", [
    ("json", json.dumps(CITY), "xgrammar"),
    ("json_object", "", "xgrammar"),
    ("json", json.dumps({"type": "object", "patternProperties": {"^x": {"type": "integer"}}}), "llguidance"),
    ("regex", r"[a-z]{3,8}@[a-z]{2,5}\.com", "xgrammar"),
    ("choice", json.dumps(["yes", "no"]), "xgrammar"),
    ("grammar", 'root ::= "a" | "b"', "xgrammar"),
    ("grammar", 'start: "a" | "b"', "xgrammar"),  # Lark, as vLLM takes it
    ("structural_tag", json.dumps({"structures": [{"begin": "<tool_call>", "schema": TOOL, "end": "</tool_call>"}],
                                   "triggers": ["<tool_call>"]}), "xgrammar"),
])
def test_admitted_on_the_library_engine(kind, spec, engine):
    assert policy.admit(policy.from_vllm(kind, spec)) == engine


@pytest.mark.parametrize("schema, keyword, pointer", [
    # forms the schema algebra cannot rewrite (a format has no positive complement): still refused, named
    ({"type": "object", "properties": {"a": {"type": "string", "not": {"format": "email"}}}}, "not", "#/properties/a/not"),
    ({"anyOf": [{"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, {"type": "array", "maxItems": 3}]}, "uniqueItems", "#/anyOf/0/uniqueItems"),
    ({"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}},
      "dependentSchemas": {"a": {"properties": {"b": {"not": {"format": "email"}}}}}}, "dependentSchemas", "#/dependentSchemas"),
])
def test_refused_with_keyword_and_pointer(schema, keyword, pointer):
    with pytest.raises(ConstraintError) as info:
        policy.admit(policy.from_vllm("json", json.dumps(schema)))
    item = info.value.unenforced
    assert (item.keyword, item.path) == (keyword, pointer)
    assert f"`{keyword}` at {pointer}" in policy.refusal_message(info.value)


def test_structural_tag_schemas_go_through_the_policy_and_the_string_fix():
    bad = {"structures": [{"begin": "<tool_call>", "schema": {**TOOL, "not": {"required": ["x"]}},
                           "end": "</tool_call>"}], "triggers": ["<tool_call>"]}
    with pytest.raises(ConstraintError, match=r"`not` at #/structures/0/schema/not|not.*#/structures/0/schema"):
        policy.from_vllm("structural_tag", json.dumps(bad))
    good = policy.from_vllm("structural_tag", json.dumps(
        {"structures": [{"begin": "<tool_call>", "schema": TOOL, "end": "</tool_call>"}], "triggers": ["<tool_call>"]}))
    from neuron_constrain.structured.engines.xgrammar.grammars import JSON_STRING_CLASS, LENGTH_STRING_CLASS

    assert LENGTH_STRING_CLASS not in good.spec and JSON_STRING_CLASS in good.spec


def test_malformed_constraints_refused():
    for kind, spec in [("regex", "[a-"), ("grammar", "root ::= ("), ("json", "{not json")]:
        with pytest.raises(ConstraintError):
            policy.admit(policy.from_vllm(kind, spec))


def test_fewest_tokens_bounds_the_shortest_answer_by_the_served_vocabularys_longest_piece(monkeypatch):
    """A schema's shortest answer over the longest piece of the served vocabulary: no answer needs fewer tokens.
    Nothing before the served vocabulary is known (a byte vocabulary would count a character a token)."""
    from neuron_constrain.structured.engines import make_engine
    from neuron_constrain.testing import toy_tokenizer

    schema = policy.from_vllm("json", json.dumps({"type": "array", "items": {"type": "string", "minLength": 30},
                                                   "minItems": 10}))
    monkeypatch.delitem(policy._SERVED, "engine", raising=False)
    assert policy.fewest_tokens(schema) is None
    engine = make_engine("auto", toy_tokenizer())
    monkeypatch.setitem(policy._SERVED, "engine", engine)
    longest = max(len(piece) for piece in engine.tokenizer.pieces)
    characters = 2 + 10 * 32 + 9  # [ "...", ... ]
    assert policy.fewest_tokens(schema) == (characters, -(-characters // longest))
    answer = json.dumps(["x" * 30] * 10, separators=(",", ":"))
    assert len(answer) == characters and len(engine.tokenizer.encode(answer)) >= characters / longest
    assert policy.fewest_tokens(policy.from_vllm("regex", "a{500}")) == (500, -(-500 // longest))  # a regex's too
    assert policy.fewest_tokens(policy.from_vllm("regex", r"(a+)\1")) is None  # a back-reference: not read here
    assert policy.fewest_tokens(policy.from_vllm("grammar", 'root ::= "a"')) is None  # grammars: not computed
    monkeypatch.setattr(policy.satisfiable, "shortest", lambda spec: pytest.fail("computed again"))
    assert policy.fewest_tokens(policy.from_vllm("json", json.dumps(schema.spec)))[0] == characters  # once a schema
    assert "max_tokens=16 cannot hold" in policy.too_few_tokens_message(characters, 40, 16)


def test_violation_names_the_control_character():
    constraint = policy.from_vllm("json", json.dumps(CITY))
    assert policy.violation(constraint, '{"city":"Paris","population":3}') is None
    why = policy.violation(constraint, '{"city":" })distance\x1b","population":0}')
    assert why and "not JSON" in why
    assert policy.violation(policy.from_vllm("regex", "[a-z]+"), "abc") is None
    assert policy.violation(policy.from_vllm("regex", "[a-z]+"), "ab1")


def test_frontend_check_raises_a_400_naming_the_parameter():
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import StructuredOutputsParams

    from neuron_constrain.vllm.validate import check_structured

    check_structured(SamplingParams())
    check_structured(SamplingParams(structured_outputs=StructuredOutputsParams(json=CITY)))
    schema = {"type": "object", "properties": {"a": {"type": "string", "not": {"format": "email"}}}}
    with pytest.raises(VLLMValidationError) as info:
        check_structured(SamplingParams(structured_outputs=StructuredOutputsParams(json=schema)))
    assert info.value.parameter == "structured_outputs.json"
    assert "`not` at #/properties/a/not" in str(info.value)


def test_last_line_of_defence_ends_an_invalid_answer_as_an_error():
    """The scheduler's check of a finished answer, on a stand-in request: an answer its constraint
    refuses becomes vLLM's FINISHED_ERROR and is counted; a valid one is left alone."""
    from vllm.v1.request import RequestStatus

    from neuron_constrain.vllm.scheduler import NeuronConstrainScheduler

    pieces = {1: b'{"city":"', 2: b"\x1b", 3: b'","population":0}', 4: b"Paris", 0: b""}
    scheduler = object.__new__(NeuronConstrainScheduler)
    scheduler.library_backend = types.SimpleNamespace(
        text=lambda ids: b"".join(pieces[i] for i in ids).decode(), snapshot=lambda: {"xgrammar": 1})
    scheduler.output_counters = {"validated_outputs": 0, "invalid_outputs": 0, "unchecked_outputs": 0}
    scheduler.violations, scheduler._counters_lock, scheduler._counters_file = [], threading.Lock(), None
    scheduler.structured_output_manager = types.SimpleNamespace(reasoner_cls=None, enable_in_reasoning=False)
    grammar = types.SimpleNamespace(nc_constraint=policy.from_vllm("json", json.dumps(CITY)), nc_engine="xgrammar")

    def request(ids):
        return types.SimpleNamespace(request_id="r", output_token_ids=ids, status=RequestStatus.FINISHED_STOPPED,
                                     structured_output_request=types.SimpleNamespace(grammar=grammar))

    good, bad = request([1, 4, 3, 0]), request([1, 2, 3, 0])
    scheduler._check_finished(good, [0])  # (the step's new tokens: the stop token)
    assert good.status == RequestStatus.FINISHED_STOPPED
    scheduler._check_finished(bad, [0])
    assert bad.status == RequestStatus.FINISHED_ERROR
    snapshot = scheduler.snapshot()
    assert snapshot["validated_outputs"] == 2 and snapshot["invalid_outputs"] == 1
    assert "not JSON" in snapshot["violations"][0]["why"]


def _burn(seconds: float) -> None:
    """Spend ``seconds`` of this thread's CPU time."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


@pytest.mark.parametrize("slow", ["fill", "accept"])
def test_a_slow_grammar_s_work_per_token_ends_it_with_each_fill_run_once(slow):
    """The engine core's per-token budget: a grammar whose fill, or whose accept, takes past the budget on
    STRIKES tokens in a row ends where it may end (only the stop token left in its row); each fill runs once
    (timing it by running it again tripled a slow grammar's cost to the batch); a fast grammar is never
    timed in CPU time nor stopped."""
    from neuron_constrain.structured.runtime.fill_budget import STRIKES
    from neuron_constrain.vllm.grammar_backend import _Budget, _stop_row

    class Grammar(_Budget):
        def __init__(self, fill_cost, accept_cost):
            self.fills, self.fill_cost, self.accept_cost = 0, fill_cost, accept_cost
            self.nc_budget, self.nc_stops = 0.01, _stop_row([2], 64)

        def fill(self, bitmask, idx):
            self.fills += 1
            bitmask[idx].fill_(-1)  # every token allowed, the stop token among them
            _burn(self.fill_cost)

        def accept(self, request_id, tokens):
            _burn(self.accept_cost)
            return True

    def run(grammar, tokens):
        bitmask = torch.zeros((1, 2), dtype=torch.int32)
        for step in range(tokens):
            grammar._timed_fill(grammar.fill, bitmask, 0)
            if grammar.nc_budget_ended:
                return step, bitmask
            grammar._timed_accept(grammar.accept, "r", [5])
        return None, bitmask

    fast = Grammar(0.0, 0.0)
    assert run(fast, 20)[0] is None and not fast.nc_costly and fast.fills == 20  # (the clock may call it slow on a busy host)
    costly = Grammar(0.015, 0.0) if slow == "fill" else Grammar(0.004, 0.012)
    step, bitmask = run(costly, 20)
    assert step is not None and step <= STRIKES + 1 and costly.fills == step + 1, (step, costly.fills)
    assert bitmask[0].tolist() == costly.nc_stops.tolist() and costly.nc_failure is None and costly.nc_costly
