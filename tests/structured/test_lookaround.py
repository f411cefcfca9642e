"""Lookarounds, word boundaries and anchors beside them, built exactly (``structured/schema/algebra/lookaround.py``).

Each construct on both engines (xgrammar, llguidance), as a JSON-schema ``pattern`` (a search) and as a
``regex(...)`` constraint (a full match): what the engine accepts is what Python's ``re`` matches on
strings both dialects read alike, and never more on the others. Then drawn patterns (hypothesis) against
the library's own tree; the complement of such a pattern; the caps and the forms refused by name.
"""
from __future__ import annotations

import json
import random
import re

import pytest
from hypothesis import HealthCheck, example, given, settings

from neuron_constrain import structured as S
from neuron_constrain.structured import engines as E
from neuron_constrain.structured.schema import patterns as P
from neuron_constrain.structured.schema import algebra
from neuron_constrain.structured.schema.algebra import lookaround, regular
from neuron_constrain.structured.schema.algebra.automata import written_size
from neuron_constrain.structured.schema.algebra.caps import CAPS, CapReached, Over, Work
from neuron_constrain.structured.schema.algebra.lookaround import language
from neuron_constrain.structured.schema.pattern_text import constraint_rules
from neuron_constrain.testing import toy_tokenizer
from neuron_constrain.testing.lookaround_patterns import LOOKAROUND_PATTERNS, lookaround_cases
from neuron_constrain.testing.vocabulary import force
from tests.conftest import examples
from tests.structured.test_patterns import _python

pytestmark = pytest.mark.torch_agnostic(lane="latest")

CONSTRUCTS = {  # pattern: strings straddling it
    "lookahead": (r"^(?=.*[0-9]).+$", ["abc", "a1", "1", "", "ab\n1", "x-1"]),
    "negative lookahead": (r"^(?!admin$)[a-z]+$", ["admin", "admins", "adm", "x", "admin\n"]),
    "lookahead past its group": (r"^(?:a(?=b)|b)+$", ["ab", "aa", "abab", "aab", "b", "a", "ba"]),
    "lookahead in a repetition": (r"^(?:(?!ab).)*$", ["aab", "ba", "bba", "aaa", "a b", "b\na"]),
    "lookbehind": (r".(?<=a)b", ["ab", "b", "xb", "bab", "ba", "aab"]),
    "negative lookbehind": (r"^(?:(?<!a)b|a)+$", ["ab", "ba", "bb", "aab", "a", "bab"]),
    "word boundary": (r"\b\d{3}\b", ["123", "a123", "1234", " 123 ", "12", "é123", "_123", "x.123"]),
    "not a word boundary": (r".\Bx\B.", ["axa", "x", " x ", "ax ", "1x_", "éxé", "axé"]),
    "anchors in a lookahead": (r"^(?!.*\.$)(?=^a).+", ["a.", "a", ".a", "ab", "ba", "a.b", "a.\n"]),
    "nested lookarounds": (r"^(?!(?=a)ab$).*$", ["ab", "abc", "b", "a", "", "ab\n"]),
    "end before a final newline": (r"^a(?=$)", ["a", "a\n", "ab"]),
    "not the end": (r"^a(?!$).", ["a", "a\n", "ab", "a\nb"]),
    "boundary after a letter": (r"^a\b", ["a", "aé", "a b", "ab", "a.", "a_"]),
    "anchor in a repetition": (r"^(?:b|a$)*", ["bba", "ab", "a", "bab", "a\n", "", "bb"]),
}


@pytest.fixture(scope="module")
def engines():
    vocabulary = toy_tokenizer()
    return {name: E.make_engine(name, vocabulary) for name in ("xgrammar", "llguidance")}


def _agreed(text: str, pattern: str = "") -> bool:
    """Whether every construct here reads ``text`` alike in both dialects (ASCII, no line terminator; and
    not empty under ``\\B``, which Python's re before 3.14 never matches in an empty text)."""
    return text.isascii() and "\n" not in text and "\r" not in text and (text or "\\B" not in pattern)


@pytest.mark.parametrize("construct", list(CONSTRUCTS))
def test_each_construct_is_exact_on_both_engines(engines, construct):
    pattern, strings = CONSTRUCTS[construct]
    referee = re.compile(pattern)
    for name, engine in engines.items():
        as_schema = engine.compile(S.json_schema({"type": "string", "pattern": pattern}))
        as_regex = engine.compile(S.regex(pattern))
        for text in strings:
            found, whole = referee.search(text) is not None, referee.fullmatch(text) is not None
            took = force(engine, as_schema, engine.tokenizer.encode(json.dumps(text, ensure_ascii=False)))
            took_whole = bool(text) and force(engine, as_regex, engine.tokenizer.encode(text))
            assert found or not took, (name, pattern, text, "pattern accepted what re.search refuses")
            assert whole or not took_whole, (name, pattern, text, "regex accepted what re.fullmatch refuses")
            if _agreed(text):
                assert took == found, (name, pattern, text)
                assert took_whole == whole or not text, (name, pattern, text)


@pytest.mark.parametrize("pattern, refused", [
    (r"^a\b", "aé"),       # ECMA's \w is ASCII (a boundary after a); Python's takes é (none): both must agree
    (r"^a(?=$)", "a\n"),   # Python's $ matches before a final newline, ECMA's does not
    (r"^\w+\b$", "é"),      # only Python's \w takes é
])
def test_where_the_dialects_differ_the_engines_take_what_both_match(engines, pattern, refused):
    for name, engine in engines.items():
        compiled = engine.compile(S.json_schema({"type": "string", "pattern": pattern}))
        assert not force(engine, compiled, engine.tokenizer.encode(json.dumps(refused, ensure_ascii=False))), name
    wide = language(P.parse(pattern, wide=True), search=True)  # what a complement excludes: either reading
    if re.search(pattern, refused):
        assert wide is not None and re.fullmatch(_python(wide), refused)


SETTINGS = settings(max_examples=examples(40), suppress_health_check=list(HealthCheck), deadline=None)


@SETTINGS
@example(case=(r"(?:(?!a)\w)+\b", ["b", "ba", "bé", "b a"]))
@example(case=(r"\B$", ["", "a", " "]))  # Python's \B (3.11) never matches in an empty text, ECMA's does
@given(case=lookaround_cases())
def test_the_built_language_is_python_s_where_the_dialects_agree(case):
    pattern, strings = case
    parsed = P.parse(pattern)
    if parsed.refused is not None:
        return
    try:
        narrow, wide = language(parsed, search=True), language(P.parse(pattern, wide=True), search=True)
    except S.ConstraintError:
        return  # past a cap: refused by name
    narrow_re, wide_re = (re.compile(_python(tree)) if tree is not None else None for tree in (narrow, wide))
    referee = re.compile(pattern)
    for text in strings:
        found = referee.search(text) is not None
        taken = narrow_re is not None and narrow_re.fullmatch(text) is not None
        assert found or not taken, (pattern, text, "the engines' reading takes what Python refuses")
        assert not found or wide_re is not None and wide_re.fullmatch(text), (pattern, text, "the wide reading lost it")
        if _agreed(text, pattern):
            assert taken == found, (pattern, text)


@SETTINGS
@given(case=lookaround_cases(count=6))
def test_a_complement_of_a_lookaround_pattern_takes_nothing_python_matches(case):
    pattern, strings = case
    if P.parse(pattern).refused is not None:
        return
    try:
        written = regular.complement_pattern(pattern)
    except Over:
        return
    ours = re.compile(_python(language(P.parse(written), search=True))) if written is not False else None
    for text in strings:
        taken = ours is not None and ours.fullmatch(text) is not None
        assert not (taken and re.search(pattern, text)), (pattern, written, text)
        if _agreed(text, pattern):
            assert taken == (re.search(pattern, text) is None), (pattern, written, text)


def test_past_the_automaton_cap_a_pattern_is_refused_by_name(engines):
    pattern = r"(?=.*a.{10}$)"  # the last 11 characters remembered: 2^11 states
    with pytest.raises(S.ConstraintError, match="automaton states.*CAPS"):
        language(P.parse(pattern), search=True)
    for engine in engines.values():
        with pytest.raises(S.ConstraintError, match="automaton states"):
            engine.compile(S.json_schema({"type": "string", "pattern": pattern}))


# a real URL pattern (SchemaStore's dein.json): `{1,256}` then `\b`, each DFA state a large subset
_COSTLY = {
    "url": r"^https?:\/\/(www\.)?[-a-zA-Z0-9@:%._\+~#=]{1,256}\.[a-zA-Z0-9()]{1,6}\b([-a-zA-Z0-9()@:%_\+.~#?&//=]*)$",
}
# automata of tens of states whose trees, written out as one expression, are millions of items or more
_WRITTEN_LARGE = {
    "no two dots": r"^(?!.*\.\.)[a-z.]{1,30}$",  # 60 states, 14 million items written
    "hostname label": r"^(?!-)[a-z0-9-]{1,63}(?<!-)$",  # 125 states, 1.7e19 items written
    "drawn": r"(?<!ab)\B(?:(?<!\d.)a?)+",
}


@pytest.mark.parametrize("pattern", _WRITTEN_LARGE.values(), ids=_WRITTEN_LARGE)
def test_a_language_too_large_to_write_as_one_expression_is_exact_as_grammar_rules(engines, pattern):
    """State elimination writes a lookaround beside a bounded repetition out exponentially; the automaton
    itself is small. It is kept (``("automaton", dfa)``) and written for xgrammar as a rule per state: exact
    against Python's re, as a schema pattern and as a regex; llguidance, which reads one expression, refuses
    it by name, naming the engine that takes it; ``auto`` compiles it on xgrammar."""
    built = language(P.parse(pattern), search=True)
    assert built[0] == "automaton" and len(built[1].live()) < CAPS["automaton_states"]
    with pytest.raises(S.ConstraintError, match=r"CAPS\['automaton_work'\].*engine='xgrammar'"):
        engines["llguidance"].compile(S.json_schema({"type": "string", "pattern": pattern}))
    auto = E.AutoEngine(engines["xgrammar"].tokenizer)
    referee, draw = re.compile(pattern), random.Random(7)
    strings = ["a", "ab", "a.b", "a..b", "-ab", "ab-", "a-b", "x" * 63, "x" * 64, "1a", "", "a" * 30 + "."]
    strings += ["".join(draw.choice("ab.-1 ") for _ in range(draw.randint(0, 40))) for _ in range(60)]
    for engine in (engines["xgrammar"], auto):
        as_schema = engine.compile(S.json_schema({"type": "string", "pattern": pattern}))
        assert as_schema.engine == "xgrammar"
        whole = None if referee.fullmatch("") is None and not any(map(referee.fullmatch, strings)) else \
            engine.compile(S.regex(pattern))
        assert whole is None or constraint_rules(pattern, "xgrammar") is not None  # the regex as rules too
        for text in strings:
            took = force(engine, as_schema, engine.tokenizer.encode(json.dumps(text)))
            assert took == (referee.search(text) is not None), (pattern, text)
            if whole is not None and text:
                assert force(engine, whole, engine.tokenizer.encode(text)) == (referee.fullmatch(text) is not None), \
                    (pattern, text)


@pytest.mark.parametrize("pattern", _COSTLY.values(), ids=_COSTLY)
def test_past_the_work_cap_a_pattern_is_refused_by_name_and_pointer(engines, pattern):
    """The steps of the construction are counted as they are taken (caps.Work): past
    ``CAPS["automaton_work"]`` the pattern is refused by that name, with the cap's value and the pattern,
    and a schema's pattern with its JSON pointer, before any engine reads the schema."""
    with pytest.raises(S.ConstraintError) as refused:
        language(P.parse(pattern), search=True)
    assert refused.value.cap == "automaton_work" and refused.value.count > CAPS["automaton_work"]
    assert f"more than {CAPS['automaton_work']} steps" in str(refused.value) and repr(pattern) in str(refused.value)
    schema = {"type": "object", "properties": {"url": {"type": "string", "pattern": pattern}}}
    for engine in engines.values():
        with pytest.raises(CapReached) as refused:
            engine.compile(S.json_schema(schema))
        error = refused.value
        assert (error.cap, error.keyword, error.path, error.pattern) == ("automaton_work", "pattern",
                                                                        "#/properties/url", pattern)
        assert "`algebra.CAPS['automaton_work']`" in str(error) and "`pattern` at #/properties/url" in str(error)


def test_the_work_cap_bounds_a_complement_and_names_where(monkeypatch):
    """The algebra's rewrites count the same steps: a `not` over a pattern past the cap (lowered here
    to show it) is refused naming the cap, the pattern, the keyword and the pointer."""
    monkeypatch.setitem(CAPS, "automaton_work", 2_000)
    regular.complement_pattern.cache_clear()
    try:
        with pytest.raises(CapReached) as refused:
            algebra.lower({"properties": {"id": {"type": "string", "not": {"pattern": "^[a-f]{1,40}x$"}}}})
    finally:
        regular.complement_pattern.cache_clear()
    error = refused.value
    assert (error.cap, error.keyword, error.path, error.pattern) == ("automaton_work", "not", "#/properties/id",
                                                                    "^[a-f]{1,40}x$")
    assert "more than 2000 steps of automaton work" in str(error)


def _steps(tree, budget: int) -> int:
    """The steps building ``tree``'s language takes (as ``language`` counts them), within ``budget``."""
    work = Work(budget)
    built = lookaround.dfa([tree], work).minimal().expression()
    if built is not None:
        work.spend(written_size(built))
    return work.steps


@settings(max_examples=examples(15), suppress_health_check=list(HealthCheck), deadline=None)
@given(pattern=LOOKAROUND_PATTERNS)
def test_the_work_counted_is_the_patterns_own(pattern):
    """The count is a property of the pattern, not of the machine or of the run: built twice it takes the
    same steps, a budget of exactly that many builds it, and one step fewer is refused by name."""
    try:
        tree = P.full_match(P.parse(pattern), search=True)
    except S.ConstraintError:
        return
    if tree is None or not lookaround.has_assertion(tree):
        return
    try:
        steps = _steps(tree, CAPS["automaton_work"])
    except Over:
        return  # past a cap: the refusals above
    assert _steps(tree, steps) == steps
    with pytest.raises(Over) as refused:
        _steps(tree, steps - 1)
    assert refused.value.cap == "automaton_work" and refused.value.maximum == steps - 1


@pytest.mark.parametrize("pattern", [r"\b\d{13}\b", r"^(?!.*\bnative\b)[a-zA-Z][a-zA-Z0-9_]*(\.[a-zA-Z][a-zA-Z0-9_]*)+$"])
def test_the_costliest_real_patterns_stay_within_the_work_cap(pattern):
    """The two real patterns (JSON Schema Store) whose automata cost the most still build, with room to
    spare: the cap refuses what real schemas do not write."""
    work = Work(CAPS["automaton_work"] // 2)
    tree = P.full_match(P.parse(pattern), search=True)
    built = lookaround.dfa([tree], work).minimal().expression()
    work.spend(written_size(built))
    assert re.fullmatch(_python(built), "x 1234567890123 y" if "d" in pattern else "com.example.app")


@pytest.mark.parametrize("pattern, feature", [
    (r"(?<=a+)b", "variable-width lookbehind"),
    (r"(?<=^a)b", "lookaround inside a lookbehind"),
    (r"(a)(?=\1)", "backreference"),
])
def test_what_is_not_built_is_refused_by_name_on_each_engine(engines, pattern, feature):
    for engine in engines.values():
        with pytest.raises(S.ConstraintError, match=feature):
            engine.compile(S.json_schema({"type": "string", "pattern": pattern}))
        with pytest.raises(S.ConstraintError, match=feature):
            engine.compile(S.regex(pattern))


DEEP = r"(?=[a-z0-9]*[0-9])(?=[a-z0-9]*[a-z])[a-z0-9]{8,64}"  # bench_hostile's `lookahead`: nests 118 levels
SHALLOW = DEEP.replace("64", "20")


def test_a_deeply_nested_built_language_goes_to_llguidance_first_and_stays_exact(engines):
    """xgrammar keeps a copy of the automaton per nesting level (its worker's reply for DEEP grew past 2 GiB);
    ``auto`` takes such a pattern to llguidance first, as a regex and as a schema's pattern, and only there:
    the same class to 20 characters stays on xgrammar."""
    from neuron_constrain.structured.schema.prepare import prepare

    assert lookaround.built_deep(DEEP, search=False) and not lookaround.built_deep(SHALLOW, search=False)
    auto = E.AutoEngine(engines["xgrammar"].tokenizer, race=False)
    schema = {"type": "object", "properties": {"code": {"type": "string", "pattern": f"^{DEEP}$"}}}
    assert prepare(S.json_schema(schema)).deep_languages == ("#/properties/code/pattern",)
    assert auto.compile(S.json_schema(schema)).engine == "llguidance"
    for pattern, engine in ((DEEP, "llguidance"), (SHALLOW, "xgrammar")):
        compiled = auto.compile(S.regex(pattern))
        assert compiled.engine == engine, pattern
        for text in ("abcdefg1", "abcdefgh", "12345678", "a1" * 10, "a1" * 11, "a1" * 32, "a1" * 33, "a1b"):
            took = force(auto, compiled, auto.tokenizer.encode(text))
            assert took == (re.fullmatch(pattern, text) is not None), (pattern, text)
