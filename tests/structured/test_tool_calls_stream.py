"""The streaming parser (``tool_calls/stream.py``): for text the grammar accepts, cut anywhere, the deltas the
``openai`` client assembles are the whole parser's content and calls."""
import pytest
from hypothesis import assume, given, settings, strategies as st

from neuron_constrain.structured import ToolCallStream, parse_tool_calls, tool_constraint
from neuron_constrain.structured.engines.xgrammar.grammars import ebnf_accepts
from neuron_constrain.structured.tool_calls.families import FAMILIES, ToolCall, write_calls
from neuron_constrain.structured.tool_calls.parse import read_section
from neuron_constrain.structured.tool_calls.stream import assembled

from test_tool_calls import FORMS, TEXT_FORMS, tools_and_calls

pytestmark = pytest.mark.torch_agnostic(lane="latest")


def _streamed(text: str, cuts: list[int], tools, choice, format):
    stream, deltas, at = ToolCallStream(tools, choice, format=format), [], 0
    for cut in sorted(set(cuts)) + [len(text)]:
        deltas += stream.feed(text[at:cut])
        at = max(at, cut)
    return deltas + stream.finish()


@settings(max_examples=25, deadline=None)
@given(tools_and_calls(), st.sampled_from(TEXT_FORMS), st.sampled_from(["required", "auto"]),
       st.lists(st.integers(0, 400), max_size=12), st.sampled_from(["", "Let me look. ", "a [b] c\n"]))
def test_streamed_calls_are_the_whole_parsers(drawn, form, choice, cuts, prose):
    tools, calls = drawn
    family, format = FAMILIES[form], FORMS.get(form, form)
    if family.arguments == "xml":
        assume(not any("\n</parameter>\n" in str(v) for c in calls for v in c.arguments.values()))
    text = (prose if choice == "auto" and not (family.content_open or family.leading) else "") + write_calls(family, calls)
    assume(ebnf_accepts(tool_constraint(tools, choice, format=format).spec, text))  # "a [b]" is no pythonic answer
    cuts = [c for c in cuts if c < len(text)]
    deltas = _streamed(text, cuts, tools, choice, format)
    assert assembled(deltas) == parse_tool_calls(text, tools, choice, format=format)
    announced = [d["tool_calls"][0] for d in deltas if "tool_calls" in d and "id" in d["tool_calls"][0]]
    assert [a["function"]["name"] for a in announced] == [c.name for c in calls]  # each call announced once
    assert [a["index"] for a in announced] == list(range(len(calls)))


def test_content_that_may_begin_a_trigger_is_held_back():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    stream = ToolCallStream(tools, "auto", format="hermes")
    assert stream.feed("Sure <tool") == [{"content": "Sure "}]
    assert stream.feed("_call>\n") == []
    deltas = stream.feed('{"name": "f", "arguments": {}}\n</tool_call>') + stream.finish()
    assert assembled([{"content": "Sure "}] + deltas) == ("Sure", [ToolCall("f", {})])
    plain = ToolCallStream(tools, "auto", format="hermes")
    assert assembled(plain.feed("a <tool") + plain.feed("box> b") + plain.finish()) == ("a <toolbox> b", [])
    with pytest.raises(ValueError, match="json"):
        ToolCallStream(tools, "auto", format="json")


@pytest.mark.parametrize("form", ["hermes", "qwen3_coder", "deepseek_v3.0", "pythonic"])
def test_a_long_answer_fed_a_character_at_a_time_is_read_in_linear_work(form, monkeypatch):
    """The section is read again from the last whole call's boundary, never from its start (python calls: once,
    when their list closes): the text the reader goes through stays within a few calls' length per feed."""
    from neuron_constrain.structured.tool_calls import stream as S

    seen = []

    def counting(family, text, at, *args, **kwargs):
        seen.append(len(text) - at)
        return read_section(family, text, at, *args, **kwargs)
    monkeypatch.setattr(S, "read_section", counting)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string"}}}}}]
    calls = [ToolCall("f", {"x": "a" * 40})] * 60
    call = len(write_calls(FAMILIES[form], calls[:1]))
    text = "Some prose first. " * 10 + write_calls(FAMILIES[form], calls)
    stream, deltas = ToolCallStream(tools, "auto", format=FORMS.get(form, form)), []
    for char in text:
        deltas += stream.feed(char)
    deltas += stream.finish()
    assert assembled(deltas) == (("Some prose first. " * 10).strip(), calls)
    assert sum(seen) <= 4 * call * len(text), (sum(seen), call, len(text))  # re-reading from the start: ~len(text)**2 / 2
