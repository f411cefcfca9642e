"""Patterns as regular languages (``structured/schema/algebra/regular.py``): the complement of a pattern holds
no string either dialect matches and every string both readings refuse; an intersection holds exactly
the strings both patterns match; each read back by the library's parser as the engines read it.

Also the two readings ``regular.py`` rests on (``patterns.parse``): the narrow one (what the engines
enforce) never matches a string Python's ``re`` refuses, the wide one matches every string it takes.
"""
from __future__ import annotations

import re
import warnings

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from neuron_constrain import structured as S
from neuron_constrain.structured.schema import patterns as P
from neuron_constrain.structured.schema.algebra import regular
from neuron_constrain.structured.schema.algebra.lookaround import language
from neuron_constrain.structured.schema.algebra.caps import Over
from neuron_constrain.testing.schemas import PATTERNS_DRAWN, readable
from tests.conftest import examples
from tests.structured.test_patterns import _python

pytestmark = pytest.mark.torch_agnostic(lane="latest")

# strings over characters the dialects read alike (no line terminator, no non-ASCII digit or letter) and
# over the ones they do not (a newline Python's $ passes, a digit only Python's \d takes, ...)
AGREED = "ab1_ \"\\.-^$[]:xA"
STRINGS = st.text(st.sampled_from(AGREED + "\n\r\u2028\u0663\u00e9\x1c"), max_size=6)
SETTINGS = settings(max_examples=examples(60), suppress_health_check=list(HealthCheck), deadline=None)


def _readable(source: str) -> bool:
    if not readable(source):
        return False
    try:
        return P.parse(source).refused is None
    except S.ConstraintError:
        return False


def _python_search(source: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return re.compile(source)


def _engine_reading(written: str):
    """The written pattern as the engines read it (the narrow tree), compiled for Python's fullmatch."""
    tree = language(P.parse(written), search=True)
    return re.compile(_python(tree))


@SETTINGS
@given(PATTERNS_DRAWN, st.lists(STRINGS, min_size=8, max_size=8))
def test_the_wide_reading_matches_whatever_python_matches(source, strings):
    if not _readable(source):
        return
    try:
        tree = language(P.parse(source, wide=True), search=True)
    except S.ConstraintError:
        return  # past a cap: refused by name
    wide = re.compile(_python(tree)) if tree is not None else None
    referee = _python_search(source)
    for text in strings:
        if referee.search(text):
            assert wide is not None and wide.fullmatch(text), (source, text)


@SETTINGS
@given(PATTERNS_DRAWN, st.lists(STRINGS, min_size=12, max_size=12))
def test_a_complement_takes_nothing_python_matches_and_everything_both_refuse(source, strings):
    if not _readable(source):
        return
    try:
        written = regular.complement_pattern(source)
    except Over:
        return  # past a cap: refused by name (test_schema_algebra)
    referee = _python_search(source)
    ours = _engine_reading(written) if written is not False else None
    for text in strings:
        taken = ours is not None and ours.fullmatch(text) is not None
        assert not (taken and referee.search(text)), (source, written, text)
        assert regular.referee_match(written, text) == (not referee.search(text)) if written else True
        if all(c in AGREED for c in text) and not referee.search(text):
            assert taken, (source, written, text)


@SETTINGS
@given(PATTERNS_DRAWN, PATTERNS_DRAWN, st.lists(STRINGS, min_size=12, max_size=12))
def test_an_intersection_takes_exactly_what_both_patterns_take(first, second, strings):
    if not (_readable(first) and _readable(second)):
        return
    try:
        written = regular.intersect_patterns((first, second))
    except Over:
        return
    narrow = [language(P.parse(s), search=True) for s in (first, second)]
    readings = [re.compile(_python(tree)) if tree is not None else None for tree in narrow]
    ours = _engine_reading(written) if written is not False else None
    for text in strings:
        both = all(r is not None and r.fullmatch(text) for r in readings)
        assert (ours is not None and ours.fullmatch(text) is not None) == both, (first, second, written, text)


@pytest.mark.parametrize("source, refused_by_the_engines", [
    (r"^[^\d]$", "\u0663"),    # Python's \d takes the Arabic-Indic three: its [^\d] does not
    (r"^[^\s]$", "\x1c"),      # Python's \s takes U+001C, ECMA-262's does not
    (r"^[^\W]$", "\u00e9"),    # [^\W] is \w: Python's takes é, ECMA-262's does not
])
def test_a_negated_class_keeps_the_narrow_side(source, refused_by_the_engines):
    """Inside ``[^...]`` a shorthand member is read at its widest, so the class stays the narrow one:
    the engines never take a character one dialect's class refuses."""
    tree = language(P.parse(source), search=True)
    assert not re.compile(_python(tree)).fullmatch(refused_by_the_engines)
    assert re.compile(_python(tree)).fullmatch("a")


def test_a_complement_is_written_compactly_and_read_back_exactly():
    """Counted repetition stays counted (a chain of like states is written once with its count): the
    complement of a 24-character hex identifier fits in a few kilobytes, and reads back as it means."""
    written = regular.complement_pattern(r"^[A-Fa-f\d]{24}$")
    assert len(written) < 4096, len(written)
    reading = _engine_reading(written)
    for text, taken in [("0" * 24, False), ("0" * 23, True), ("0" * 25, True), ("g" + "0" * 23, True),
                        ("0" * 24 + "\n", False), ("\u0663" * 24, False), ("", True)]:
        assert (reading.fullmatch(text) is not None) == taken, (text, taken)
    assert regular.complement_pattern("") is False  # "" matches every string: no complement
    assert regular.complement_pattern(r"(a)\1") is None  # a backreference: no sound complement
    assert regular.intersect_patterns(("^a$", "^b$")) is False
