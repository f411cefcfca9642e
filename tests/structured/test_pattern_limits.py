"""A regex's cost bounded before any engine reads it (``schema/limits.py``: ``pattern_size``,
``repeat_nesting``, ``varying_repeat``), and a referee (``validation.py``, ``referee.py``) that a
backtracking pattern cannot hang."""
from __future__ import annotations

import multiprocessing
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import neuron_constrain.structured as S
from neuron_constrain.structured import validation
from neuron_constrain.structured.engines import make_engine
from neuron_constrain.structured.schema import limits as L
from neuron_constrain.structured.schema import patterns
from neuron_constrain.testing.vocabulary import toy_tokenizer

pytestmark = pytest.mark.torch_agnostic(lane="latest")

HOSTILE = "((([a-z]{1,20}){1,20}){1,20}){1,5}"  # passed every limit before; one xgrammar fill 9.9 s

# (constraint, the limit it passes under the defaults, where)
PAST = [
    (S.regex(HOSTILE), "repeat_nesting", ""),
    (S.json_schema({"type": "string", "pattern": HOSTILE}), "repeat_nesting", "#/pattern"),
    (S.json_schema({"type": "object", "properties": {"a": {"type": "string", "pattern": "^([a-z]{1,3}){1,100}$"}}}),
     "varying_repeat", "#/properties/a/pattern"),
    (S.json_schema({"type": "object", "patternProperties": {"^(a|b|c){1,200}$": {}}}), "varying_repeat",
     "#/patternProperties"),
    (S.json_schema({"type": "object", "propertyNames": {"pattern": "^(([a-z]+)+)+$"}}), "repeat_nesting",
     "#/propertyNames/pattern"),
    (S.regex("(" + "abcdefghij" * 100 + "){1,600}"), "pattern_size", ""),
    (S.regex("[a-z]{1,60000}[0-9]{1,6000}"), "pattern_size", ""),
]


@pytest.mark.parametrize("constraint, limit, where", PAST, ids=[f"{p[1]}-{i}" for i, p in enumerate(PAST)])
def test_a_costly_pattern_is_refused_by_name_before_any_engine(constraint, limit, where):
    with pytest.raises(L.LimitError) as info:
        L.check(constraint)
    error = info.value
    assert (error.limit, error.where) == (limit, where)
    assert f"over the limit {limit}={getattr(L.DEFAULT, limit)}" in str(error) and f"Limits({limit}=...)" in str(error)
    raised = L.Limits(pattern_size=10 ** 6, repeat_nesting=8, varying_repeat=1000)
    L.check(constraint, raised)  # raising the limit lets it through


def test_the_engines_refuse_the_hostile_pattern_before_compiling():
    engine = make_engine("auto", toy_tokenizer())
    try:
        with pytest.raises(L.LimitError, match="4, over the limit repeat_nesting=2"):
            engine.compile(S.json_schema({"type": "string", "pattern": HOSTILE}))
    finally:
        engine.close()


REAL = [r"^(\d{1,3}\.){3}\d{1,3}$", r"^[a-z0-9._%+-]+@([a-z0-9-]+\.)+[a-z]{2,}$", r"^\d{4}-\d{2}-\d{2}$",
        r"^([A-Za-z0-9+/]{4})*([A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$", r"^([a-z0-9-]{1,63}\.){1,8}[a-z]{2,63}$"]


@pytest.mark.parametrize("pattern", REAL)
def test_real_patterns_pass(pattern):
    L.check(S.regex(pattern))
    L.check(S.json_schema({"type": "string", "pattern": pattern}))


def _regex(depth: int):
    """A strategy of ``(pattern, match, match)``: a regex over ``a``/``b`` and two strings it fully matches."""
    atom = st.sampled_from([("a", "a", "a"), ("[ab]", "a", "b"), ("b", "b", "b")])
    if depth == 0:
        return atom

    def repeat(args):
        (pattern, one, other), low, extra, counts = args
        high = low + extra
        first, second = (min(high, low + c) for c in counts)
        return f"({pattern}){{{low},{high}}}", one * first, other * second

    def sequence(parts):
        return "".join(p[0] for p in parts), "".join(p[1] for p in parts), "".join(p[2] for p in parts)

    def alternation(args):
        (left, right), pick = args
        chosen = [left, right]
        return f"({left[0]}|{right[0]})", chosen[pick[0]][1], chosen[pick[1]][2]

    inner = _regex(depth - 1)
    return st.one_of(
        atom,
        st.tuples(inner, st.integers(0, 3), st.integers(0, 3), st.tuples(st.integers(0, 3), st.integers(0, 3)))
        .map(repeat),
        st.lists(inner, min_size=1, max_size=3).map(sequence),
        st.tuples(st.tuples(inner, inner), st.tuples(st.integers(0, 1), st.integers(0, 1))).map(alternation))


@settings(max_examples=60, deadline=None)
@given(_regex(3))
def test_the_cost_bounds_every_match(drawn):
    """Each written-out position matches one character: no match is longer than ``size``; a pattern
    that does not vary matches strings of one length only."""
    pattern, one, other = drawn
    assert re.fullmatch(pattern, one) and re.fullmatch(pattern, other)
    cost = L.pattern_cost(patterns.parse(pattern).tree)
    assert len(one) <= cost.size and len(other) <= cost.size
    if not cost.varies:
        assert len(one) == len(other)
    wrapped = L.pattern_cost(patterns.parse(f"({pattern}){{0,2}}").tree)
    assert wrapped.nesting == cost.nesting + 1 and wrapped.size == 2 * cost.size


# --------------------------------------------------------------------------- the referee
BACKTRACKS = r"(([a-z]{1,20}){1,20}){1,20}"  # Python's re: 0.1 s on 12 letters and a `!`, 9 s on 16


def test_the_referee_gives_up_on_a_backtracking_pattern_and_goes_on(monkeypatch):
    monkeypatch.setattr(validation, "REFEREE_SECONDS", 0.5)
    started = validation._REFEREE.started
    for constraint, text in [(S.regex(BACKTRACKS), "a" * 40 + "!"),
                             (S.json_schema({"type": "string", "pattern": f"^{BACKTRACKS}$"}), '"' + "a" * 40 + '!"')]:
        verdict = validation.validate_output(constraint, text)
        assert verdict is not None and "could not be checked" in verdict and "0.5 s" in verdict
    assert validation._REFEREE.started >= started + 2  # killed each time, started again
    assert validation.validate_output(S.regex(BACKTRACKS), "a" * 40) is None
    assert validation.validate_output(S.regex("[a-z]+"), "ab!") == "does not match /[a-z]+/"
    schema = S.json_schema({"type": "object", "patternProperties": {"^x": {"type": "integer"}}})
    assert validation.validate_output(schema, '{"x1": 1}') is None
    assert "not of type 'integer'" in validation.validate_output(schema, '{"x1": "one"}')


def _judge_in_a_pool_worker(text: str):
    return validation.validate_output(S.regex("[a-z]+"), text)


def test_the_referee_starts_inside_a_daemonic_process():
    with multiprocessing.get_context("fork").Pool(1) as pool:  # a Pool's workers are daemonic
        assert pool.map(_judge_in_a_pool_worker, ["abc", "ab!"]) == [None, "does not match /[a-z]+/"]
