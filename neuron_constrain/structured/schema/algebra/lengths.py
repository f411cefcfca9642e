"""A pattern's strings cut to a length range and written as one pattern: ``minLength``/``maxLength``
beside a ``pattern`` for an engine that cannot weigh them there.

    within(r"^([a-z][0-9])+$", 1000, None)   # ('^(?:(?:[a-z][0-9]){500,})$', True): the pattern, exact or not
    write_bounds(schema, narrowed)           # each pattern beside bounds in a schema so written (in place)
    length_lookahead(r"^(?=.{1,253}$)[a-z.]+$")  # ('^[a-z.]+$', 1, 253): a length bound as a lookahead, read as one
    fewest(r"(ab){3,}c?")                    # 6: the fewest characters of a whole match
    cut(tree, 3, 8)                          # (tree', exact): tree' matches only tree's strings of 3-8 characters

llguidance 1.9 intersects a pattern with its length bounds itself and proves the intersection non-empty
within a fixed budget (10,000 derivative steps: "Unable to determine if regex is empty"); a long
``minLength`` beside a pattern passes that budget (``([a-z][0-9])+`` with ``minLength: 1000``). Written into
the pattern, the bound needs no proof.

Exact where the automaton of the intersection fits the algebra's caps (``regular.intersect_patterns`` with
a pattern of so many characters), or where the pattern's tree makes it so (:func:`cut`): a repetition of
a part of one width counts (``(ab)+`` from 1000 characters: ``(ab){500,}``), a sequence whose parts but one
have one width gives that one what the bound leaves, an alternation cuts each branch. Elsewhere narrower,
never wider: a repetition of parts of varying width counts so that its narrowest pieces reach the least
and its widest stay under the most (where they have no most: about as many pieces as each may have
characters); a sequence gives the characters it lacks to its parts that can
grow (one without a most first) and shares what the most allows among them. The caller lists a narrower
pattern (``CompiledGrammar.narrowed``).

The other way round, a pattern bounding its own length with a lookahead, ``^(?=.{1,253}$)...`` (how hostnames
are often bounded), is read as ``minLength``/``maxLength`` beside the rest (:func:`lookahead_bounds`, in
``algebra.lower``; ``limits`` builds the rest alone): the lookahead's automaton is the rest's times the count, past
the algebra's state cap where the rest's is small, and the engines weigh the bounds themselves.
"""
from __future__ import annotations

import math
import re

from neuron_constrain.structured.constraints import ConstraintError
from neuron_constrain.structured.schema.code_points import LINE_TERMINATORS, normalize, subtract
from neuron_constrain.structured.schema import patterns, rewrite
from neuron_constrain.structured.schema.algebra import lookaround, regular
from neuron_constrain.structured.schema.algebra.automata import fold
from neuron_constrain.structured.schema.algebra.caps import Over

_TRIES = 64  # counts a repetition of varying pieces tries under a most before it gives up
EMPTY = ("seq", ())


# ``^(?=.{n,m}$)`` at the start: the common way to bound a pattern's length inside it (hostnames: 1-253)
_LENGTH_LOOKAHEAD = re.compile(r"\^\(\?=\^?\.(?:\{(\d{1,6})(,(\d{0,6}))?\}|([*+]))\$\)")


def length_lookahead(source) -> tuple[str, int, int | None] | None:
    """``^(?=.{n,m}$)rest`` (a length bound written as a lookahead) as ``("^rest", n, m)`` (``m`` None: no most),
    where ``^rest`` with ``minLength: n`` and ``maxLength: m`` is the same language in the engines' reading:
    ``rest`` one alternative whose language (its own lookarounds built) holds no line terminator (the
    lookahead's ``.`` takes none; an open end takes any text); else None. Its automaton is ``rest``'s, where the
    lookahead's is that times the count (``^(?=.{1,253}$)`` before a hostname: past the algebra's state cap)."""
    found = _LENGTH_LOOKAHEAD.match(source) if isinstance(source, str) else None
    if found is None:
        return None
    counted, more, most, star = found.groups()
    low = (0 if star == "*" else 1) if star else int(counted)
    high = None if star or more and not most else low if not more else int(most)
    if high is not None and high < low:
        return None
    rest = "^" + source[found.end():]
    try:
        pattern = patterns.parse(rest)
        if pattern.refused is not None or len(pattern.branches) != 1 or pattern.tree[0] == "alt":
            return None  # a refused feature, or alternatives (the lookahead bounds the first alone)
        tree = lookaround.language(pattern, search=True)  # its own lookarounds built (an open end: any text)
    except ConstraintError:
        return None  # not read, or past a cap
    return (rest, low, high) if tree is not None and tree[0] != "automaton" and _avoids(tree, LINE_TERMINATORS) \
        else None


def lookahead_bounds(schema: dict) -> None:
    """Each ``{pattern: "^(?=.{n,m}$)rest"}`` of ``schema`` (edited in place) as ``{pattern: "^rest", minLength: n,
    maxLength: m}`` (met with the node's own bounds) where that is the same language (:func:`length_lookahead`)."""
    for _, node in rewrite.walk(schema):
        bounded = length_lookahead(node.get("pattern"))
        if bounded is None or not all(type(node.get(key, 0)) is int for key in ("minLength", "maxLength")):
            continue
        node["pattern"], low, high = bounded
        if low:
            node["minLength"] = max(node.get("minLength", 0), low)
        if high is not None:
            node["maxLength"] = min(node.get("maxLength", high), high)


def write_bounds(schema: dict, narrowed: list | None = None) -> None:
    """Each node of ``schema`` (edited in place) with a ``pattern`` beside ``minLength``/``maxLength`` (and no
    ``format``) given one pattern of those lengths, the bounds dropped: where exact; also where narrower when
    ``narrowed`` (a list) is given, which receives their JSON pointers, but never in a schema with
    `not`/`if`/`oneOf` (where a narrower subschema could widen what it accepts)."""
    nodes = list(rewrite.walk(schema))
    negating = any(rewrite.NEGATING & set(node) for _, node in nodes)
    for path, node in nodes:
        low, high = node.get("minLength", 0), node.get("maxLength")
        if not isinstance(node.get("pattern"), str) or "format" in node or (low, high) == (0, None) or not all(
                type(bound) is int for bound in (low, 0 if high is None else high)):
            continue
        written = within(node["pattern"], low, high)
        if written is None or not written[1] and (narrowed is None or negating):
            continue
        node["pattern"] = written[0]
        node.pop("minLength", None)
        node.pop("maxLength", None)
        if not written[1]:
            narrowed.append(path)


def within(source: str, low: int, high: int | None) -> tuple[str, bool] | None:
    """``source``'s strings (a JSON Schema ``pattern``: a search) of ``low`` to ``high`` characters (None: no
    most) as one anchored pattern, and whether it is exact (else narrower); None where no pattern is written
    here (a refused feature, no string left, a cap)."""
    try:
        exact = regular.intersect_patterns((source, f"^{regular.ANY_CHARACTER}{{{low},{'' if high is None else high}}}$"))
    except (Over, ConstraintError):
        exact = None
    if isinstance(exact, str):
        return exact, True
    if exact is False:
        return None  # no string of the pattern has such a length
    try:
        pattern = patterns.parse(source)
        tree = None if pattern.refused is not None else lookaround.language(pattern, search=True)
    except ConstraintError:
        return None  # not read, or its lookarounds past a cap
    if tree is None or tree[0] == "automaton":
        return None  # a refused feature, or lookarounds whose tree is too large to write
    bounded, is_exact = cut(tree, low, high)
    if bounded is None:
        return None
    try:
        return regular.write(bounded), is_exact
    except Over:
        return None


def fewest(source: str) -> int:
    """A lower bound on the characters of a string ``source`` matches whole (a ``regex`` constraint), from its
    parsed tree (cached: the limits check parsed it): anchors, lookarounds and word boundaries count as none
    (they only take strings away), each set as one character in either dialect. 0 where it is not read (a
    syntax error, a refused feature: the compile names them)."""
    try:
        pattern = patterns.parse(source)
    except ConstraintError:
        return 0
    return 0 if pattern.refused is not None else fold(pattern.tree, _fewest_characters)


def _fewest_characters(node, parts: list) -> int:
    kind = node[0]
    if kind == "chars":
        return 1
    if kind == "seq":
        return sum(parts)
    if kind == "alt":
        return min(parts, default=0)
    if kind == "repeat":
        return parts[0] * node[2]
    return 0  # zero-width: an anchor, a lookaround, a word boundary


def cut(tree, low: int, high: int | None) -> tuple[tuple | None, bool]:
    """A tree matching only strings ``tree`` matches of ``low`` to ``high`` characters (None: no string), and
    whether it matches all of them. ``tree``: sets, sequences, alternations, repetitions."""
    fewest, most = _width(tree)
    if low <= fewest and (high is None or most is not None and most <= high):
        return tree, True
    if most is not None and most < low or high is not None and fewest > high:
        return None, True
    kind = tree[0]
    if kind == "alt":
        kept, exact = [], True
        for branch in tree[1]:
            part, part_exact = cut(branch, low, high)
            exact &= part_exact
            if part is not None:
                kept.append(part)
        return (None if not kept else kept[0] if len(kept) == 1 else ("alt", tuple(kept))), exact
    if kind == "repeat":
        return _cut_repeat(tree, low, high)
    return _cut_seq(tree, low, high)  # a set is one character: always decided above


def _cut_repeat(tree, low: int, high: int | None):
    body, least, greatest = tree[1], tree[2], tree[3]
    narrow, wide = _width(body)
    if narrow == wide:  # pieces of one width (never 0: the repetition's width would be 0, decided above)
        count_low = max(least, -(-low // narrow))
        count_high = _smaller(greatest, None if high is None else high // narrow)
        return (("repeat", body, count_low, count_high) if count_high is None or count_low <= count_high else None), \
            True
    if narrow == 0:  # pieces that may be empty: the same strings repeat the non-empty ones, any count from 0
        body, exact = cut(body, 1, high)
        if body is None:
            return None, exact
        part, part_exact = cut(("repeat", body, 0, greatest), low, high)
        return part, exact and part_exact
    count_low = max(least, -(-low // narrow))  # narrowest pieces reach ``low``
    if high is None:
        if greatest is None or count_low <= greatest:
            return ("repeat", body, count_low, greatest), False
        piece, _ = cut(body, -(-low // greatest), None)  # ``greatest`` pieces, each wide enough
        return (None if piece is None else ("repeat", piece, greatest, greatest)), False
    if wide is not None:  # widest pieces stay under ``high``
        count_high = _smaller(greatest, high // wide)
        if count_low <= count_high:
            return ("repeat", body, count_low, count_high), False
    # a count from ``fewest`` to ``most`` of pieces cut to ``piece_low``..``high // most`` characters: about as
    # many pieces as each may have characters, where the least allows
    most_allowed = greatest if greatest is not None else high // narrow
    if count_low <= most_allowed:
        fewest, piece_low = count_low, narrow
        most = min(most_allowed, max(count_low, 1, math.isqrt(high // narrow)))
    else:  # too few pieces at their narrowest: each wider
        fewest = most = most_allowed
        piece_low = -(-low // most_allowed) if most_allowed else 0
    if most == 0:
        return (EMPTY if fewest == 0 else None), False
    for count in range(most, max(fewest, 1) - 1, -1)[:_TRIES]:
        piece, _ = cut(body, piece_low, high // count)
        if piece is not None:
            return ("repeat", piece, fewest, count), False
    return None, False


def _cut_seq(tree, low: int, high: int | None):
    items = tree[1]
    spans = [_width(item) for item in items]
    fewest = sum(narrow for narrow, _ in spans)
    varying = [i for i, (narrow, wide) in enumerate(spans) if narrow != wide]
    if len(varying) == 1:  # the others have one width: this one takes the rest of the range, exactly
        i = varying[0]
        rest = fewest - spans[i][0]
        part, exact = cut(items[i], max(low - rest, 0), None if high is None else high - rest)
        return (None if part is None else ("seq", (*items[:i], part, *items[i + 1:]))), exact
    # what each varying part must add to its fewest (``more``) and may add (``room``), shared in turn
    room_of = {i: None if spans[i][1] is None else spans[i][1] - spans[i][0] for i in varying}
    order = sorted(varying, key=lambda i: (room_of[i] is not None, -(room_of[i] or 0)))  # no most first
    more, lacking = dict.fromkeys(varying, 0), max(low - fewest, 0)
    for i in order:
        more[i] = lacking if room_of[i] is None else min(lacking, room_of[i])
        lacking -= more[i]
    if lacking:
        return None, False
    room = dict(room_of)
    if high is not None:
        spare = high - fewest - sum(more.values())
        if spare < 0:
            return None, False
        bounded = sorted((i for i in varying if room_of[i] is not None), key=lambda i: room_of[i])
        for i in bounded:  # parts with a little room first keep all of it where the spare allows
            room[i] = more[i] + min(room_of[i] - more[i], spare)
            spare -= room[i] - more[i]
        unbounded = [i for i in varying if room_of[i] is None]
        for n, i in enumerate(unbounded):  # the rest shared alike among the parts without a most
            share = spare // len(unbounded) + (1 if n < spare % len(unbounded) else 0)
            room[i] = more[i] + share
    parts = list(items)
    for i in varying:
        narrow = spans[i][0]
        if more[i] == 0 and room[i] == room_of[i]:
            continue  # this part is free: it keeps its own widths
        part, _ = cut(items[i], narrow + more[i], None if room[i] is None else narrow + room[i])
        if part is None:
            return None, False
        parts[i] = part
    return ("seq", tuple(parts)), False


def _smaller(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else min(a, b)


def _width(node) -> tuple[int, int | None]:
    """The fewest and the most characters ``node`` matches (None: no most), each shared subtree once."""
    return fold(node, _combined_width)


def _combined_width(node, parts: list) -> tuple[int, int | None]:
    kind = node[0]
    if kind == "chars":
        return 1, 1
    if kind in ("seq", "alt"):
        lows, highs = [p[0] for p in parts or [(0, 0)]], [p[1] for p in parts or [(0, 0)]]
        most = None if None in highs else (sum(highs) if kind == "seq" else max(highs))
        return (sum(lows) if kind == "seq" else min(lows)), most
    (narrow, wide), = parts
    return narrow * node[2], 0 if wide == 0 else None if wide is None or node[3] is None else wide * node[3]


def _avoids(tree, ranges) -> bool:
    """Whether no set of ``tree`` (sets, sequences, alternations, repetitions) holds a character of ``ranges``."""
    return fold(tree, lambda node, inside: all(inside) and (
        node[0] != "chars" or subtract(node[1], ranges) == normalize(node[1])))
