"""Structured outputs through ``generate()`` on real tokenizers (Tekken 131072, sentencepiece
v3 32768 and v1 32000 from mistral-common) and a tiny random-weight Llama of that vocabulary:
every constraint kind; every answer validates (or, at the token limit, is a prefix its
grammar accepts), no control token inside grammar text, and the text returned is the
tokenizer's decode of the tokens. Plus the async runtime: time limit, compile errors, cache."""
from __future__ import annotations

import json

import pytest
import torch
import xgrammar as xgr

from neuron_constrain import structured as S
from neuron_constrain.kernels import unpack_bitmask
from neuron_constrain.structured.engines.xgrammar.grammars import compile_grammar, xgrammar_info
from neuron_constrain.structured.tokenizers import from_mistral, mistral_data_file
from neuron_constrain.testing import tiny_decoder, weather_tool

# what this file checks is host-side, the same on every torch: the main lane runs it (see the torch_agnostic marker)
pytestmark = pytest.mark.torch_agnostic

BATCH = torch.export.Dim("batch")
MAX_NEW = 24

WEATHER = weather_tool(8)
SEARCH = {
    "type": "function",
    "function": {"name": "search", "parameters": {"type": "object", "properties": {"q": {"type": "string", "maxLength": 6}}, "required": ["q"]}},
}
TOOLS = [WEATHER, SEARCH]
SEARCH_ONLY = {"type": "function", "function": {"name": "search"}}

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["name", "age"]},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
    {"enum": ["small", "medium", "large"]},
    {"type": "object", "properties": {"v": {"anyOf": [{"type": "null"}, {"type": "integer", "minimum": -5, "maximum": 5}]}}, "required": ["v"]},
]


class LastTokenGreedy(torch.nn.Module):
    """Greedy step computing only the last position's logits (8x less lm_head work at 131k)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False, logits_to_keep=1).logits[:, -1].argmax(-1)


def _constraints(tok, name):
    out = [S.json_schema(s) for s in SCHEMAS]
    out += [
        S.json_schema(SCHEMAS[0], whitespace="compact"),
        S.json_schema(SCHEMAS[3], whitespace="bounded"),
        S.any_json(),
        S.regex(r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"),
        S.choice(["yes", "no", "maybe so"]),
        S.ebnf('root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "x"'),
        S.tool_constraint(TOOLS, "required"),
        S.tool_constraint(TOOLS, "required", format="hermes", tokenizer=tok),
        S.tool_constraint(TOOLS, SEARCH_ONLY, format="llama3", tokenizer=tok),
        None,
    ]
    if tok.control_token("[TOOL_CALLS]") is not None:
        out += [S.tool_constraint(TOOLS, "required", format="mistral", tokenizer=tok),
                S.tool_constraint(TOOLS, SEARCH_ONLY, format="mistral", tokenizer=tok)]
    return out


@pytest.fixture(scope="module")
def tokenizers(mistral_tokenizers):
    """Tekken, sentencepiece v3 and v1 (``from_mistral`` of the files mistral-common ships, built
    once per session in conftest), in this order: ``models`` seeds each tiny Llama by it."""
    return {name: mistral_tokenizers[name] for name in ("tekken", "sp3", "sp1")}


@pytest.fixture(scope="module")
def models(tokenizers):
    """One tiny Llama per vocabulary, transformed with the logit mask (dynamic batch, window 8)."""
    ids = torch.zeros(2, 8, dtype=torch.long)
    out = {}
    for seed, (name, tok) in enumerate(tokenizers.items()):
        model = tiny_decoder("llama", vocab_size=tok.vocab_size, hidden_size=32, layers=1, seed=seed)
        out[name] = S.transform_decoder(LastTokenGreedy(model), (ids,), vocab_size=tok.vocab_size, dynamic_shapes=({0: BATCH},))
    return out


@pytest.fixture(scope="module")
def runtimes(tokenizers, models):
    """One runtime per tokenizer, reused by every test (compiled grammars stay cached)."""
    built = {name: S.StructuredRuntime.for_model(models[name], tok, max_rows=24) for name, tok in tokenizers.items()}
    yield built
    for runtime in built.values():
        runtime.close()


def _accepts_prefix(tok, constraint, tokens) -> bool:
    matcher = xgr.GrammarMatcher(compile_grammar(xgr.GrammarCompiler(xgrammar_info(tok.info), max_threads=1), constraint))
    return all(matcher.accept_token(t) for t in tokens)


@pytest.mark.parametrize("name", ["tekken", "sp3", "sp1"])
def test_every_constraint_kind_on_a_real_tokenizer(tokenizers, models, runtimes, name, record_property):
    tok, model, runtime = tokenizers[name], models[name], runtimes[name]
    constraints = _constraints(tok, name)
    prompts = ["Answer:", "Reply in JSON", "{", "call a tool", "x"] * 4
    result = S.generate(model, prompts[: len(constraints)], constraints, MAX_NEW, tokenizer=tok, runtime=runtime)
    controls = tok.special_ids - set(tok.stop_token_ids)
    tool_calls = tok.control_token("[TOOL_CALLS]")
    validated = 0
    for constraint, out in zip(constraints, result.outputs):
        where = (name, constraint.describe() if constraint else None, out.text, out.tokens)
        assert out.finish_reason in ("stop", "length"), where
        body = out.tokens[:-1] if out.finish_reason == "stop" else out.tokens
        # the text returned is the tokenizer's decode, and exactly the pieces the grammar matched
        assert out.text == tok.decode(body) == b"".join(tok.pieces[t] for t in body).decode("utf-8", "replace"), where
        own = tok._decode(body)  # mistral-common's own decode (sentencepiece strips the first piece's space)
        assert own == (out.text[1:] if name != "tekken" and out.text.startswith(" ") else out.text), where
        assert all(t < tok.vocab_size for t in out.tokens), where
        if constraint is None:
            continue
        # no control token inside grammar text (Mistral's call opens with [TOOL_CALLS], by id)
        inside = [t for t in body if t in controls and not (t == tool_calls and constraint.kind == "ebnf" and "Token(" in constraint.spec)]
        assert inside == [], where
        if out.finish_reason == "stop":
            assert S.validate_output(constraint, out.text) is None, (where, S.validate_output(constraint, out.text))
            validated += 1
        else:
            assert len(out.tokens) == MAX_NEW and _accepts_prefix(tok, constraint, out.tokens), where
    mistral = [(c, o) for c, o in zip(constraints, result.outputs) if c is not None and c.kind == "ebnf" and "Token(" in c.spec]
    for constraint, out in mistral:
        assert out.tokens[0] == tool_calls, out.tokens  # structural: nothing before the call
    print(f"\n{name}: {validated}/{sum(c is not None for c in constraints)} validated")
    record_property("validated", validated)
    assert validated >= len(constraints) // 3


def test_runtime_reused_across_generate_calls_hits_the_cache(tokenizers, models, runtimes):
    tok, model, runtime = tokenizers["sp3"], models["sp3"], runtimes["sp3"]
    schema = {"type": "object", "properties": {"k": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["k"]}
    hits, misses = runtime.cache_hits, runtime.cache_misses
    first = S.generate(model, ["a", "b"], [S.json_schema(schema), S.json_schema(dict(schema))], 8, tokenizer=tok, runtime=runtime)
    assert (runtime.cache_hits - hits, runtime.cache_misses - misses) == (1, 1)  # the twin shares one compilation
    second = S.generate(model, ["a"], [S.json_schema(json.loads(json.dumps(schema)))], 8, tokenizer=tok, runtime=runtime)
    assert (runtime.cache_hits - hits, runtime.cache_misses - misses) == (2, 1)
    again, before = second.outputs[0], first.outputs[0]
    if (again.engines, again.moved_at) == (before.engines, before.moved_at):  # auto's race moved both alike:
        assert again.tokens == before.tokens  # same prompt, same grammar, same greedy answer
    assert S.json_schema(schema, whitespace="bounded").key != S.json_schema(schema).key  # options are part of the key


SLOW = {  # bounded strings at 131k tokens: seconds to compile on xgrammar (llguidance refuses minProperties
    "type": "object",  # beside an optional property)
    "properties": {**{f"field_{i}": {"type": "string", "minLength": 1, "maxLength": 30 + i} for i in range(10)},
                   "note": {"type": "string"}},
    "required": [f"field_{i}" for i in range(10)], "minProperties": 1,
}


def test_a_schema_past_its_time_limit_fails_alone(tokenizers, models, runtimes):
    tok, model, runtime = tokenizers["tekken"], models["tekken"], runtimes["tekken"]
    fast = [S.choice(["yes", "no"]), S.regex("[0-9]{1,3}"), None]
    for index, constraint in enumerate(fast):  # compiled beforehand: the batch below reads the cache
        runtime.add(("warm", index), constraint)
    assert runtime.wait([("warm", i) for i in range(3)], timeout=60)
    for index in range(3):
        runtime.remove(("warm", index))
    runtime.add("slow-direct", S.json_schema(SLOW), timeout=0.001)
    assert runtime.ready(["slow-direct"]) == []  # add() returned before the compilation finished
    runtime.remove("slow-direct")
    result = S.generate(model, ["a", "b", "c", "d"], [S.json_schema(SLOW)] + fast, 6, tokenizer=tok, runtime=runtime,
                        compile_timeout=0.05)
    slow, *others = result.outputs
    assert slow.finish_reason == "error" and slow.tokens == []
    assert "did not compile within 0.05 s" in slow.error and "\n" not in slow.error
    for constraint, out in zip(fast, others):
        assert out.finish_reason in ("stop", "length") and out.tokens, out
        if constraint is not None and out.finish_reason == "stop":
            assert S.validate_output(constraint, out.text) is None


def test_vocab_size_disagreeing_with_the_graph_is_refused(tokenizers, models):
    with pytest.raises(ValueError, match=r"transformed with vocab_size=32768 but the tokenizer info has 32000 tokens"):
        S.StructuredRuntime.for_model(models["sp3"], tokenizers["sp1"], max_rows=1)  # same mask width, 768 tokens apart
    padded = from_mistral(mistral_data_file("tokenizer.model.v1"), vocab_size=32768)
    S.StructuredRuntime.for_model(models["sp3"], padded, max_rows=1).close()  # padding: never text, accepted


def test_a_compile_error_fails_alone_with_one_clean_line(tokenizers, models, runtimes):
    tok, model, runtime = tokenizers["sp1"], models["sp1"], runtimes["sp1"]
    bad = S.json_schema({"type": "object", "properties": {"a": {"type": "strin"}}})
    result = S.generate(model, ["a", "b"], [bad, S.choice(["ok"])], 4, tokenizer=tok, runtime=runtime)
    assert result.outputs[0].finish_reason == "error"
    message = result.outputs[0].error
    assert 'Unsupported type "strin"' in message and "\n" not in message
    assert ".cc:" not in message and "/project" not in message and not message.startswith("[")
    assert result.outputs[1].text == "ok" and result.outputs[1].finish_reason == "stop"
    runtime.add("bad", bad)
    runtime.wait(["bad"], timeout=30)
    assert isinstance(runtime.error("bad"), S.GrammarFailedError)
    mask = runtime.step(["bad"])  # scheduled anyway: its row allows only the stop token, and no one else's fails
    assert unpack_bitmask(mask, tok.vocab_size)[0].nonzero().flatten().tolist() == [tok.eos_id]
    assert runtime.accept_rows(["bad"], [tok.eos_id]).failed == {"bad": runtime.error("bad")}
    runtime.remove("bad")


def test_teacher_forced_mistral_common_tool_call_encoding(tokenizers, runtimes):
    """mistral-common's own encoding of an assistant tool call is accepted, token by token,
    by the "mistral" required grammar; the auto parser lifts the call from the tokens."""
    from mistral_common.protocol.instruct.messages import AssistantMessage, ToolMessage, UserMessage
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.protocol.instruct.tool_calls import Function, FunctionCall, Tool, ToolCall
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    for name, file in [("tekken", "tekken_240911.json"), ("sp3", "mistral_instruct_tokenizer_240323.model.v3")]:
        tok, runtime = tokenizers[name], runtimes[name]
        mt = MistralTokenizer.from_file(mistral_data_file(file))
        tools = [Tool(function=Function(name=t["function"]["name"], description="", parameters=t["function"]["parameters"])) for t in TOOLS]
        call = ToolCall(id="abcdefghi", function=FunctionCall(name="get_weather", arguments='{"location": "Paris", "unit": "celsius"}'))
        messages = [UserMessage(content="Weather in Paris?"), AssistantMessage(tool_calls=[call]),
                    ToolMessage(tool_call_id="abcdefghi", name="get_weather", content="20C"), UserMessage(content="Rome?")]
        tokens = mt.encode_chat_completion(ChatCompletionRequest(messages=messages, tools=tools)).tokens
        start = tokens.index(tok.control_token("[TOOL_CALLS]"))
        answer = tokens[start:tokens.index(tok.eos_id, start) + 1]  # the assistant turn, as mistral-common encodes it
        assert answer[0] == tok.control_token("[TOOL_CALLS]") and answer[-1] == tok.eos_id
        runtime.add(("forced", name), S.tool_constraint(TOOLS, "required", format="mistral", tokenizer=tok))
        for token in answer:  # each token allowed by the row the runtime fills
            mask = runtime.step([("forced", name)])
            assert (int(mask[0, token // 32]) >> (token % 32)) & 1, (name, token, tok.names[token])
            runtime.accept(("forced", name), [token])
        assert runtime.finished(("forced", name))
        runtime.remove(("forced", name))
        content, calls = S.parse_tool_calls("", TOOLS, "auto", format="mistral", tokens=answer[:-1], tokenizer=tok)
        assert content == "" and [(c.name, c.arguments) for c in calls] == [("get_weather", {"location": "Paris", "unit": "celsius"})]
        text = "Let me check."
        content, calls = S.parse_tool_calls("", TOOLS, "auto", format="mistral", tokens=tok.encode(text) + answer[:-1], tokenizer=tok)
        assert content == "Let me check." and calls[0].name == "get_weather"
        # free text before the call is refused by the required grammar
        runtime.add(("free", name), S.tool_constraint(TOOLS, "required", format="mistral", tokenizer=tok))
        mask = runtime.step([("free", name)])
        allowed = [t for t in range(tok.vocab_size) if (int(mask[0, t // 32]) >> (t % 32)) & 1]
        assert allowed == [tok.control_token("[TOOL_CALLS]")]
        runtime.remove(("free", name))


def test_huggingface_tokenizer_through_generate(tokenizers, models):
    """The Hugging Face route (fast tokenizer of the v3 sentencepiece model) drives the same model."""
    import os
    import shutil
    import tempfile

    import transformers

    folder = tempfile.mkdtemp()
    try:
        shutil.copy(mistral_data_file("mistral_instruct_tokenizer_240323.model.v3"), os.path.join(folder, "tokenizer.model"))
        hf = transformers.AutoTokenizer.from_pretrained(folder)
    finally:
        shutil.rmtree(folder)
    tok = S.from_huggingface(hf)
    constraints = [S.json_schema(SCHEMAS[0], whitespace="compact"), S.regex(r"[a-z]{2,6}"), S.choice(["yes", "no"]),
                   S.tool_constraint(TOOLS, "required", format="mistral", tokenizer=tok)]
    result = S.generate(models["sp3"], ["Answer:", "x", "y", "tool"], constraints, 12, tokenizer=tok)
    for constraint, out in zip(constraints, result.outputs):
        body = out.tokens[:-1] if out.finish_reason == "stop" else out.tokens
        assert out.text == hf.decode([hf.convert_tokens_to_ids("a")] + body, skip_special_tokens=True)[1:], out
        assert [t for t in body if t in tok.special_ids and t != tok.control_token("[TOOL_CALLS]")] == []
        if out.finish_reason == "stop":
            assert S.validate_output(constraint, out.text) is None, (constraint.describe(), out.text)
        else:
            assert _accepts_prefix(tok, constraint, out.tokens)
    assert result.outputs[3].tokens[0] == tok.control_token("[TOOL_CALLS]") == 5


@pytest.mark.parametrize("format", ["hermes", "llama3", "json"])
def test_tool_formats_accept_the_canonical_call_and_parse_auto(tokenizers, runtimes, format):
    tok, runtime = tokenizers["tekken"], runtimes["tekken"]
    key = "parameters" if format == "llama3" else "arguments"
    call = {"name": "get_weather", key: {"location": "Paris", "unit": "celsius"}}
    body = json.dumps(call)
    text = {"hermes": f"<tool_call>\n{body}\n</tool_call>", "llama3": body, "json": json.dumps([call])}[format]
    choice = "required" if format != "llama3" else {"type": "function", "function": {"name": "get_weather"}}
    constraint = S.tool_constraint(TOOLS, choice, format=format, tokenizer=tok)
    runtime.add(("canon", format), constraint)
    for token in tok.encode(text) + [tok.eos_id]:  # teacher forcing: each token allowed by its row
        mask = runtime.step([("canon", format)])
        assert (int(mask[0, token // 32]) >> (token % 32)) & 1, (format, tok.names[token])
        runtime.accept(("canon", format), [token])
    assert runtime.finished(("canon", format))
    runtime.remove(("canon", format))
    assert S.validate_output(constraint, text) is None
    assert S.validate_output(constraint, "Sure! " + text) is not None  # free text before the call: not a call
    content, calls = S.parse_tool_calls("Let me look. " + text + " Done.", TOOLS, "auto", format=format)
    assert content == "Let me look.  Done." and [(c.name, c.arguments) for c in calls] == [("get_weather", call[key])]
    bad = text.replace("Paris", "Paris, France, Europe")  # maxLength 8
    assert S.validate_output(constraint, bad) is not None
