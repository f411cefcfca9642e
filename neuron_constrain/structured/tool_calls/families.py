"""One declarative description per tool-call family: how its models write calls.

    family = resolve("mistral", tokenizer)    # the v11+ form where the vocabulary has [ARGS]
    family.trigger, family.call_open, family.arguments    # what the grammar and the parsers read
    write_calls(family, [ToolCall("f", {"a": 1})])        # the family's writer (tests, docs, demos)

Each description is read off the model's own chat template or published prompt format:
Qwen 2.5/3's template (``hermes``), Qwen3-Coder's (``qwen3_coder``), Llama 3.1-3.3's
(``llama3_json``), Llama 4's pythonic list (``pythonic``), mistral-common's tokenizers (``mistral``:
``json.dumps`` of the calls after ``[TOOL_CALLS]`` up to v7; ``[TOOL_CALLS]name[ARGS]{...}`` per
call from v11, ``[CALL_ID]id`` before ``[ARGS]`` from v13), DeepSeek V3's and V3.1's templates
(``deepseek_v3``: both forms), Kimi K2's (``functions.NAME:IDX``), gpt-oss's harmony format (the
``commentary`` channel). Text that the tokenizer has as a control token is matched as that token
(``controls``), never as text that spells it.
"""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Sequence

from neuron_constrain.structured.constraints import ConstraintError


@dataclasses.dataclass
class ToolCall:
    """One tool call read from an answer.

    Attributes:
        name: the tool's name.
        arguments: its arguments, valid against the tool's parameters when the call was constrained.
    """

    name: str
    arguments: dict


@dataclasses.dataclass(frozen=True)
class ToolFamily:
    """How one model family writes tool calls.

    Attributes:
        name: its ``TOOL_FORMATS`` name.
        models: the models that write it (the guide's table).
        arguments: ``"json"`` (one JSON object), ``"xml"`` (``<parameter=P>`` blocks, values typed by
            the schema) or ``"python"`` (keyword arguments, Python literals).
        call_open: the text before a call's arguments; ``{name}`` is the tool's name, ``{index}`` the
            call's number in the answer (digits; Kimi's ``functions.NAME:IDX``), ``{call_id}`` an optional
            ``[CALL_ID]`` and 9 letters or digits (Mistral v13), where the vocabulary has ``[CALL_ID]``.
        call_close: the text after them.
        name_style: ``"json"`` (a JSON string) or ``"raw"`` (the name as it is).
        separator: between two calls.
        section_open: before the first call (``optional_open``: it may be left out).
        section_close: after the last call.
        optional_space: a space may follow ``section_open`` (sentencepiece writes ``"▁["``).
        call_id: a call may end with mistral's ``, "id": "<9 letters or digits>"``.
        trigger: what starts the calls under ``tool_choice="auto"``.
        content_open: what starts an answer that is text, not calls (harmony's final channel): ``auto``
            is then that and free text, or the calls.
        leading: the calls are the whole answer when there are any (the model writes no text before them, and
            the servers' parsers read calls only at the start: vLLM's ``pythonic`` and ``llama3_json``):
            ``auto`` is free text, or the calls.
        loose: a pattern the parser also reads under ``auto`` (group 1: a JSON call object), for models
            that drift from their template; never what the grammar writes.
        controls: the names matched as control tokens where the tokenizer has them.
        required_controls: the control tokens without which the family is refused.
    """

    name: str
    models: str
    arguments: str
    call_open: str
    call_close: str
    name_style: str = "json"
    separator: str = ""
    section_open: str = ""
    section_close: str = ""
    optional_open: bool = False
    optional_space: bool = False
    call_id: bool = False
    trigger: str = ""
    content_open: str = ""
    leading: bool = False
    loose: str = ""
    controls: tuple[str, ...] = ()
    required_controls: tuple[str, ...] = ()

    def spelled(self, name: str) -> str:
        """The tool's name as the family writes it inside ``call_open``.

        Args:
            name: the tool's name.

        Returns:
            A JSON string, or the name itself.
        """
        return json.dumps(name, ensure_ascii=False) if self.name_style == "json" else name

    def opening_parts(self) -> list[str]:
        """``call_open`` as literal texts and the placeholders ``"{name}"`` / ``"{index}"`` / ``"{call_id}"``."""
        text = self.call_open.replace("{{", "\1").replace("}}", "\2")
        parts = re.split(r"(\{name\}|\{index\}|\{call_id\})", text)
        return [part.replace("\1", "{").replace("\2", "}") for part in parts if part]


_DS = "<｜"  # DeepSeek's tags open with a full-width bar
_DS_CONTROLS = tuple(f"{_DS}{name}｜>" for name in ("tool▁calls▁begin", "tool▁calls▁end", "tool▁call▁begin",
                                                    "tool▁call▁end", "tool▁sep"))
FAMILIES = {
    family.name: family for family in (
        ToolFamily("hermes", "Qwen 2.5, Qwen 3, Hermes 2/3, SmolLM3", "json",
                   '<tool_call>\n{{"name": {name}, "arguments": ', "}\n</tool_call>", separator="\n",
                   trigger="<tool_call>", loose=r"<tool_call>\s*(.*?)\s*</tool_call>",
                   controls=("<tool_call>", "</tool_call>")),
        ToolFamily("qwen3_coder", "Qwen3-Coder, Qwen3-Next", "xml",
                   "<tool_call>\n<function={name}>\n", "</function>\n</tool_call>", name_style="raw",
                   separator="\n", trigger="<tool_call>", controls=("<tool_call>", "</tool_call>")),
        ToolFamily("llama3_json", "Llama 3.1, 3.2, 3.3", "json",
                   '{{"name": {name}, "parameters": ', "}", separator="; ", section_open="<|python_tag|>",
                   optional_open=True, trigger='{"name": ', leading=True, controls=("<|python_tag|>",)),
        ToolFamily("pythonic", "Llama 4, Llama 3.2 (1B/3B), ToolACE", "python",
                   "{name}(", ")", name_style="raw", separator=", ", section_open="[", section_close="]",
                   trigger="[", leading=True),
        ToolFamily("mistral", "Mistral tokenizers v3-v7 (Mistral 7B v0.3, Nemo, Small 3)", "json",
                   '{{"name": {name}, "arguments": ', "}", separator=", ", section_open="[TOOL_CALLS][",
                   section_close="]", optional_space=True, call_id=True, trigger="[TOOL_CALLS]",
                   controls=("[TOOL_CALLS]",), required_controls=("[TOOL_CALLS]",)),
        ToolFamily("mistral_v11", "Mistral tokenizers v11+ (Magistral, Small 3.2, Devstral)", "json",
                   "[TOOL_CALLS]{name}{call_id}[ARGS]", "", name_style="raw", trigger="[TOOL_CALLS]",
                   controls=("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"), required_controls=("[TOOL_CALLS]", "[ARGS]")),
        ToolFamily("deepseek_v3.1", "DeepSeek V3.1, V3.2 (non-thinking)", "json",
                   f"{_DS}tool▁call▁begin｜>{{name}}{_DS}tool▁sep｜>", f"{_DS}tool▁call▁end｜>", name_style="raw",
                   section_open=f"{_DS}tool▁calls▁begin｜>", section_close=f"{_DS}tool▁calls▁end｜>",
                   trigger=f"{_DS}tool▁calls▁begin｜>", controls=_DS_CONTROLS),
        ToolFamily("deepseek_v3.0", "DeepSeek V3 (0324), R1 (0528)", "json",
                   f"{_DS}tool▁call▁begin｜>function{_DS}tool▁sep｜>{{name}}\n```json\n",
                   f"\n```{_DS}tool▁call▁end｜>", name_style="raw", separator="\n",
                   section_open=f"{_DS}tool▁calls▁begin｜>", section_close=f"{_DS}tool▁calls▁end｜>",
                   trigger=f"{_DS}tool▁calls▁begin｜>", controls=_DS_CONTROLS),
        ToolFamily("kimi_k2", "Kimi K2", "json",
                   "<|tool_call_begin|>functions.{name}:{index}<|tool_call_argument_begin|>", "<|tool_call_end|>",
                   name_style="raw", section_open="<|tool_calls_section_begin|>",
                   section_close="<|tool_calls_section_end|>", trigger="<|tool_calls_section_begin|>",
                   controls=("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                             "<|tool_call_argument_begin|>", "<|tool_call_end|>")),
        ToolFamily("harmony", "gpt-oss", "json",
                   "<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>", "<|call|>",
                   name_style="raw", separator="<|start|>assistant", trigger="<|channel|>commentary to=",
                   content_open="<|channel|>final<|message|>",
                   controls=("<|channel|>", "<|constrain|>", "<|message|>", "<|call|>", "<|start|>")),
    )
}
ALIASES = {"llama3": "llama3_json"}
FORMS = {"deepseek_v3": ("deepseek_v3.1", "deepseek_v3.0")}  # one name, either form accepted and read
TOOL_FORMATS = ("json", "mistral", "hermes", "llama3", "llama3_json", "qwen3_coder", "pythonic", "deepseek_v3",
                "kimi_k2", "harmony")
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}\Z")  # OpenAI's rule for a function's name


def control(tokenizer, name: str) -> int | None:
    """The id of control token ``name`` in ``tokenizer`` (None: it has none, or no tokenizer)."""
    lookup = getattr(tokenizer, "control_token", None)
    return lookup(name) if lookup is not None else None


def resolve(format: str, tokenizer=None) -> ToolFamily | None:
    """The family a ``TOOL_FORMATS`` name means with this tokenizer (None for ``"json"``).

    Args:
        format: one of ``TOOL_FORMATS``.
        tokenizer: the request's tokenizer: ``"mistral"`` is the v11+ form where it has ``[ARGS]``.

    Returns:
        The family's description; None for ``"json"`` (a JSON array of calls, built apart).

    Raises:
        ConstraintError: an unknown format.
    """
    if format not in TOOL_FORMATS:
        raise ConstraintError(f"tool-call format {format!r} is not one of {TOOL_FORMATS}")
    if format == "json":
        return None
    return forms(format, tokenizer)[0]


def forms(format: str, tokenizer=None) -> tuple[ToolFamily, ...]:
    """Every form a ``TOOL_FORMATS`` name accepts (``deepseek_v3``: V3.1's and V3's; others: one), the one its
    writer writes first.

    Args:
        format: one of ``TOOL_FORMATS`` other than ``"json"``.
        tokenizer: as :func:`resolve`.

    Returns:
        The families.
    """
    if format == "mistral" and control(tokenizer, "[ARGS]") is not None:
        return (FAMILIES["mistral_v11"],)
    if format in FORMS:
        return tuple(FAMILIES[name] for name in FORMS[format])
    return (FAMILIES[ALIASES.get(format, format)],)


def tool_functions(tools: Sequence[dict]) -> dict[str, dict]:
    """OpenAI ``tools`` as ``{name: parameters schema}``; raises ConstraintError for one that is not a function tool."""
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


def named_tool(tool_choice) -> str | None:
    """The tool a named ``tool_choice`` names, or None."""
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if isinstance(name, str):
            return name
    return None


def xml_value(value) -> str:
    """A value as Qwen3-Coder's template writes a parameter: ``tojson`` for objects and arrays, else ``| string``."""
    if isinstance(value, (dict, list)):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, bool) or value is None:
        return str(value)  # Jinja's `| string` of a Python bool / None: True, False, None
    return str(value) if not isinstance(value, float) else repr(value)


def python_value(value) -> str:
    """A value as a Python literal (strings double-quoted with JSON's escapes, which Python reads alike)."""
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(python_value(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {python_value(v)}" for k, v in value.items()) + "}"
    return repr(value)


def write_call(family: ToolFamily, call: ToolCall, index: int = 0) -> str:
    """One call as the family's model writes it (control tokens spelled as their names)."""
    if family.arguments == "json":
        body = json.dumps(call.arguments, ensure_ascii=False)
    elif family.arguments == "xml":
        body = "".join(f"<parameter={key}>\n{xml_value(value)}\n</parameter>\n" for key, value in call.arguments.items())
    else:
        body = ", ".join(f"{key}={python_value(value)}" for key, value in call.arguments.items())
    opening = family.call_open.format(name=family.spelled(call.name), index=index, call_id="")
    return opening + body + family.call_close


def write_calls(family: ToolFamily, calls: Sequence[ToolCall]) -> str:
    """Calls as the family's model writes them: the writer the round-trip properties check the grammar and
    parser against.

    Args:
        family: the family (``resolve(format, tokenizer)``).
        calls: one or more calls.

    Returns:
        The text, control tokens spelled as their names.
    """
    opening = "" if family.optional_open else family.section_open  # the template writes no optional opening
    written = family.separator.join(write_call(family, call, index) for index, call in enumerate(calls))
    return opening + written + family.section_close
