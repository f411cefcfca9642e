"""The streaming parser: text deltas in, OpenAI chat-completion deltas out (``content`` and ``tool_calls``).

    stream = ToolCallStream(tools, "auto", format="hermes")
    for piece in pieces:
        for delta in stream.feed(piece):     # {"content": ...} or {"tool_calls": [{"index", ...}]}
            ...
    deltas = stream.finish()                 # what is left: trailing content, calls only now whole

Each call is announced once its opening is read (``index``, ``id``, ``type``, ``function.name``, empty
``arguments``) and its arguments follow once the call is whole, as the JSON text ``json.dumps`` writes:
the ``openai`` client's accumulation of the deltas is the whole parser's calls. Text that could still turn
out to be the trigger is held back until it is told apart. For text the family's grammar accepts, the calls
streamed are the calls ``parse_tool_calls`` reads from the whole text (a property test checks it); on text no
grammar constrained, a call already announced stays announced even if what follows breaks the section.
Control tokens are read as their names (``parse.spelled_text`` writes generated tokens so). The work is
linear in the answer's length: each feed looks for the trigger in the new text only and reads the section
again from the last whole call's boundary (python calls once, when their list closes).
"""
from __future__ import annotations

import json
from typing import Sequence

from neuron_constrain.structured.tool_calls import families as F
from neuron_constrain.structured.tool_calls.families import ToolCall
from neuron_constrain.structured.tool_calls.parse import BracketScan, parse_family, read_section


class ToolCallStream:
    """One answer's streaming parser.

    Args:
        tools: the request's tools.
        tool_choice: its ``tool_choice`` (``required`` / named: the whole answer is calls).
        format: one of ``TOOL_FORMATS`` other than ``"json"``.
        tokenizer: as ``parse_tool_calls`` (``"mistral"``: the v11+ form where it has ``[ARGS]``).

    Raises:
        ValueError: ``"json"`` (no trigger to stream by) or an unknown format.
    """

    def __init__(self, tools: Sequence[dict], tool_choice="auto", *, format: str, tokenizer=None):
        if format == "json" or format not in F.TOOL_FORMATS:
            raise ValueError(f"format={format!r}: stream one of {F.TOOL_FORMATS[1:]} (\"json\" has no trigger; "
                             "parse the whole answer with parse_tool_calls)")
        self.forms = F.forms(format, tokenizer)
        self.functions = F.tool_functions(tools)
        self.forced = tool_choice == "required" or F.named_tool(tool_choice) is not None
        self.none = tool_choice == "none"
        self.text, self.content_sent, self.sent, self.names_sent, self.calls_sent = "", 0, 0, 0, 0
        self.section: tuple[F.ToolFamily, int] | None = None  # the form and where its calls begin
        # linear in the answer's length: the trigger is looked for in new text only, and the section is read
        # again from the last whole call's boundary (its form then settled), not from its start
        self.scanned = 0  # the trigger search's start
        self.read: list = []  # the reader's progress up to `resume`
        self.resume: int | None = None
        self.brackets: BracketScan | None = None  # python calls: read once their list closes

    def feed(self, delta: str) -> list[dict]:
        """The deltas ``delta`` completes.

        Args:
            delta: the next piece of the answer's text.

        Returns:
            Chat-completion deltas: ``{"content": str}`` or ``{"tool_calls": [...]}``.
        """
        self.text += delta
        return self._deltas(final=False)

    def finish(self) -> list[dict]:
        """The deltas left when the answer ends: content held back, calls only now whole.

        Returns:
            Chat-completion deltas.
        """
        return self._deltas(final=True)

    def _content(self, upto: int) -> list[dict]:
        start = max(self.content_sent, self._content_start())
        piece = self.text[start:upto]
        self.content_sent = max(self.content_sent, upto)
        return [{"content": piece}] if piece else []

    def _content_start(self) -> int:
        opening = self.forms[0].content_open
        return len(opening) if opening and self.text.startswith(opening) else 0

    def _held(self) -> int:
        """Where content must stop: the longest end of the text that could begin a trigger (or harmony's
        final-channel tag) is held back."""
        text, cut = self.text, len(self.text)
        marks = [f.trigger for f in self.forms] + [f.section_open for f in self.forms if f.optional_open]
        for mark in marks:
            for size in range(min(len(mark) - 1, len(text)), 0, -1):
                if text.endswith(mark[:size]):
                    cut = min(cut, len(text) - size)
                    break
        opening = self.forms[0].content_open
        if opening and opening.startswith(text):
            cut = 0
        return cut

    def _find_section(self) -> None:
        if self.section is not None:
            return
        if self.forced:
            self.section = (self.forms[0], len(self.text) - len(self.text.lstrip()))
            return
        starts, marks = [], [(family, mark) for family in self.forms
                             for mark in [family.trigger] + ([family.section_open] if family.optional_open else [])]
        longest = max(len(mark) for _, mark in marks)
        since = max(self._content_start(), self.scanned - longest + 1)
        for family, mark in marks:
            at = self.text.find(mark, since)
            if at >= 0:
                starts.append((at, family))
        self.scanned = len(self.text)
        if starts:
            at, family = min(starts, key=lambda pair: pair[0])
            self.section = (family, at)

    def _deltas(self, final: bool) -> list[dict]:
        if self.none:
            return self._content(len(self.text) if final else self._held())
        self._find_section()
        if self.section is None:
            return self._content(len(self.text) if final else self._held())
        out = self._content(self.section[1])
        progress = self._progress()
        for item in progress[self.sent:]:
            out += self._announce(item)
        if final:
            out += self._rest()
        return out

    def _progress(self) -> list:
        """What the reader got through (names and whole calls), trying each form where there are several
        until one has read a whole call and another follows."""
        if self.section[0].arguments == "python":  # calls come whole when the list closes: read it then
            self.brackets = self.brackets or BracketScan(self.section[1])
            if self.brackets.scan(self.text) is None:
                return []
        best, boundaries = [], []
        settled = self.resume is not None or len(self.forms) == 1
        for family in (self.section[0],) if settled else self.forms:
            progress, found = [], []
            try:
                read_section(family, self.text, self.section[1] if self.resume is None else self.resume,
                             self.functions, progress, found, continued=self.resume is not None)
            except (ValueError, json.JSONDecodeError):
                pass
            if len(progress) > len(best):
                best, boundaries, self.section = progress, found, (family, self.section[1])
        if boundaries:  # each whole call before the last boundary was read as [its name, the call]
            whole = 2 * len(boundaries)
            self.read, best, self.resume = self.read + best[:whole], best[whole:], boundaries[-1]
        return self.read + best

    def _announce(self, item) -> list[dict]:
        """The deltas of one step of the reader: a call's name, or a whole call (its name too where the
        form reads calls whole, as ``pythonic`` does)."""
        self.sent += 1
        if not isinstance(item, ToolCall):
            self.names_sent += 1
            return [_call(self.names_sent - 1, item)]
        index = self.calls_sent
        self.calls_sent += 1
        if index < self.names_sent:
            return [_arguments(index, item.arguments)]
        self.names_sent += 1
        return [_call(index, item.name), _arguments(index, item.arguments)]

    def _rest(self) -> list[dict]:
        """At the end: the whole parser's reading; what it found beyond the streamed calls, and trailing content."""
        family, start = self.section
        content, calls = "", []
        try:
            calls, end = read_section(family, self.text, start, self.functions)
            content = self.text[end:]
        except (ValueError, json.JSONDecodeError):
            content, calls = parse_family(family, self.text[start:], self.functions, False) if not self.forced \
                else (self.text[start:], [])
        out = []
        for index in range(self.calls_sent, len(calls)):
            out += self._announce(calls[index])
        if content.strip() and not self.forced:
            out.append({"content": content})
        return out


def _call(index: int, name: str) -> dict:
    return {"tool_calls": [{"index": index, "id": f"call_{index}", "type": "function",
                            "function": {"name": name, "arguments": ""}}]}


def _arguments(index: int, arguments: dict) -> dict:
    return {"tool_calls": [{"index": index, "function": {"arguments": json.dumps(arguments, ensure_ascii=False)}}]}


def assembled(deltas: Sequence[dict]) -> tuple[str, list[ToolCall]]:
    """Deltas accumulated as the ``openai`` client does: ``(content, calls)``.

    Args:
        deltas: what a :class:`ToolCallStream` gave.

    Returns:
        The content and the calls (arguments read from their JSON text).
    """
    content, calls = "", {}
    for delta in deltas:
        content += delta.get("content") or ""
        for part in delta.get("tool_calls") or ():
            call = calls.setdefault(part["index"], {"name": "", "arguments": ""})
            call["name"] += part.get("function", {}).get("name") or ""
            call["arguments"] += part.get("function", {}).get("arguments") or ""
    return content.strip(), [ToolCall(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]
