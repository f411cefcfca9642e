"""The differential soundness check: random schemas from JSON Schema's whole keyword vocabulary,
random instances, each engine against ``jsonschema``.

    from hypothesis import given
    @given(schema_and_instances("untyped"))
    def test(case):
        verdict = differential(engine, *case)     # Verdict: refused, or per instance accepted / valid
        assert not verdict.unsound                # an accepted instance jsonschema calls invalid

``schema_and_instances(region)`` draws a schema from one region of the vocabulary (``REGIONS``:
typed assertions, untyped assertions, combinators, references local and not, arrays and
objects with the applicators engines tend to drop; patterns drawn from a regex grammar covering
the features of ``structured/schema/patterns.py``; combinator branches that carry one half of an
adjacency unit; property names JSON writes with escapes; formats; counts and existentials over an
object's names: ``minProperties``/``maxProperties`` on open objects, ``propertyNames``, ``not`` over
object subschemas, overlapping ``oneOf``, ``dependent*``, ``unevaluated*``; numbers and their spellings,
``numbers.py``) and instances from a small
domain that straddles the schema's limits (so about half are invalid). ``differential`` compiles the schema
with the default policy (``json_schema(schema, strict=False)``: JSON Schema's own semantics)
and teacher-forces every instance, written as ``json.dumps`` writes it (the ``compact``
whitespace), through the engine, and again with its strings written raw (no JSON escapes: a quote,
a backslash, a newline as themselves), which must be refused unless that text is JSON the schema
takes. An engine may refuse a schema; it must never accept an invalid instance of one it
compiled. Valid instances it rejects are counted (over-restriction), not failed.
``regex_differential`` does the same for ``regex(...)`` constraints, judged by ``re.fullmatch``. ``benchmarks/bench_soundness.py`` runs the same check longer.
"""
from __future__ import annotations

import dataclasses
import json
import re
import warnings
import zlib

from hypothesis import strategies as st

from neuron_constrain.structured.constraints import ConstraintError, json_schema, regex
from neuron_constrain.structured.schema.keywords import post_validate
from neuron_constrain.testing.existentials import existentials_case
from neuron_constrain.testing.numbers import numbers_case, spelled
from neuron_constrain.testing.vocabulary import force

REGIONS = ("typed", "untyped", "combinators", "references", "applicators", "patterns", "adjacency", "names",
           "formats", "existentials", "numbers")
TYPES = ("string", "integer", "number", "boolean", "null", "array", "object")
KEYS = ("a", "b", "c")
STRINGS = ("", "a", "ab", "abc", "ba", "a1", "Zz", "2024-01-02", "x@y.z", "a\nb")
NUMBERS = (-2, 0, 1, 2, 3, 4, 6, 0.5, 1.5, 2.5, -0.5, 1.0)
PATTERNS = ("^a", "b", "^[a-z]+$", "^a.$", "[0-9]")
FORMATS = ("date", "email", "uri", "regex", "ipv4", "flag-topic")


def _either(*strategies):
    """One of ``strategies``, each as likely (``st.one_of`` leans on the first ones when derandomized)."""
    return st.sampled_from(strategies).flatmap(lambda strategy: strategy)


def _values(depth: int = 2):
    scalars = _either(st.none(), st.booleans(), st.sampled_from(NUMBERS), st.sampled_from(STRINGS))
    if depth == 0:
        return scalars
    inner = _values(depth - 1)
    return _either(scalars, scalars, st.lists(inner, max_size=3),
                     st.dictionaries(st.sampled_from(KEYS), inner, max_size=3))


VALUES = _values()
_LIMIT = st.integers(0, 3)


def _pick(options: dict):
    """A dict of 1..3 of ``options``' keywords, each with a value drawn from its strategy."""
    return st.lists(st.sampled_from(sorted(options)), min_size=1, max_size=3, unique=True).flatmap(
        lambda names: st.fixed_dictionaries({name: options[name] for name in names}))


def _string():
    return {"minLength": _LIMIT, "maxLength": _LIMIT, "pattern": st.sampled_from(PATTERNS),
            "format": st.sampled_from(FORMATS)}


def _number():
    limit = st.sampled_from(NUMBERS)
    return {"minimum": limit, "maximum": limit, "exclusiveMinimum": limit, "exclusiveMaximum": limit,
            "multipleOf": st.sampled_from((2, 3, 0.5, 1.5))}


def _array(sub):
    return {"items": sub, "prefixItems": st.lists(sub, min_size=1, max_size=2), "minItems": _LIMIT,
            "maxItems": _LIMIT, "uniqueItems": st.booleans(), "contains": sub,
            "unevaluatedItems": st.one_of(st.just(False), sub)}


def _object(sub):
    return {"properties": st.dictionaries(st.sampled_from(KEYS), sub, min_size=1, max_size=2),
            "required": st.lists(st.sampled_from(KEYS), min_size=1, max_size=2, unique=True),
            "additionalProperties": st.one_of(st.booleans(), sub), "patternProperties": st.just({"^a": {"type": "integer"}}),
            "minProperties": _LIMIT, "maxProperties": _LIMIT, "propertyNames": st.just({"maxLength": 1}),
            "dependentRequired": st.just({"a": ["b"]}), "unevaluatedProperties": st.just(False)}


_FAMILY = {"string": "string", "integer": "number", "number": "number", "array": "array", "object": "object"}


def _leaf():
    """A typed scalar schema with assertions of its type (or a bare type, an enum, a const)."""
    typed = st.sampled_from(("string", "integer", "number")).flatmap(
        lambda t: _pick(_string() if t == "string" else _number()).map(lambda a: {"type": t, **a}))
    return _either(typed, st.sampled_from(TYPES).map(lambda t: {"type": t}),
                     st.lists(VALUES, min_size=1, max_size=3).map(lambda v: {"enum": v}),
                     VALUES.map(lambda v: {"const": v}))


def _typed(sub):
    kinds = st.sampled_from(("string", "integer", "number", "array", "object"))

    def build(kind):
        family = {"string": _string(), "integer": _number(), "number": _number(), "array": _array(sub),
                  "object": _object(sub)}[kind]
        type_value = st.one_of(st.just(kind), st.just([kind, "null"]))
        return st.tuples(type_value, _pick(family)).map(lambda pair: {"type": pair[0], **pair[1]})
    plain = kinds.flatmap(build)
    with_literals = st.tuples(plain, st.lists(VALUES, min_size=1, max_size=3)).map(
        lambda pair: {**pair[0], "enum": pair[1]})
    return _either(plain, plain, with_literals)


def _untyped(sub):
    families = st.lists(st.sampled_from(("string", "number", "array", "object")), min_size=1, max_size=2, unique=True)

    def build(names):
        parts = [_pick({"string": _string(), "number": _number(), "array": _array(sub),
                        "object": _object(sub)}[name]) for name in names]
        return st.tuples(*parts).map(lambda ds: {k: v for d in ds for k, v in d.items()})
    bare = families.flatmap(build)
    return _either(bare, st.tuples(bare, st.lists(VALUES, min_size=1, max_size=3)).map(
        lambda pair: {**pair[0], "enum": pair[1]}))


def _combinator(sub):
    branches = st.lists(sub, min_size=1, max_size=3)
    plain = st.tuples(st.sampled_from(("anyOf", "oneOf", "allOf")), branches).map(lambda p: {p[0]: p[1]})
    with_type = st.tuples(st.sampled_from(TYPES), st.sampled_from(("anyOf", "oneOf")), branches).map(
        lambda p: {"type": p[0], p[1]: p[2]})
    return _either(plain, plain, plain, with_type, with_type, sub.map(lambda s: {"not": s}),
                   st.tuples(sub, sub).map(lambda p: {"if": p[0], "then": p[1]}))


def _reference(sub):
    """A ``$ref`` to a definition: local pointers, and the non-local forms of one document."""
    def build(target):
        return st.sampled_from((
            {"$defs": {"d": target}, "$ref": "#/$defs/d"},
            {"$defs": {"d": target}, "type": "object", "properties": {"a": {"$ref": "#/$defs/d"}}},
            {"$defs": {"d": target}, "$ref": "#/$defs/d", "maxLength": 1},
            {"$defs": {"a~b": target}, "$ref": "#/$defs/a~0b"},
            {"$defs": {"a/b": target}, "$ref": "#/$defs/a~1b"},
            {"$id": "https://example.com/root.json", "$defs": {"d": {"$id": "d.json", **target}}, "$ref": "d.json"},
            {"$defs": {"d": {"$anchor": "here", **target}}, "$ref": "#here"},
            {"$id": "urn:example:root", "$defs": {"d": target}, "$ref": "urn:example:root#/$defs/d"},
            {"$defs": {"d": target}, "$ref": "https://example.com/elsewhere.json"},
            {"$dynamicAnchor": "node", "$defs": {"d": target}, "$dynamicRef": "#node"},
        ))
    return sub.flatmap(build)


_SIMPLE = ({}, {"type": "integer"}, {"type": ["string", "null"]})


def _applicators(sub):
    return _either(
        _pick(_array(sub)).map(lambda a: {"type": "array", **a}),
        _pick(_object(sub)).map(lambda a: {"type": "object", **a}),
        st.tuples(st.lists(st.sampled_from(_SIMPLE), min_size=1, max_size=2), st.sampled_from((False, *_SIMPLE))).map(
            lambda p: {"type": "array", "prefixItems": p[0], "unevaluatedItems": p[1]}),
        st.tuples(st.sampled_from(("minProperties", "maxProperties")), _LIMIT).map(
            lambda p: {"type": "object", p[0]: p[1]}),
    )


# --------------------------------------------------------------------------- patterns
# Pieces of ECMA-262 syntax, each a feature of structured/schema/patterns.py (rewritten or refused), with the
# characters that straddle it: a digit or not, a newline or not, a quote, a backslash, a reserved word.
PATTERN_ATOMS = ("a", "b", "1", "_", "-", " ", '"', "\\\\", "\\n", "é", "\\.", "\\/", "\\-", "\\^", "\\$",
                 ".", "[ab]", "[^a]", "[a-c]", "[\\d_]", "[^\\s]", "[[:alpha:]]", "[\\^a]", "[a\\]]", '[^"]',
                 "\\d", "\\D", "\\w", "\\W", "\\s", "\\S", "\\x41", "\\u0062", "\\t", "\\0")
REFUSED_ATOMS = ("\\b", "\\B", "a{,2}", "(?i)a", "\\p{L}", "a*+")  # refused features (a few in ten patterns)
PATTERN_STRINGS = ("", "a", "b", "ab", "ba", "a1", "1", "11", "_", "a b", 'a"b', "a\\b", "a\nb", "\n", "é", "A",
                   "-", "^", "$", ".", "[", "]", ":", "aa", "abc", "admin", "admins", "x", "\r", "\u2028", "a.b")


def _pattern_text(depth: int = 2):
    plain = st.sampled_from(PATTERN_ATOMS)
    atom = _either(*([plain] * 8), st.sampled_from(REFUSED_ATOMS))
    if depth > 0:
        inner = _pattern_text(depth - 1)
        groups = _either(inner.map(lambda p: f"({p})"), inner.map(lambda p: f"(?:{p})"))
        lookaround = _either(inner.map(lambda p: f"(?={p})"), inner.map(lambda p: f"(?!{p})"),
                             inner.map(lambda p: f"(?<=a)({p})\\1"))
        atom = _either(*([atom] * 6), groups, groups, lookaround)
    quantifier = st.sampled_from(("", "", "", "*", "+", "?", "{2}", "{1,2}", "{2,}", "*?", "+?"))
    term = st.tuples(atom, quantifier).map(
        lambda p: p[0] + p[1] if p[0] not in REFUSED_ATOMS[2:] and not p[0].startswith(("(?=", "(?!", "\\b", "\\B"))
        else p[0])
    # an anchor at the edges of a branch, or (rarely) between two of its terms
    anchor = st.sampled_from(("", "", "", "", "", "^", "$"))
    branch = st.tuples(st.sampled_from(("", "", "^")), st.lists(st.tuples(anchor, term), min_size=1, max_size=3),
                       st.sampled_from(("", "", "$"))).map(
        lambda p: p[0] + "".join(a + t if i else t for i, (a, t) in enumerate(p[1])) + p[2])
    return st.lists(branch, min_size=1, max_size=2).map("|".join)


PATTERNS_DRAWN = _pattern_text()


def readable(pattern: str) -> bool:
    """Whether Python's re (the referee) reads ``pattern`` (quietly: its FutureWarnings are ECMA's syntax)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            re.compile(pattern)
            return True
        except re.error:
            return False


def pattern_strings(pattern: str):
    """Strings that straddle ``pattern``'s features: the fixed list, and matches hypothesis draws."""
    fixed = st.lists(st.sampled_from(PATTERN_STRINGS), min_size=6, max_size=6)
    if not readable(pattern):
        return fixed
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        matches = st.lists(st.from_regex(pattern, fullmatch=False).filter(lambda t: "\x00" not in t), max_size=3)
    return st.tuples(fixed, matches).map(lambda p: p[0] + p[1])


def _pattern_case(pattern: str):
    keyed = st.sampled_from(("pattern", "patternProperties", "propertyNames", "patternProperties-closed"))

    def build(pair):
        where, strings = pair
        if where == "pattern":
            return {"type": "string", "pattern": pattern}, strings
        objects = [{s: 1} for s in strings] + [{s: "x"} for s in strings[:3]]
        if where == "propertyNames":
            return {"type": "object", "propertyNames": {"pattern": pattern}}, objects
        closed = {"additionalProperties": False} if where.endswith("closed") else {}
        return {"type": "object", "patternProperties": {pattern: {"type": "integer"}}, **closed}, objects
    return st.tuples(keyed, pattern_strings(pattern)).map(build)


# --------------------------------------------------------------------------- adjacency, names, formats
_UNITS = (("properties", "additionalProperties"), ("patternProperties", "additionalProperties"),
          ("prefixItems", "items"), ("contains", "minContains"), ("contains", "maxContains"), ("if", "then"),
          ("if", "else"), ("dependentRequired", "properties"), ("properties", "unevaluatedProperties"),
          ("prefixItems", "unevaluatedItems"))
_HALVES = {
    "properties": {"a": {"type": "integer"}}, "additionalProperties": False, "patternProperties": {"^b": {"type": "string"}},
    "prefixItems": [{"type": "integer"}], "items": False, "contains": {"type": "string"}, "minContains": 2,
    "maxContains": 1, "if": {"required": ["a"]}, "then": {"required": ["b"]}, "else": {"required": ["c"]},
    "dependentRequired": {"a": ["b"]}, "unevaluatedProperties": False, "unevaluatedItems": False,
}
_ADJACENT_VALUES = ({}, {"a": 1}, {"a": "x"}, {"b": 1}, {"b": "x"}, {"a": 1, "b": 2}, {"c": 1}, {"a": 1, "c": "x"},
                    [], [1], [1, 2], ["x"], [1, "x"], ["x", "y"], [1, "x", "y"], "x", 3)


def _adjacent_case():
    def build(picked):
        (first, second), combinator, swap, other = picked
        outer, inner = ((second, first) if swap else (first, second))
        kind = "array" if {first, second} & {"prefixItems", "items", "contains", "minContains", "maxContains",
                                             "unevaluatedItems"} else "object"
        branch = {inner: _HALVES[inner]}
        branches = [branch] if combinator == "allOf" or not other else [branch, {"type": "string"}]
        return {"type": kind, outer: _HALVES[outer], combinator: branches}
    schema = st.tuples(st.sampled_from(_UNITS), st.sampled_from(("allOf", "anyOf", "oneOf")), st.booleans(),
                       st.booleans()).map(build)
    return st.tuples(schema, st.lists(st.sampled_from(_ADJACENT_VALUES), min_size=8, max_size=8, unique_by=json.dumps))


NAMES = ('a"b', "a\\b", "a\nb", "a\tb", "\x01", "é", "a/b", "~1", "ab", "a")


def _names_case():
    def build(picked):
        names, closed, required = picked
        schema = {"type": "object", "properties": {n: {"type": "integer"} for n in names}}
        if closed is not None:
            schema["additionalProperties"] = closed
        if required:
            schema["required"] = names[:1]
        instances = [{n: v} for n in names + ["z"] for v in (1, "x")] + [{names[0]: 1, "z": "x"}]
        return schema, instances
    return st.tuples(st.lists(st.sampled_from(NAMES), min_size=1, max_size=2, unique=True),
                     st.sampled_from((None, False, {"type": "string"})), st.booleans()).map(build)


FORMAT_STRINGS = ("2024-01-02", "2024-13-40", "2024-01-02T03:04:05Z", "03:04:05Z", "P1D", "x@y.z", 'a"b@y.z',
                  "a\\b@y.z", "example.com", "-bad-", "1.2.3.4", "1.2.3.999", "::1", "http://x/y", "not a uri",
                  "a\nb", "/a/b", "/a~2", "0/a", "{x}", "123e4567-e89b-12d3-a456-426614174000", "[a-", "^a$", "")


def _format_case():
    from neuron_constrain.structured.schema.keywords import STANDARD_FORMATS
    return st.tuples(st.sampled_from(sorted(STANDARD_FORMATS)),
                     st.lists(st.sampled_from(FORMAT_STRINGS), min_size=8, max_size=8, unique=True)).map(
        lambda p: ({"type": "string", "format": p[0]}, p[1]))


_CASES = {"patterns": lambda: PATTERNS_DRAWN.flatmap(_pattern_case), "adjacency": _adjacent_case,
          "names": _names_case, "formats": _format_case, "existentials": existentials_case,
          "numbers": numbers_case}


def schemas(region: str):
    """Schemas from ``region`` of the vocabulary (``REGIONS``), nested up to two levels."""
    if region not in REGIONS:
        raise ValueError(f"region {region!r}: pick one of {REGIONS}")
    if region in _CASES:
        return _CASES[region]().map(lambda case: case[0])
    sub = _either(_leaf(), _typed(_leaf()))
    outer = {"typed": _typed, "untyped": _untyped, "combinators": _combinator, "references": _reference,
             "applicators": _applicators}[region]
    return outer(_either(sub, _untyped(_leaf())) if region != "typed" else sub)


def schema_and_instances(region: str, *, count: int = 12):
    """``(schema, instances)``: the instances mix values near the schema's own literals with random ones
    (the pattern, adjacency, names and formats regions draw instances made for their schemas)."""
    if region in _CASES:
        return _CASES[region]()
    return st.tuples(schemas(region), st.lists(VALUES, min_size=count, max_size=count))


@dataclasses.dataclass
class Verdict:
    """One schema on one engine: refused (the reason), or what happened to each instance."""

    engine: str
    schema: object
    refused: str | None = None
    unsound: list = dataclasses.field(default_factory=list)  # (instance, why jsonschema calls it invalid)
    over_restricted: list = dataclasses.field(default_factory=list)  # valid instances the grammar rejected
    accepted_valid: int = 0


def raw_json(value) -> str:
    """``value`` as ``json.dumps`` writes it, but every string written raw (no escapes): not JSON
    wherever a string holds a quote, a backslash or a control character."""
    if isinstance(value, str):
        return '"' + value + '"'
    if isinstance(value, list):
        return "[" + ", ".join(map(raw_json, value)) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{raw_json(k)}: {raw_json(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)


def repeated_key(value) -> str | None:
    """An object written with its first member twice (``{"a": 1, "a": 1, "b": 2}``): a JSON reader keeps
    one, so a grammar that counts members as written (``minProperties``) must not take it for two."""
    if not isinstance(value, dict) or not value:
        return None
    members = [f"{json.dumps(k, ensure_ascii=False)}: {json.dumps(v, ensure_ascii=False)}" for k, v in value.items()]
    return "{" + ", ".join(members[:1] + members) + "}"


def differential(engine, schema, instances, *, tokenizer=None, strict: bool = False, samples: int = 2) -> Verdict:
    """``schema`` compiled on ``engine`` (default policy), each instance teacher-forced and judged by
    ``jsonschema`` (:func:`keywords.post_validate`: the declared draft, formats asserted); each
    instance's raw spelling (:func:`raw_json`) too, where it differs, its numbers spelled another way
    (``numbers.spelled``), and an object's spelling with a key written twice (:func:`repeated_key`); and
    ``samples`` random walks
    through the grammar's masks (:func:`walks`), judged the same way."""
    verdict = Verdict(engine.name, schema)
    try:
        compiled = engine.compile(json_schema(schema, strict=strict))
    except ConstraintError as error:
        verdict.refused = str(error)
        return verdict
    encode = (tokenizer or engine.tokenizer).encode
    for instance in instances:
        text = json.dumps(instance, ensure_ascii=False)
        why_invalid = post_validate(schema, text)
        if why_invalid is not None and why_invalid.startswith("the schema"):
            verdict.refused = f"jsonschema cannot apply the schema: {why_invalid}"  # an invalid schema: no judge
            return verdict
        accepted = force(engine, compiled, encode(text))
        if accepted and why_invalid is not None:
            verdict.unsound.append((text, why_invalid))
        elif not accepted and why_invalid is None:
            verdict.over_restricted.append(text)
        elif accepted:
            verdict.accepted_valid += 1
        raw = raw_json(instance)
        if raw != json.dumps(instance, ensure_ascii=False, separators=(", ", ": ")) and raw != text:
            why_raw = post_validate(schema, raw)
            if why_raw is not None and force(engine, compiled, encode(raw)):
                verdict.unsound.append((raw, f"raw spelling: {why_raw}"))
        other = spelled(instance, zlib.crc32(text.encode()))  # its numbers written another way, the same values
        if other is not None and other != text:
            why_other = post_validate(schema, other)
            if why_other is not None and force(engine, compiled, encode(other)):
                verdict.unsound.append((other, f"numbers spelled another way: {why_other}"))
        twice = repeated_key(instance)
        if twice is not None:
            why_twice = post_validate(schema, twice)
            if why_twice is not None and force(engine, compiled, encode(twice)):
                verdict.unsound.append((twice, f"a key written twice: {why_twice}"))
    decode = (tokenizer or engine.tokenizer).decode
    for tokens in walks(engine, compiled, samples, seed=zlib.crc32(json.dumps(schema, sort_keys=True).encode())):
        text = decode(tokens)
        why = post_validate(schema, text)
        if why is not None:
            verdict.unsound.append((text, f"a random walk through the mask wrote it: {why}"))
    return verdict


def walks(engine, compiled, count: int, *, seed: int, max_tokens: int = 48) -> list[list[int]]:
    """``count`` random walks through ``compiled``'s masks: each step one allowed token at random
    (a stop token, where allowed, a third of the time); the walks that end within ``max_tokens``.
    What an engine writes this way must be valid: it finds holes no listed instance reaches (an
    escape JSON does not have, a raw control character)."""
    import random

    import torch

    import numpy as np

    rng, stops, done = random.Random(seed), set(engine.stop_token_ids), []
    buffer = torch.zeros((1, engine.width), dtype=torch.int32)
    for _ in range(count):
        matcher, tokens = engine.matcher(compiled), []
        for _ in range(max_tokens):
            if engine.batch_fill([matcher], buffer, [0]):
                break
            bits = np.unpackbits(buffer.numpy().view(np.uint8), bitorder="little")[:engine.vocab_size]
            allowed = np.flatnonzero(bits).tolist()
            if not allowed:
                break
            stop = [t for t in allowed if t in stops]
            token = stop[0] if stop and rng.random() < 1 / 3 else rng.choice(allowed)
            if not matcher.accept_token(token):
                break
            if token in stops:
                done.append(tokens)
                break
            tokens.append(token)
    return done


def regex_differential(engine, pattern: str, strings) -> Verdict:
    """A ``regex(pattern)`` constraint on ``engine``: each string forced, judged by ``re.fullmatch``."""
    verdict = Verdict(engine.name, pattern)
    try:
        referee = re.compile(pattern)
    except re.error as error:
        verdict.refused = f"Python's re cannot read the pattern: {error}"
        return verdict
    try:
        compiled = engine.compile(regex(pattern))
    except ConstraintError as error:
        verdict.refused = str(error)
        return verdict
    for text in strings:
        accepted = bool(text) and force(engine, compiled, engine.tokenizer.encode(text))
        valid = referee.fullmatch(text) is not None
        if accepted and not valid:
            verdict.unsound.append((text, f"re.fullmatch({pattern!r}) does not match"))
        elif valid and not accepted and text:
            verdict.over_restricted.append(text)
        elif accepted:
            verdict.accepted_valid += 1
    return verdict
