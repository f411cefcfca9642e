"""Patterns as regular languages: the complement and the intersection of patterns, written back as one.

    complement_pattern(r"^[A-Fa-f\\d]{24}$")   # a pattern matching the strings this one does not
    intersect_patterns((p, q))                # a pattern matching the strings both match
    referee_match(pattern, text)              # what the referee says of a pattern, one written here too

JSON Schema's ``pattern`` is a search. Its complement holds every string neither dialect finds the
pattern in, so the pattern is read wide (``patterns.parse(source, wide=True)``: each set the union
of ECMA-262's and Python's, a final ``$`` also before a last newline); an intersection reads each
pattern narrow (what both dialects match), as the engines do. The language goes through automata
over code-point intervals: Thompson's NFA, the subset construction over the intervals its labels
cut the code points into (surrogates are never text), completed and complemented or multiplied,
minimized (Moore's refinement), then written back by state elimination as explicit sets, groups,
alternation and counted repetition: a text the library's parser and Python's ``re`` read alike,
anchored ``^(?:...)$``. What is written is exact for the engines' reading and may refuse a string
only one dialect would take; the algebra's judge (``jsonschema``, the referee) reads a pattern
written here as what it stands for (:func:`referee_match`: not the first, or all of them, each
read by Python's ``re``), never as its text.

Every step is bounded (``caps.CAPS``: ``nfa_states``, ``automaton_states``, ``automaton_work``: the steps
of the construction counted as they are taken, ``pattern_chars``): past a cap the rewrite is refused by
name, with the pattern, never truncated. Lookarounds, word boundaries and anchors anywhere are
built exactly (``lookaround.py``); a pattern with a refused feature (back-references, ...) has no complement
here (None).
"""
from __future__ import annotations

import collections
import contextlib
import functools
import re

from neuron_constrain.structured.schema import patterns
from neuron_constrain.structured.schema.algebra import lookaround
from neuron_constrain.structured.schema.algebra.automata import Dfa
from neuron_constrain.structured.schema.algebra.caps import Over, over
from neuron_constrain.structured.constraints import ConstraintError

# any character, written so that both dialects (and the library's parser) read it alike
ANY_CHARACTER = f"[\\x00-\\uD7FF\\uE000-{chr(0x10FFFF)}]"

# a pattern written here -> what it stands for: ("not", source) or ("all", sources)
_WRITTEN: "collections.OrderedDict[str, tuple]" = collections.OrderedDict()
_WRITTEN_KEPT = 4096


def referee_match(source: str, text: str) -> bool:
    """Whether the referee (Python's ``re``, a search) finds ``source`` in ``text``; for a pattern written
    here, whether it finds what that pattern stands for (not the pattern complemented, or all of them)."""
    meaning = _WRITTEN.get(source)
    if meaning is None:
        return re.search(source, text) is not None
    if meaning[0] == "not":
        return not referee_match(meaning[1], text)
    return all(referee_match(part, text) for part in meaning[1])


@functools.lru_cache(maxsize=256)
def complement_pattern(source: str):
    """A pattern (search semantics, like every JSON Schema ``pattern``) that matches exactly the strings
    ``source`` matches in neither dialect; ``False`` when it matches every string; None when ``source``
    has a feature read differently or not at all (no complement is sound then)."""
    pattern = _parsed(source, wide=True)
    if pattern is None:
        return None
    tree = patterns.full_match(pattern, search=True)
    with _naming(source):
        dfa = lookaround.dfa([tree] if tree is not None else [])
        return _written(dfa.complement().minimal(), ("not", source))


@functools.lru_cache(maxsize=256)
def intersect_patterns(sources: tuple, wide: bool = False):
    """A pattern matching exactly the strings every one of ``sources`` matches (each read narrow, as the
    engines read it, or ``wide``: in either dialect); ``False`` when no string does; None when one has a
    refused feature."""
    trees = []
    for source in sources:
        pattern = _parsed(source, wide=wide)
        if pattern is None:
            return None
        tree = patterns.full_match(pattern, search=True)
        if tree is None:
            return False
        trees.append(tree)
    with _naming(sources):
        return _written(lookaround.dfa(trees).minimal(), ("all", sources))


@contextlib.contextmanager
def _naming(patterns_built):
    """A cap passed while building ``patterns_built`` (a source, or a tuple of them) names them."""
    try:
        yield
    except Over as passed:
        passed.pattern = patterns_built
        raise


def _parsed(source: str, wide: bool):
    try:
        pattern = patterns.parse(source, wide)
    except ConstraintError:
        return None
    return None if pattern.refused is not None else pattern


def _written(dfa: Dfa, meaning: tuple):
    tree = dfa.expression()
    if tree is None:
        return False
    source = write(tree)
    _WRITTEN[source] = meaning
    _WRITTEN.move_to_end(source)
    while len(_WRITTEN) > _WRITTEN_KEPT:
        _WRITTEN.popitem(last=False)
    return source


# --------------------------------------------------------------------------- text
def write(tree) -> str:
    """``tree`` (sets, sequences, alternations, repetitions) as one anchored pattern, ``^(?:...)$``, that the
    library's parser and Python's ``re`` read alike.

    Raises:
        Over: it would pass ``CAPS["pattern_chars"]`` (measured before writing: state elimination shares
            subtrees, which the text writes out each time).
    """
    over("pattern_chars", _length(tree, {}))
    return f"^(?:{_write(tree)})$"


def _write_code(code: int) -> str:
    char = chr(code)
    if char.isascii() and char.isalnum() or code > 0xFFFF:
        return char
    return f"\\u{code:04x}"


def _count_text(low: int, high) -> str:
    return "*" if (low, high) == (0, None) else "?" if (low, high) == (0, 1) else \
        f"{{{low},}}" if high is None else f"{{{low},{high}}}"


def _length(node, memo: dict) -> int:
    """``len(_write(node))``, each shared subtree measured once (state elimination shares them)."""
    known = memo.get(id(node))
    if known is not None:
        return known
    kind = node[0]
    if kind == "chars":
        size = len(_write(node))
    elif kind == "seq":
        size = sum(_length(child, memo) + (4 if child[0] == "alt" else 0) for child in node[1])
    elif kind == "alt":
        size = sum(_length(child, memo) for child in node[1]) + len(node[1]) - 1
    else:
        size = _length(node[1], memo) + (0 if node[1][0] == "chars" else 4) + len(_count_text(node[2], node[3]))
    memo[id(node)] = size
    return size


def _write(node) -> str:
    kind = node[0]
    if kind == "chars":
        ranges = node[1]
        if len(ranges) == 1 and ranges[0][0] == ranges[0][1]:
            return _write_code(ranges[0][0])
        return "[" + "".join(_write_code(low) if low == high else f"{_write_code(low)}-{_write_code(high)}"
                             for low, high in ranges) + "]"
    if kind == "seq":
        return "".join(f"(?:{_write(child)})" if child[0] == "alt" else _write(child) for child in node[1])
    if kind == "alt":
        return "|".join(_write(child) for child in node[1])
    inner = _write(node[1])
    if node[1][0] != "chars":
        inner = f"(?:{inner})"
    return inner + _count_text(node[2], node[3])
