"""A family's description -> the whole-answer parser: ``(content, calls)`` from what a model wrote.

    parse_tool_calls(text, tools, "auto", format="qwen3_coder")     # free text, then calls
    parse_tool_calls(text=None or "", tools, "required", format="mistral", tokens=ids, tokenizer=tok)
    check_answer(text, functions, tool_choice, format=...)          # validate_output of a tool constraint

The reader walks the same description the grammar is built from (``families.py``): the section's opening,
each call's opening with the tool's name, its arguments (JSON, ``<parameter>`` blocks typed by the schema,
or Python keyword arguments), the separator and the closing. Generated tokens are read with the family's
control tokens spelled as their names (a plain decode drops them).
"""
from __future__ import annotations

import json
import re
from typing import Sequence

from neuron_constrain.structured.tool_calls import families as F
from neuron_constrain.structured.tool_calls.arguments import python_arguments, read_xml_value
from neuron_constrain.structured.tool_calls.families import ToolCall

_CALL_ID = re.compile(r',\s*"id":\s*"[a-zA-Z0-9]{9}"')
_DECODER = json.JSONDecoder()


def _expect(text: str, at: int, literal: str) -> int:
    if not text.startswith(literal, at):
        raise ValueError(f"expected {literal!r} at {at}, found {text[at:at + 20]!r}")
    return at + len(literal)


def _opening(family: F.ToolFamily, text: str, at: int) -> int:
    opening = family.section_open
    if not opening:
        return at
    if family.optional_open:
        return at + len(opening) if text.startswith(opening, at) else at
    if family.optional_space and family.trigger and opening.startswith(family.trigger):
        at = _expect(text, at, family.trigger)
        at += text.startswith(" ", at)
        opening = opening[len(family.trigger):]
    return _expect(text, at, opening)


class BracketScan:
    """Where a bracketed Python expression that opens at ``at`` closes (brackets inside strings skipped),
    read as the text grows: ``scan(text)`` goes on from where the last call stopped."""

    def __init__(self, at: int):
        self.end, self.depth, self.quote = at, 0, ""  # where the scan goes on, brackets open, the open quote

    def scan(self, text: str) -> int | None:
        """The index just after the closing bracket, or ``None`` while the text ends before it.

        Args:
            text: the answer so far (each call's text extends the last one's).

        Returns:
            The end, or ``None``.
        """
        end = self.end
        while end < len(text):
            char = text[end]
            if self.quote:  # inside a string: to its closing quote, escapes skipped
                if char == "\\":
                    if end + 1 == len(text):
                        break
                    end += 1
                elif char == self.quote:
                    self.quote = ""
            elif char in "\"'":
                self.quote = char
            elif char in "[({":
                self.depth += 1
            elif char in "])}":
                self.depth -= 1
                if self.depth == 0:
                    self.end = end
                    return end + 1
            end += 1
        self.end = end
        return None


def _python_section(family: F.ToolFamily, text: str, at: int, functions: dict) -> tuple[list[ToolCall], int]:
    """``[f(a=1), ...]`` from ``at``: to its matching bracket (outside strings), read by ``ast``."""
    end = BracketScan(at).scan(text)
    if end is None:
        raise ValueError("the list of calls is not closed")
    calls = [ToolCall(name, arguments) for name, arguments in python_arguments(text[at:end])]
    for call in calls:
        _known(call.name, functions)
    return calls, end


def _known(name: str, functions: dict) -> None:
    if name not in functions:
        raise ValueError(f"{name!r} is not one of the tools {sorted(functions)}")


def _xml_arguments(text: str, at: int, parameters: dict) -> tuple[dict, int]:
    properties, arguments = parameters.get("properties") or {}, {}
    while text.startswith("<parameter=", at):
        head = text.find(">\n", at)
        if head < 0:
            raise ValueError("a <parameter= tag is not closed")
        key = text[at + len("<parameter="):head]
        end = text.find("\n</parameter>\n", head + 2)
        if end < 0 or key not in properties or key in arguments:
            raise ValueError(f"the parameter {key!r} is unknown, repeated or not closed")
        arguments[key] = read_xml_value(text[head + 2:end], properties[key])
        at = end + len("\n</parameter>\n")
    return arguments, at


def _read_opening(family: F.ToolFamily, parts: list[str], text: str, at: int) -> tuple[str, int]:
    """A call's opening from ``at``: its literal parts, the tool's name, index (digits) and optional Mistral
    call id; ``(name, end)``."""
    name = None
    for index, part in enumerate(parts):
        if part == "{call_id}":
            match = re.compile(r"\[CALL_ID\][a-zA-Z0-9]{9}").match(text, at)
            at = match.end() if match else at
        elif part == "{index}":
            match = re.compile(r"[0-9]+").match(text, at)
            if match is None:
                raise ValueError(f"no call index at {at}")
            at = match.end()
        elif part == "{name}" and family.name_style == "json":
            name, at = _DECODER.raw_decode(text, at)
            if not isinstance(name, str):
                raise ValueError("a tool's name is not a string")
        elif part == "{name}":
            following = next((p for p in parts[index + 1:] if p != "{call_id}"), None)
            end = text.find(following, at) if following not in (None, "{index}") else -1
            if end < 0:
                raise ValueError(f"no {following!r} after the tool's name")
            if "{call_id}" in parts[index + 1:] and "[CALL_ID]" in text[at:end]:
                end = text.index("[CALL_ID]", at)
            name, at = text[at:end], end
        else:
            at = _expect(text, at, part)
    return name, at


def read_section(family: F.ToolFamily, text: str, at: int, functions: dict, progress: list | None = None,
                 boundaries: list | None = None, *, continued: bool = False) -> tuple[list[ToolCall], int]:
    """The calls written from ``at`` on, and where they end.

    Args:
        family: the family.
        text: the answer, control tokens spelled as their names.
        at: where the calls begin (the section's opening, or the first call's).
        functions: ``{name: parameters}``.
        progress: a list the reader appends to as it goes (the streaming parser reads it when the text
            ends early): each call's name once its opening is read, then the call once it is whole.
        boundaries: a list the reader appends to where another call's opening follows a whole call (after
            the separator): the streaming parser resumes there with ``continued=True`` (python calls: none).
        continued: ``at`` is a call's opening inside the section (a boundary), not the section's start.

    Returns:
        ``(calls, end)``.

    Raises:
        ValueError: the text there is not the family's calls to these tools.
    """
    at = at if continued else _opening(family, text, at)
    if family.arguments == "python":
        calls, end = _python_section(family, text, at - len(family.section_open), functions)
        if progress is not None:
            progress.extend(calls)
        return calls, end
    parts, calls = family.opening_parts(), []
    while True:
        name, at = _read_opening(family, parts, text, at)
        _known(name, functions)
        if progress is not None:
            progress.append(name)
        if family.arguments == "json":
            arguments, at = _DECODER.raw_decode(text, at)
            if not isinstance(arguments, dict):
                raise ValueError(f"the arguments of {name} are not a JSON object")
        else:
            arguments, at = _xml_arguments(text, at, functions[name])
        if family.call_id and (match := _CALL_ID.match(text, at)):
            at = match.end()
        at = _expect(text, at, family.call_close.replace("{{", "{").replace("}}", "}"))
        calls.append(ToolCall(name, arguments))
        if progress is not None:
            progress.append(calls[-1])
        if not text.startswith(family.separator + parts[0], at):
            break
        at += len(family.separator)
        if boundaries is not None:
            boundaries.append(at)
    return calls, _expect(text, at, family.section_close)


def spelled_text(tokens: Sequence[int], tokenizer, family: F.ToolFamily | None) -> str:
    """Generated tokens as text, the family's control tokens spelled as their names."""
    names = {F.control(tokenizer, name): name for name in (family.controls if family else ())}
    names.pop(None, None)
    parts, run = [], []
    for token in [int(t) for t in tokens]:
        if token in names:
            parts += [tokenizer.decode(run), names[token]]
            run = []
        else:
            run.append(token)
    return "".join(parts) + tokenizer.decode(run)


def _starts(family: F.ToolFamily, text: str, at: int) -> int:
    starts = [i for i in (text.find(family.trigger, at),
                          text.find(family.section_open, at) if family.optional_open else -1) if i >= 0]
    return min(starts, default=-1)


def parse_family(family: F.ToolFamily, text: str, functions: dict, forced: bool) -> tuple[str, list[ToolCall]]:
    """``(content, calls)`` of ``text`` in ``family``'s spelling: forced, the whole text is calls."""
    if forced:
        stripped = text.strip()
        if family.trigger in family.controls and not stripped.startswith(family.trigger):
            stripped = family.trigger + stripped  # the constrained answer, its control token dropped by a decode
        calls, end = read_section(family, stripped, 0, functions)
        if stripped[end:].strip():
            raise ValueError(f"text after the calls: {stripped[end:end + 40]!r}")
        return "", calls
    kept, calls, at = [], [], 0
    if family.content_open and text.startswith(family.content_open):
        at = len(family.content_open)  # harmony's final channel: the text answer
    while (start := _starts(family, text, at)) >= 0:
        try:
            found, end = read_section(family, text, start, functions)
        except (ValueError, json.JSONDecodeError):
            found, end = _loose(family, text, start, functions)
        if not found:
            kept.append(text[at:start + 1])
            at = start + 1
            continue
        kept.append(text[at:start])
        calls += found
        at = end
    kept.append(text[at:])
    return "".join(kept).strip(), calls


def _loose(family: F.ToolFamily, text: str, at: int, functions: dict) -> tuple[list[ToolCall], int]:
    """Under ``auto``, a block the family's ``loose`` pattern reads (``hermes``: any whitespace around the JSON,
    its keys in any order, arguments as a JSON string): ``([call], end)``, or ``([], at)``."""
    match = re.compile(family.loose, re.DOTALL).match(text, at) if family.loose else None
    call = _as_call(_loads(match.group(1)), functions) if match else None
    return ([call], match.end()) if call else ([], at)


def _loads(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _as_call(value, functions: dict) -> ToolCall | None:
    if not isinstance(value, dict) or value.get("name") not in functions:
        return None
    arguments = value.get("arguments", value.get("parameters"))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    return ToolCall(value["name"], arguments) if isinstance(arguments, dict) else None


def _parse_json(text: str, functions: dict, forced: bool) -> tuple[str, list[ToolCall]]:
    """``format="json"``: JSON objects ``{"name", "arguments"|"parameters"}``, alone or in arrays."""
    if forced:
        value = json.loads(text)
        calls = [_as_call(v, functions) for v in (value if isinstance(value, list) else [value])]
        if not calls or None in calls:
            raise ValueError(f"the answer {text[:80]!r} is not a call to {sorted(functions)}")
        return "", calls
    calls, kept, at = [], [], 0
    while at < len(text):
        start = min((i for i in (text.find("{", at), text.find("[", at)) if i >= 0), default=-1)
        if start < 0:
            break
        try:
            value, end = _DECODER.raw_decode(text, start)
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
        format: one of ``TOOL_FORMATS`` (``"json"``: JSON objects ``{"name": <a tool>,
            "arguments"|"parameters": {...}}``, alone or in arrays; the others as ``families.FAMILIES``
            describes them).
        tokens: the generated tokens: read with the family's control tokens spelled as their names (a
            decode drops them); ``text`` is then not read.
        tokenizer: decodes ``tokens``; ``"mistral"``: the v11+ form where it has ``[ARGS]``.

    Returns:
        ``(content, calls)``: the text outside calls, and each call's name and arguments.

    Raises:
        ValueError: an unknown format; a ``required``/named answer that is not calls to the tools;
            ``tokens`` without ``tokenizer``.
    """
    if format not in F.TOOL_FORMATS:
        raise ValueError(f"tool-call format {format!r} is not one of {F.TOOL_FORMATS}")
    family = F.resolve(format, tokenizer)
    functions = F.tool_functions(tools)
    if tokens is not None:
        if tokenizer is None:
            raise ValueError("parse_tool_calls(tokens=...) needs tokenizer= to spell the control tokens and decode")
        text = spelled_text(tokens, tokenizer, family)
    if tool_choice == "none":
        return text, []
    forced = tool_choice == "required" or F.named_tool(tool_choice) is not None
    if family is None:
        return _parse_json(text, functions, forced)
    failures = []
    for form in F.forms(format, tokenizer):
        try:
            content, calls = parse_family(form, text, functions, forced)
        except (ValueError, json.JSONDecodeError) as error:
            failures.append(f"{form.name}: {error}")
            continue
        if calls or form is F.forms(format, tokenizer)[-1]:
            return content, calls
    raise ValueError(f"the answer is not {format} calls to {sorted(functions)} ({'; '.join(failures)})")


def check_answer(text: str, functions: dict, tool_choice, *, format: str, max_calls: int | None = None,
                 response_format=None) -> str | None:
    """``validate_output`` of a tool-call constraint: the answer parsed, each call's arguments valid.

    Args:
        text: the answer.
        functions: ``{name: parameters}``.
        tool_choice: the request's ``tool_choice``.
        format: the ``TOOL_FORMATS`` name.
        max_calls: the most calls allowed (None: no bound).
        response_format: ``auto``'s response schema: an answer with no calls is JSON valid against it.

    Returns:
        None, or why the answer is not valid.
    """
    import jsonschema

    tools = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in functions.items()]
    try:
        content, calls = parse_tool_calls(text, tools, tool_choice, format=format)
    except (ValueError, json.JSONDecodeError) as error:
        return f"not {format} tool calls: {error}"
    forced = tool_choice == "required" or F.named_tool(tool_choice) is not None
    if forced and (content or not calls):
        return f"not only {format} tool calls: free text {content[:40]!r}"
    if max_calls is not None and len(calls) > max_calls:
        return f"{len(calls)} calls where at most {max_calls} were allowed"
    named = F.named_tool(tool_choice)
    pairs = [(call.name, functions[call.name], call.arguments) for call in calls]
    if response_format is not None and not calls:
        try:
            pairs.append(("the response", response_format, json.loads(text)))
        except json.JSONDecodeError as error:
            return f"neither calls nor JSON: {error}"
    for name, schema, value in pairs:
        if named and name != named:
            return f"called {name!r}, not the named {named!r}"
        validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        errors = sorted(validator(schema).iter_errors(value), key=str)
        if errors:
            return f"{name} arguments: {errors[0].message}"
    return None
