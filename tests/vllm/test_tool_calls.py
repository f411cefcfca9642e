"""Tool calls through the real ``openai`` client, on the shared plugin server (tiny model, ``--tool-call-parser
hermes``, ``--tool-strict-level parameter``): ``required`` / named / ``auto`` strict, streamed and not with equal
calls, ``parallel_tool_calls=false`` held by the grammar, tools with ``response_format``; and, in process, the
parser -> family table (``policy.PARSER_FAMILIES``, ``validate.install_tool_calls``) with its 400 for a parser that has no family."""
from __future__ import annotations

import json

import jsonschema
import pytest

from checks import SCHEMAS, TOOLS, check_tool_calls

MODEL = "tiny"
MSG = [{"role": "user", "content": "Give me the answer."}]
TOOL_CALL_TOKEN = "32000"  # <tool_call> in the tiny model's vocabulary (tiny_checkpoint.py)
SAMPLING = dict(temperature=0, max_tokens=96, frequency_penalty=1.5, tools=TOOLS)
NAMED = {"type": "function", "function": {"name": "search"}}


@pytest.fixture(scope="module")
def server(plugin_server):
    return plugin_server


def unstreamed(server, **kwargs):
    choice = server.client().chat.completions.create(model=MODEL, messages=MSG, **kwargs).choices[0]
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []]
    return choice, calls


def streamed(server, **kwargs):
    """The stream's tool-call deltas assembled as the ``openai`` client's users do: by ``index``, the name
    once, the argument fragments concatenated."""
    calls, content, finish = {}, [], None
    for chunk in server.client().chat.completions.create(model=MODEL, messages=MSG, stream=True, **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        finish = chunk.choices[0].finish_reason or finish
        content.append(delta.content or "")
        for part in delta.tool_calls or []:
            call = calls.setdefault(part.index, {"name": "", "arguments": ""})
            if part.function is not None:
                call["name"] += part.function.name or ""
                call["arguments"] += part.function.arguments or ""
    assembled = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]
    return "".join(content), assembled, finish


@pytest.mark.parametrize("tool_choice", ["required", NAMED, "auto"], ids=["required", "named", "auto"])
def test_calls_are_strict_and_equal_streamed_or_not(server, tool_choice):
    bias = {TOOL_CALL_TOKEN: 100} if tool_choice == "auto" else None  # auto: the random model opens a call
    kwargs = dict(SAMPLING, tool_choice=tool_choice, logit_bias=bias, parallel_tool_calls=False)
    choice, calls = unstreamed(server, **kwargs)
    names = ["search"] if tool_choice == NAMED else None
    check_tool_calls(choice.message, choice.finish_reason, names=names)
    # OpenAI's finish reason for a named choice is "stop"
    assert choice.finish_reason == ("stop" if tool_choice == NAMED else "tool_calls") and len(calls) == 1
    assert not (choice.message.content or "").strip(), choice.message.content  # calls only, no free text
    content, stream_calls, finish = streamed(server, **kwargs)
    assert stream_calls == calls and finish == choice.finish_reason, (stream_calls, calls, finish)


def test_auto_without_a_trigger_is_free_text(server):
    choice, calls = unstreamed(server, **dict(SAMPLING, max_tokens=16), tool_choice="auto")
    assert choice.message.content and not calls
    content, stream_calls, _ = streamed(server, **dict(SAMPLING, max_tokens=16), tool_choice="auto")
    assert content == choice.message.content and not stream_calls


def test_parallel_tool_calls_false_is_held_in_the_grammar(server):
    """The same push towards another ``<tool_call>`` gives several calls with parallel calls allowed and
    exactly one without: the grammar, not a parser dropping the rest, holds the limit."""
    # "13": the newline byte token, the separator between two hermes blocks (Qwen's template writes one)
    push = dict(SAMPLING, tool_choice="required", logit_bias={TOOL_CALL_TOKEN: 30, "13": 5}, max_tokens=160)
    several, many = unstreamed(server, **push, parallel_tool_calls=True)
    one, single = unstreamed(server, **push, parallel_tool_calls=False)
    check_tool_calls(several.message, several.finish_reason)
    check_tool_calls(one.message, one.finish_reason)
    assert len(many) > 1 and len(single) == 1, (many, single)


def test_tools_with_response_format(server):
    """Tools and a response schema in one request: the answer is calls, or JSON valid against the schema."""
    schema = SCHEMAS["point"]
    response_format = {"type": "json_schema", "json_schema": {"name": "point", "schema": schema}}
    for bias in (None, {TOOL_CALL_TOKEN: 100}):
        choice, calls = unstreamed(server, **dict(SAMPLING, max_tokens=160), tool_choice="auto", logit_bias=bias,
                                   response_format=response_format, parallel_tool_calls=False)
        assert choice.finish_reason in ("stop", "tool_calls"), (choice.finish_reason, choice.message)
        if calls:
            check_tool_calls(choice.message, choice.finish_reason)
        else:
            jsonschema.validate(json.loads(choice.message.content), schema)
        assert bool(calls) == (bias is not None), (calls, choice.message.content)


def test_a_tool_keyword_no_engine_enforces_is_a_400(server):
    import openai

    bad = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}}}}}]
    with pytest.raises(openai.BadRequestError) as raised:
        server.client().chat.completions.create(model=MODEL, messages=MSG, tools=bad, tool_choice="required")
    assert "'f'" in str(raised.value) and "uniqueItems" in str(raised.value) and "#/properties/x" in str(raised.value)


# --------------------------------------------------------------------------- in process: the parser table
@pytest.fixture(scope="module")
def tokenizer():
    from neuron_constrain.testing.tiny_checkpoint import build
    from vllm.tokenizers import get_tokenizer

    from conftest import ROOT

    return get_tokenizer(str(build(ROOT / "build" / "tiny-llama")))


def adjusted(tokenizer, parser: str, tool_choice, **request):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser import ParserManager

    from neuron_constrain.vllm.validate import install_tool_calls

    install_tool_calls()
    parser_cls = ParserManager.get_parser(tool_parser_name=parser, enable_auto_tools=True,
                                          tool_strict_level="parameter", tokenizer=tokenizer)
    body = ChatCompletionRequest(model=MODEL, messages=MSG, tools=TOOLS, tool_choice=tool_choice, **request)
    return parser_cls(tokenizer, body.tools).adjust_request(body)


def test_every_served_family_is_a_library_format():
    from neuron_constrain.structured import TOOL_FORMATS
    from neuron_constrain.vllm.policy import PARSER_FAMILIES, family

    assert family("hermes") == "hermes" and family("llama3_json") in ("llama3_json", "llama3")
    for parser, families in PARSER_FAMILIES.items():
        if any(name in TOOL_FORMATS for name in families):
            assert family(parser) in families


def test_a_family_the_library_does_not_build_is_refused_by_name(monkeypatch):
    from neuron_constrain.structured import tools
    from neuron_constrain.vllm.policy import ToolParserError, family

    monkeypatch.setattr(tools, "TOOL_FORMATS", ("json", "hermes"))
    with pytest.raises(ToolParserError, match="'kimi_k2'.*family 'kimi_k2'.*hermes"):
        family("kimi_k2")


def test_a_second_family_gets_its_own_grammar(tokenizer):
    """``llama3_json`` is served by the library's llama3 family: a required call is one ``{"name",
    "parameters"}`` object (the grammar accepts it; the hermes form is refused)."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    llama = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    llama.add_special_tokens({"additional_special_tokens": ["<|python_tag|>"]})  # as Llama 3.1's tokenizer has it
    request = adjusted(llama, "llama3_json", "required", parallel_tool_calls=False)
    grammar = request.structured_outputs.grammar
    assert f"Token({llama.convert_tokens_to_ids('<|python_tag|>')})" in grammar  # the optional tag, by id
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(llama)).compile_grammar(grammar)

    def accepts(_, text: str) -> bool:
        matcher = xgr.GrammarMatcher(compiled)
        return matcher.accept_string(text) and matcher.is_completed()
    call = {"name": "search", "parameters": {"query": "x", "limit": 2}}
    assert accepts(grammar, json.dumps(call))
    assert not accepts(grammar, json.dumps({"name": "search", "parameters": {"query": "x", "limit": 11}}))
    assert not accepts(grammar, '<tool_call>\n{"name": "search", "arguments": {"query": "x", "limit": 2}}\n</tool_call>')


def test_a_parser_with_no_family_gets_a_400_naming_it(tokenizer):
    from vllm.exceptions import VLLMValidationError

    for tool_choice in ("required", "auto", NAMED):
        with pytest.raises(VLLMValidationError, match="--tool-call-parser 'xlam' has no tool-call family"):
            adjusted(tokenizer, "xlam", tool_choice)
    request = adjusted(tokenizer, "xlam", "none")  # nothing to enforce: served as vLLM serves it
    assert request.structured_outputs is None


def test_mistral_calls_start_with_the_control_token(tmp_path):
    """``mistral`` on vLLM's Mistral tokenizer (Tekken, from mistral-common's files): a required call opens with
    the ``[TOOL_CALLS]`` control token, named by id in the grammar (never its spelling); so does a strict
    ``auto``'s call, after free text."""
    import shutil

    from vllm.tokenizers import get_tokenizer

    from neuron_constrain.structured.tokenizers import mistral_data_file

    shutil.copy(mistral_data_file("tekken_240911.json"), tmp_path / "tekken.json")
    tekken = get_tokenizer(str(tmp_path), tokenizer_mode="mistral")
    marker = tekken.tokenizer.get_special_token("[TOOL_CALLS]")
    request = adjusted(tekken, "mistral", "required", parallel_tool_calls=False)
    assert f"Token({marker})" in request.structured_outputs.grammar
    assert "[TOOL_CALLS]" not in request.structured_outputs.grammar
    auto = adjusted(tekken, "mistral", "auto").structured_outputs.grammar
    assert f"Token({marker})" in auto and "[TOOL_CALLS]" in auto  # the token opens calls; free text never spells it
