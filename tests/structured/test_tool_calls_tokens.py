"""Tool-call families on a real vocabulary (Tekken, from mistral-common's files): control tokens matched as
tokens, random walks through the masks parse into valid calls, and generated tokens parse back."""
import json
import random

import jsonschema
import numpy
import pytest
import xgrammar as xgr

from neuron_constrain.structured import ConstraintError, parse_tool_calls, tool_constraint
from neuron_constrain.structured.engines.xgrammar.grammars import xgrammar_info
from neuron_constrain.structured.tokenizers import from_mistral, mistral_data_file
from neuron_constrain.structured.tool_calls.families import ToolCall

pytestmark = pytest.mark.torch_agnostic(lane="latest")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"unit": {"type": "string", "enum": ["c", "f"]}, "days": {"type": "integer"},
                                     "city": {"type": "string", "maxLength": 4}},
    "required": ["unit"], "additionalProperties": False}}}
SHORT = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"unit": {"type": "string", "enum": ["c", "f"]}, "days": {"type": "integer"}},
    "required": ["unit"], "additionalProperties": False}}}
PING = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def tekken_v11(tmp_path_factory):
    """Tekken with the control tokens v11+ files define at ranks 32 and 33 ([ARGS], [CALL_ID])."""
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer

    data = json.load(open(mistral_data_file("tekken_240911.json")))
    specials = [{"rank": s["rank"], "token_str": str(getattr(s["token_str"], "value", s["token_str"])), "is_control": True}
                for s in Tekkenizer.DEPRECATED_SPECIAL_TOKENS]
    specials += [{"rank": r, "token_str": f"<SPECIAL_{r}>", "is_control": True} for r in range(20, 32)]
    specials += [{"rank": 32, "token_str": "[ARGS]", "is_control": True},
                 {"rank": 33, "token_str": "[CALL_ID]", "is_control": True}]
    data["special_tokens"], data["config"]["version"] = specials, "v11"
    path = tmp_path_factory.mktemp("tekken") / "tekken_v11.json"
    path.write_text(json.dumps(data))
    return from_mistral(str(path))


def _walk(tokenizer, constraint, seed: int, limit: int = 120) -> list[int] | None:
    """A random walk through the masks: an allowed token at each step (stop when allowed), None if unfinished."""
    info = xgrammar_info(tokenizer.info)
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info, max_threads=1).compile_grammar(constraint.spec))
    bitmask, rng, out = xgr.allocate_token_bitmask(1, info.vocab_size), random.Random(seed), []
    for _ in range(limit):
        if matcher.is_terminated():
            return out
        matcher.fill_next_token_bitmask(bitmask)
        bits = numpy.unpackbits(bitmask[0].numpy().view(numpy.uint8), bitorder="little")[:info.vocab_size]
        allowed = numpy.flatnonzero(bits).tolist()
        token = tokenizer.eos_id if bits[tokenizer.eos_id] else rng.choice(allowed)
        assert matcher.accept_token(token)
        out.append(token)
    return None


def _finished_walks(tokenizer, constraint, seeds: int) -> list[list[int]]:
    """The walks of seeds ``0..seeds-1`` that finished within the limit; at least one must."""
    walks = [w for w in (_walk(tokenizer, constraint, seed) for seed in range(seeds)) if w is not None]
    assert walks, f"none of {seeds} random walks finished"
    return walks


def _valid(calls, tools) -> None:
    parameters = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for call in calls:
        jsonschema.validate(call.arguments, parameters[call.name])


@pytest.mark.parametrize("version", ["v7", "v11"])
def test_mistral_walks_parse_into_valid_calls(tekken, tekken_v11, version):
    tok = tekken if version == "v7" else tekken_v11
    tools = [WEATHER, PING]
    constraint = tool_constraint(tools, "required", format="mistral", tokenizer=tok)
    for tokens in _finished_walks(tok, constraint, 3):
        assert tokens[0] == tok.control_token("[TOOL_CALLS]")
        body = tokens[:-1]
        content, calls = parse_tool_calls("", tools, "required", format="mistral", tokens=body, tokenizer=tok)
        assert content == "" and calls
        _valid(calls, tools)


def test_mistral_v11_spelling_is_matched_as_tokens(tekken_v11):
    tok = tekken_v11
    args, calls_token = tok.control_token("[ARGS]"), tok.control_token("[TOOL_CALLS]")
    assert (calls_token, args) == (9, 32)
    tokens = [calls_token, *tok.encode("get_weather"), args, *tok.encode('{"unit": "c"}'),
              calls_token, *tok.encode("ping"), args, *tok.encode("{}")]
    constraint = tool_constraint([WEATHER, PING], "required", format="mistral", tokenizer=tok)
    info = xgrammar_info(tok.info)
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info, max_threads=1).compile_grammar(constraint.spec))
    assert all(matcher.accept_token(t) for t in tokens) and matcher.accept_token(tok.eos_id)
    assert parse_tool_calls("", [WEATHER, PING], "required", format="mistral", tokens=tokens, tokenizer=tok)[1] == [
        ToolCall("get_weather", {"unit": "c"}), ToolCall("ping", {})]
    call_id = tok.control_token("[CALL_ID]")  # v13 writes [CALL_ID] and 9 letters or digits after the name
    with_id = tokens[:tokens.index(args)] + [call_id, *tok.encode("a1B2c3D4e")] + tokens[tokens.index(args):]
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info, max_threads=1).compile_grammar(constraint.spec))
    assert all(matcher.accept_token(t) for t in with_id) and matcher.accept_token(tok.eos_id)
    assert parse_tool_calls("", [WEATHER, PING], "required", format="mistral", tokens=with_id, tokenizer=tok)[1] == [
        ToolCall("get_weather", {"unit": "c"}), ToolCall("ping", {})]
    spelled = xgr.GrammarMatcher(xgr.GrammarCompiler(info, max_threads=1).compile_grammar(constraint.spec))
    assert not spelled.accept_string("[TOOL_CALLS]")  # the name spelled as text is not the control token
    one = tool_constraint([WEATHER, PING], "required", format="mistral", tokenizer=tok, parallel_tool_calls=False)
    single = xgr.GrammarMatcher(xgr.GrammarCompiler(info, max_threads=1).compile_grammar(one.spec))
    first = tokens[:tokens.index(calls_token, 1)]
    assert all(single.accept_token(t) for t in first) and not single.accept_token(calls_token)


@pytest.mark.parametrize("format", ["hermes", "qwen3_coder", "pythonic", "llama3_json"])
def test_text_families_walk_on_tekken_into_valid_calls(tekken, format):
    tools = [SHORT, PING]
    constraint = tool_constraint(tools, "required", format=format, tokenizer=tekken, max_tool_calls=2)
    for tokens in _finished_walks(tekken, constraint, 2):
        content, calls = parse_tool_calls(tekken.decode(tokens[:-1]), tools, "required", format=format)
        assert content == "" and 1 <= len(calls) <= 2
        _valid(calls, tools)


def test_mistral_auto_dispatches_on_the_control_token(tekken):
    constraint = tool_constraint([WEATHER], "auto", format="mistral", tokenizer=tekken)
    info = xgrammar_info(tekken.info)
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info, max_threads=1).compile_grammar(constraint.spec))
    tokens = tekken.encode("Let me check.") + [tekken.control_token("[TOOL_CALLS]")] + tekken.encode(
        '[{"name": "get_weather", "arguments": {"unit": "f"}}]')
    assert all(matcher.accept_token(t) for t in tokens) and matcher.accept_token(tekken.eos_id)
    content, calls = parse_tool_calls("", [WEATHER], "auto", format="mistral", tokens=tokens, tokenizer=tekken)
    assert content == "Let me check." and calls == [ToolCall("get_weather", {"unit": "f"})]
    with pytest.raises(ConstraintError, match="needs a tokenizer"):
        tool_constraint([WEATHER], "auto", format="mistral")


SPECIAL = {  # each family's control tokens, special as that model's tokenizer defines them
    "kimi_k2": ["<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                "<|tool_call_argument_begin|>", "<|tool_call_end|>"],
    "harmony": ["<|channel|>", "<|constrain|>", "<|message|>", "<|call|>", "<|start|>"],
    "llama3_json": ["<|python_tag|>"],
}


@pytest.fixture(scope="module")
def smollm2_with_controls():
    """SmolLM2's tokenizer with the control tokens of Kimi K2, gpt-oss (harmony) and Llama 3 added as special."""
    from transformers import AutoTokenizer

    from neuron_constrain.models import smollm2_dir
    from neuron_constrain.structured import from_huggingface

    hf = AutoTokenizer.from_pretrained(str(smollm2_dir()))
    hf.add_special_tokens({"additional_special_tokens": [t for names in SPECIAL.values() for t in names]})
    return hf, from_huggingface(hf)


@pytest.mark.parametrize("format", ["kimi_k2", "harmony", "llama3_json"])
def test_control_tokens_are_matched_as_tokens(smollm2_with_controls, format):
    hf, tok = smollm2_with_controls
    assert all(tok.control_token(name) is not None for name in SPECIAL[format])
    from neuron_constrain.structured.tool_calls.families import FAMILIES, write_calls

    calls = [ToolCall("get_weather", {"unit": "c", "days": 2}), ToolCall("ping", {})]
    text = write_calls(FAMILIES[format], calls)
    if format == "llama3_json":
        text = "<|python_tag|>" + text
    tokens = hf.encode(text)
    assert {tok.control_token(name) for name in SPECIAL[format]} & set(tokens)
    constraint = tool_constraint([SHORT, PING], "required", format=format, tokenizer=tok)
    info = xgrammar_info(tok.info)
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    matcher = xgr.GrammarMatcher(compiler.compile_grammar(constraint.spec))
    assert all(matcher.accept_token(t) for t in tokens) and matcher.accept_token(tok.eos_id)
    assert not xgr.GrammarMatcher(compiler.compile_grammar(constraint.spec)).accept_string(text[:12])  # spelled as text
    assert parse_tool_calls("", [SHORT, PING], "required", format=format, tokens=tokens, tokenizer=tok) == ("", calls)


@pytest.mark.parametrize("version", ["v7", "v11"])
def test_mistral_tokens_stream_into_the_whole_parsers_calls(tekken, tekken_v11, version):
    """Generated tokens, spelled with their control tokens (``spelled_text``), fed token by token to the stream."""
    from neuron_constrain.structured import ToolCallStream
    from neuron_constrain.structured.tool_calls.families import FAMILIES, write_calls
    from neuron_constrain.structured.tool_calls.parse import spelled_text
    from neuron_constrain.structured.tool_calls.stream import assembled

    tok = tekken if version == "v7" else tekken_v11
    family = FAMILIES["mistral" if version == "v7" else "mistral_v11"]
    calls = [ToolCall("get_weather", {"unit": "c", "days": 1}), ToolCall("ping", {})]
    tokens = tok.encode("Sure. ")
    for piece in write_calls(family, calls).replace("[TOOL_CALLS]", "\0[TOOL_CALLS]\0").replace(
            "[ARGS]", "\0[ARGS]\0").split("\0"):
        tokens += [tok.control_token(piece)] if piece in ("[TOOL_CALLS]", "[ARGS]") else tok.encode(piece)
    stream, deltas = ToolCallStream([SHORT, PING], "auto", format="mistral", tokenizer=tok), []
    for end in range(1, len(tokens) + 1):  # each step: the text the tokens so far spell, less what was fed
        deltas += stream.feed(spelled_text(tokens[:end], tok, family)[len(stream.text):])
    deltas += stream.finish()
    whole = parse_tool_calls("", [SHORT, PING], "auto", format="mistral", tokens=tokens, tokenizer=tok)
    assert assembled(deltas) == whole == ("Sure.", calls)


@pytest.mark.parametrize("special", [True, False], ids=["special", "added-as-text"])
def test_auto_free_text_never_takes_the_trigger_token(special):
    """hermes ``auto`` where ``<tool_call>`` is one token, special or added, and the engine's token table (vLLM's,
    ``TokenizerInfo.from_huggingface``) reads its text as text. Either way the token opens a call and free text
    never spells it (the grammar once let the vLLM lane's model repeat the token as free text, never opening a
    call)."""
    from transformers import AutoTokenizer

    from neuron_constrain.models import smollm2_dir
    from neuron_constrain.structured import from_huggingface
    from neuron_constrain.structured.tool_calls.families import FAMILIES, write_calls

    hf = AutoTokenizer.from_pretrained(str(smollm2_dir()))
    tags = ["<tool_call>", "</tool_call>"]
    hf.add_special_tokens({"additional_special_tokens": tags}) if special else hf.add_tokens(tags)
    tok = from_huggingface(hf)
    trigger = hf.convert_tokens_to_ids("<tool_call>")
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=tok.info.vocab_size)  # as vLLM builds it: the
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_grammar(                 # token's text is text
        tool_constraint([SHORT], "auto", format="hermes", tokenizer=tok).spec)
    prose = hf.encode("Sure. ", add_special_tokens=False)
    answer = hf.encode("Sure. " + write_calls(FAMILIES["hermes"], [ToolCall("get_weather", {"unit": "c"})]),
                       add_special_tokens=False)
    assert trigger in answer
    matcher = xgr.GrammarMatcher(compiled)
    assert all(matcher.accept_token(t) for t in answer) and matcher.accept_token(tok.eos_id)
    matcher = xgr.GrammarMatcher(compiled)
    assert all(matcher.accept_token(t) for t in prose) and matcher.accept_token(trigger)
    assert not any(matcher.accept_token(t) for t in [trigger, *prose])  # after the trigger, the call: no text
    matcher = xgr.GrammarMatcher(compiled)
    assert all(matcher.accept_token(t) for t in prose) and matcher.accept_token(tok.eos_id)  # text alone answers
