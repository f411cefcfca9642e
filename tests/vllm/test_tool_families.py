"""Tool calls of four more families through the real ``openai`` client, each on its own plugin server
(``--tool-call-parser`` of that family; ``test_tool_calls.py`` serves ``hermes``): ``required`` / named /
``auto``, streamed and not with equal calls, ``parallel_tool_calls=false`` one call, tools with
``response_format``. The servers parse with vLLM's own parser for the family; the grammar is the
library's (``validate.install_tool_calls``), so a call the grammar lets through that vLLM's parser did not
read would show here as a missing call.

``pythonic`` and ``qwen3_coder`` run on the tiny checkpoint, ``llama3_json`` on it with Llama 3.1's
``<|python_tag|>`` added (vLLM's parser refuses a vocabulary without it), ``mistral`` on it with
mistral-common's v3 instruct tokenizer (``[TOOL_CALLS]`` a control token; ``--tokenizer-mode mistral``).
One server runs at a time (each holds ~2.5 GB). ``auto`` with a push on the family's first token of a
call (``logit_bias``: the random model never opens one by itself) gives calls, without it free text.
"""
from __future__ import annotations

import json

import jsonschema
import pytest

from checks import SCHEMAS, TOOLS, check_tool_calls
from conftest import ROOT
from test_tool_calls import NAMED, streamed, unstreamed

# parser -> the tiny checkpoint its server loads
FAMILIES = {"pythonic": "tiny", "qwen3_coder": "tiny", "llama3_json": "tiny-llama3", "mistral": "tiny-mistral"}
SAMPLING = dict(temperature=0, max_tokens=96, frequency_penalty=1.5, tools=TOOLS)


def opening_token(parser: str, piece: str | None = None) -> int:
    """The id of the token that opens the family's calls in its checkpoint's vocabulary (or of ``piece``)."""
    from neuron_constrain.testing.tiny_checkpoint import build

    model = FAMILIES[parser]
    folder = build(ROOT / "build" / "tiny-llama") if model == "tiny" else \
        build(ROOT / "build" / model, family=model.split("-", 1)[1])
    if parser == "mistral":
        from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

        return MistralTokenizer.from_file(f"{folder}/tokenizer.model.v3").instruct_tokenizer.tokenizer \
            .get_special_token("[TOOL_CALLS]")
    from transformers import AutoTokenizer

    piece = piece or {"pythonic": "[", "qwen3_coder": "<tool_call>", "llama3_json": "<|python_tag|>"}[parser]
    token = AutoTokenizer.from_pretrained(folder).convert_tokens_to_ids(piece)
    assert isinstance(token, int) and token >= 0, (parser, piece, token)
    return token


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, server_dir):
    """One family's server at a time (each holds ~2.5 GB beside the lane's shared servers), stopped after its tests."""
    from conftest import Server

    parser = request.param
    server = Server(f"family-{parser}", tmp=server_dir, model=FAMILIES[parser], extra=["--tool-call-parser", parser],
                    max_num_seqs=4)
    yield parser, server
    server.stop()


@pytest.mark.parametrize("tool_choice", ["required", NAMED, "auto"], ids=["required", "named", "auto"])
def test_calls_are_strict_and_equal_streamed_or_not(family, tool_choice):
    parser, server = family
    bias = {str(opening_token(parser)): 100} if tool_choice == "auto" else None
    kwargs = dict(SAMPLING, tool_choice=tool_choice, logit_bias=bias, parallel_tool_calls=False)
    choice, calls = unstreamed(server, **kwargs)
    check_tool_calls(choice.message, choice.finish_reason, names=["search"] if tool_choice == NAMED else None)
    # parallel_tool_calls=false: one call, then the end (the grammar's, not a parser dropping the rest)
    assert choice.finish_reason == ("stop" if tool_choice == NAMED else "tool_calls") and len(calls) == 1, (
        choice.finish_reason, calls, choice.message.content)
    assert not (choice.message.content or "").strip(), choice.message.content  # calls only, no free text
    content, stream_calls, finish = streamed(server, **kwargs)
    assert stream_calls == calls and finish == choice.finish_reason, (stream_calls, calls, finish)


def test_auto_without_a_push_is_free_text_that_never_opens_a_call(family):
    from neuron_constrain.structured.tool_calls.families import resolve

    parser, server = family
    kwargs = dict(SAMPLING, max_tokens=24, tool_choice="auto")
    choice, calls = unstreamed(server, **kwargs)
    assert choice.message.content and not calls, (choice.message.content, calls)
    assert resolve(parser).trigger not in choice.message.content
    content, stream_calls, _ = streamed(server, **kwargs)
    assert content == choice.message.content and not stream_calls


def test_tools_with_response_format(family):
    """The answer is calls (pushed towards the family's opening token), or a JSON value valid against the
    response schema (pushed away from it: the random model left alone may open either)."""
    parser, server = family
    schema = SCHEMAS["point"]
    response_format = {"type": "json_schema", "json_schema": {"name": "point", "schema": schema}}
    opening = str(opening_token(parser))
    # away from calls: pieces that merely start with "[" ("[s") open pythonic calls too, so push "{" up as well
    away = {opening: -100} if parser == "mistral" else {opening: -100, str(opening_token(parser, "{")): 100}
    for bias in (away, {opening: 100}):
        choice, calls = unstreamed(server, **dict(SAMPLING, max_tokens=160), tool_choice="auto", logit_bias=bias,
                                   response_format=response_format, parallel_tool_calls=False)
        if bias is away:
            assert not calls and choice.finish_reason == "stop", (calls, choice.message.content)
            jsonschema.validate(json.loads(choice.message.content), schema)
        else:
            check_tool_calls(choice.message, choice.finish_reason)
            assert len(calls) == 1 and choice.finish_reason == "tool_calls", (calls, choice.message.content)
