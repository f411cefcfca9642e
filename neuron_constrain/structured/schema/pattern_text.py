"""A parsed pattern written back for an engine: plain regex text, or xgrammar EBNF.

    to_regex(parse(p), search=True, anchored=True)   # llguidance's JSON-schema patterns: ^(?:...)$
    to_regex(parse(p), search=False, anchored=False) # regex constraints, on every engine
    to_ebnf(parse(p), search=True, json=True, rules=r, prefix="p0s")  # xgrammar's JSON-schema patterns, over
                                                     # the escaped text (r: rules an automaton's states need)
    constraint_rules(source, "xgrammar")             # a regex constraint as a whole EBNF grammar, or None

Only sets (every non-alphanumeric character written by code point: ``\\u{2d}``, ``\\U0000002d``),
groups, alternation and counted repetition are written: the syntax both engines read the same
way (``patterns.py`` says why nothing is passed through as written). xgrammar matches a
JSON-schema pattern against the text between the quotes as written, escapes included, so its
EBNF spells each character a JSON string escapes (``"``, ``\\``, U+0000-U+001F) as that escape.

A language built by automata that would be too large written as one expression
(``lookaround.language`` returns ``("automaton", dfa)``: a lookaround beside a bounded repetition,
``^(?!-)[a-z0-9-]{1,63}(?<!-)$``) has no regex text here (``to_regex`` refuses it by name); in EBNF it
is written as rules, one per live state (``name_s ::= [set] name_t | ... | ""``), linear in its size.
"""
from __future__ import annotations

from neuron_constrain.structured.constraints import ConstraintError
from neuron_constrain.structured.schema.algebra.automata import joined
from neuron_constrain.structured.schema.code_points import complement, subtract
from neuron_constrain.structured.schema.algebra.lookaround import language
from neuron_constrain.structured.schema.patterns import CONTROLS_WITHOUT_ESCAPES, Pattern, parse


def _escape(code: int) -> str:
    char = chr(code)
    return char if char.isascii() and char.isalnum() else f"\\u{{{code:x}}}"


def _members(ranges, write) -> str:
    """A class's members, never starting with ``^``: both xgrammar parsers decode an escape first and
    then read a leading ``^`` as negation (``[\\u{5e}a]`` is ``[^a]`` there)."""
    ranges = list(ranges)
    if len(ranges) > 1 and ranges[0][0] == 0x5E:
        lo, hi = ranges.pop(0)
        ranges.append((lo, lo))
        if hi > lo:
            ranges.insert(0, (lo + 1, hi))
    return "".join(write(lo) if lo == hi else f"{write(lo)}-{write(hi)}" for lo, hi in ranges)


def _regex_set(ranges) -> str:
    if tuple(ranges) == ((0, 0),):  # U+0000 alone: xgrammar's from_regex writes it as "" (nothing)
        return "[^\\u{1}-\\u{10ffff}]"
    if len(ranges) == 1 and ranges[0][0] == ranges[0][1]:
        return _escape(ranges[0][0])
    if len(ranges) == 1 and ranges[0][0] == 0x5E:  # [^-x]: "^" alone, then the rest
        return f"(?:{_escape(0x5E)}|{_regex_set(((0x5F, ranges[0][1]),))})"
    return "[" + _members(ranges, _escape) + "]"


def _count(lo: int, hi: int | None) -> str:
    if (lo, hi) == (0, None):
        return "*"
    if (lo, hi) == (1, None):
        return "+"
    if (lo, hi) == (0, 1):
        return "?"
    return f"{{{lo}}}" if lo == hi else f"{{{lo},}}" if hi is None else f"{{{lo},{hi}}}"


def _regex(node) -> str:
    kind = node[0]
    if kind == "chars":
        return _regex_set(node[1])
    if kind == "seq":
        return "".join(_regex(child) if child[0] != "alt" else f"(?:{_regex(child)})" for child in node[1])
    if kind == "alt":
        return "|".join(_regex(child) for child in node[1])
    inner = _regex(node[1])
    single = node[1][0] == "chars"
    return (inner if single else f"(?:{inner})") + _count(node[2], node[3])


def _built(pattern: Pattern, search: bool):
    tree = language(pattern, search=search)
    if tree is None:
        raise ConstraintError(f"the pattern {pattern.source!r} matches no string; fix the pattern")
    return tree


def _unwritable(pattern: Pattern) -> ConstraintError:
    refusal = ConstraintError(
        f"the pattern {pattern.source!r} is regular, but written as one regular expression it would pass "
        "`algebra.CAPS['automaton_work']` (its lookarounds, word boundaries or anchors beside a bounded "
        "repetition); xgrammar takes it as grammar rules: use engine='xgrammar' or 'auto'")
    refusal.cap = "automaton_work"
    return refusal


def to_regex(pattern: Pattern, *, search: bool, anchored: bool) -> str:
    """The pattern in the plain syntax (sets written by code point, ``(?:)`` groups, counted repeats),
    matched against the whole text (``anchored`` adds ``^...$`` for an engine that searches);
    :class:`ConstraintError` for a language kept as an automaton."""
    tree = _built(pattern, search)
    if tree[0] == "automaton":
        raise _unwritable(pattern)
    body = _regex(tree)
    return f"^(?:{body})$" if anchored else body


_JSON_SHORT = {0x08: "b", 0x09: "t", 0x0A: "n", 0x0C: "f", 0x0D: "r"}
_JSON_ESCAPED = ((0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C))  # what a JSON string writes as an escape


def _ebnf_char(code: int) -> str:
    char = chr(code)
    return char if char.isascii() and char.isalnum() else f"\\U{code:08x}"


def _hex(digits) -> str:
    """An EBNF class of hex digits, either case (``json.dumps`` writes lower case, others upper)."""
    chars = sorted({c for d in digits for c in (d, d.upper())})
    return f'"{chars[0]}"' if len(chars) == 1 else "[" + "".join(chars) + "]"


def _json_escapes(codes) -> str:
    """Every spelling of the escaped characters ``codes`` in a JSON string: ``\\\\n`` and
    ``\\\\u000a`` alike, as one EBNF expression."""
    short = [_JSON_SHORT.get(code, chr(code)) for code in codes if code in _JSON_SHORT or code in (0x22, 0x5C)]
    by_third = {}
    for code in codes:
        digits = f"{code:04x}"
        by_third.setdefault(digits[2], []).append(digits[3])
    unicode = " | ".join(f"{_hex(third)} {_hex(fourths)}" for third, fourths in sorted(by_third.items()))
    parts = [f'"u00" ({unicode})']
    if short:
        parts.insert(0, "[" + "".join(_ebnf_char(ord(c)) if not c.isalnum() else c for c in short) + "]")
    return '("\\\\" (' + " | ".join(parts) + "))"


def _ebnf_set(ranges, json: bool) -> str:
    parts = _ebnf_set_parts(ranges, json)
    return parts[0] if len(parts) == 1 else "(" + " | ".join(parts) + ")"


def _ebnf_set_parts(ranges, json: bool) -> list[str]:
    """The set as EBNF alternatives: its class, and its escapes where ``json``."""
    parts = []
    plain = subtract(ranges, _JSON_ESCAPED) if json else ranges
    if plain:
        if len(plain) == 1 and plain[0][0] == plain[0][1]:
            parts.append(f'"{_ebnf_char(plain[0][0])}"')
        elif len(plain) == 1 and plain[0][0] == 0x5E:  # [^-x]: "^" alone, then the rest
            parts += [f'"{_ebnf_char(0x5E)}"', _ebnf_set(((0x5F, plain[0][1]),), json)]
        else:
            parts.append("[" + _members(plain, _ebnf_char) + "]")
    if json:
        escaped = [code for lo, hi in subtract(ranges, complement(_JSON_ESCAPED)) for code in range(lo, hi + 1)]
        if escaped:
            parts.append(_json_escapes(escaped))
    return parts


def _ebnf(node, json: bool, rules: dict | None = None, prefix: str = "p") -> str:
    kind = node[0]
    if kind == "chars":
        return _ebnf_set(node[1], json)
    if kind == "seq":
        return "(" + " ".join(_ebnf(child, json, rules, prefix) for child in node[1]) + ")" if node[1] else '""'
    if kind == "alt":
        return "(" + " | ".join(_ebnf(child, json, rules, prefix) for child in node[1]) + ")"
    lo, hi = node[2], node[3]
    child = node[1]
    if rules is not None and hi is None and lo < 2 and child[0] in ("chars", "alt") and not (
            child[0] == "chars" and len(_ebnf_set_parts(child[1], json)) == 1):
        # xgrammar masks a star over anything but one class at 50-60 ms a token on 131k tokens (an escape beside
        # a class, ``(c | "\\" e)*``), a right-recursive rule of flat alternatives in microseconds (its own
        # strings are written so: ``s ::= "" | c s | "\\" e s``)
        parts = _ebnf_set_parts(child[1], json) if child[0] == "chars" else \
            [_ebnf(c, json, rules, prefix) for c in child[1]]
        name = f"{prefix}r{len(rules)}"  # after the parts' own rules: a name no part took
        rules[name] = " | ".join(['""'] + [f"{part} {name}" for part in parts])
        return name if lo == 0 else "(" + " | ".join(f"{part} {name}" for part in parts) + ")"
    inner = _ebnf(child, json, rules, prefix)
    if child[0] == "repeat":  # a quantifier on a quantified element: grouped, as EBNF takes one suffix
        inner = f"({inner})"
    return f"{inner}{_count(lo, hi)}" if hi is None and lo < 2 or (lo, hi) == (0, 1) else \
        f"{inner}{{{lo},{-1 if hi is None else hi}}}"


def to_ebnf(pattern: Pattern, *, search: bool, json: bool, rules: dict | None = None, prefix: str = "p") -> str:
    """The pattern as one xgrammar EBNF expression matched against the whole text; ``json``: over
    the text a JSON string writes (``"`` as ``\\"``, a newline as ``\\n`` or ``\\u000a``, ...).
    A language kept as an automaton is the name of its start rule, its rules (one per live state,
    named ``prefix`` + the state) added to ``rules`` (name -> body); :class:`ConstraintError` without
    ``rules``."""
    tree = _built(pattern, search)
    if tree[0] != "automaton":
        return _ebnf(tree, json, rules, prefix)
    if rules is None:
        raise _unwritable(pattern)
    automaton = tree[1]
    live = automaton.live()
    for state in sorted(live):
        by_target: dict = {}
        for atom, target in enumerate(automaton.moves[state]):
            if target in live:
                by_target.setdefault(target, []).append(automaton.atoms[atom])
        branches = [f"{_ebnf_set(joined(ranges), json)} {prefix}{target}" for target, ranges in by_target.items()]
        rules[f"{prefix}{state}"] = " | ".join(branches + (['""'] if state in automaton.accepting else []))
    return f"{prefix}0"


def ebnf_rules(rules: dict) -> str:
    """``rules`` (name -> body) as EBNF lines."""
    return "\n".join(f"{name} ::= {body}" for name, body in rules.items())


def _regex_pattern(source: str, enforced: frozenset) -> Pattern:
    """A ``regex(...)`` constraint's pattern, or its refusal. Matched against the raw output: no JSON escapes
    for a set without the quote to confuse."""
    pattern = parse(source)
    refusal = pattern.refusal(enforced | {CONTROLS_WITHOUT_ESCAPES})
    if refusal is not None:
        raise refusal
    return pattern


def constraint_rules(source: str, engine: str, enforced: frozenset = frozenset()) -> str | None:
    """A ``regex(...)`` constraint whose language is kept as an automaton, as a whole xgrammar EBNF
    grammar (``root`` and a rule per state); None for every other regex (``constraint_regex``'s text
    serves). Refusals as :func:`constraint_regex`'s."""
    try:
        pattern = _regex_pattern(source, enforced)
        if _built(pattern, False)[0] != "automaton":
            return None
        rules: dict = {}
        start = to_ebnf(pattern, search=False, json=False, rules=rules, prefix="state")
        return f"root ::= {start}\n{ebnf_rules(rules)}"
    except ConstraintError as error:
        raise ConstraintError(f"{engine} refused this regex constraint: {error}") from None


def constraint_regex(source: str, engine: str, enforced: frozenset = frozenset()) -> str:
    """A ``regex(...)`` constraint as ``engine`` gets it (the whole output must match): the plain text,
    or :class:`ConstraintError` naming a refused feature the engine does not enforce (``enforced``)."""
    try:
        return to_regex(_regex_pattern(source, enforced), search=False, anchored=False)
    except ConstraintError as error:
        raise ConstraintError(f"{engine} refused this regex constraint: {error}") from None
