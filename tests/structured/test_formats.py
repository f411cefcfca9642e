"""The 2020-12 formats as exact grammars (``schema/formats.py``), judged three ways: strings drawn from
each grammar by the referee (``jsonschema``'s format checker, format assertion on, where its checker is
installed), the specifications' own examples (``benchmarks/data/formats.json``), and every engine,
teacher-forced and walked at random through its masks. A format no grammar writes is refused by name."""
from __future__ import annotations

import json
import pathlib
import re
import zlib

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from neuron_constrain import structured as S
from neuron_constrain.structured import engines as E
from neuron_constrain.structured.schema import formats, keywords, patterns, prepare
from neuron_constrain.testing import toy_tokenizer
from neuron_constrain.testing.schemas import walks
from neuron_constrain.testing.vocabulary import force
from tests.conftest import examples

pytestmark = pytest.mark.torch_agnostic(lane="latest")  # host-side: the same on every torch

EXAMPLES = json.loads((pathlib.Path(__file__).parents[2] / "benchmarks" / "data" / "formats.json")
                      .read_text(encoding="utf-8"))["formats"]
CHECKER = jsonschema.Draft202012Validator.FORMAT_CHECKER
CHECKED = sorted(name for name in formats.FORMATS if formats.checked(name))
EXACT = sorted(name for name, found in formats.FORMATS.items() if found.exact)
SETTINGS = settings(max_examples=examples(25), suppress_health_check=list(HealthCheck))


def matches(name: str, text: str) -> bool:
    """Whether the grammar of ``name`` takes ``text`` (its pattern as Python reads it, and its length bound)."""
    found = formats.FORMATS[name]
    return (re.fullmatch(found.pattern, text) is not None
            and (found.max_length is None or len(text) <= found.max_length))


@pytest.fixture(scope="module")
def toy_engines():
    """Every engine choice on a byte-level vocabulary."""
    vocabulary = toy_tokenizer()
    return {name: E.make_engine(name, vocabulary) for name in E.ENGINE_CHOICES}


def test_every_standard_format_has_a_grammar():
    assert set(formats.FORMATS) == keywords.STANDARD_FORMATS
    # the checkers this environment has (jsonschema's optional packages decide the rest): the stdlib's always
    assert {"date", "ipv4", "ipv6", "uuid", "email"} <= set(CHECKED)
    assert set(EXACT) <= set(CHECKED)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_the_specifications_examples(name):
    """Every invalid example refused; a valid one refused only by a grammar that says it is narrower; every
    accepted example valid for the referee where it has a checker."""
    cases = EXAMPLES[name]
    assert [text for text in cases["invalid"] if matches(name, text)] == []
    refused = [text for text in cases["valid"] if not matches(name, text)]
    assert not refused or formats.FORMATS[name].narrower, refused
    if name in CHECKED:
        taken = [text for text in cases["valid"] + cases["invalid"] if matches(name, text)]
        assert all(CHECKER.conforms(text, name) for text in taken)


def _drawn(name):
    """Strings of the grammar of ``name``; hypothesis reads a set of all non-ASCII characters slowly (20 s for
    ten `idn-email` strings), so there strings are drawn from Latin-1 and a few CJK characters (a sub-language)."""
    found = formats.FORMATS[name]
    pattern = found.pattern.replace(formats._NON_ASCII, "\\x80-\\xFF\u4e00-\u4e10")
    return st.from_regex(re.compile(pattern), fullmatch=True).filter(
        lambda text: found.max_length is None or len(text) <= found.max_length)


@SETTINGS
@given(data=st.data())
@pytest.mark.parametrize("name", CHECKED)
def test_strings_drawn_from_a_grammar_pass_the_referee(name, data):
    text = data.draw(_drawn(name))
    assert CHECKER.conforms(text, name), text


_ALPHABETS = {"date": "0123456789-", "ipv4": "0123456789.", "ipv6": "0123456789abcdefABCDEFg:.%"}


@SETTINGS
@given(data=st.data())
@pytest.mark.parametrize("name", EXACT)
def test_an_exact_grammar_is_the_referees_language(name, data):
    """Near the edge of the language (a drawn string with one character inserted, deleted or replaced)
    the grammar and the referee agree, both ways."""
    text = data.draw(_drawn(name))
    at = data.draw(st.integers(0, len(text)))
    char = data.draw(st.sampled_from(_ALPHABETS[name]))
    edit = data.draw(st.sampled_from(("insert", "delete", "replace")))
    edited = {"insert": text[:at] + char + text[at:], "delete": text[:at] + text[at + 1:],
              "replace": text[:at] + char + text[at + 1:]}[edit]
    assert matches(name, edited) == CHECKER.conforms(edited, name), edited


def _corner_cases() -> dict[str, list[str]]:
    years = ["0000", "0001", "0004", "0100", "0400", "1900", "1996", "2000", "2023", "2024", "2100", "2400", "9999",
             "999", "19999"]
    months = [f"{m:02d}" for m in range(14)] + ["1", "001"]
    days = [f"{d:02d}" for d in range(33)] + ["1"]
    dates = [f"{y}-{m}-{d}" for y in years for m in months for d in days] + ["\uff12\uff10\uff12\uff14-01-01", "2024-01-01\n"]
    octets = ["0", "00", "01", "1", "9", "10", "99", "100", "199", "200", "249", "250", "255", "256", "999", "-1", "\u0663"]
    addresses = [text for a in octets for b in octets for text in (f"{a}.{b}.1.2", f"1.2.{a}.{b}", f"{a}.{b}.{a}")]
    return {"date": dates, "ipv4": addresses + ["1.2.3.4\n"]}


@pytest.mark.parametrize("name", ["date", "ipv4"])
def test_an_exact_grammar_takes_the_referees_corners(name):
    """Every calendar corner (leap centuries, year 0, month 13, day 31, full-width digits, a final newline)
    and every octet corner (leading zeros, 256, Arabic-Indic digits), enumerated: the grammar takes
    exactly what jsonschema's format check takes (what the drawn edits above may miss)."""
    assert formats.FORMATS[name].exact
    wrong = [text for text in _corner_cases()[name] if matches(name, text) != CHECKER.conforms(text, name)]
    assert wrong == []


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_every_engine_enforces_the_grammar(toy_engines, name):
    """Teacher-forced: each example accepted exactly where the grammar takes it; random walks through the
    masks write only strings of the grammar (and the referee's, where it has a checker)."""
    schema = {"type": "string", "format": name}
    cases = EXAMPLES[name]
    for engine_name, engine in toy_engines.items():
        try:
            compiled = engine.compile(S.json_schema(schema))
        except S.ConstraintError as refused:  # a bounded format on xgrammar: too many states to intersect
            assert engine_name == "xgrammar" and formats.FORMATS[name].max_length, refused
            assert "maxLength" in str(refused)
            continue
        for text in cases["valid"] + cases["invalid"]:
            taken = force(engine, compiled, engine.tokenizer.encode(json.dumps(text, ensure_ascii=False)))
            assert taken == matches(name, text), (engine_name, text)
        for tokens in walks(engine, compiled, 3, seed=zlib.crc32(name.encode()), max_tokens=40):
            text = json.loads(engine.tokenizer.decode(tokens))
            assert matches(name, text) and CHECKER.conforms(text, name), (engine_name, text)


@SETTINGS
@given(text=_drawn("regex"))
def test_a_regex_the_grammar_takes_is_read_by_ecma_262_and_by_the_referee(text):
    """`regex` is written as a regular part of its language (groups nested at most three deep): each string drawn
    from it is a pattern the library's ECMA-262 parser reads and the referee's `re` compiles."""
    re.compile(text)
    patterns.parse(text)


def test_regex_is_narrower_by_what_it_says_and_named_where_narrowed(toy_engines):
    schema = {"type": "object", "properties": {"r": {"type": "string", "format": "regex", "minLength": 1}}}
    cases = {"^(a(b(c)))$": True, "[a-z_-]+\\.json$": True, "((((a))))": False, "(?=a)b": False, "": False,
             "(": False, "x{3,2}": False}
    for engine_name, engine in toy_engines.items():
        compiled = engine.compile(S.json_schema(schema))
        assert "#/properties/r" in compiled.narrowed, (engine_name, compiled.narrowed)
        for text, taken in cases.items():
            tokens = engine.tokenizer.encode(json.dumps({"r": text}))
            assert force(engine, compiled, tokens) == taken, (engine_name, text)


def _view(schema, engine):
    return prepare.prepare(S.json_schema(schema)).view(engine).schema


def test_format_beside_pattern_and_lengths_is_the_intersection(toy_engines):
    beside = {"type": "string", "format": "ipv4", "pattern": "^10\\.", "maxLength": 8}
    for engine_name, engine in toy_engines.items():
        compiled = engine.compile(S.json_schema(beside))
        for text, taken in (("10.1.2.3", True), ("11.1.2.3", False), ("10.1.2.34", False), ("10.1.2", False)):
            assert force(engine, compiled, engine.tokenizer.encode(json.dumps(text))) == taken, (engine_name, text)
    # xgrammar does not enforce lengths beside a pattern: they are written into it; llguidance keeps them beside
    assert "maxLength" not in _view(beside, "xgrammar") and "format" not in _view(beside, "xgrammar")
    assert _view(beside, "llguidance")["maxLength"] == 8
    assert _view({"type": "string", "format": "hostname"}, "llguidance")["maxLength"] == 253
    malformed = {"type": "string", "format": "ipv4", "pattern": 5}  # never overwritten: left as written
    formats.write_patterns(malformed, True)
    assert malformed == {"type": "string", "format": "ipv4", "pattern": 5}


def test_a_narrower_grammar_stays_a_format_beside_negation_an_exact_one_is_written():
    """Beside `not`/`if`/`oneOf` (where the algebra left them) a narrower grammar could widen the schema (a
    `oneOf` branch refusing what the referee says it matches): it stays a `format`, for the engine's own list
    to decide or refuse; an exact one is written. Without them both are written, the narrower one listed."""
    for negation in ("not", "if", "oneOf"):
        schema = {"properties": {"u": {"format": "uuid"}, "v": {"format": "ipv4"}}, negation: {"required": ["u"]}}
        narrowed: list = []
        formats.write_patterns(schema, True, narrowed)
        assert schema["properties"]["u"] == {"format": "uuid"} and narrowed == []
        assert schema["properties"]["v"] == {"pattern": formats.FORMATS["ipv4"].pattern}
    schema = {"properties": {"u": {"format": "uuid"}}}
    narrowed = []
    formats.write_patterns(schema, True, narrowed)
    assert schema["properties"]["u"] == {"pattern": formats.FORMATS["uuid"].pattern}
    assert narrowed == ["#/properties/u"]
