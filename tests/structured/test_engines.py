"""Both grammar engines behind one mask contract, on the real Tekken tokenizer (131072 ids):
every constraint kind through ``generate``, masks compared row by row, speculative rows,
finished requests, errors, and the EBNF -> Lark conversion for llguidance."""
from __future__ import annotations

import json

import pytest
import torch
from jsonschema import Draft202012Validator

from neuron_constrain import structured as S
from neuron_constrain.structured import engines as E
from neuron_constrain.structured.engines.xgrammar.grammars import root_as_definition
from neuron_constrain.structured.schema.rewrite import walk
from neuron_constrain.kernels import unpack_bitmask
from neuron_constrain.testing import GreedyStep, force, tiny_decoder, weather_tool

# what this file checks is host-side, the same on every torch: the main lane runs it (see the torch_agnostic marker)
pytestmark = pytest.mark.torch_agnostic

BATCH = torch.export.Dim("batch")
WEATHER = weather_tool(8)
GRAMMAR = 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "x" | "\\u00e9"'


@pytest.fixture(scope="module")
def model(tekken):
    step = GreedyStep(tiny_decoder("llama", vocab_size=tekken.vocab_size, hidden_size=32, layers=1, seed=3))
    ids = torch.zeros(2, 6, dtype=torch.long)
    return S.transform_decoder(step, (ids,), vocab_size=tekken.vocab_size, dynamic_shapes=({0: BATCH},))


def _prefix_ok(xgrammar_engine, constraint, tekken, tokens) -> bool:
    """The tokens are a prefix of some output of ``constraint``: a fresh xgrammar matcher takes each
    one and its mask allows it (xgrammar allows any tokenization; llguidance would refuse a
    non-canonical tokenization of forced text, so it is not the judge of xgrammar's outputs)."""
    return force(xgrammar_engine, xgrammar_engine.compile(constraint), tokens, stop=False)


def _all_kinds(tekken):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
              "maximum": 99}, "tag": {"enum": ["a", "b"]}}, "required": ["ok", "n", "tag"], "additionalProperties": False}
    return [
        S.json_schema(schema),
        S.any_json(),
        S.regex(r"[a-z]{2,5}@[a-z]{2,4}\.com"),
        S.choice(["yes", "no", 'say "hi"', "café"]),
        S.ebnf(GRAMMAR),
        S.tool_constraint([WEATHER], "required"),
        S.tool_constraint([WEATHER], {"type": "function", "function": {"name": "get_weather"}}),
        *(S.tool_constraint([WEATHER], "required", format=f, tokenizer=tekken) for f in ("mistral", "hermes", "llama3")),
    ]


# Of _all_kinds, those whose every output is short (bounded strings, enums, fixed keys, one named
# call): they must finish in the budget. Any JSON, the EBNF list and "required" (any number of
# calls) can go on.
BOUNDED = {0, 2, 3, 6}


@pytest.mark.parametrize("engine", E.ENGINES)
def test_every_kind_through_generate(model, tekken, engines, engine):
    """Every kind runs through generate on the engine: an output is valid, or (for kinds that
    can go on forever: any JSON, a repeating EBNF list) a valid prefix at the token limit."""
    constraints = _all_kinds(tekken)
    runtime = S.StructuredRuntime.for_model(model, tekken, max_rows=len(constraints), engine=engine)
    try:
        result = S.generate(model, ["answer:"] * len(constraints), constraints, 64, tokenizer=tekken, runtime=runtime)
    finally:
        runtime.close()
    for index, (constraint, out) in enumerate(zip(constraints, result.outputs)):
        assert out.finish_reason in ("stop", "length"), (constraint.describe(), out.error)
        named = {tekken.eos_id, tekken.control_token("[TOOL_CALLS]")}  # control tokens a grammar may name
        assert not any(t in tekken.special_ids and t not in named for t in out.tokens), out.tokens
        if index in BOUNDED:
            assert out.finish_reason == "stop", (engine, constraint.describe(), out.text)
        if out.finish_reason == "stop":
            assert S.validate_output(constraint, out.text) is None, (engine, constraint.describe(), out.text)
        else:  # a valid prefix
            assert _prefix_ok(engines["xgrammar"], constraint, tekken, out.tokens), (engine, constraint.describe(), out.text)


# Schemas where neither engine forces text: llguidance tokenizes forced text canonically
# (after `{` with a required key it allows only `{"`), xgrammar allows every tokenization. Where an
# integer is read, xgrammar also takes its integral spellings (`2.0`, `-0`: engines guide, "Integers") and
# llguidance spells it plainly: there xgrammar's mask holds llguidance's, and the rest agrees.
AGREE = [
    ({"type": "array", "items": {"type": "number"}}, [1.5, -0.25, 3e5, 7]),
    ({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 300}, "maxItems": 4}, [0, 250, 17]),
    ({"enum": ["red", "green", "blue", 3, None, True]}, "green"),
    ({"type": "string", "pattern": "^[a-z]{2,4}-[0-9]+$"}, "ab-12"),
    ({"type": "array", "items": {"type": "boolean"}, "maxItems": 3}, [True, False]),
    ({"type": "boolean"}, False),
    ({"anyOf": [{"type": "integer"}, {"type": "null"}, {"type": "array", "items": {"type": "number"}}]}, [2.5]),
    ({"type": ["integer", "null"]}, 42),
]


# Schemas recursing into their root, with texts Tekken writes with one token closing several nested values
# (``]]``, ``}}}``, ``]}``): xgrammar 0.2.8's mask refused that token (its matcher took it) until the root was moved
# into ``$defs`` (``grammars.root_as_definition``).
ROOT_RECURSIVE = [
    ({"type": "array", "items": {"anyOf": [{"type": "integer"}, {"$ref": "#"}]}},
     ["[[1]]", "[1, [2, [3]]]", "[[[]]]"], ['[["a"]]', "[[1, null]]"]),
    ({"type": "object", "properties": {"child": {"$ref": "#"}}, "additionalProperties": False},
     ['{"child": {"child": {}}}', '{"child": {"child": {"child": {}}}}'], ['{"child": {"other": {}}}']),
    ({"$defs": {"leaf": {"type": "integer"}}, "type": "object", "additionalProperties": False,
      "properties": {"v": {"$ref": "#/$defs/leaf"}, "kids": {"type": "array", "items": {"$ref": "#"}}}},
     ['{"kids": [{"kids": [{"v": 1}]}]}', '{"kids": [{"kids": []}]}'], ['{"kids": [{"v": "1"}]}']),
]


@pytest.mark.parametrize("schema, valid, invalid", ROOT_RECURSIVE, ids=["array", "object", "beside-defs"])
def test_recursion_into_the_root_masks_the_token_that_closes_nested_values(tekken, engines, schema, valid, invalid):
    judge = Draft202012Validator(schema)
    assert all(judge.is_valid(json.loads(t)) for t in valid) and not any(judge.is_valid(json.loads(t)) for t in invalid)
    pieces = {tekken.decode([t]).strip() for text in valid for t in tekken.encode(text)}
    assert pieces & {"]]", "}}}", "]}"}, pieces  # a token closing several values, as the model writes them
    moved = root_as_definition(schema)
    refs = [node["$ref"] for _, node in walk(moved) if "$ref" in node]
    assert moved["$ref"] == "#/$defs/ncroot" and all(ref.startswith("#/$defs/") for ref in refs), refs
    for name, engine in engines.items():
        compiled = engine.compile(S.json_schema(schema))
        assert all(force(engine, compiled, tekken.encode(t)) for t in valid), name
        assert not any(force(engine, compiled, tekken.encode(t)) for t in invalid), name
    plain = {"type": "array", "items": {"$ref": "#/$defs/n"}, "$defs": {"n": {"type": "integer"}}}
    assert root_as_definition(plain) is plain  # no reference into the root: the schema as it was


ASSERTING_NOTHING = [  # (schema, valid, invalid): parts that assert nothing, which xgrammar's policy refused
    ({"$defs": {"unused": {"type": "string", "pattern": "^a"}}, "type": "string", "maxLength": 2}, ['"bc"'], ['"bcd"']),
    ({"$defs": {"used": {"$ref": "#/$defs/inner"}, "inner": {"type": "string", "pattern": "^a"},
                "unused": {"pattern": "^b"}}, "$ref": "#/$defs/used"}, ['"ab"'], ['"ba"']),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False,
      "patternProperties": {}}, ['{"a": 1}'], ['{"b": 1}']),
]


@pytest.mark.parametrize("schema, valid, invalid", ASSERTING_NOTHING, ids=["unused-defs", "reached-defs", "no-patterns"])
def test_what_asserts_nothing_compiles_on_xgrammar(tekken, engines, schema, valid, invalid):
    """A definition no `$ref` reaches (xgrammar drops it, and the markers of its patterns with it, which read as a
    pattern dropped) and an empty `patternProperties` (no name matched) assert nothing: xgrammar compiles the
    schema, and enforces the rest."""
    for name, engine in engines.items():
        compiled = engine.compile(S.json_schema(schema))
        assert all(force(engine, compiled, tekken.encode(t)) for t in valid), name
        assert not any(force(engine, compiled, tekken.encode(t)) for t in invalid), name


@pytest.mark.parametrize("schema, instance", AGREE, ids=[json.dumps(s)[:40] for s, _ in AGREE])
def test_engines_masks_agree_row_by_row(tekken, engines, schema, instance):
    constraint = S.json_schema(schema)
    matchers = {n: e.matcher(e.compile(constraint)) for n, e in engines.items()}
    buffers = {n: torch.zeros((2, e.width), dtype=torch.int32) for n, e in engines.items()}
    tokens = tekken.encode(json.dumps(instance, ensure_ascii=False)) + [tekken.eos_id]
    for step, token in enumerate(tokens):
        for name, engine in engines.items():
            engine.batch_fill([matchers[name]], buffers[name], [1])
        x, g = buffers["xgrammar"][1], buffers["llguidance"][1]
        if "integer" in json.dumps(schema):
            assert torch.equal(x & g, g), (step, tekken.decode(tokens[:step]), int((g & ~x).sum()))
        else:
            assert torch.equal(x, g), (step, tekken.decode(tokens[:step]), int((x != g).sum()))
        assert all(m.accept_token(token) for m in matchers.values()), step
    assert all(m.is_terminated() for m in matchers.values())


@pytest.mark.parametrize("engine", E.ENGINES)
@pytest.mark.parametrize("threads", [1, 2])
def test_batch_fill_on_threads_writes_each_matchers_own_row(tekken, engine, threads):
    """Many rows at different states, filled by the engine's batch fill (1 or 2 threads, rows in
    a shuffled order): each row equals that matcher's own fill."""
    filler = E.make_engine(engine, tekken, fill_threads=threads)
    try:
        matchers = []
        for (schema, instance) in AGREE * 2:
            tokens = tekken.encode(json.dumps(instance, ensure_ascii=False))
            matcher = filler.matcher(filler.compile(S.json_schema(schema)))
            assert all(matcher.accept_token(t) for t in tokens[: len(matchers) % len(tokens)])
            matchers.append(matcher)
        rows = [(7 * i) % len(matchers) for i in range(len(matchers))]
        assert sorted(rows) == list(range(len(matchers)))
        batch = torch.zeros((len(matchers), filler.width), dtype=torch.int32)
        filler.batch_fill(matchers, batch, rows)
        one = torch.zeros((1, filler.width), dtype=torch.int32)
        for matcher, row in zip(matchers, rows):
            matcher.fill_next_token_bitmask(one, 0)
            assert torch.equal(batch[row], one[0]), row
        assert len({tuple(r.tolist()) for r in batch}) >= 8  # distinct states: a row mix-up would show
    finally:
        filler.close()


@pytest.mark.parametrize("constraint", [
    S.regex(r"(19|20)[0-9]{2}-[01][0-9]"), S.choice(["red", "green", "blue"]), S.ebnf('root ::= [0-9]+ ("." [0-9]+)?'),
], ids=["regex", "choice", "ebnf"])
def test_regex_choice_ebnf_masks_agree(tekken, engines, constraint):
    text = {"regex": "2024-07", "choice": "green", "ebnf": "12.5"}[constraint.kind]
    matchers = {n: e.matcher(e.compile(constraint)) for n, e in engines.items()}
    buffers = {n: torch.zeros((1, e.width), dtype=torch.int32) for n, e in engines.items()}
    for step, token in enumerate(tekken.encode(text) + [tekken.eos_id]):
        for name, engine in engines.items():
            engine.batch_fill([matchers[name]], buffers[name], [0])
        assert torch.equal(buffers["xgrammar"], buffers["llguidance"]), (constraint.kind, step)
        assert all(m.accept_token(token) for m in matchers.values())


def test_speculative_rows_and_finished_are_the_same(model, tekken):
    """Draft rows (fill, accept draft, fill, roll back), a refused draft, a drafted stop token,
    and a finished request's stop-only rows: the same buffer from both engines."""
    # numbers, not integers: xgrammar also takes an integer's integral spellings (`1.0`), llguidance does not
    constraint = S.json_schema({"type": "array", "items": {"type": "number"}, "maxItems": 3})
    text = tekken.encode("[1, 22]")
    bad = tekken.encode("x")[0]
    rows = {}
    for engine in E.ENGINES:
        runtime = S.StructuredRuntime.for_model(model, tekken, max_rows=12, engine=engine)
        try:
            runtime.add("a", constraint)
            runtime.add("b", constraint)
            runtime.wait(["a", "b"])
            first = runtime.step(["a", "b"], drafts={"a": text[:3], "b": [text[0], bad, text[1]]}).clone()
            assert runtime.accept("a", text) is False           # drafts + bonus accepted, not finished
            assert runtime.accept("a", [tekken.eos_id]) is True  # stop token: finished
            second = runtime.step(["a", "b"], drafts={"b": text[:2]}).clone()
            runtime.accept("b", text)
            third = runtime.step(["b"], drafts={"b": [tekken.eos_id, text[0]]}).clone()
            with pytest.raises(S.DisallowedTokenError):
                runtime.accept("a", [text[0]])                   # finished: only stop tokens
            assert runtime.finished("a") and not runtime.finished("b")
        finally:
            runtime.close()
        rows[engine] = (first, second, third)
    for x, g in zip(rows["xgrammar"], rows["llguidance"]):
        assert torch.equal(x, g)
    first, second, third = rows["xgrammar"]
    stop_only = first.new_zeros(first.shape[1])
    stop_only[tekken.eos_id // 32] = 1 << (tekken.eos_id % 32)
    assert torch.equal(second[0], stop_only)                 # finished request: stop only
    assert torch.equal(first[5], first[6])                    # past a refused draft: the refusing row repeats
    assert torch.equal(third[1], stop_only)                   # after a drafted stop token


def test_matcher_contract_after_stop_token(tekken, engines):
    """Accepting a stop token terminates; rollback(1) undoes it; a refused token leaves no trace."""
    for name, engine in engines.items():
        matcher = engine.matcher(engine.compile(S.regex("[0-9]+")))
        assert not matcher.accept_token(tekken.encode("x")[0]), name
        for token in tekken.encode("12"):
            assert matcher.accept_token(token), name
        assert not matcher.is_terminated()
        assert matcher.accept_token(tekken.eos_id) and matcher.is_terminated(), name
        matcher.rollback(1)
        assert not matcher.is_terminated()
        assert matcher.accept_token(tekken.encode("3")[0]), name   # the grammar goes on from "12"
        choice = engine.matcher(engine.compile(S.choice(["ok"])))   # llguidance stops before EOS here
        assert choice.accept_token(tekken.encode("ok")[0])
        assert choice.accept_token(tekken.eos_id) and choice.is_terminated()
        choice.rollback(2)
        assert not choice.is_terminated() and choice.accept_token(tekken.encode("ok")[0]), name


@pytest.mark.parametrize("engine", E.ENGINES)
def test_errors_are_one_clean_line(engines, engine):
    for bad in (S.regex("(unclosed"), S.json_schema({"$ref": "#/definitions/missing"}), S.ebnf("root ::= (")):
        with pytest.raises(S.ConstraintError) as info:
            engines[engine].compile(bad)
        message = str(info.value)
        assert "\n" not in message and engine in message, message
    with pytest.raises(ValueError, match="pick one of auto, xgrammar, llguidance"):
        E.make_engine("outlines", None)


def test_ebnf_lookaheads_dropped_and_builtins_refused_on_llguidance(tekken, engines):
    grammar = S.ebnf('root ::= item "b"\nitem ::= "a"+ (="b")')
    compiled = {n: e.compile(grammar) for n, e in engines.items()}
    for text in ("ab", "aaab", "b", "aa"):
        verdicts = {n: force(e, compiled[n], tekken.encode(text)) for n, e in engines.items()}
        assert verdicts["xgrammar"] == verdicts["llguidance"] == (text in ("ab", "aaab")), (text, verdicts)
    with pytest.raises(S.ConstraintError, match="not defined.*engine='xgrammar'"):
        engines["llguidance"].compile(S.ebnf("root ::= basic_string"))
    with pytest.raises(S.ConstraintError, match="engine='xgrammar'"):
        engines["llguidance"].compile(S.ebnf('root ::= TagDispatch(("<a>", r))\nr ::= "x"'))


EBNF_CASES = [
    (GRAMMAR, ["(1,x,é)", "(x)", "(1,", "()", "(12)"]),
    ('root ::= ("a" | "a" "b") "b"', ["ab", "abb", "abbb", "b"]),  # needs context-free, not greedy, lexing
    ('root ::= [a-c\\-]{2,3} "@" [^\\n"]* # comment\n', ["ab@", "-c@xy z", "a@", 'ab@"']),
    ('root ::= obj\nobj ::= "{" ws (pair ("," ws pair)*)? "}"\npair ::= [a-z]+ ":" [0-9]+ ws\nws ::= [ \\t]*',
     ["{}", "{ a:1 ,b:22}", "{a:}", "{a:1,}"]),
    ('root ::= "\\x41" [\\u0061-\\u0063]+ "\\t"?', ["Aab", "Aab\t", "A", "Ad"]),
]


@pytest.mark.parametrize("grammar, texts", EBNF_CASES, ids=range(len(EBNF_CASES)))
def test_ebnf_to_lark_accepts_exactly_what_xgrammar_accepts(tekken, engines, grammar, texts):
    constraint = S.ebnf(grammar)
    compiled = {n: e.compile(constraint) for n, e in engines.items()}
    for text in texts:
        verdicts = {n: force(e, compiled[n], tekken.encode(text)) for n, e in engines.items()}
        assert verdicts["xgrammar"] == verdicts["llguidance"], (text, verdicts, E.ebnf_to_lark(grammar))
    assert any(force(engines["xgrammar"], compiled["xgrammar"], tekken.encode(t)) for t in texts)


def test_lark_conversion_names_rules_and_refuses_duplicates():
    lark = E.ebnf_to_lark('root ::= item-x+\nitem-x ::= "a" [b-c]')
    assert lark.splitlines() == ["start: r_item_x_1 +", 'r_item_x_1: ("a") /[\\x{62}-\\x{63}]/']
    with pytest.raises(S.ConstraintError, match="defined twice"):
        E.ebnf_to_lark('root ::= "a"\nroot ::= "b"')


def test_llguidance_needs_the_tokenizer_not_a_bare_info(tekken):
    with pytest.raises(ValueError, match="needs the tokenizer itself"):
        S.StructuredRuntime(tekken.info, max_rows=1, engine="llguidance")


@pytest.mark.parametrize("name", ["tokenizer.model.v1", "mistral_instruct_tokenizer_240323.model.v3"])
def test_llguidance_forces_text_without_sentencepiece_dummy_prefix(mistral_tokenizers, name):
    """After "f" a boolean must go on "alse": llguidance forces the canonical tokens of that
    text, which a sentencepiece encode would start with a dummy-prefix space (" al" "se")."""
    tok = mistral_tokenizers[{"tokenizer.model.v1": "sp1", "mistral_instruct_tokenizer_240323.model.v3": "sp3"}[name]]
    step = GreedyStep(tiny_decoder("llama", vocab_size=tok.vocab_size, hidden_size=32, layers=1, seed=3))
    model = S.transform_decoder(step, (torch.zeros(2, 6, dtype=torch.long),), vocab_size=tok.vocab_size,
                                dynamic_shapes=({0: BATCH},))
    engine = E.make_engine("llguidance", tok)
    matcher = engine.matcher(engine.compile(S.json_schema({"type": "boolean"})))
    assert matcher.accept_token(tok.encode("\nf")[-1])  # the piece "f", no leading space
    buffer = torch.zeros((1, engine.width), dtype=torch.int32)
    engine.batch_fill([matcher], buffer, [0])
    from neuron_constrain.kernels import unpack_bitmask

    allowed = unpack_bitmask(buffer, tok.vocab_size)[0].nonzero().flatten().tolist()
    assert allowed and all(tok.info.decoded_vocab[i] in (b"a", b"al", b"als", b"alse") for i in allowed), \
        [tok.info.decoded_vocab[i] for i in allowed]
    result = S.generate(model, ["Answer:", "Pick:"], [S.json_schema({"type": "boolean"}), S.choice(["yes", "no"])],
                        8, tokenizer=tok, engine="llguidance")
    assert [o.finish_reason for o in result.outputs] == ["stop", "stop"]
    assert result.outputs[0].text in ("true", "false") and result.outputs[1].text in ("yes", "no")


# ----------------------------------------------------------------------------- the engine contract (base.py)


class _Failing:
    """A matcher whose fill raises: one request's broken grammar."""

    def fill_next_token_bitmask(self, buffer, row=0):
        raise RuntimeError("this grammar is broken")


@pytest.mark.parametrize("name", E.ENGINE_CHOICES)
def test_engine_contract(tekken, name):
    """What base.py promises, run against each engine: rows refused before any write, mask and
    accept agree, refused tokens leave no trace, stop and rollback, batch failures per row."""
    engine = E.make_engine(name, tekken)
    try:
        compiled = engine.compile(S.json_schema({"type": "object", "properties": {"a": {"type": "integer"}},
                                                 "required": ["a"]}))
        matcher = engine.matcher(compiled)
        parent = torch.full((4, engine.width), 7, dtype=torch.int32)
        view = parent[:2]
        for buffer, row in [(view, 2), (view, -1), (parent, 4)]:  # past the view writes into its parent
            with pytest.raises((ValueError, RuntimeError), match="out of bounds|outside the buffer"):
                matcher.fill_next_token_bitmask(buffer, row)
            with pytest.raises(ValueError, match="outside the buffer"):
                engine.batch_fill([matcher], buffer, [row])
        for bad in (torch.zeros((2, engine.width), dtype=torch.int64), torch.zeros((2, engine.width + 1), dtype=torch.int32),
                    torch.zeros((engine.width, 2), dtype=torch.int32).t()):
            with pytest.raises(ValueError):
                engine.batch_fill([matcher], bad, [0])
        assert bool((parent == 7).all()), "a refused fill wrote into the buffer"

        one = torch.zeros((1, engine.width), dtype=torch.int32)
        text = tekken.encode('{"a": 12}')
        for step, token in enumerate(text + [tekken.eos_id]):
            assert engine.batch_fill([matcher], one, [0]) == []
            allowed = unpack_bitmask(one, tekken.vocab_size)[0]
            assert bool(allowed[token]), step
            ids = allowed.nonzero().flatten().tolist()
            refused = (~allowed).nonzero().flatten().tolist()
            for probe in ids[:: max(1, len(ids) // 20)] + [tekken.eos_id]:  # mask and accept agree
                if bool(allowed[probe]) != matcher.accept_token(probe):
                    raise AssertionError(f"{name}: token {probe} allowed={bool(allowed[probe])} at step {step}")
                if bool(allowed[probe]):
                    matcher.rollback(1)
            for probe in refused[:: max(1, len(refused) // 20)]:
                assert not matcher.accept_token(probe), (name, step, probe)  # and a refusal leaves no trace
            assert matcher.accept_token(token), (name, step)
        assert matcher.is_terminated()
        matcher.rollback(1)
        assert not matcher.is_terminated() and matcher.accept_token(tekken.eos_id)

        rows = torch.zeros((3, engine.width), dtype=torch.int32)
        fresh = [engine.matcher(compiled) for _ in range(2)]
        failures = engine.batch_fill([fresh[0], _Failing(), fresh[1]], rows, [0, 1, 2])
        assert [i for i, _ in failures] == [1] and "broken" in str(failures[0][1])
        assert torch.equal(rows[0], rows[2]) and bool(rows[0].any()) and not bool(rows[1].any())
    finally:
        engine.close()


def test_llguidance_dead_end_allows_nothing_rather_than_a_stop_token_it_refuses(tekken, engines):
    """llguidance's mask allows EOS in an error state, where its matcher refuses EOS: the wrapper
    clears such stop bits, so the row is empty (the graph flags it) and mask and accept agree."""
    engine = engines["llguidance"]
    matcher = engine.matcher(engine.compile(S.regex("ab")))
    matcher.inner.consume_token(tekken.encode("x")[0])  # llguidance's own dead end: an error state
    assert matcher.inner.is_error()
    buffer = torch.zeros((1, engine.width), dtype=torch.int32)
    assert engine.batch_fill([matcher], buffer, [0]) == []
    assert not bool(buffer.any()), unpack_bitmask(buffer, tekken.vocab_size)[0].nonzero().flatten().tolist()
    assert not matcher.accept_token(tekken.eos_id)


def test_rows_checked_once_per_fill_still_refuse_every_bad_buffer(tekken):
    """The row checks run once per fill (``batch_fill``: ``check_rows``, then ``_fill_checked``;
    auto no longer checks again in each engine, llguidance's matcher not again after its
    engine): every bad buffer or row is still refused with the ValueError before a write, for
    llguidance's raw-pointer writes alone and among xgrammar's rows in auto (without the race, so that
    xgrammar's matchers are in the batch)."""
    auto = E.AutoEngine(tekken, race=False)
    try:
        keys = auto.compile(S.json_schema({"type": "object", "properties": {"x": {"type": "number", "multipleOf": 0.5}}}))
        plain = auto.compile(S.json_schema({"type": "array", "items": {"type": "integer"}}))
        assert (keys.engine, plain.engine) == ("llguidance", "xgrammar")
        width = auto.width
        parent = torch.full((4, width), 7, dtype=torch.int32)
        bad = [(parent[:2], [2]), (parent[:2], [-1]), (parent, [4]),
               (torch.full((2, width), 7, dtype=torch.int64), [0]), (torch.full((2, width + 1), 7, dtype=torch.int32), [0]),
               (torch.full((width, 2), 7, dtype=torch.int32).t(), [0]), (torch.full((4, width), 7, dtype=torch.int32)[::2], [1]),
               (torch.full((width,), 7, dtype=torch.int32), [0]), ([[7] * width], [0])]
        for engine, compiled in ((auto, keys), (auto.llguidance, keys), (auto, plain)):
            for mixed in (False, True):
                matchers = [engine.matcher(compiled)] + ([auto.matcher(plain)] if mixed and engine is auto else [])
                for buffer, rows in bad:
                    rows = rows + [0] * (len(matchers) - 1)
                    with pytest.raises(ValueError, match="mask buffer|outside the buffer"):
                        engine.batch_fill(matchers, buffer, rows)
                    if isinstance(buffer, torch.Tensor) and buffer.dtype == torch.int32:
                        assert bool((buffer == 7).all()), "a refused fill wrote into the buffer"
        assert bool((parent == 7).all())
        # llguidance's stop-bit clearing reuses its view of a buffer: a view made on parent[:2] is not
        # used past its end when the same memory comes back with more rows (remade, the row still cleared)
        llg = auto.llguidance
        dead = llg.matcher(llg.compile(S.regex("ab")))
        dead.inner.consume_token(tekken.encode("x")[0])  # an error state, whose llguidance mask allows EOS
        for buffer, row in ((parent[:2], 1), (parent, 3), (parent[:1], 0)):
            parent.fill_(-1)
            assert llg.batch_fill([dead], buffer, [row]) == []
            assert not bool(parent[row].any()) and bool((parent[[r for r in range(4) if r != row]] == -1).all())
    finally:
        auto.close()


def test_auto_takes_xgrammar_where_it_enforces_everything_and_llguidance_for_the_rest(tekken):
    """The route (without the race: with it, what xgrammar takes starts on llguidance, test_race.py)."""
    engine = E.AutoEngine(tekken, race=False)
    try:
        plain = engine.compile(S.json_schema({"type": "array", "items": {"type": "integer"}}))
        keys = engine.compile(S.json_schema({"type": "object", "properties": {"x": {"type": "number", "multipleOf": 0.5}}}))
        tag = engine.compile(S.tool_constraint([WEATHER], "required", format="hermes", tokenizer=tekken))
        assert (plain.engine, keys.engine, tag.engine) == ("xgrammar", "llguidance", "xgrammar")
        assert not keys.unenforced  # llguidance enforces a fractional multipleOf
        with pytest.raises(S.ConstraintError, match="xgrammar"):  # neither takes it: both reasons
            engine.compile(S.json_schema({"anyOf": [{"type": "array", "contains": {"type": "string"}},
                                                    {"type": "array", "maxItems": 40}]}))
        matchers = [engine.matcher(c) for c in (plain, keys, plain)]
        rows = torch.zeros((3, engine.width), dtype=torch.int32)
        assert engine.batch_fill(matchers, rows, [2, 0, 1]) == []  # both engines' matchers in one batch
        for compiled, row in zip((plain, keys), (2, 0)):
            own = E.make_engine(compiled.engine, tekken)
            one = torch.zeros((1, own.width), dtype=torch.int32)
            own.matcher(own.compile(compiled.constraint)).fill_next_token_bitmask(one, 0)
            assert torch.equal(rows[row], one[0]), compiled.engine
        assert torch.equal(rows[1], rows[2])
    finally:
        engine.close()


@pytest.mark.parametrize("format", ["json", "hermes", "mistral"])
def test_parallel_tool_calls_false_allows_exactly_one_call(tekken, engines, format):
    """tool_choice="required": two calls pass by default (OpenAI's parallel_tool_calls=True) and are
    refused by the mask, on both engines, with parallel_tool_calls=False; one call passes both ways."""
    call = {"name": "get_weather", "arguments": {"location": "Paris", "unit": "celsius"}}
    body = json.dumps(call)
    one, two = {
        "json": (json.dumps([call]), json.dumps([call, call])),
        "hermes": (f"<tool_call>\n{body}\n</tool_call>", f"<tool_call>\n{body}\n</tool_call>\n<tool_call>\n{body}\n</tool_call>"),
        "mistral": (json.dumps([call]), json.dumps([call, call])),
    }[format]
    prefix = [tekken.control_token("[TOOL_CALLS]")] if format == "mistral" else []
    for parallel in (True, False):
        constraint = S.tool_constraint([WEATHER], "required", format=format, tokenizer=tekken, parallel_tool_calls=parallel)
        for name, engine in engines.items():
            compiled = engine.compile(constraint)
            assert force(engine, compiled, prefix + tekken.encode(one)), (format, parallel, name)
            assert force(engine, compiled, prefix + tekken.encode(two)) == parallel, (format, parallel, name)
        if format == "hermes":  # the validator agrees with the grammar
            assert (S.validate_output(constraint, two) is None) == parallel


SURROGATE = b"\xed\xa0\x80"  # U+D800's three bytes: no UTF-8 (a reader decodes three replacement characters)


@pytest.mark.parametrize("constraint, before, after", [
    (S.json_schema({"type": "string", "maxLength": 1}, strict=False), '"', '"'),  # found by bench_soundness
    (S.json_schema({"type": "string", "maxLength": 100}, strict=False), '"', '"'),
    (S.json_schema({"type": "string"}, strict=False), '"', '"'),
    (S.json_schema({"type": "object", "properties": {"a": {}}}, strict=False), '{"a": "', '"}'),  # an untyped value
    (S.any_json(), '["', '"]'),
], ids=["maxLength 1", "maxLength 100", "string", "untyped", "any json"])
def test_no_engine_writes_a_surrogate_inside_a_string(engines, constraint, before, after):
    """xgrammar 0.2.8's string classes took an encoded surrogate as one character; ``é`` in its place is taken."""
    for name, engine in engines.items():
        tokenizer, compiled = engine.tokenizer, engine.compile(constraint)
        pieces = tokenizer.info.decoded_vocab
        for text, allowed in ((SURROGATE, False), ("é".encode(), True)):
            tokens = [*tokenizer.encode(before), *(pieces.index(bytes([byte])) for byte in text), *tokenizer.encode(after)]
            assert force(engine, compiled, tokens) is allowed, (name, text)
