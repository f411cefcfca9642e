"""Patterns read the way the referee reads them, and written back in the one syntax engines agree on.

    pattern = parse(r"^\\d{3}-[a-z.]+$")       # Pattern: the tree, its features (name, offset)
    pattern.refused                             # the first feature no engine enforces (Feature), or None
    full_match(pattern, search=True)            # the tree matched against the whole text

JSON Schema's ``pattern``, ``patternProperties`` and ``propertyNames`` are ECMA-262 regular
expressions matched anywhere in the string (``search``); a ``regex(...)`` constraint matches the
whole output. The referee (``jsonschema``, ``validate_output``) runs Python's ``re``. The engines
read neither dialect faithfully (xgrammar 0.2.8 drops lookaheads and mid-pattern anchors, lets
``.`` match a newline, reads ``[\\^a]`` as negated, matches JSON-schema patterns against the
*escaped* text; llguidance 1.9.1 reads ``[[:alpha:]]`` as POSIX and ``\\d`` as Unicode), so no
pattern reaches an engine as written (``pattern_text.py`` writes it). :func:`parse` builds a tree
of code-point sets, sequences, alternations and repetitions; every construct the two dialects
agree on is rewritten with its meaning kept (a *rewrite* feature: ``\\d`` -> ``[0-9]``, lazy ->
greedy, anchors at the edges of a branch -> a full match); lookarounds, ``\\b``/``\\B`` and anchors
beside them stay in the tree as zero-width ``look``/``boundary``/``start``/``end`` nodes, whose
exact language ``algebra/lookaround.py`` builds by automata (anchors in a repetition too); every other
construct is a *refused* feature naming its offset (backreferences, flags, ``{,n}``, ...). Where the dialects differ on a
set (``\\D``, ``\\W``, ``.``, ``\\b``'s ``\\w``) the tree takes the intersection: an engine may refuse a
string one reading accepts, never accept one either reading refuses (inside a negated class or a
negative lookaround the other way, so that what it excludes is the wider). ``parse(source,
wide=True)`` reads the other way: each set the union of the readings and ``$`` also before a last
newline (as Python's ``$``): every string either reading matches, what a complement excludes.
"""
from __future__ import annotations

import dataclasses
import functools
import re

from neuron_constrain.structured.schema.code_points import (ANY, LINE_TERMINATORS, complement, covers, normalize, shorthand,
                                                     subtract)
from neuron_constrain.structured.constraints import ConstraintError

MAX_DEPTH = 200  # nested groups; deeper is refused (the parser recurses once a level)
MAX_BRANCHES = 64  # alternatives made when anchors inside groups are moved to the edges

# Constructs rewritten with their meaning kept (recorded, never refused), and what becomes of them.
REWRITES = {
    "dot": "`.` -> every character but a line terminator (\\n \\r \\u2028 \\u2029: ECMA-262's, which include Python's)",
    "shorthand class": "`\\d \\w \\s` -> ECMA-262's ASCII sets; `\\D \\W \\S` -> the characters neither Python's "
                       "Unicode set nor ECMA's holds",
    "lazy quantifier": "`*? +? ?? {n,m}?` -> greedy (the same strings match)",
    "group syntax": "`(?:...)`, `(?<name>...)` -> a plain group",
    "character escape": "`\\xHH \\uHHHH \\cX \\0 \\t \\n \\v \\f \\r`, escaped punctuation -> the character itself",
    "bracket text in a class": "`[[:alpha:]]` -> ECMA-262's meaning (one of `[:alph`, then `]`), written escaped",
    "edge anchor": "`^`/`$` at the edges of a branch -> the search written as a full match",
    "unmatchable anchor": "a `^` after text that cannot be empty (or `$` before) -> that branch matches nothing",
    "anchor in the middle": "`^`/`$` in a repetition (or past the edge rewrite's alternatives) -> built as lookarounds",
    **{name: f"`{text}` -> its exact language, built by automata (`algebra/lookaround.py`)" for name, text in (
        ("lookahead", "(?=...)"), ("negative lookahead", "(?!...)"), ("lookbehind", "(?<=...)"),
        ("negative lookbehind", "(?<!...)"), ("word boundary", "\\b`, `\\B"))},
}
CONTROLS_WITHOUT_ESCAPES = "every control character without the quote or backslash"
# Constructs no engine enforces with the referee's meaning, or that the dialects read differently.
REFUSED = {
    "variable-width lookbehind": "`(?<=a+)`, `(?<!a|bc)`: Python's re, the referee, refuses a lookbehind whose "
                                 "alternatives differ in length",
    "lookaround inside a lookbehind": "`(?<=(?=a).)`, `(?<=^a)`: not built here; write the lookbehind without it",
    "backreference": "`\\1`, `\\k<name>`: no engine enforces it",
    "inline flags": "`(?i)`, `(?i:...)`: not ECMA-262 (Python's re reads them)",
    "Python-only syntax": "`(?P<..>`, `(?P=..)`, `(?#..)`, `(?>..)`, `(?(..)`, possessive `*+`: not ECMA-262",
    "quantifier {,n}": "ECMA-262 reads `{,n}` as text, Python's re as `{0,n}`: write `{0,n}`",
    "Unicode property escape": "`\\p{..}`, `\\P{..}`: Python's re, the referee, does not read them",
    "ambiguous escape": "an escape ECMA-262 and Python's re read differently (`\\a`, `\\z`, `\\u{..}`, `\\x` without "
                        "two hex digits, octal): write the character",
    "empty class": "`[]`/`[^]`: ECMA-262 reads no character / any character, Python's re a literal `]`",
    "class escape in a range": "`[\\d-z]`: ECMA-262 (u flag) and Python's re refuse it",
    CONTROLS_WITHOUT_ESCAPES: "a set holding every control character (U+0000-U+001F) but not `\"` or `\\` (`[^\"]`, "
                              "`[^\\\\]`): llguidance 1.9 also takes the escaped quote and backslash there, in a JSON string",
}


@dataclasses.dataclass(frozen=True)
class Feature:
    name: str  # a key of REWRITES or REFUSED
    offset: int  # where in the pattern it starts

    @property
    def refused(self) -> bool:
        return self.name in REFUSED


@dataclasses.dataclass(frozen=True)
class Pattern:
    source: str
    tree: tuple  # ("chars", ranges) | ("seq", items) | ("alt", branches) | ("repeat", node, lo, hi: None unbounded)
    #   | ("start",) | ("end", wide) | ("look", ahead, negated, node) | ("boundary", negated, wide): zero-width
    features: tuple[Feature, ...]
    branches: tuple = ()  # each alternative as (starts anchored, ends anchored, items): anchors moved to the edges

    @property
    def refused(self) -> Feature | None:
        return next((f for f in self.features if f.refused), None)

    def refusal(self, enforced: frozenset = frozenset()) -> ConstraintError | None:
        """The error for a ``regex(...)`` constraint with a refused feature outside ``enforced``, or None."""
        feature = next((f for f in self.features if f.refused and f.name not in enforced), None)
        return None if feature is None else ConstraintError(
            f"the regex {self.source!r} uses {feature.name} at offset {feature.offset} ({REFUSED[feature.name]}); "
            "no engine here enforces it with the meaning ECMA-262 and Python's re give it: rewrite the regex without it")


# --------------------------------------------------------------------------- the parser
_CONTROL = {"t": 9, "n": 10, "v": 11, "f": 12, "r": 13}
_SYNTAX = set("^$\\.*+?()[]{}|/-")


class _Parser:
    def __init__(self, source: str, wide: bool = False):
        self.text, self.at, self.features, self.groups = source, 0, [], 0
        self.wide = wide  # sets read as the union of the dialects (else their intersection)

    def note(self, name: str, offset: int) -> None:
        self.features.append(Feature(name, offset))

    def error(self, why: str, offset: int | None = None) -> ConstraintError:
        where = self.at if offset is None else offset
        return ConstraintError(f"the pattern {self.text!r} is not an ECMA-262 regular expression: {why} at offset "
                               f"{where}; fix the pattern")

    def peek(self, count: int = 1) -> str:
        return self.text[self.at:self.at + count]

    def parse(self) -> tuple:
        tree = self.disjunction(0)
        if self.at < len(self.text):
            raise self.error("an unmatched `)`")
        return tree

    def disjunction(self, depth: int) -> tuple:
        if depth > MAX_DEPTH:
            raise ConstraintError(f"the pattern nests groups deeper than {MAX_DEPTH} levels at offset {self.at}; "
                                  "flatten it")
        branches = [self.alternative(depth)]
        while self.peek() == "|":
            self.at += 1
            branches.append(self.alternative(depth))
        return branches[0] if len(branches) == 1 else ("alt", tuple(branches))

    def alternative(self, depth: int) -> tuple:
        items = []
        while self.at < len(self.text) and self.peek() not in "|)":
            start = self.at
            atom = self.atom(depth)
            quantified = self.quantifier(atom, start)
            if quantified is not None:
                items.append(quantified)
            elif atom is not None:
                items.append(atom)
        return items[0] if len(items) == 1 else ("seq", tuple(items))

    def quantifier(self, atom, start: int):
        char = self.peek()
        if char in ("*", "+", "?"):
            lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[char]
            self.at += 1
        elif char == "{":
            match = re.match(r"\{(\d*)(,?)(\d*)\}", self.text[self.at:])
            if match is None or not match.group(1):
                if match is not None and match.group(2):  # "{,n}", "{,}": Python's re reads a quantifier
                    self.note("quantifier {,n}", self.at)
                    self.at += match.end()
                    return atom
                return None  # a literal "{" (both dialects)
            lo = int(match.group(1))
            hi = lo if not match.group(2) else (int(match.group(3)) if match.group(3) else None)
            if hi is not None and hi < lo:
                raise self.error(f"the quantifier {match.group(0)} has its bounds out of order")
            self.at += match.end()
        else:
            return None
        if atom is None or atom[0] in ("start", "end", "boundary"):
            raise self.error("a quantifier with nothing to repeat", start)
        if self.peek() == "?":
            self.note("lazy quantifier", self.at)
            self.at += 1
        elif self.peek() == "+":
            self.note("Python-only syntax", self.at)
            self.at += 1
        if self.peek() in ("*", "+", "?") or self.peek() == "{" and re.match(r"\{\d+(,\d*)?\}", self.text[self.at:]):
            raise self.error("a quantifier after a quantifier")
        return ("repeat", atom, lo, hi)

    def atom(self, depth: int):
        char, start = self.peek(), self.at
        self.at += 1
        if char == "^":
            return ("start",)
        if char == "$":
            return ("end", self.wide)  # Python's `$` also matches before a final newline: the wide reading takes it
        if char == ".":
            self.note("dot", start)
            return ("chars", subtract(ANY, ((0x0A, 0x0A),) if self.wide else LINE_TERMINATORS))
        if char == "[":
            members = self.char_class(start)
            if covers(members, 0x00, 0x1F) and not (covers(members, 0x22, 0x22) and covers(members, 0x5C, 0x5C)):
                self.note(CONTROLS_WITHOUT_ESCAPES, start)
            return ("chars", members)
        if char == "(":
            return self.group(start, depth)
        if char == "\\":
            return self.escape(start, in_class=False)
        if char in "*+?":
            raise self.error("a quantifier with nothing to repeat", start)
        if char == "{" and re.match(r"\{\d*,?\d*\}", self.text[start:]) and self.text[start:start + 2] != "{}":
            raise self.error("a quantifier with nothing to repeat", start)
        return ("chars", ((ord(char), ord(char)),))

    def group(self, start: int, depth: int):
        rest = self.text[self.at:]
        kinds = (("?=", "lookahead"), ("?!", "negative lookahead"), ("?<=", "lookbehind"),
                 ("?<!", "negative lookbehind"))
        kind = next((name for prefix, name in kinds if rest.startswith(prefix)), None)
        if kind is not None:
            self.note(kind, start)
            ahead, negated = kind.endswith("lookahead"), kind.startswith("negative")
            self.at += 2 if ahead else 3
            self.wide ^= negated  # what a negative lookaround excludes is read the other way (as a negated class)
            inner = self.disjunction(depth + 1)
            self.wide ^= negated
            self.close(start)
            if not ahead and (_holds(inner, ("start", "end", "look", "boundary")) or len(set(_width(inner))) != 1):
                nested = _holds(inner, ("start", "end", "look", "boundary"))
                self.note("lookaround inside a lookbehind" if nested else "variable-width lookbehind", start)
            return ("look", ahead, negated, inner)
        if rest.startswith("?:"):
            self.note("group syntax", start)
            self.at += 2
        elif rest.startswith("?<"):
            match = re.match(r"\?<([A-Za-z_$][\w$]*)>", rest)
            if match is None:
                raise self.error("a malformed group name", start)
            self.note("group syntax", start)
            self.at += match.end()
            self.groups += 1
        elif rest.startswith("?"):
            python_only = rest[1:2] in ("P", "#", ">", "(")
            self.note("Python-only syntax" if python_only else "inline flags", start)
            end = self.text.find(")", self.at)
            self.at = len(self.text) if end < 0 else end + 1
            return ("refused",)
        else:
            self.groups += 1
        inner = self.disjunction(depth + 1)
        self.close(start)
        return inner

    def close(self, start: int) -> None:
        if self.peek() != ")":
            raise self.error("an unclosed `(`", start)
        self.at += 1

    def escape(self, start: int, in_class: bool):
        """After a backslash: a set of code points, or an assertion / refused node outside a class."""
        if self.at >= len(self.text):
            raise self.error("a pattern ending in `\\`", start)
        char = self.text[self.at]
        self.at += 1
        if char in "dwsDWS":
            self.note("shorthand class", start)
            return ("chars", shorthand(char, self.wide))
        if char in "pP":
            self.note("Unicode property escape", start)
            if self.peek() == "{":
                end = self.text.find("}", self.at)
                self.at = len(self.text) if end < 0 else end + 1
            return ("refused",)
        if char == "b" and in_class:
            self.note("character escape", start)
            return ("chars", ((8, 8),))
        if char in "bB":
            self.note("word boundary", start)
            return ("boundary", char == "B", self.wide)
        if char == "k" and self.peek() == "<" or char.isdigit() and char != "0":
            backreference = not in_class and (self.groups or char == "k")
            self.note("backreference" if backreference else "ambiguous escape", start)
            while self.peek().isdigit() or self.peek() and char == "k" and self.text[self.at - 1] != ">":
                self.at += 1
            return ("refused",)
        code = self.character(char, start)
        if code is None:
            return ("refused",)
        return ("chars", ((code, code),))

    def character(self, char: str, start: int) -> int | None:
        """The code point of a character escape (after ``\\char``), or None (an ambiguous escape, noted)."""
        if char in _CONTROL:
            self.note("character escape", start)
            return _CONTROL[char]
        if char == "0" and not self.peek().isdigit():
            self.note("character escape", start)
            return 0
        if char == "c" and self.peek().isascii() and self.peek().isalpha():
            self.note("character escape", start)
            self.at += 1
            return ord(self.text[self.at - 1]) % 32
        hex_digits = {"x": 2, "u": 4}.get(char)
        if hex_digits and re.fullmatch(f"[0-9A-Fa-f]{{{hex_digits}}}", self.peek(hex_digits)):
            self.note("character escape", start)
            self.at += hex_digits
            return int(self.text[self.at - hex_digits:self.at], 16)
        if not char.isascii() or not char.isalnum():  # escaped punctuation, or any non-ASCII character
            if char in _SYNTAX:
                self.note("character escape", start)
            return ord(char)
        self.note("ambiguous escape", start)
        return None

    def char_class(self, start: int) -> tuple:
        negated = self.peek() == "^"
        self.at += negated
        self.wide ^= negated  # a negated class's members read the other way: the class keeps the reading's side
        try:
            return self._class_members(start, negated)
        finally:
            self.wide ^= negated

    def _class_members(self, start: int, negated: bool) -> tuple:
        if self.peek() == "]":
            self.note("empty class", start)
            self.at += 1
            return ANY if negated else ()
        ranges: list = []
        while True:
            if self.at >= len(self.text):
                raise self.error("an unclosed `[`", start)
            if self.peek() == "]":
                self.at += 1
                break
            low = self.class_atom()
            if self.peek() == "-" and self.peek(2) != "-]" and self.text[self.at + 1:self.at + 2] not in ("]", ""):
                dash = self.at
                self.at += 1
                high = self.class_atom()
                if isinstance(low, tuple) or isinstance(high, tuple):
                    self.note("class escape in a range", dash)
                    continue
                if high < low:
                    raise self.error(f"the class range {chr(low)!r}-{chr(high)!r} is out of order", dash)
                ranges.append((low, high))
            else:
                ranges += low if isinstance(low, tuple) else [(low, low)]
        return complement(ranges) if negated else normalize(ranges)

    def class_atom(self):
        """One class member: a code point, or a tuple of ranges (a shorthand class)."""
        start, char = self.at, self.peek()
        self.at += 1
        if char == "[":
            self.note("bracket text in a class", start)
        if char != "\\":
            return ord(char)
        node = self.escape(start, in_class=True)
        if node[0] == "refused":
            return ()
        ranges = node[1]
        return ranges[0][0] if len(ranges) == 1 and ranges[0][0] == ranges[0][1] else ranges


@functools.lru_cache(maxsize=1024)
def parse(source: str, wide: bool = False) -> Pattern:
    """``source`` read as ECMA-262 and Python's ``re`` agree (see the module docstring); a syntax
    error raises :class:`ConstraintError`, a refused feature is listed (``Pattern.refused``).
    ``wide``: every string either dialect matches (a superset of both readings)."""
    if not isinstance(source, str):
        raise ConstraintError(f"a pattern must be a string, got {type(source).__name__}")
    parser = _Parser(source, wide)
    tree = parser.parse()
    branches = None if _holds(tree, ("look", "boundary")) else _edges(tree, parser)
    if branches is None or any(f.name == "anchor in the middle" for f in parser.features):  # algebra/lookaround.py
        return Pattern(source, tree, tuple(parser.features), ((False, False, (tree,)),))  # reads them where they stand
    if wide:  # Python's `$` also matches before a final newline
        newline = ("repeat", ("chars", ((0x0A, 0x0A),)), 0, 1)
        branches = tuple((left, right, items + (newline,) * right) for left, right, items in branches)
    return Pattern(source, tree, tuple(parser.features), branches)


# --------------------------------------------------------------------------- anchors to the edges
def _holds(node, kinds: tuple) -> bool:
    """Whether ``node`` holds a node of one of ``kinds`` (anchors: ``start``, ``end``; ``look``, ``boundary``)."""
    kind = node[0]
    if kind in ("seq", "alt"):
        return any(_holds(child, kinds) for child in node[1])
    return kind in kinds or kind == "repeat" and _holds(node[1], kinds)


def _width(node) -> tuple:
    """The fewest and the most characters ``node`` matches (None: no most)."""
    kind = node[0]
    if kind in ("seq", "alt"):
        lows, highs = zip(*[_width(child) for child in node[1]] or [(0, 0)])
        pick = (min, max) if kind == "alt" else (sum, sum)
        return pick[0](lows), None if None in highs else pick[1](highs)
    if kind == "repeat":
        low, high = _width(node[1])
        return low * node[2], None if None in (high, node[3]) else high * node[3]
    return (1, 1) if kind == "chars" else (0, 0)


def nullable(node) -> bool:
    """Whether ``node`` matches the empty string (anchors, lookarounds and refused nodes are zero-width)."""
    return _width(node)[0] == 0


def _expand(node, parser: _Parser) -> list[list]:
    """``node`` as alternatives of flat item lists, alternations holding an anchor distributed."""
    kind = node[0]
    if kind == "seq":
        out: list[list] = [[]]
        for child in node[1]:
            parts = _expand(child, parser)
            out = [left + right for left in out for right in parts]
            if len(out) > MAX_BRANCHES:
                parser.note("anchor in the middle", 0)
                return [[node]]
        return out
    if kind == "alt" and _holds(node, ("start", "end")):
        out = [items for child in node[1] for items in _expand(child, parser)]
        if len(out) > MAX_BRANCHES:
            parser.note("anchor in the middle", 0)
            return [[node]]
        return out
    if kind == "repeat" and _holds(node, ("start", "end")):
        parser.note("anchor in the middle", 0)
    return [[node]]


def _edges(tree, parser: _Parser) -> tuple:
    """Each alternative of the pattern as ``(starts anchored, ends anchored, items)``, anchors gone;
    an alternative no string can match (a ``^`` after text that cannot be empty) is dropped."""
    out = []
    for items in _expand(tree, parser):
        starts = [i for i, item in enumerate(items) if item[0] == "start"]
        ends = [i for i, item in enumerate(items) if item[0] == "end"]
        left, right = bool(starts), bool(ends)
        if starts:
            before, items = items[:starts[-1]], items[starts[-1] + 1:]
            if not all(nullable(x) for x in before):
                parser.note("unmatchable anchor", 0)
                continue
            # before the last ^ only the empty string; a $ there: only the empty text (Python also takes "\n")
            if any(x[0] == "end" for x in before):
                if not all(nullable(x) for x in items):
                    parser.note("unmatchable anchor", 0)
                    continue
                items = []  # `right` holds already: a $ was there
        if ends:
            first = next((i for i, item in enumerate(items) if item[0] == "end"), None)
            if first is None:  # every $ was before the last ^: handled above
                items = []
            elif not all(nullable(x) for x in items[first + 1:]):
                parser.note("unmatchable anchor", 0)
                continue
            else:
                items = items[:first]
        if any(item[0] in ("start", "end") for item in items):
            parser.note("unmatchable anchor", 0)
            continue
        if left or right:
            parser.note("edge anchor", 0)
        out.append((left, right, tuple(items)))
    return tuple(out)


def full_match(pattern: Pattern, *, search: bool) -> tuple | None:
    """The pattern as one anchor-free tree matched against the whole text: with ``search`` (JSON
    Schema's meaning) an unanchored edge takes any text; None when no string can match."""
    any_text = ("repeat", ("chars", ANY), 0, None)
    branches = []
    for left, right, items in pattern.branches:
        items = list(items)
        if search and not left:
            items.insert(0, any_text)
        if search and not right:
            items.append(any_text)
        branch = _prune(("seq", tuple(items)))
        if branch is not None:
            branches.append(branch)
    if not branches:
        return None
    return branches[0] if len(branches) == 1 else ("alt", tuple(branches))


def _prune(node):
    """``node`` without the parts that can match nothing (an empty set); None if it matches nothing."""
    kind = node[0]
    if kind == "chars":
        return node if node[1] else None
    if kind == "repeat":
        inner = _prune(node[1])
        return ("repeat", inner, node[2], node[3]) if inner is not None else ("seq", ()) if node[2] == 0 else None
    if kind not in ("seq", "alt") or not node[1]:
        return node
    kept = [_prune(child) for child in node[1]]
    if kind == "seq" and any(item is None for item in kept):
        return None
    kept = [item for item in kept if item is not None]
    return None if not kept else kept[0] if len(kept) == 1 else (kind, tuple(kept))
