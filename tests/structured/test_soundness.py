"""Never silently wrong, found by the test itself: schemas drawn from JSON Schema's whole keyword
vocabulary (``neuron_constrain.testing.schemas``), instances around them, and every engine judged by
``jsonschema``: an instance the grammar accepts must be valid, or the schema must have been refused.

Each region of the vocabulary is its own test, so a hole names its class: assertions on untyped
schemas (``untyped``), ``$ref`` forms that are not plain local pointers (``references``),
``unevaluatedItems`` and other applicators engines drop (``applicators``), combinators, typed
assertions. ``make test-long`` (``--hypothesis-profile=long``) runs ten times the examples;
``benchmarks/bench_soundness.py`` counts refusals and over-restriction as well.
"""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, example, given, settings

from neuron_constrain import structured as S
from neuron_constrain.structured import engines as E
from neuron_constrain.testing import toy_tokenizer
from neuron_constrain.testing.schemas import (PATTERNS_DRAWN, differential, pattern_strings, regex_differential,
                                              schema_and_instances)
from neuron_constrain.testing.vocabulary import force
from tests.conftest import examples

# host-side, the same on every torch: one lane runs it, the latest (the shorter; see the torch_agnostic marker)
pytestmark = pytest.mark.torch_agnostic(lane="latest")


@pytest.fixture(scope="module")
def toy_engines():
    """Every engine choice on a byte-level vocabulary: each instance is a few dozen tokens."""
    vocabulary = toy_tokenizer()
    return {name: E.make_engine(name, vocabulary) for name in E.ENGINE_CHOICES}


SETTINGS = settings(max_examples=examples(40), suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow, HealthCheck.data_too_large])


def _judge(engines, case):
    schema, instances = case
    for name, engine in engines.items():
        verdict = differential(engine, schema, instances)
        assert not verdict.unsound, (  # a class the issue found: the examples above pin one of each
            f"{name} compiled {json.dumps(schema)} and accepted instances jsonschema calls invalid: {verdict.unsound[:3]}")


@SETTINGS
@example(case=({"type": "string", "enum": ["a", 1]}, [1, "a"]))
@example(case=({"type": "number", "multipleOf": 0.5}, [0.3, 1.5]))
@given(case=schema_and_instances("typed"))
def test_typed_assertions_never_accept_an_invalid_instance(toy_engines, case):
    _judge(toy_engines, case)


@SETTINGS
@example(case=({"maxLength": 2}, ["foo", "ab", 5]))
@example(case=({"minimum": 3, "maxItems": 1}, [1, 4, [1, 2], "x"]))
@given(case=schema_and_instances("untyped"))
def test_untyped_assertions_never_accept_an_invalid_instance(toy_engines, case):
    _judge(toy_engines, case)


@SETTINGS
@example(case=({"type": "object", "anyOf": [{"type": ["string", "null"]}]}, [None, "a", {}]))
@example(case=({"not": {"pattern": "^a"}}, [5, "b", "ab"]))  # the complement took every non-string
@example(case=({"type": "object", "oneOf": [{"maxLength": 0, "pattern": "^a"}, {"maxLength": 0, "pattern": "^a"}]},
               [{}, {"c": None}]))
@given(case=schema_and_instances("combinators"))
def test_combinators_never_accept_an_invalid_instance(toy_engines, case):
    _judge(toy_engines, case)


def test_strict_mode_never_makes_overlapping_one_of_branches_disjoint(toy_engines):
    """Strict mode closes the second branch, so llguidance took the branches as disjoint and wrote the enum's
    object; JSON Schema (the schema as sent) finds it valid under both: oneOf refuses it."""
    schema = {"type": "object", "oneOf": [{"enum": [{"a": None, "b": 1}]}, {"type": "object", "required": ["b"]}]}
    for name, engine in toy_engines.items():
        verdict = differential(engine, schema, [{"a": None, "b": 1}, {"b": 2}], strict=True)
        assert not verdict.unsound, (name, verdict.unsound)


@SETTINGS
@example(case=({"$id": "https://example.com/root.json", "$defs": {"d": {"$id": "d.json", "type": "integer"}}, "$ref": "d.json"}, ["x", 1]))
@example(case=({"$defs": {"d": {"$anchor": "here", "type": "integer"}}, "$ref": "#here"}, ["x", 1]))
@example(case=({"$defs": {"a/b": {"type": "integer"}}, "$ref": "#/$defs/a~1b"}, ["x", 1]))
@example(case=({"$ref": "https://example.com/elsewhere.json"}, ["x", 1]))
@example(case=({"$defs": {"a/b": {"type": ["array", "null"], "unevaluatedItems": False, "enum": [[None]]}},
                "$ref": "#/$defs/a~1b"}, ["abc", [], None, [None]]))  # a shared alias, emptied by a rewrite in place
@given(case=schema_and_instances("references"))
def test_references_never_accept_an_invalid_instance(toy_engines, case):
    _judge(toy_engines, case)


@SETTINGS
@example(case=({"type": "array", "prefixItems": [{"type": "integer"}], "unevaluatedItems": False}, [[1, 2], [1]]))
@given(case=schema_and_instances("applicators"))
def test_applicators_never_accept_an_invalid_instance(toy_engines, case):
    _judge(toy_engines, case)


# ---- one level deeper (issue 42): inside patterns, between keywords, names, formats
@SETTINGS
@example(case=({"type": "string", "pattern": "^(?=.*[0-9]).+$"}, ["abc", "a1"]))  # xgrammar dropped the lookahead
@example(case=({"type": "string", "pattern": "^(?!admin$)[a-z]+$"}, ["admin", "admins"]))
@example(case=({"type": "string", "pattern": '^"$'}, ['"', "a"]))  # xgrammar let the quote in raw: not JSON
@example(case=({"type": "string", "pattern": "^[[:alpha:]]$"}, ["a", "a]", ":]"]))  # llguidance: a POSIX class
@example(case=({"type": "object", "propertyNames": {"pattern": "^(?!a)"}}, [{"a": 1}, {"b": 1}]))
@example(case=({"type": "string", "pattern": "b"}, ["abc", "b", "a"]))
@example(case=({"type": "string", "pattern": '[^"]b'}, ['"b', "xb"]))  # llguidance took the escaped quote
@example(case=({"type": "string", "pattern": "^[^\\\\]b$"}, ["\\b", "xb"]))
@example(case=({"type": "string", "pattern": '^[^"]?$(^[^"]?$(^1))'}, ["", "1"]))  # `$` before the last `^`
@example(case=({"type": "string", "pattern": "[^a]?$(?:^[^a]?$(?: ?)?)"}, [":", ""]))  # a `$` dropped with the text before `^`
@given(case=schema_and_instances("patterns"))
def test_patterns_never_accept_an_invalid_instance(toy_engines, case):
    _judge(toy_engines, case)


REGEX_CASES = PATTERNS_DRAWN.flatmap(lambda p: pattern_strings(p).map(lambda strings: (p, strings)))


@SETTINGS
@example(case=("a.b", ["a\nb", "axb"]))  # xgrammar's `.` took a newline
@example(case=("a^b|c", ["ab", "c"]))  # xgrammar ignored the anchor in the middle
@example(case=("[\\^a]", ["b", "^", "a"]))  # xgrammar read a leading \^ in a class as negation
@example(case=("^a?$^b", ["", "b", "ab"]))
@example(case=("\\w\\0+|\"", ["a", "a\x00", '"']))  # xgrammar's from_regex wrote a lone U+0000 as "" (nothing)
@given(case=REGEX_CASES)
def test_regex_constraints_never_accept_what_python_re_refuses(toy_engines, case):
    pattern, strings = case
    for name, engine in toy_engines.items():
        verdict = regex_differential(engine, pattern, strings)
        assert not verdict.unsound, f"{name} compiled regex({pattern!r}) and accepted {verdict.unsound[:3]}"


@SETTINGS
@example(case=({"type": "object", "additionalProperties": False, "allOf": [{"properties": {"a": {}}}]}, [{"a": 1}]))
@example(case=({"type": "array", "items": False, "allOf": [{"prefixItems": [{"type": "integer"}]}]}, [[1], []]))
@example(case=({"type": "object", "allOf": [{"properties": {"a": {}}}], "properties": {"b": {}},
                "additionalProperties": False}, [{"a": 1}, {"b": 2}]))
@example(case=({"type": "object", "dependentRequired": {"a": ["b"]},  # xgrammar merged an allOf holding an anyOf
                "oneOf": [{"properties": {"a": {"type": "integer"}}}, {"type": "string"}]}, [{"a": 1}, ",", {"a": 1, "b": 2}]))
@example(case=({"type": "object", "properties": {"a": {"type": "integer"}}, "propertyNames": {"maxLength": 1}},
               [{"a": "x"}, {"a": 1}, {"bc": 1}]))  # xgrammar dropped properties beside propertyNames
@example(case=({"type": ["object", "null"], "propertyNames": {"maxLength": 1}, "additionalProperties": False},
               [{"a": 1}, {}, None]))
@given(case=schema_and_instances("adjacency"))
def test_adjacent_keywords_never_accept_an_invalid_instance(toy_engines, case):
    _judge(toy_engines, case)


@SETTINGS
@example(case=({"type": "object", "properties": {'a"b': {"type": "integer"}}}, [{'a"b': "x"}, {'a"b': 1}]))
@example(case=({"type": "object", "properties": {"é": {"type": "integer"}}}, [{"é": "x"}, {"é": 1}]))
@given(case=schema_and_instances("names"))
def test_property_names_are_matched_exactly_however_they_are_escaped(toy_engines, case):
    _judge(toy_engines, case)


@SETTINGS
@example(case=({"type": "string", "format": "date"}, ["2024-02-30", "2024-02-29"]))
@example(case=({"type": "string", "format": "ipv4"}, ["01.2.3.4", "1.2.3.4"]))
@given(case=schema_and_instances("formats"))
def test_formats_never_accept_an_invalid_instance(toy_engines, case):
    _judge(toy_engines, case)


def test_no_engine_writes_text_that_is_not_json_for_a_format(toy_engines):
    """Texts no instance reaches (a JSON escape that does not exist, a raw quote): found by random walks
    through xgrammar's own `email` and `json-pointer` grammars, pinned here."""
    for name, engine in toy_engines.items():
        for fmt, text in (("email", '"\\"\\a\\"@x.com"'), ("json-pointer", '"/a"b"'),
                          ("relative-json-pointer", '"0/a"b"')):
            try:
                compiled = engine.compile(S.json_schema({"type": "string", "format": fmt}))
            except S.ConstraintError:
                continue
            assert not force(engine, compiled, engine.tokenizer.encode(text)), (name, fmt, text)


def test_engine_warnings_are_refusals(toy_engines, capfd):
    """What an engine reports it ignores becomes a refusal on that engine, for each kind of message."""
    import xgrammar as xgr

    from neuron_constrain.structured.engines.xgrammar.grammars import reported

    for build, arg, said in ((xgr.Grammar.from_json_schema, {"type": "string", "pattern": "^(?=a).*$"}, "Lookahead"),
                             (xgr.Grammar.from_regex, "a^b", "middle"),
                             (xgr.Grammar.from_json_schema, {"oneOf": [{"type": "integer"}, {"type": "number"}]},
                              "oneOf")):
        with pytest.raises(S.ConstraintError, match="xgrammar would not enforce part of this constraint") as info:
            reported(build, arg)
        assert said in str(info.value)
    reported(xgr.Grammar.from_regex, "a^b", refuse=False)  # unenforced="allow": written back, never swallowed
    assert "middle" in capfd.readouterr().err
    with pytest.raises(S.ConstraintError, match="Unknown format|would not enforce"):
        toy_engines["llguidance"].compile(S.json_schema({"type": "string", "format": "date", "contentEncoding": 1,
                                                         "not": {"format": "email"}}))  # no rewrite expresses it


# ---- rewrites that keep the meaning (rewrite.normalize), each on every engine
def _verdicts(engines, schema, instances):
    return {name: differential(engine, schema, instances) for name, engine in engines.items()}


@pytest.mark.parametrize("schema, valid, invalid", [
    (True, [5, {"a": [1, None]}, "x"], []),
    ({"type": "object", "properties": {"a": True}, "required": ["a"]}, [{"a": 5}, {"a": "x"}], [{}]),
    ({"type": "string", "maxLength": 2.0, "minLength": 1.0}, ["ab", "a"], ["abc", ""]),
    ({"$defs": {"a/b": {"type": "integer"}}, "$ref": "#/$defs/a~1b"}, [1], ["x"]),
    ({"$defs": {"a~b": {"type": "integer"}}, "$ref": "#/$defs/a~0b"}, [1], ["x"]),
    ({"$defs": {'a"b': {"type": "integer"}}, "$ref": "#/$defs/a%22b"}, [1], ["x"]),
    ({"$id": "https://example.com/root.json", "$defs": {"d": {"$id": "d.json", "type": "integer"}}, "$ref": "d.json"},
     [1], ["x"]),
    ({"$defs": {"d": {"$anchor": "here", "type": "integer"}}, "$ref": "#here"}, [1], ["x"]),
    ({"$id": "urn:example:root", "$defs": {"d": {"type": "integer"}}, "$ref": "urn:example:root#/$defs/d"}, [1], ["x"]),
], ids=["true", "true-subschema", "float-limits", "pointer-slash", "pointer-tilde", "pointer-percent", "id-relative",
        "anchor", "urn"])
def test_rewrites_that_keep_the_meaning_compile_and_enforce_on_every_engine(toy_engines, schema, valid, invalid):
    """Each of these was a compile error or a silent hole on some engine; now every engine compiles
    it, takes every valid instance and refuses every invalid one."""
    for name, verdict in _verdicts(toy_engines, schema, valid + invalid).items():
        assert verdict.refused is None, (name, verdict.refused)
        assert not verdict.unsound and not verdict.over_restricted, (name, verdict)
        assert verdict.accepted_valid == len(valid), (name, verdict)


def test_false_schema_and_remote_refs_are_refused_by_name(toy_engines):
    for name, engine in toy_engines.items():
        with pytest.raises(S.ConstraintError, match="it is `false`|`false`: no output is valid"):
            engine.compile(S.json_schema(False))
        with pytest.raises(S.ConstraintError) as info:
            engine.compile(S.json_schema({"$ref": "https://example.com/elsewhere.json#/x"}))
        message = str(info.value)
        assert "https://example.com/elsewhere.json#/x" in message and "never fetched" in message, (name, message)


def test_untyped_assertions_are_exact_on_every_engine(toy_engines):
    """An untyped node's assertions apply to their own type only: xgrammar gets the node split by type
    (``values.split_types``: 5 passes ``maxLength``), not typed by its assertions as it was; neither accepts "abc"."""
    verdicts = _verdicts(toy_engines, {"maxLength": 2}, ["ab", "abc", 5])
    for name in ("xgrammar", "llguidance"):
        assert not verdicts[name].over_restricted and verdicts[name].accepted_valid == 2, name
    assert all(not v.unsound for v in verdicts.values())
    # the string branch is a bounded string: xgrammar writes it with its escapes (at most 64 characters), exact
    assert toy_engines["xgrammar"].compile(S.json_schema({"minimum": 2})).narrowed == ()
    assert toy_engines["xgrammar"].compile(S.json_schema({"maxLength": 2})).narrowed == ()
    assert toy_engines["auto"].compile(S.json_schema({"maxLength": 2})).narrowed == ()
    fallback = toy_engines["auto"].compile(S.json_schema({"properties": {"a": {}}, "minProperties": 1}, strict=False))
    assert fallback.engine == "xgrammar" and fallback.narrowed == ()  # llguidance counts only required names


def test_a_bounded_string_routes_to_the_engine_that_takes_its_escapes(toy_engines):
    """xgrammar writes a bounded string with its escapes up to 64 characters (exact: auto races it as any exact
    schema); past that without escapes (narrower, sound): its compile says so, and auto takes llguidance, which
    accepts the escaped value the schema allows."""
    short = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4}}, "required": ["name"]}
    instances = [{"name": 'a"b'}, {"name": "ab"}, {"name": "abcde"}]
    assert toy_engines["xgrammar"].compile(S.json_schema(short)).narrowed == ()
    verdict = _verdicts({"xgrammar": toy_engines["xgrammar"]}, short, instances)["xgrammar"]
    assert not verdict.over_restricted and verdict.accepted_valid == 2 and not verdict.unsound
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 100}}, "required": ["name"]}
    assert toy_engines["xgrammar"].compile(S.json_schema(schema)).narrowed == ("#/properties/name",)
    verdicts = _verdicts(toy_engines, schema, instances)
    assert verdicts["xgrammar"].over_restricted == ['{"name": "a\\"b"}']
    routed = toy_engines["auto"].compile(S.json_schema(schema))
    assert routed.engine == "llguidance" and routed.narrowed == ()
    assert _verdicts({"auto": toy_engines["auto"]}, schema, [{"name": 'a"b'}])["auto"].accepted_valid == 1
    # as stock vLLM (the plugin): xgrammar's own bounded string (escapes=False) on xgrammar, narrowed and saying so
    as_vllm = E.AutoEngine(toy_tokenizer(), narrow_bounded_strings=True, race=False)  # as the plugin builds it
    kept = as_vllm.compile(S.json_schema(short, escapes=False))
    assert kept.engine == "xgrammar" and kept.narrowed == ("#/properties/name",)
    split = as_vllm.compile(S.json_schema({"maxLength": 2}, escapes=False))  # untyped: split, the string branch bounded
    assert split.engine == "xgrammar" and split.narrowed == ("#/anyOf/0",)


@pytest.mark.parametrize("schema", [{"type": "object", "minProperties": 2},
                                    {"type": "object", "properties": {"b": {}}, "minProperties": 2}])
def test_a_repeated_key_never_counts_twice(toy_engines, schema):
    """xgrammar counts keys as written and may repeat an additional one; a JSON reader keeps one:
    `{"b": 1, "b": 2}` has one property, so at least two is refused there unless the object is closed."""
    text = '{"b": 1, "b": 2}'
    assert len(json.loads(text)) == 1
    for name, engine in toy_engines.items():
        try:
            compiled = engine.compile(S.json_schema(schema, strict=False))
        except S.ConstraintError:
            continue
        assert not force(engine, compiled, engine.tokenizer.encode(text)), f"{name} took a repeated key as two"
    closed = {**schema, "properties": {"a": {}, "b": {}}, "additionalProperties": False}
    compiled = toy_engines["xgrammar"].compile(S.json_schema(closed))
    assert force(toy_engines["xgrammar"], compiled, toy_engines["xgrammar"].tokenizer.encode('{"a": 1, "b": 2}'))
    assert not force(toy_engines["xgrammar"], compiled, toy_engines["xgrammar"].tokenizer.encode(text))


def test_closed_object_names_are_judged_once(toy_engines):
    """`propertyNames` beside `additionalProperties: false` keeps the declared names it takes (the algebra),
    so both engines compile it exactly."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "bc": {}}, "propertyNames": {"maxLength": 1},
              "additionalProperties": False}
    for name in ("xgrammar", "llguidance"):
        verdict = _verdicts({name: toy_engines[name]}, schema, [{"a": 1}, {"bc": 1}, {"a": "x"}, {}])[name]
        assert verdict.refused is None and not verdict.unsound and verdict.accepted_valid == 2, verdict


@pytest.mark.parametrize("table", ["guarantee", "regex"])
def test_the_docs_tables_are_the_lists(table):
    """The engines guide's tables are generated from the allowlists: a list changed without the guide fails here."""
    import pathlib

    from neuron_constrain.structured.schema import keywords as K

    guide = (pathlib.Path(__file__).parents[2] / "docs" / "guides" / "engines.md").read_text()
    copy = guide.split(f"<!-- {table}-table:start -->\n")[1].split(f"\n<!-- {table}-table:end -->")[0]
    assert copy == getattr(K, f"{table}_table")(), "regenerate the table in docs/guides/engines.md: python -c 'from " \
        f"neuron_constrain.structured import keywords as K; print(K.{table}_table())'"


@pytest.mark.parametrize("schema", [{"type": "string", "maxLength": 2}, {"type": "string", "minLength": 2},
                                    {"type": "string", "minLength": 1, "maxLength": 1},
                                    {"type": "string", "maxLength": 100}, {"type": "string", "minLength": 65}])
@pytest.mark.parametrize("escapes", [True, False])
def test_a_bounded_string_on_xgrammar_is_exact_or_narrower_never_wider(schema, escapes):
    """xgrammar's own bounded string takes raw control characters (invalid JSON) and no escape; the library's
    takes JSON's string characters only, counted as code points, with JSON's escapes up to
    ``STRING_CHAIN_COUNTS`` characters (a chain of rules, one per count): exact there. Past it (a class with the
    escapes in it makes xgrammar's fills grow with the bound: 1.9 s a token at maxLength 1024), and everywhere with
    ``escapes=False`` (the vLLM plugin's), the escaped spellings are refused: sound, narrower, listed in
    ``narrowed``."""
    import jsonschema

    from neuron_constrain.structured.engines.xgrammar.grammars import ebnf_accepts, schema_grammar

    text = str(schema_grammar(S.json_schema(schema, escapes=escapes)))
    exact = escapes and max(schema.get("minLength", 0), schema.get("maxLength", 0)) <= 64
    long = "x" * 70
    for value in ["ab", "a", "\n", "\u00e9", "\U0001F600", "\U0001F600x", "abc", "", 'a"b', "\x06", "\\", long,
                  long + '"', long[:-1] + "\t"]:
        valid = jsonschema.Draft202012Validator(schema).is_valid(value)
        raw = json.dumps(value, ensure_ascii=False)
        needs_escape = any(c in value for c in '"\\') or any(ord(c) < 0x20 for c in value)
        assert ebnf_accepts(text, raw) == (valid and (exact or not needs_escape)), (schema, raw, valid)
    assert not ebnf_accepts(text, '"a\x06"') and not ebnf_accepts(text, '"\x06"')  # raw controls: never JSON
    compiled = E.XGrammarEngine(toy_tokenizer()).compile(S.json_schema(schema, escapes=escapes))
    assert compiled.narrowed == (() if exact else ("#",))


def test_formats_as_patterns_compile_and_enforce_on_xgrammar(toy_engines):
    """The formats xgrammar had no sound grammar for compile there now: date and ipv4 exactly, email
    narrowed (a dot-atom address; listed in ``narrowed`` on both engines, which read the same pattern: auto races
    them as for any schema xgrammar takes exactly)."""
    xgrammar = toy_engines["xgrammar"]
    cases = {"date": (["2024-02-29", "2000-02-29", "0001-01-01"], ["2023-02-29", "1900-02-29", "2024-04-31", "0000-01-01"]),
             "ipv4": (["1.2.3.4", "255.0.10.199"], ["01.2.3.4", "256.1.1.1", "1.2.3"])}
    for name, (valid, invalid) in cases.items():
        verdict = differential(xgrammar, {"type": "string", "format": name}, valid + invalid)
        assert verdict.refused is None and not verdict.unsound and not verdict.over_restricted, (name, verdict)
        assert verdict.accepted_valid == len(valid), (name, verdict)
    assert xgrammar.compile(S.json_schema({"type": "string", "format": "date"})).narrowed == ()
    email = {"type": "object", "properties": {"to": {"type": "string", "format": "email"}}}
    assert xgrammar.compile(S.json_schema(email)).narrowed == ("#/properties/to",)
    verdict = differential(xgrammar, email, [{"to": "a.b@example.com"}, {"to": "a@b@c"}, {"to": "nobody"}])
    assert not verdict.unsound and verdict.accepted_valid == 1 and verdict.over_restricted == ['{"to": "a@b@c"}']
    assert toy_engines["llguidance"].compile(S.json_schema(email)).narrowed == ("#/properties/to",)
    assert toy_engines["auto"].compile(S.json_schema(email)).narrowed == ("#/properties/to",)


@SETTINGS
@example(case=({"type": "object", "minProperties": 2}, [{}, {"a": 1}, {"a": 1, "b": 2}]))  # counted on the host
@example(case=({"type": "object", "propertyNames": False, "properties": {"a": {}}}, [{}, {"a": 1}]))
@given(case=schema_and_instances("existentials"))
def test_counts_and_existentials_over_names_never_accept_an_invalid_instance(toy_engines, case):
    _judge(toy_engines, case)
