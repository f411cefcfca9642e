"""Length bounds and patterns (``structured/schema/algebra/lengths.py``, ``patterns.length_lookahead``): the pattern
:func:`cut` writes matches only the strings of the pattern within the bounds (every string, where it says exact),
checked over every string of a small alphabet; llguidance, which cannot prove a pattern beside a long
``minLength`` non-empty, compiles such schemas with the bound in the pattern, exactly where the tree allows; and
a length bound written as a lookahead (``^(?=.{1,253}$)...``) is read as ``minLength``/``maxLength``.
"""
from __future__ import annotations

import itertools
import re
import warnings

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from neuron_constrain import structured as S
from neuron_constrain.structured import engines as E
from neuron_constrain.structured.schema import patterns as P
from neuron_constrain.structured.schema.algebra import lengths, regular
from neuron_constrain.structured.schema.algebra.lookaround import has_assertion, language
from neuron_constrain.testing import toy_tokenizer
from neuron_constrain.testing.schemas import PATTERNS_DRAWN, differential, pattern_strings, readable
from tests.conftest import examples
from tests.structured.test_patterns import STRINGS, _python

pytestmark = pytest.mark.torch_agnostic(lane="latest")  # host-side: the same on every torch

ALPHABET = "abc"
_SETS = [("chars", ((ord(c), ord(c)),)) for c in "ab"] + [("chars", ((ord("a"), ord("b")),))]


def _trees(depth: int = 3):
    leaf = st.sampled_from(_SETS)
    if depth == 0:
        return leaf
    sub = _trees(depth - 1)
    counts = st.tuples(st.integers(0, 2), st.one_of(st.none(), st.integers(0, 3))).filter(
        lambda c: c[1] is None or c[0] <= c[1])
    return st.one_of(
        leaf,
        st.lists(sub, min_size=2, max_size=3).map(lambda items: ("seq", tuple(items))),
        st.lists(sub, min_size=2, max_size=3).map(lambda items: ("alt", tuple(items))),
        st.tuples(sub, counts).map(lambda t: ("repeat", t[0], t[1][0], t[1][1])),
    )


def _matcher(tree):
    return re.compile(regular.write(tree))


@settings(max_examples=examples(80), suppress_health_check=list(HealthCheck), deadline=None)
@given(_trees(), st.integers(0, 6), st.one_of(st.none(), st.integers(0, 7)))
def test_a_cut_pattern_matches_only_the_strings_within_the_bounds(tree, low, high):
    if high is not None and high < low:
        return
    cut, exact = lengths.cut(tree, low, high)
    original = _matcher(tree)
    written = _matcher(cut) if cut is not None else None
    longest = (high if high is not None else low + 3) + 1
    for size in range(longest + 1):
        for text in map("".join, itertools.product(ALPHABET, repeat=size)):
            wanted = original.fullmatch(text) is not None and low <= size and (high is None or size <= high)
            got = written is not None and written.fullmatch(text) is not None
            assert not got or wanted, (tree, low, high, text)  # never wider
            assert not exact or got == wanted, (tree, low, high, text)  # exact: every such string


@settings(max_examples=examples(80), suppress_health_check=list(HealthCheck), deadline=None)
@given(_trees())
def test_the_fewest_characters_of_a_plain_pattern_are_its_shortest_match(tree):
    """``lengths.fewest`` (the vLLM server's max_tokens check for a regex) is exact without assertions."""
    source, matcher = regular.write(tree), _matcher(tree)
    least = lengths.fewest(source)
    for size in range(min(least, 6) + 1):
        found = any(matcher.fullmatch("".join(t)) for t in itertools.product(ALPHABET, repeat=size))
        assert found == (size == least), (source, least, size)


@settings(max_examples=examples(80), suppress_health_check=list(HealthCheck), deadline=None)
@given(PATTERNS_DRAWN, st.data())
def test_no_whole_match_of_a_drawn_pattern_is_shorter_than_its_fewest_characters(source, data):
    """Drawn patterns with lookarounds, anchors, word boundaries, classes: a lower bound on every whole match
    (Python's reading: a ``regex`` constraint's)."""
    if not readable(source):
        return
    least = lengths.fewest(source)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pattern = re.compile(source)
        drawn = data.draw(st.lists(st.from_regex(pattern, fullmatch=True), max_size=3))
    for text in drawn + data.draw(st.lists(STRINGS, min_size=4, max_size=4)):
        assert not pattern.fullmatch(text) or len(text) >= least, (source, least, text)


@pytest.mark.parametrize("source, least", [
    ("a{500}", 500), (r"(?:[a-z][0-9]){5000,}", 10_000), (r"(?=.*\d)[a-z\d]{8,64}", 8), (r"^\w{3}\b$", 3),
    ("x|", 0), (r"(a)\1", 0), ("(", 0),  # a back-reference, a syntax error: not read here
])
def test_the_fewest_characters_of_a_regex(source, least):
    assert lengths.fewest(source) == least


@pytest.mark.parametrize("source, low, high, expected", [
    ("^([a-z][0-9])+$", 1000, None, "^(?:(?:[a-z][0-9]){500,})$"),  # one width: the count, exactly
    ("^(ab|cde)*$", 5000, None, "^(?:(?:ab|cde){2500,})$"),  # varying: its narrowest pieces reach the least
])
def test_a_repetition_takes_its_count(source, low, high, expected):
    assert lengths.within(source, low, high) == (expected, source.startswith("^([a-z]"))


def test_a_sequence_shares_the_room_among_the_parts_that_can_grow():
    written, exact = lengths.within(r"^[a-z]+@[a-z]+\.[a-z]{2,}$", 300, 400)
    assert not exact
    pattern = re.compile(written)
    assert pattern.fullmatch("a" * 295 + "@" + "b" + "." + "cc") and not pattern.fullmatch("a@b.cc")
    assert all(300 <= len(text) <= 400 for text in ("a" * 329 + "@" + "b" * 34 + "." + "c" * 35,)) \
        and pattern.fullmatch("a" * 329 + "@" + "b" * 34 + "." + "c" * 35)


@pytest.fixture(scope="module")
def engines():
    tokenizer = toy_tokenizer()
    return {name: E.make_engine(name, tokenizer) for name in ("llguidance", "auto")}


LONG = {  # llguidance 1.9.1 alone: "Unable to determine if regex is empty" for each
    "one width": ({"type": "string", "pattern": "^([a-z][0-9])+$", "minLength": 600},
                  ["a0" * 300, "a0" * 299, "a0" * 299 + "a", "a0" * 400, "a0" * 300 + "!"], ()),
    "intersected patterns": ({"type": "string", "allOf": [{"pattern": "^([a-z][0-9])+$"}, {"pattern": "(t|8){10}$"}],
                              "minLength": 600}, ["a0" * 295 + "t8" * 5, "a0" * 294 + "t8" * 5, "a0" * 300], ("#",)),
}


@settings(max_examples=examples(60), suppress_health_check=list(HealthCheck), deadline=None)
@given(PATTERNS_DRAWN, st.integers(0, 5), st.one_of(st.none(), st.integers(0, 8)), st.data())
def test_a_drawn_pattern_cut_by_its_tree_is_never_wider(source, low, high, data):
    """Drawn patterns (the soundness test's), cut by their tree alone (the route past the automaton's caps),
    against the tree's own reading on strings that straddle the pattern's features."""
    if high is not None and high < low or not readable(source):
        return
    try:
        pattern = P.parse(source)
    except S.ConstraintError:
        return
    tree = None if pattern.refused is not None else P.full_match(pattern, search=True)
    if tree is None or has_assertion(tree):
        return
    cut, exact = lengths.cut(tree, low, high)
    original = re.compile(_python(tree), re.DOTALL)
    written = re.compile(_python(cut), re.DOTALL) if cut is not None else None
    for text in data.draw(pattern_strings(source)) + data.draw(st.lists(STRINGS, min_size=4, max_size=4)):
        wanted = original.fullmatch(text) is not None and low <= len(text) and (high is None or len(text) <= high)
        got = written is not None and written.fullmatch(text) is not None
        assert not got or wanted, (source, low, high, text)
        assert not exact or got == wanted, (source, low, high, text)


def test_a_narrower_pattern_is_never_written_beside_a_negation():
    """Under `oneOf` a narrower branch could widen the schema (a value only the other branch then takes)."""
    branch = {"type": "string", "pattern": "^[a-z]+@[a-z]+$", "minLength": 300}
    alone, narrowed = {"anyOf": [dict(branch), {"type": "integer"}]}, []
    lengths.write_bounds(alone, narrowed)
    assert narrowed == ["#/anyOf/0"] and "minLength" not in alone["anyOf"][0]
    negated, narrowed = {"oneOf": [dict(branch), {"type": "integer"}]}, []
    lengths.write_bounds(negated, narrowed)
    assert narrowed == [] and negated["oneOf"][0] == branch
    exact, narrowed = {"oneOf": [{"type": "string", "pattern": "^(ab)+$", "minLength": 300}, {"type": "integer"}]}, []
    lengths.write_bounds(exact, narrowed)  # exact: written whatever the schema holds
    written = exact["oneOf"][0]
    assert narrowed == [] and set(written) == {"type", "pattern"}
    assert re.fullmatch(written["pattern"], "ab" * 150) and not re.fullmatch(written["pattern"], "ab" * 149)


@pytest.mark.parametrize("source, expected", [
    (r"^(?=.{1,253}$)([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\.)+[a-z]{2,63}$",
     (r"^([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\.)+[a-z]{2,63}$", 1, 253)),
    ("^(?=^.{2,4}$)[a-z]+$", ("^[a-z]+$", 2, 4)),
    ("^(?=.{3,}$)[a-z]+$", ("^[a-z]+$", 3, None)),
    ("^(?=.{1,5}$)a|b", None),  # the lookahead bounds the first alternative alone
    ("^(?=.{1,5}$)a", None),  # an open end: the rest may hold a line terminator, which `.` refuses
    ("^(?=.{1,5}$)[^x]+$", None),  # so may [^x]
    ("^(?=.{5,2}$)a$", None),
])
def test_a_length_lookahead_is_read_as_length_bounds(source, expected):
    assert lengths.length_lookahead(source) == expected


@settings(max_examples=examples(60), suppress_health_check=list(HealthCheck), deadline=None)
@given(_trees(), st.booleans(), st.sampled_from(("", "(?=.*a)", "(?!.*bb)")), st.integers(0, 3),
       st.one_of(st.none(), st.integers(0, 3), st.integers(0, 3)))
def test_a_length_lookahead_read_as_bounds_is_the_same_language(tree, repeated, look, low, extra):
    """``^(?=.{n,m}$)rest`` (``rest`` with or without lookaheads of its own, holding no line terminator) in the
    engines' reading (its automaton) against ``^rest`` with the bounds, on every string of a 3-letter alphabet."""
    tree = ("repeat", tree, 0, None) if repeated else tree  # strings longer than the bounds, to cut
    high = None if extra is None else low + extra
    rest = f"^{look}{regular.write(tree)[1:]}"
    source = f"^(?=.{{{low},{'' if high is None else high}}}$){rest[1:]}"
    bounded = lengths.length_lookahead(source)
    if language(P.parse(rest), search=True) is None:
        assert bounded is None, source  # no string: left to the schema's own check
        return
    assert bounded is not None, source  # one alternative, anchored, no line terminator: always read as bounds
    written, low, high = bounded
    whole, plain = (language(P.parse(pattern), search=True) for pattern in (source, written))
    whole, plain = (re.compile(_python(tree)) if tree is not None else None for tree in (whole, plain))
    for size in range((high if high is not None else low + 3) + 2):
        for text in map("".join, itertools.product(ALPHABET, repeat=size)):
            inside = plain is not None and plain.fullmatch(text) is not None and low <= size and (
                high is None or size <= high)
            assert inside == (whole is not None and whole.fullmatch(text) is not None), (source, text)


HOSTNAME = {"type": "string", "pattern": r"^(?=.{1,253}$)([a-zA-Z0-9]([a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?\.)+[a-zA-Z]{2,63}$"}


_HOST_254 = ".".join(["a" * 62] * 4)[:250] + ".com"  # 254 characters: one too many for a hostname
LOOKAHEAD_IDIOMS = {  # each refused before (513 automaton states, over the cap of 512)
    "a hostname": (HOSTNAME, ["example.com", "a.b.io", _HOST_254[1:], _HOST_254, "-bad.com", "example", "a..com",
                              "x" * 64 + ".io"], ()),
    "password rules": ({"type": "string", "pattern": "^(?=.{8,128}$)(?=.*[A-Z])(?=.*[0-9]).*$"},
                       ["Abcdefg1", "A1" * 64, "abcdefg1", "ABCDEFGH", "Ab1", "A1" * 65], ()),
    "an email with its local part bounded": (
        {"type": "string", "pattern": r"^(?=.{1,254}$)(?=.{1,64}@)[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}$"},
        ["john.doe@example.com", "a@b.io", "a" * 65 + "@b.io", "john@", "@example.com", "a@b.c"], ("#",)),
}


@pytest.mark.parametrize("name", sorted({**LONG, **LOOKAHEAD_IDIOMS}))
def test_each_compiles_on_llguidance_and_auto_exactly_or_listed_narrower(engines, name):
    """Each refused before on both: its valid instances taken (those a narrower pattern keeps), none invalid."""
    schema, instances, narrowed = {**LONG, **LOOKAHEAD_IDIOMS}[name]
    for engine in engines.values():
        verdict = differential(engine, schema, instances, strict=False, samples=0)
        assert verdict.refused is None and not verdict.unsound and not verdict.over_restricted, verdict
        assert verdict.accepted_valid == sum(map(jsonschema.Draft202012Validator(schema).is_valid, instances)) > 0, \
            verdict
        assert engine.compile(S.json_schema(schema, strict=False)).narrowed == narrowed
