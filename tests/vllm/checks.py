"""Validity checks for constrained outputs: complete (parsed and validated) or, at
``max_tokens``, a prefix the grammar accepts (xgrammar's GrammarMatcher)."""
from __future__ import annotations

import functools
import json
import re

import jsonschema
import xgrammar as xgr

from conftest import ROOT

SCHEMAS = {
    "person": {
        "type": "object",
        # A pattern, not maxLength: vLLM's xgrammar 0.2.8 grammar for a length-bounded string admits raw
        # control characters (invalid JSON), which sampled requests do emit (docs/guides/vllm.md).
        # Anchored: stock vLLM reads every pattern as anchored, the plugin reads it as JSON Schema does (a
        # search), so only an anchored pattern means the same to both servers.
        "properties": {"name": {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"},
                       "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": False,
    },
    "palette": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]},
                       "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}},
        "required": ["color", "tags"], "additionalProperties": False,
    },
    "point": {
        "type": "object",
        "properties": {"point": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                                 "required": ["x", "y"], "additionalProperties": False},
                       "ok": {"type": "boolean"}},
        "required": ["point", "ok"], "additionalProperties": False,
    },
}
REGEX = r"[a-z]{3,8}@[a-z]{2,5}\.com"
CHOICES = ["yes", "no", "maybe"]
GRAMMAR = 'root ::= "SELECT " col (", " col)? " FROM " table\ncol ::= "id" | "name" | "age"\ntable ::= "users" | "orders"\n'
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "search", "description": "Search the web", "parameters": {
        "type": "object", "properties": {"query": {"type": "string", "maxLength": 16},
                                         "limit": {"type": "integer", "minimum": 1, "maximum": 10}},
        "required": ["query", "limit"], "additionalProperties": False}}},
]
TOOL_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@functools.lru_cache(maxsize=1)
def compiler():
    from transformers import AutoTokenizer

    from neuron_constrain.testing.tiny_checkpoint import build

    tokenizer = AutoTokenizer.from_pretrained(build(ROOT / "build" / "tiny-llama"))
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    return info, xgr.GrammarCompiler(info)


def grammar_accepts(kind: str, spec, text: str) -> tuple[bool, bool]:
    """(the grammar accepts ``text`` as a prefix, and it is complete there)."""
    _, c = compiler()
    if kind == "json":  # as vLLM compiles it with disable_any_whitespace (the servers' setting)
        compiled = c.compile_json_schema(json.dumps(spec), any_whitespace=False, separators=(",", ":"))
    elif kind == "regex":
        compiled = c.compile_regex(spec)
    elif kind == "choice":
        compiled = c.compile_regex("|".join(re.escape(s) for s in spec))
    else:
        compiled = c.compile_grammar(spec)
    matcher = xgr.GrammarMatcher(compiled)
    if not matcher.accept_string(text):
        return False, False
    return True, _can_end(matcher)


def _can_end(matcher) -> bool:
    """The grammar may end here: it is terminated, or it allows a stop token next."""
    if matcher.is_terminated():
        return True
    info, _ = compiler()
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)
    matcher.fill_next_token_bitmask(mask)
    stops = info.stop_token_ids
    return any(bool((int(mask[0, t // 32]) >> (t % 32)) & 1) for t in stops)


def check(kind: str, spec, text: str, finish_reason: str) -> None:
    """Assert ``text`` satisfies the constraint: complete at ``stop``, a valid prefix at ``length``."""
    assert text is not None, "no text"
    prefix_ok, complete = grammar_accepts(kind, spec, text)
    assert prefix_ok, f"{kind} constraint violated by {text!r}"
    if finish_reason == "length":
        return
    assert finish_reason == "stop", f"finish_reason={finish_reason!r} for {text!r}"
    assert complete, f"{text!r} stopped before the {kind} grammar could end"
    if kind == "json":
        jsonschema.validate(json.loads(text), spec)
    elif kind == "regex":
        assert re.fullmatch(spec, text), text
    elif kind == "choice":
        assert text in spec, text


def check_tool_calls(message, finish_reason: str, *, names=None) -> list:
    """Every call names a declared function and its arguments validate; returns the calls."""
    calls = message.tool_calls or []
    assert calls, f"no tool call parsed (finish_reason={finish_reason!r}, content={message.content!r})"
    for call in calls:
        assert call.function.name in (names or TOOL_SCHEMAS), call.function.name
        jsonschema.validate(json.loads(call.function.arguments), TOOL_SCHEMAS[call.function.name])
    return calls
