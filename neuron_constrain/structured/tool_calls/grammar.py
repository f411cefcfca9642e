"""A family's description -> the constraint of a request's ``tools`` / ``tool_choice`` (an xgrammar structural
tag, turned into EBNF text that both engines read).

    tool_constraint(tools, "required", format="qwen3_coder", tokenizer=tok, max_tool_calls=2)
    tool_constraint(tools, "auto", format="hermes", tokenizer=tok)   # free text until <tool_call>, then calls
    tool_constraint(tools, "auto", format="hermes", response_format=schema)   # calls | a JSON value

``required``: one call or more (``parallel_tool_calls=False``: one; ``max_tool_calls=N``: at most N), then
the end. A named choice: one call of that tool. ``auto``: free text until the family's trigger, then calls
exactly to the end (free text never holds a text trigger; a control token is never text); where the family's
calls lead the answer (``pythonic``, ``llama3_json``), free text or calls. With
``response_format`` the answer is calls or a JSON value valid against that schema. JSON is written with at
most ``whitespace`` whitespace characters in each gap.
"""
from __future__ import annotations

import keyword
from typing import Sequence

from neuron_constrain.structured.constraints import Constraint, ConstraintError, engine_message, json_schema
from neuron_constrain.structured.engines.xgrammar.grammars import structural_tag_text
from neuron_constrain.structured.tool_calls import families as F
from neuron_constrain.structured.tool_calls.arguments import arguments_element, json_arguments

_MISTRAL_ID = {"type": "string", "pattern": "^[a-zA-Z0-9]{9}$"}


def _pieces(text: str, family: F.ToolFamily, tokenizer) -> list[dict]:
    """``text`` as elements: each of the family's control names the tokenizer has becomes that token."""
    elements, rest = [], text
    while rest:
        found = [(rest.find(name), name) for name in family.controls
                 if name in rest and F.control(tokenizer, name) is not None]
        if not found:
            elements.append({"type": "const_string", "value": rest})
            break
        at, name = min(found)
        if at:
            elements.append({"type": "const_string", "value": rest[:at]})
        elements.append({"type": "token", "token": F.control(tokenizer, name)})
        rest = rest[at + len(name):]
    return elements


def _seq(elements: list[dict]) -> dict:
    return elements[0] if len(elements) == 1 else {"type": "sequence", "elements": elements}


def _any_of(elements: list[dict]) -> dict:
    return elements[0] if len(elements) == 1 else {"type": "or", "elements": elements}


def _check_bare_name(family: F.ToolFamily, name: str) -> None:
    """A name the family writes bare must not run into what follows it: a Python identifier that is no keyword
    (``pythonic``), else OpenAI's rule for a function's name."""
    if family.name_style != "raw":
        return
    python = family.arguments == "python"
    if python and F.IDENTIFIER.match(name) and not keyword.iskeyword(name) or not python and F.TOOL_NAME.match(name):
        return
    rule = "a Python identifier (not a keyword)" if python else "letters, digits, _ and - (OpenAI's rule)"
    raise ConstraintError(f"tool {name!r}: {family.name} writes a tool's name bare, so it must be {rule}; "
                          "rename the tool or use format='hermes'")


class _Builder:
    """The elements of one request's calls: each tool's arguments built (and refused) once."""

    def __init__(self, family: F.ToolFamily, functions: dict, tokenizer, whitespace: int):
        self.family, self.tokenizer = family, tokenizer
        for name in functions:
            _check_bare_name(family, name)
        self.arguments = {name: arguments_element(family, name, parameters, whitespace)
                          for name, parameters in functions.items()}

    def call(self, name: str) -> list[dict]:
        family, elements, text = self.family, [], ""
        for part in family.opening_parts() + [None]:
            if part in ("{index}", "{call_id}", None):
                elements += _pieces(text, family, self.tokenizer) if text else []
                elements += [self._placeholder(part)] if part else []
                text = ""
            else:
                text += family.spelled(name) if part == "{name}" else part
        elements = [e for e in elements if e.get("value", None) != ""] + [self.arguments[name]]
        if family.call_id:
            elements.append({"type": "optional", "content": _seq([
                {"type": "const_string", "value": ', "id": '},
                {"type": "json_schema", "json_schema": _MISTRAL_ID}])})
        elements += _pieces(family.call_close, family, self.tokenizer)
        return elements

    def _placeholder(self, part: str) -> dict:
        if part == "{index}":
            return {"type": "regex", "pattern": "0|[1-9][0-9]{0,5}"}  # a call counter: bounded, never a runaway
        token = F.control(self.tokenizer, "[CALL_ID]")
        if token is None:
            return {"type": "const_string", "value": ""}
        return {"type": "optional", "content": _seq([{"type": "token", "token": token},
                                                     {"type": "regex", "pattern": "[a-zA-Z0-9]{9}"}])}

    def section(self, names: list[str], low: int, high: int | None) -> dict:
        """``low`` to ``high`` calls (None: no bound) of ``names``."""
        family = self.family
        opening = _pieces(family.section_open, family, self.tokenizer) if family.section_open else []
        if family.optional_open:
            usable = opening and opening[0]["type"] == "token"  # the tag only where the vocabulary has it
            opening = [{"type": "optional", "content": _seq(opening)}] if usable else []
        if family.optional_space and opening:
            opening.insert(1, {"type": "optional", "content": {"type": "const_string", "value": " "}})
        one = _any_of([_seq(self.call(name)) for name in names])
        elements = opening + [one]
        if high is None or high > 1:
            separator = _pieces(family.separator, family, self.tokenizer) if family.separator else []
            elements.append({"type": "repeat", "min": max(low - 1, 0), "max": -1 if high is None else high - 1,
                             "content": _seq(separator + [one])})
        if family.section_close:
            elements += _pieces(family.section_close, family, self.tokenizer)
        return _seq([e for e in elements if e.get("value", None) != ""])

    def free_text(self) -> dict:
        """Text that never holds the trigger's text. Where the trigger opens with a control token, the
        exclusion still holds: a vocabulary may also carry that token's text as text (an added token that is
        not special), and free text spelling the trigger would be read as a call by the parser, or keep the
        grammar in free text after the token itself. Nor does free text hold any of the family's control
        tokens: one that may open calls (llama3_json's optional ``<|python_tag|>``) would be read as calls
        by a server's parser, and a detokenizer that skips special tokens would hide it from the text."""
        return {"type": "any_text", "excludes": list(dict.fromkeys([self.family.trigger, *self.family.controls]))}


def _forms_section(builders: list[_Builder], names: list[str], low: int, high: int | None) -> dict:
    return _any_of([builder.section(names, low, high) for builder in builders])


def _auto(builders: list[_Builder], names: list[str], high: int | None) -> dict:
    """Free text until the trigger, then calls to the end; a family whose text answers open with their own
    tag (``content_open``) writes that tag and text, or the calls; a family whose calls lead (``leading``),
    free text or the calls."""
    family, calls = builders[0].family, _forms_section(builders, names, 1, high)
    free = builders[0].free_text()
    if family.content_open:
        opening = _pieces(family.content_open, family, builders[0].tokenizer)
        return {"type": "or", "elements": [_seq(opening + [free]), calls]}
    if family.leading:
        return {"type": "or", "elements": [free, calls]}
    return {"type": "sequence", "elements": [free, {"type": "optional", "content": calls}]}


def _limit(parallel_tool_calls: bool, max_tool_calls) -> int | None:
    if max_tool_calls is not None and (not isinstance(max_tool_calls, int) or isinstance(max_tool_calls, bool)
                                       or max_tool_calls < 1):
        raise ConstraintError(f"max_tool_calls={max_tool_calls!r}: pass a positive int, or None for no bound")
    return 1 if not parallel_tool_calls else max_tool_calls


def tool_constraint(
    tools: Sequence[dict], tool_choice: str | dict = "auto", *, format: str = "json", tokenizer=None,
    parallel_tool_calls: bool = True, max_tool_calls: int | None = None, response_format: dict | None = None,
    whitespace: int = 2,
) -> Constraint | None:
    """OpenAI ``tools`` + ``tool_choice`` -> the constraint that enforces it.

    Args:
        tools: OpenAI tools (``{"type": "function", "function": {"name", "parameters"}}``).
        tool_choice: ``"required"`` (one or more calls to the given tools), a named choice
            ``{"type": "function", "function": {"name": n}}`` (one call of ``n``), ``"auto"`` (free text
            until the family's trigger, then calls; ``"json"``: nothing to enforce) or ``"none"``.
        format: how the model writes calls, one of ``TOOL_FORMATS`` (``families.FAMILIES`` describes each;
            ``"llama3"`` is ``"llama3_json"``; ``"mistral"`` is the v11+ form where the tokenizer has ``[ARGS]``).
        tokenizer: the tokenizer: its control tokens are matched as tokens (``"mistral"`` needs ``[TOOL_CALLS]``).
        parallel_tool_calls: OpenAI's flag; ``False``: one call, then the end.
        max_tool_calls: at most this many calls (None: no bound).
        response_format: a JSON schema: under ``"auto"`` the answer is calls or a JSON value valid against it.
        whitespace: the whitespace characters a gap of JSON may hold.

    Returns:
        The constraint, or ``None`` where nothing is enforced (``"none"``; ``"auto"`` of ``"json"``).

    Raises:
        ConstraintError: an unknown format or option, ``"required"`` with no tools, a named tool not in
            ``tools``, a tool whose parameters the family cannot enforce (naming the tool and the pointer),
            a control token the family needs missing from the tokenizer.
    """
    family = F.resolve(format, tokenizer)
    functions = F.tool_functions(tools)
    high = _limit(parallel_tool_calls, max_tool_calls)
    if not isinstance(whitespace, int) or isinstance(whitespace, bool) or whitespace < 1:
        raise ConstraintError(f"whitespace={whitespace!r}: pass the whitespace characters a JSON gap may hold (an int >= 1)")
    if response_format is not None and not isinstance(response_format, (dict, bool)):
        raise ConstraintError("response_format= takes the response's JSON schema (a dict)")
    named = F.named_tool(tool_choice)
    if tool_choice not in ("auto", "none", "required", None) and named is None:
        raise ConstraintError(f"tool_choice={tool_choice!r} is not one of 'auto', 'none', 'required' or "
                              '{"type": "function", "function": {"name": ...}}')
    if named is not None and named not in functions:
        raise ConstraintError(f"tool_choice names {named!r} but the tools are {sorted(functions)}; add it to tools")
    if tool_choice == "required" and not functions:
        raise ConstraintError('tool_choice="required" with no tools: pass tools, or use tool_choice="auto"')
    if response_format is not None and tool_choice not in ("auto", None):
        raise ConstraintError(f"response_format= with tool_choice={tool_choice!r}: the answer must be calls, so "
                              "the response schema would never apply; use tool_choice='auto' (calls | schema)")
    if tool_choice == "none" or (tool_choice in ("auto", None) and not functions):
        return None if response_format is None else json_schema(response_format, whitespace="bounded",
                                                                max_whitespace=whitespace)
    if family is None:
        return _json_constraint(functions, tool_choice, named, high, response_format, whitespace)
    for needed in family.required_controls:
        if F.control(tokenizer, needed) is None:
            raise ConstraintError(
                f'format="{format}" needs a tokenizer with the {needed} control token: pass '
                "tokenizer=from_mistral(...) (Tekken, sentencepiece v3+) or choose another format")
    builders = [_Builder(form, functions, tokenizer, whitespace) for form in F.forms(format, tokenizer)]
    names = [named] if named else list(functions)
    if named:
        body = _forms_section(builders, names, 1, 1)
    elif tool_choice == "required":
        body = _forms_section(builders, names, 1, high)
    elif response_format is not None:
        body = {"type": "or", "elements": [_forms_section(builders, names, 1, high),
                                           json_arguments("response_format", response_format, whitespace)]}
    else:
        body = _auto(builders, names, high)
    return _constraint(body, family.name, functions, tool_choice, format, high, response_format, whitespace)


def _json_constraint(functions, tool_choice, named, high, response_format, whitespace) -> Constraint | None:
    """``format="json"``: a JSON array of ``{"name", "arguments"}`` (named: one object), as today."""
    def call(name):
        return {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                "properties": {"name": {"type": "string", "enum": [name]}, "arguments": functions[name]}}

    if named:
        return json_schema(call(named))
    calls = [call(name) for name in functions]
    array = {"type": "array", "minItems": 1, **({} if high is None else {"maxItems": high}),
             "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if tool_choice == "required":
        return json_schema(array)
    if response_format is None:
        return None
    for name, parameters in functions.items():
        json_arguments(name, parameters, whitespace)  # the policy, naming the tool
    body = {"type": "or", "elements": [json_arguments("tools", array, whitespace),
                                       json_arguments("response_format", response_format, whitespace)]}
    return _constraint(body, "json", functions, tool_choice, "json", high, response_format, whitespace)


def _constraint(body, name, functions, tool_choice, format, high, response_format, whitespace) -> Constraint:
    from neuron_constrain.structured.tool_calls.parse import check_answer

    try:
        text = structural_tag_text({"type": "structural_tag", "format": body})
    except ConstraintError:
        raise
    except Exception as error:  # noqa: BLE001 - xgrammar's message
        raise ConstraintError(f"xgrammar could not build the {name} tool-call grammar ({engine_message(error)})") from error
    return Constraint(
        "ebnf", text, "bounded", max_whitespace=whitespace,
        validate=lambda answer: check_answer(answer, functions, tool_choice, format=format, max_calls=high,
                                             response_format=response_format),
    )

