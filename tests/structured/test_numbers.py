"""Values of any type, exactly (issue 57): integral numbers are integers on xgrammar, untyped and multi-typed
nodes keep every type, ``enum`` / ``const`` compare by value; nothing the referee refuses is ever accepted."""
from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from neuron_constrain.structured import constraints as S
from neuron_constrain.structured import engines as E
from neuron_constrain.structured.engines.xgrammar import integers
from neuron_constrain.structured.engines.xgrammar.grammars import ebnf_accepts
from neuron_constrain.structured.schema import rewrite, values
from neuron_constrain.structured.validation import validate_output
from neuron_constrain.testing import force, toy_tokenizer
from neuron_constrain.testing.numbers import _forms, spelled
from neuron_constrain.testing.schemas import VALUES, differential, schema_and_instances
from tests.conftest import examples

pytestmark = pytest.mark.torch_agnostic(lane="latest")

SETTINGS = settings(max_examples=examples(20), deadline=None, suppress_health_check=[
    HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def toy_engines():
    vocabulary = toy_tokenizer()
    return {name: E.make_engine(name, vocabulary) for name in ("xgrammar", "llguidance")}


def _accepts(engine, schema, text: str) -> bool:
    return force(engine, engine.compile(S.json_schema(schema, strict=False)), engine.tokenizer.encode(text))


# Each row failed on xgrammar before issue 57 (a valid text rejected), except the invalid column: never accepted.
EXACT_ON_XGRAMMAR = [
    ({"type": "integer"}, ["1.0", "-0.0", "-0", "100.000", "1e2", "1e+16", "1.5e+16", "1e+300"],
     ["1.5", "1e-2", "1.5e0", "1.23e1", "01", "1.", "1e400", "1" + "0" * 400 + ".0"]),
    ({"type": ["integer", "null"]}, ["2.0", "null"], ["2.5", '"2"']),
    ({"type": "integer", "minimum": 1, "maximum": 3}, ["3.0", "2.00"], ["0.0", "4.0", "3.5", "-0.0"]),
    ({"type": "integer", "maximum": 1}, ["1.0", "-0.0", "-7.0"], ["2.0", "1.5"]),
    ({"type": "integer", "multipleOf": 3}, ["9.0", "-3.0", "0.0"], ["4.0", "3.5"]),
    ({"type": "number", "minimum": 0}, ["-0.0", "-0"], ["-1", "-0.5"]),
    ({"type": "number", "exclusiveMinimum": 0}, ["1"], ["-0.0", "0", "-0"]),
    ({"const": 2}, ["2.0", "2"], ["2.5", "20"]),
    ({"const": 0}, ["0.0", "-0.0"], ["1", "false"]),
    ({"enum": [1, "a", None]}, ["1.0"], ["2", '"b"']),
    ({"enum": [False, 0]}, ["0.0", "false"], ["true", "1"]),
    ({"enum": [{"a": 1}, [1, 2]]}, ['{"a": 1}', "[1, 2]", "[1.0, 2]"], ["[1]", "[1, 2, 3]", "{}"]),
    ({"const": {"a": 1, "b": [True, None]}}, ['{"b": [true, null], "a": 1}'], ['{"a": 1}']),
    ({"maxLength": 2}, ["5", "[1, 2, 3]"], ['"abc"']),
    ({"propertyNames": {"maxLength": 1}}, ['"abcd"', "[1, 2]"], ['{"ab": 1}']),
    ({"type": ["integer", "string"], "minimum": 2, "maxLength": 3}, ["3.0", '"abc"'], ["1", '"abcd"', "null"]),
]


@pytest.mark.parametrize("schema,valid,invalid", EXACT_ON_XGRAMMAR, ids=[json.dumps(r[0]) for r in EXACT_ON_XGRAMMAR])
def test_values_of_any_type_are_exact_on_xgrammar(toy_engines, schema, valid, invalid):
    validator = jsonschema.Draft202012Validator(schema)
    assert all(validator.is_valid(json.loads(t)) for t in valid) and not any(
        validator.is_valid(json.loads(t)) for t in invalid if _is_json(t))  # the table is jsonschema's
    xgrammar = toy_engines["xgrammar"]
    assert [t for t in valid if not _accepts(xgrammar, schema, t)] == []
    for engine in toy_engines.values():  # llguidance: plain integer spellings only (narrower), never wider
        try:
            assert [t for t in invalid if _accepts(engine, schema, t)] == [], engine.name
        except S.ConstraintError:
            assert engine.name == "llguidance"  # propertyNames: refused by name there


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def test_llguidance_spells_integers_plainly_and_auto_ends_on_xgrammar(toy_engines):
    """The documented narrowing: llguidance's JSON compiler writes an integer as ``-?(0|[1-9][0-9]*)``; auto's
    race ends on xgrammar, which takes ``1.0``; the library's own validation agrees with the grammar."""
    assert not _accepts(toy_engines["llguidance"], {"type": "integer"}, "1.0")
    auto = E.AutoEngine(toy_engines["xgrammar"].tokenizer, race=False)
    constraint = S.json_schema({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    compiled = auto.compile(constraint)
    assert compiled.engine == "xgrammar" and force(auto, compiled, auto.tokenizer.encode('{"n": 4.0}'))
    assert validate_output(constraint, '{"n": 4.0}') is None and validate_output(constraint, '{"n": 4.5}') is not None


def test_equal_items_spelled_apart_are_still_duplicates(toy_engines):
    """``uniqueItems``: 1 and 1.0 are one value (the item tracker reads the items as JSON)."""
    for engine in toy_engines.values():
        schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True, "maxItems": 3}
        assert not _accepts(engine, schema, "[1, 1.0]") and _accepts(engine, schema, "[1, 2]"), engine.name


NUMBER_TEXT = st.from_regex(r"-?(0|[1-9][0-9]{0,20})(\.[0-9]{1,18})?([eE][+-]?[0-9]{1,3})?", fullmatch=True)


def _integral(text: str) -> bool:
    value = json.loads(text)
    return isinstance(value, int) or (isinstance(value, float) and value.is_integer())


@settings(max_examples=examples(120), deadline=None)
@example(text="1" + "0" * 400 + ".0")  # a float past 1.8e308 is inf: no integer to the referee
@example(text="1e308")
@example(text="12e296")
@given(text=NUMBER_TEXT)
def test_an_integral_spelling_is_an_integer_to_the_referee(text):
    """Whatever ``basic_integer`` takes, ``json.loads`` reads as an integer (an int, or a finite float that is
    one); the forms ``json.dumps`` writes for integral floats are all taken."""
    grammar = _INTEGRAL_GRAMMAR
    if ebnf_accepts(grammar, text):
        assert _integral(text), text
    value = json.loads(text)
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e300:
        assert ebnf_accepts(grammar, json.dumps(value)), json.dumps(value)


_INTEGRAL_GRAMMAR = integers.INTEGRAL_RULES + integers.BASIC_INTEGER + "\nroot ::= basic_integer\n"


@pytest.mark.parametrize("step", [1, 3, 32])
def test_the_multiples_automaton_is_the_multiples(step):
    grammar = "\n".join(integers._multiples(step, "m_")) + "\nroot ::= m_root\n"
    for number in list(range(0, 40)) + [96, 10 ** 15, 10 ** 15 + 1, 10 ** 16]:
        assert ebnf_accepts(grammar, str(number)) == (number % step == 0 and number < 10 ** 16), (step, number)


@settings(max_examples=examples(200), deadline=None)
@given(value=st.one_of(st.integers(-10 ** 6, 10 ** 6), st.floats(-1e6, 1e6, allow_nan=False), VALUES), seed=st.integers(0, 9))
def test_a_number_spelled_another_way_is_the_same_value(value, seed):
    text = spelled(value, seed)
    if text is not None:
        assert json.loads(text) == value, text
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        assert all(json.loads(form) == value for form in _forms(value))


@SETTINGS
@given(case=st.one_of(schema_and_instances("untyped"), schema_and_instances("numbers")))
def test_the_rewrites_keep_the_meaning(case):
    """``split_types`` and ``values_as_schemas`` keep exactly the valid values (jsonschema on both schemas)."""
    schema, instances = case
    rewritten = json.loads(json.dumps(schema))
    values.split_types(rewritten, rewrite.walk)
    values.values_as_schemas(rewritten, rewrite.walk, integral_numbers=True)
    before, after = jsonschema.Draft202012Validator(schema), jsonschema.Draft202012Validator(rewritten)
    for instance in instances:
        assert before.is_valid(instance) == after.is_valid(instance), (schema, rewritten, instance)


@SETTINGS
@example(case=({"type": "integer", "maximum": 1}, [2.0, 1.0, -0.0]))  # 2.0 spelled with a fraction above the bound
@example(case=({"type": "integer", "multipleOf": 2, "minimum": 0}, [3, 4.0]))  # xgrammar drops the step: refused
@example(case=({"type": "number", "exclusiveMinimum": 0}, [-0.0, 0.0, 1]))
@example(case=({"enum": [{"a": 1.0, "b": 2}, 3]}, [{"b": 2, "a": 1}, {"a": 1.5, "b": 2}, 3.0]))
@given(case=schema_and_instances("numbers"))
def test_numbers_never_accept_an_invalid_instance(toy_engines, case):
    schema, instances = case
    for name, engine in toy_engines.items():
        verdict = differential(engine, schema, instances)
        assert not verdict.unsound, f"{name} compiled {json.dumps(schema)} and accepted {verdict.unsound[:3]}"
