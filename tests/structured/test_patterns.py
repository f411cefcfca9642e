"""Patterns read as the referee reads them (``structured/schema/patterns.py``, ``pattern_text.py``,
``code_points.py``): every feature rewritten or refused by name and offset, the code-point set
algebra, and the tree's language never larger than Python's ``re`` reading of the pattern.

The engines' side (what each engine accepts once a pattern is written back) is the differential
test's (``tests/structured/test_soundness.py``: the patterns and regex regions).
"""
from __future__ import annotations

import json
import re
import warnings

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from neuron_constrain import structured as S
from neuron_constrain.structured.schema import code_points as C
from neuron_constrain.structured.schema import patterns as P
from neuron_constrain.structured.schema.algebra.lookaround import language
from neuron_constrain.structured.schema.pattern_text import to_ebnf, to_regex
from neuron_constrain.testing.schemas import PATTERNS_DRAWN, pattern_strings, readable
from tests.conftest import examples

pytestmark = pytest.mark.torch_agnostic(lane="latest")


@pytest.mark.parametrize("source, feature, offset", [
    (r"(?<=a+)b", "variable-width lookbehind", 0),
    (r"x(?<!a|bc)b", "variable-width lookbehind", 1),
    (r"(?<=^a)b", "lookaround inside a lookbehind", 0),
    (r"(?<=(?=a).)b", "lookaround inside a lookbehind", 0),
    (r"(?<=\ba)b", "lookaround inside a lookbehind", 0),
    (r"(a)\1", "backreference", 3),
    (r"(?<x>a)\k<x>", "backreference", 7),
    (r"(?i)abc", "inline flags", 0),
    (r"(?P<x>a)", "Python-only syntax", 0),
    (r"a*+", "Python-only syntax", 2),
    (r"(?#note)a", "Python-only syntax", 0),
    (r"a{,3}", "quantifier {,n}", 1),
    (r"\p{L}+", "Unicode property escape", 0),
    (r"\u{41}", "ambiguous escape", 0),
    (r"\a", "ambiguous escape", 0),
    (r"[\1]", "ambiguous escape", 1),
    (r"[]a]", "empty class", 0),
    (r"[^]", "empty class", 0),
    (r"[\d-z]", "class escape in a range", 3),
])
def test_each_refused_feature_is_named_with_its_offset(source, feature, offset):
    pattern = P.parse(source)
    assert pattern.refused == P.Feature(feature, offset), pattern.features
    error = pattern.refusal()
    assert feature in str(error) and f"offset {offset}" in str(error) and repr(source) in str(error)


@pytest.mark.parametrize("source, text, ebnf_has", [
    (r"^\d{3}$", "[0-9]{3}", "[0-9]"),
    (r"^\w$", r"[0-9A-Z\u{5f}a-z]", "[0-9A-Z"),
    (r"^a*?b+?$", "a*b+", '"a"*'),
    (r"^(?:ab|c)$", "ab|c", '"a" "b"'),
    (r"^(?<name>a)$", "a", '"a"'),
    (r"^\x41\u0042\t$", r"AB\u{9}", '"\\\\" ([t]'),
    (r"^[[:alpha:]]$", r"[\u{3a}\u{5b}ahlp]\u{5d}", "[\\U0000003a\\U0000005bahlp]"),
])
def test_rewrites_keep_the_meaning_in_the_plain_syntax(source, text, ebnf_has):
    pattern = P.parse(source)
    assert pattern.refused is None and not any(f.refused for f in pattern.features)
    assert to_regex(pattern, search=True, anchored=True) == f"^(?:{text})$"
    assert ebnf_has in to_ebnf(pattern, search=True, json=True)


def test_search_is_written_as_a_full_match_and_anchors_move_to_the_edges():
    anything = r"[\u{0}-\u{d7ff}\u{e000}-\u{10ffff}]*"
    assert to_regex(P.parse("b"), search=True, anchored=False) == f"{anything}b{anything}"
    assert to_regex(P.parse("b"), search=False, anchored=False) == "b"  # a regex constraint: the whole output
    assert to_regex(P.parse("^a|b$"), search=True, anchored=False) == f"a{anything}|{anything}b"
    assert to_regex(P.parse("(^a|b)c"), search=True, anchored=False) == f"ac{anything}|{anything}bc{anything}"
    # a ^ after text that cannot be empty: that branch matches nothing (Python and ECMA agree)
    assert to_regex(P.parse("a^b|c"), search=False, anchored=False) == "c"
    assert to_regex(P.parse("a?^b"), search=False, anchored=False) == "b"
    with pytest.raises(S.ConstraintError, match="matches no string"):
        to_regex(P.parse("a^b"), search=False, anchored=False)


def test_a_leading_caret_is_never_first_in_a_class():
    """xgrammar decodes an escape, then reads a leading ``^`` as negation: ``[\\u{5e}a]`` is ``[^a]`` there."""
    for source in (r"[\^a]", r"[\^-a]", r"[\^]"):
        regex, ebnf = to_regex(P.parse(source), search=False, anchored=False), to_ebnf(P.parse(source), search=False,
                                                                                     json=False)
        assert not regex.startswith("[\\u{5e}") and not ebnf.startswith("[\\U0000005e"), (regex, ebnf)


def test_syntax_errors_and_nesting_are_refused_cleanly():
    for source in ("(a", "a)", "*a", "a{2,1}", "[b-a]", "a**", "\\"):
        with pytest.raises(S.ConstraintError, match="not an ECMA-262 regular expression"):
            P.parse(source)
    with pytest.raises(S.ConstraintError, match="deeper than"):
        P.parse("(" * 300 + "a" + ")" * 300)


# ---- the code-point set algebra
RANGES = st.lists(st.tuples(st.integers(0, 0x300), st.integers(0, 0x300)).map(sorted), max_size=6)
SETTINGS = settings(max_examples=examples(60), suppress_health_check=[HealthCheck.too_slow])


def _members(ranges):
    return {c for lo, hi in ranges for c in range(lo, min(hi, 0x300) + 1)}


@SETTINGS
@given(RANGES, RANGES)
def test_set_algebra(first, second):
    a, b = C.normalize(first), C.normalize(second)
    assert _members(a) == _members(first)
    assert all(lo <= hi and (i == 0 or a[i - 1][1] + 1 < lo) for i, (lo, hi) in enumerate(a))  # sorted, merged
    assert C.complement(C.complement(a)) == a
    assert _members(C.subtract(a, b)) == _members(a) - _members(b)
    assert not _members(C.complement(a)) & _members(a)


def test_shorthand_classes_are_what_both_dialects_agree_on():
    digits, not_digits = C.shorthand("d"), C.shorthand("D")
    assert digits == ((0x30, 0x39),)
    arabic_three = 0x663  # a digit to Python's re, not to ECMA-262: neither \d nor \D may take it
    assert not any(lo <= arabic_three <= hi for lo, hi in digits + not_digits)
    spaces = C.shorthand("s")
    assert any(lo <= 0x20 <= hi for lo, hi in spaces) and not any(lo <= 0x1C <= hi for lo, hi in spaces)


# ---- the tree's language is never larger than Python's reading
def _python(node) -> str:
    """The tree in Python's syntax (a test-side twin of pattern_text's writer)."""
    kind = node[0]
    if kind == "chars":
        return "[" + "".join(f"\\U{lo:08x}-\\U{hi:08x}" for lo, hi in node[1]) + "]" if node[1] else "(?!)"
    if kind == "seq":
        return "".join(f"(?:{_python(child)})" for child in node[1])
    if kind == "alt":
        return "|".join(f"(?:{_python(child)})" for child in node[1])
    hi = "" if node[3] is None else node[3]
    return f"(?:{_python(node[1])}){{{node[2]},{hi}}}"


STRINGS = st.text(st.sampled_from('ab1_ "\\\n\r.é-^$[]:xA\u2028٣'), max_size=6)


@settings(max_examples=examples(60), suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(PATTERNS_DRAWN, st.lists(STRINGS, min_size=8, max_size=8))
def test_what_the_tree_matches_python_matches(source, strings):
    if not readable(source):
        return
    try:
        pattern = P.parse(source)
    except S.ConstraintError:
        return
    if pattern.refused is not None:
        return
    try:
        tree = language(pattern, search=True)
    except S.ConstraintError:
        return  # past a cap: refused by name
    ours = re.compile(_python(tree)) if tree is not None else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        referee = re.compile(source)
    for text in strings:
        if ours is not None and ours.fullmatch(text):
            assert referee.search(text), (source, text, _python(tree))


@settings(max_examples=examples(20), suppress_health_check=list(HealthCheck), deadline=None)
@given(data=st.data())
def test_a_star_written_as_a_right_recursive_rule_takes_the_same_strings(data):
    """Where ``to_ebnf`` may add rules (a schema's patterns on xgrammar), a star over a set with JSON escapes, or
    over alternatives, is a right-recursive rule (``s ::= "" | c s | "\\" e s``: xgrammar masks a star over such a
    group at 50-60 ms a token on 131k tokens, the rule in microseconds); the grammar takes exactly the JSON
    texts the plain form takes."""
    import xgrammar as xgr

    from neuron_constrain.structured.schema.pattern_text import ebnf_rules

    source = data.draw(PATTERNS_DRAWN.filter(readable))
    try:
        pattern = P.parse(source)
        if pattern.refused is not None:
            return  # refused by name before any grammar is written (the policy's)
        plain = to_ebnf(pattern, search=True, json=True)
    except S.ConstraintError:
        return  # no string, or a language kept as an automaton (written as rules either way)
    rules: dict = {}
    ruled = to_ebnf(pattern, search=True, json=True, rules=rules, prefix="t")
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo([b"x"]), max_threads=1)
    grammars = [compiler.compile_grammar(f"root ::= {ruled}\n{ebnf_rules(rules)}"),
                compiler.compile_grammar(f"root ::= {plain}")]
    for text in data.draw(pattern_strings(source)) + ["", 'a"b\\c\n']:
        written = json.dumps(text, ensure_ascii=False)[1:-1]
        taken = []
        for grammar in grammars:
            matcher = xgr.GrammarMatcher(grammar)
            taken.append(matcher.accept_string(written) and matcher.is_completed())
        assert taken[0] == taken[1], (source, text, rules)


@pytest.mark.parametrize("source", ["^a.*$", "^(?:x|.*y)*z$", "^(?:a|[^b]*c)+$", "^(?:\\d|(?:[^x]|y)*)*;$"])
def test_a_star_over_an_escaped_set_is_a_rule(source):
    """Each star over escapes or alternatives is a rule of its own (nested ones too, each named apart), and the
    grammar takes what Python's `re` finds, JSON-escaped."""
    from neuron_constrain.structured.engines.xgrammar.grammars import ebnf_accepts
    from neuron_constrain.structured.schema.pattern_text import ebnf_rules

    rules: dict = {}
    ruled = to_ebnf(P.parse(source), search=True, json=True, rules=rules, prefix="t")
    assert rules and all(body.startswith('"" | ') for body in rules.values()), (ruled, rules)
    grammar = f"root ::= {ruled}\n{ebnf_rules(rules)}"
    for text in ["a", "ab\"", "xz", "xyxz", "yz", "z", "ac", "abc", "aac", 'q"yz', "1;", "yy;", "x;", "1x;", "\n;", ""]:
        expected = re.search(source, text) is not None
        assert ebnf_accepts(grammar, json.dumps(text, ensure_ascii=False)[1:-1]) == expected, (source, text)
    assert to_ebnf(P.parse("^[a-z]*$"), search=True, json=True, rules=(plain := {}), prefix="t") and not plain
