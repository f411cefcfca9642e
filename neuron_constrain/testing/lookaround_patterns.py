"""Random patterns with lookarounds, word boundaries and anchors inside them, and strings around them.

    @given(case=lookaround_cases())        # (pattern, strings): the differential test's lookaround region
    def test(case): ...

Each pattern mixes plain atoms with ``(?=X)``, ``(?!X)`` (``X`` itself may hold ``$``, ``.*`` and further
lookarounds), fixed-width ``(?<=Y)``/``(?<!Y)``, ``\\b``, ``\\B`` and ``^``/``$``, some inside
repetitions, so that a lookahead reaches past its group. The strings mix characters both dialects
read alike (``AGREED``: where a verdict must be exact) with those they do not (a newline before
which Python's ``$`` matches, ``é`` that only Python's ``\\w`` takes), and matches hypothesis draws
from Python's reading. The referee is Python's ``re`` (``structured/schema/algebra/lookaround.py``).
"""
from __future__ import annotations

import warnings

from hypothesis import strategies as st

AGREED = "ab1_ .x-"  # characters ECMA-262 and Python's re read alike in every construct drawn here
STRING_CHARS = AGREED + "\né"
_ATOMS = ("a", "b", "1", ".", "\\w", "\\d", "[ab]", "\\.", " ", "x")
_FIXED = ("a", "b", "\\w", "[ab]", "a|b", "ab", "\\d.", " ")  # fixed-width lookbehind bodies
_ALONE = ("\\b", "\\B", "\\b", "\\B", "^", "$")


def _term(depth: int):
    atom = st.tuples(st.sampled_from(_ATOMS), st.sampled_from(("", "", "*", "+", "?", "{2}"))).map("".join)
    if depth == 0:
        return atom
    inner = st.lists(_term(depth - 1), min_size=1, max_size=3).map("".join)
    tail = st.sampled_from(("", "", "", "$", ".*$"))
    assertion = st.one_of(
        st.tuples(st.sampled_from(("(?=", "(?!")), inner, tail).map(lambda p: f"{p[0]}{p[1]}{p[2]})"),
        st.tuples(st.sampled_from(("(?<=", "(?<!")), st.sampled_from(_FIXED)).map(lambda p: f"{p[0]}{p[1]})"),
        st.sampled_from(_ALONE))
    repeated = st.tuples(assertion, atom, st.sampled_from(("*", "+", "{1,3}"))).map(lambda p: f"(?:{p[0]}{p[1]}){p[2]}")
    return st.one_of(atom, atom, atom, assertion, assertion, repeated)


LOOKAROUND_PATTERNS = st.tuples(st.sampled_from(("", "", "^")), st.lists(_term(2), min_size=1, max_size=4),
                                st.sampled_from(("", "", "$"))).map(lambda p: p[0] + "".join(p[1]) + p[2])


def lookaround_cases(count: int = 10):
    """``(pattern, strings)``: a drawn pattern, random strings over ``STRING_CHARS`` and up to three of its matches."""
    return LOOKAROUND_PATTERNS.flatmap(lambda pattern: st.tuples(st.just(pattern), _strings(pattern, count)))


def _strings(pattern: str, count: int):
    drawn = st.lists(st.text(st.sampled_from(STRING_CHARS), max_size=7), min_size=count, max_size=count)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            matches = st.lists(st.from_regex(pattern, fullmatch=False).filter(lambda t: "\x00" not in t and len(t) < 24),
                               max_size=3)
        except Exception:  # noqa: BLE001 - a pattern hypothesis cannot draw from: the random strings only
            return drawn
    return st.tuples(drawn, matches).map(lambda p: p[0] + p[1])
