"""OpenAI ``tools`` + ``tool_choice``: the constraint that enforces a call, and the
parser that lifts calls out of an answer, in the formats real models emit.

    format     required / named (a grammar: no free text before the call)        "auto" (parsed)
    "json"     [{"name": n, "arguments": {...}}, ...]  (named: one object)           JSON objects in text
    "mistral"  [TOOL_CALLS] (control token) [{"name", "arguments", "id"?}, ...]     split at [TOOL_CALLS]
    "hermes"   <tool_call>\n{"name", "arguments"}\n</tool_call> (newline-separated)  <tool_call> blocks
    "llama3"   {"name": n, "parameters": {...}}                                    JSON objects in text

``"mistral"`` needs the tokenizer (``tool_constraint(..., tokenizer=tok)``): the call
starts with the ``[TOOL_CALLS]`` control token, which the grammar names by id (it is
never text), then mistral-common's JSON (``", "`` / ``": "`` separators, an optional
9-character ``id``): the form of tokenizer versions v3 to v7 (Tekken 240911,
sentencepiece v3); v11+'s ``[TOOL_CALLS]name[ARGS]{...}`` is not built here. A tag that is a control token of the tokenizer (``<tool_call>`` in
some tokenizers) is matched as that token. JSON whitespace is bounded (2 per gap).
"""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Mapping, Sequence

from neuron_constrain.structured.constraints import Constraint, ConstraintError, engine_message, json_schema
from neuron_constrain.structured.engines.xgrammar.grammars import structural_tag_text

TOOL_FORMATS = ("json", "mistral", "hermes", "llama3")
_MISTRAL_ID = {"type": "string", "pattern": "^[a-zA-Z0-9]{9}$"}


@dataclasses.dataclass
class ToolCall:
    """One tool call read from an answer.

    Attributes:
        name: the tool's name.
        arguments: its arguments, valid against the tool's parameters when the call was constrained.
    """

    name: str
    arguments: dict


def _tool_functions(tools: Sequence[dict]) -> dict[str, dict]:
    functions = {}
    for index, tool in enumerate(tools or ()):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(tool, dict) and tool.get("type") == "function" and isinstance(function, dict)
                and isinstance(function.get("name"), str)):
            raise ConstraintError(
                f"tools[{index}] is not an OpenAI function tool; write "
                '{"type": "function", "function": {"name": ..., "parameters": {...JSON schema...}}}'
            )
        functions[function["name"]] = function.get("parameters") or {"type": "object"}
    return functions


def _call_schema(name: str, parameters: dict) -> dict:
    return {
        "type": "object",
        "properties": {"name": {"type": "string", "enum": [name]}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _named_tool(tool_choice) -> str | None:
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if isinstance(name, str):
            return name
    return None


def _format_call_schema(format: str, name: str, parameters: dict) -> dict:
    key = "parameters" if format == "llama3" else "arguments"
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "enum": [name]}, key: parameters},
        "required": ["name", key],
        "additionalProperties": False,
    }
    if format == "mistral":
        schema["properties"]["id"] = _MISTRAL_ID
    return schema


def _tag(text: str, tokenizer) -> dict | str:
    """``text`` as a structural-tag begin/end: the control token of that name if the tokenizer has one."""
    token = tokenizer.control_token(text.strip()) if tokenizer is not None and hasattr(tokenizer, "control_token") else None
    return text if token is None else {"type": "token", "token": token}


def _structural(format: str, functions: dict[str, dict], only: str | None, tokenizer, one_call: bool) -> dict:
    names = [only] if only else list(functions)
    schemas = [_format_call_schema(format, n, functions[n]) for n in names]
    one = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    content = lambda schema: {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 2}  # noqa: E731
    if format == "mistral":
        token = tokenizer.control_token("[TOOL_CALLS]") if tokenizer is not None and hasattr(tokenizer, "control_token") else None
        if token is None:
            raise ConstraintError(
                'format="mistral" needs a tokenizer with the [TOOL_CALLS] control token: pass '
                "tokenizer=from_mistral(...) (Tekken, sentencepiece v3+) or choose another format"
            )
        array = {"type": "array", "items": one, "minItems": 1, **({"maxItems": 1} if one_call else {})}
        return {"type": "sequence", "elements": [
            {"type": "token", "token": token},
            {"type": "optional", "content": {"type": "const_string", "value": " "}},  # sentencepiece writes "▁["
            content(array),
        ]}
    if format == "hermes":
        begin, end = _tag("<tool_call>", tokenizer), _tag("</tool_call>", tokenizer)
        begin = begin if not isinstance(begin, str) else "<tool_call>\n"
        end = end if not isinstance(end, str) else "\n</tool_call>"
        tags = [{"type": "tag", "begin": begin, "content": content(schema), "end": end} for schema in schemas]
        return {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
                "stop_after_first": one_call}
    return content(one)  # llama3: one {"name", "parameters"} object


def _structural_constraint(format: str, functions: dict, only: str | None, tokenizer, tool_choice,
                           one_call: bool) -> Constraint:
    tag = {"type": "structural_tag", "format": _structural(format, functions, only, tokenizer, one_call)}
    try:
        text = structural_tag_text(tag)  # JSON string characters, as json_schema does
    except Exception as error:
        raise ConstraintError(f"xgrammar could not build the {format} tool-call grammar ({engine_message(error)})") from error
    return Constraint(
        "ebnf", text, "bounded",
        validate=lambda answer: _check_calls(answer, functions, tool_choice, format, one_call),
    )


def tool_constraint(
    tools: Sequence[dict], tool_choice: str | dict = "auto", *, format: str = "json", tokenizer=None,
    parallel_tool_calls: bool = True,
) -> Constraint | None:
    """OpenAI ``tools`` + ``tool_choice`` -> the constraint that enforces it.

    Args:
        tools: OpenAI tools (``{"type": "function", "function": {"name", "parameters"}}``).
        tool_choice: ``"required"`` (one or more calls to the given tools), a named choice
            ``{"type": "function", "function": {"name": n}}`` (one call of ``n``), or ``"auto"`` /
            ``"none"`` (free text: nothing to enforce; parse it with :func:`parse_tool_calls`).
        format: how the model writes calls, one of ``TOOL_FORMATS``: ``"json"`` (a JSON array of
            ``{"name", "arguments"}``; named: one object), ``"mistral"``, ``"hermes"``, ``"llama3"``.
        tokenizer: the tokenizer, for formats that start with a control token (``"mistral"``).
        parallel_tool_calls: OpenAI's flag; ``False`` makes ``"required"`` exactly one call (a
            small model may otherwise repeat its call until the token limit).

    Returns:
        The constraint, or ``None`` for ``"auto"`` / ``"none"``.

    Raises:
        ConstraintError: an unknown format, ``"required"`` with no tools, a named tool not in
            ``tools``, a tool without a name or with parameters that are not a schema.
    """
    if format not in TOOL_FORMATS:
        raise ConstraintError(f"tool-call format {format!r} is not one of {TOOL_FORMATS}")
    functions = _tool_functions(tools)
    if tool_choice in ("auto", "none", None):
        return None
    if tool_choice == "required":
        if not functions:
            raise ConstraintError('tool_choice="required" with no tools: pass tools, or use tool_choice="auto"')
        if format != "json":
            return _structural_constraint(format, functions, None, tokenizer, tool_choice, not parallel_tool_calls)
        calls = [_call_schema(name, params) for name, params in functions.items()]
        return json_schema({"type": "array", "minItems": 1, **({} if parallel_tool_calls else {"maxItems": 1}),
                            "items": calls[0] if len(calls) == 1 else {"anyOf": calls}})
    name = _named_tool(tool_choice)
    if name is None:
        raise ConstraintError(
            f"tool_choice={tool_choice!r} is not one of 'auto', 'none', 'required' or "
            '{"type": "function", "function": {"name": ...}}'
        )
    if name not in functions:
        raise ConstraintError(f"tool_choice names {name!r} but the tools are {sorted(functions)}; add it to tools")
    if format != "json":
        return _structural_constraint(format, functions, name, tokenizer, tool_choice, True)
    return json_schema(_call_schema(name, functions[name]))


def _check_calls(text: str, functions: dict, tool_choice, format: str, one_call: bool) -> str | None:
    """``validate_output`` of a tool-call constraint: parsed, and each call's arguments valid."""
    import jsonschema

    try:
        content, calls = parse_tool_calls(text, [{"type": "function", "function": {"name": n, "parameters": p}}
                                                 for n, p in functions.items()], tool_choice, format=format)
    except (ValueError, json.JSONDecodeError) as error:
        return f"not a {format} tool call: {error}"
    if content or not calls:
        return f"not only {format} tool calls: free text {content[:40]!r}"
    if one_call and len(calls) > 1:
        return f"{len(calls)} calls where one was asked for"
    named = _named_tool(tool_choice)
    for call in calls:
        if named and call.name != named:
            return f"called {call.name!r}, not the named {named!r}"
        schema = functions[call.name]
        validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        errors = sorted(validator(schema).iter_errors(call.arguments), key=str)
        if errors:
            return f"{call.name} arguments: {errors[0].message}"
    return None


def _as_call(value, functions: Mapping[str, dict]) -> ToolCall | None:
    if not isinstance(value, dict) or value.get("name") not in functions:
        return None
    arguments = value.get("arguments", value.get("parameters"))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    return ToolCall(value["name"], arguments) if isinstance(arguments, dict) else None


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_calls(
    text: str,
    tools: Sequence[dict],
    tool_choice: str | dict = "auto",
    *,
    format: str = "json",
    tokens: Sequence[int] | None = None,
    tokenizer=None,
) -> tuple[str, list[ToolCall]]:
    """``(content, calls)`` from a model's answer.

    ``required``/named: the answer is the constrained output and is parsed whole.
    ``auto``: calls are lifted out of free text; the rest is the content. ``none``: no calls.

    Args:
        text: the model's answer.
        tools: the tools the request offered.
        tool_choice: the request's ``tool_choice``.
        format: ``"json"`` / ``"llama3"``: JSON objects ``{"name": <a tool>,
            "arguments"|"parameters": {...}}`` (alone or in arrays); ``"hermes"``:
            ``<tool_call>...</tool_call>`` blocks; ``"mistral"``: everything after the
            ``[TOOL_CALLS]`` control token.
        tokens: the generated tokens (``"mistral"``: a decode drops the control token).
        tokenizer: decodes ``tokens``.

    Returns:
        ``(content, calls)``: the text outside calls, and each call's name and arguments.

    Raises:
        ValueError: an unknown format; a ``required``/named answer that is not calls to the tools;
            ``tokens`` without ``tokenizer``.
    """
    if format not in TOOL_FORMATS:
        raise ValueError(f"tool-call format {format!r} is not one of {TOOL_FORMATS}")
    functions = _tool_functions(tools)
    if tool_choice == "none":
        return text, []
    forced = tool_choice == "required" or _named_tool(tool_choice)
    if format == "mistral":
        if tokens is not None:
            if tokenizer is None:
                raise ValueError("parse_tool_calls(tokens=...) needs tokenizer= to split at [TOOL_CALLS] and decode")
            marker = tokenizer.control_token("[TOOL_CALLS]")
            tokens = [int(t) for t in tokens]
            if marker not in tokens:
                if forced:
                    raise ValueError(f"the answer has no [TOOL_CALLS] token; it is not a call to {sorted(functions)}")
                return tokenizer.decode(tokens).strip(), []
            at = tokens.index(marker)
            head, tail = tokenizer.decode(tokens[:at]), tokenizer.decode(tokens[at + 1:])
        elif "[TOOL_CALLS]" in text:
            head, _, tail = text.partition("[TOOL_CALLS]")
        elif forced:  # the constrained answer, its control token dropped by the decode
            head, tail = "", text
        else:
            return text.strip(), []
        value = json.loads(tail)
        calls = [_as_call(v, functions) for v in (value if isinstance(value, list) else [value])]
        if not calls or None in calls:
            raise ValueError(f"the answer {tail[:80]!r} is not a call to {sorted(functions)}")
        return head.strip(), calls
    if format == "hermes":
        calls, kept, at = [], [], 0
        for match in _HERMES.finditer(text):
            call = _as_call(_loads(match.group(1)), functions)
            if call is None:
                if forced:
                    raise ValueError(f"the block {match.group(0)[:80]!r} is not a call to {sorted(functions)}")
                continue
            kept.append(text[at:match.start()])
            at = match.end()
            calls.append(call)
        kept.append(text[at:])
        content = "".join(kept).strip()
        if forced and (content or not calls):
            raise ValueError(f"the answer {text[:80]!r} is not only <tool_call> blocks for {sorted(functions)}")
        return content, calls
    if forced:
        value = json.loads(text)
        calls = [_as_call(v, functions) for v in (value if isinstance(value, list) else [value])]
        if not calls or None in calls:
            raise ValueError(f"the answer {text[:80]!r} is not a call to {sorted(functions)}")
        return "", calls
    decoder, calls, kept, at = json.JSONDecoder(), [], [], 0
    while at < len(text):
        start = min((i for i in (text.find("{", at), text.find("[", at)) if i >= 0), default=-1)
        if start < 0:
            break
        try:
            value, end = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            kept.append(text[at:start + 1])
            at = start + 1
            continue
        found = [_as_call(v, functions) for v in (value if isinstance(value, list) else [value])]
        if found and None not in found:
            calls.extend(found)
            kept.append(text[at:start])
        else:
            kept.append(text[at:end])
        at = end
    kept.append(text[at:])
    return "".join(kept).strip(), calls


def _loads(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None
