"""Tool-call families (``structured/tool_calls/``): the writer, the grammar and the parser agree, by property;
limits and refusals. Host-only: grammars are matched as text (``ebnf_accepts``); the token-level tests on
Tekken are in ``test_tool_calls_tokens.py``."""
import json
import keyword

import jsonschema
import pytest
from hypothesis import assume, given, settings, strategies as st

from neuron_constrain.structured import ConstraintError, parse_tool_calls, tool_constraint, validate_output
from neuron_constrain.structured.engines.xgrammar.grammars import ebnf_accepts
from neuron_constrain.structured.tool_calls.families import FAMILIES, ToolCall, resolve, write_calls

pytestmark = pytest.mark.torch_agnostic(lane="latest")
TEXT_FAMILIES = ["hermes", "qwen3_coder", "llama3_json", "pythonic", "deepseek_v3", "kimi_k2", "harmony"]
FORMS = {"deepseek_v3.0": "deepseek_v3", "deepseek_v3.1": "deepseek_v3"}  # each form, and the format that reads it
TEXT_FORMS = [name for name in FAMILIES if not name.startswith("mistral")]
NAME = st.from_regex(r"[a-z][a-z0-9_]{0,8}", fullmatch=True).filter(lambda name: not keyword.iskeyword(name))
TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
PARAMETER = st.sampled_from([
    ({"type": "string"}, TEXT),
    ({"type": "integer"}, st.integers(-10**6, 10**6)),
    ({"type": "boolean"}, st.booleans()),
    ({"type": "string", "enum": ["celsius", "fahrenheit"]}, st.sampled_from(["celsius", "fahrenheit"])),
    ({"type": "array", "items": {"type": "integer"}}, st.lists(st.integers(0, 99), max_size=3)),
])


@st.composite
def tools_and_calls(draw):
    """A tool set (1-3 tools, 0-3 typed parameters each, some required) and 1-3 calls valid against it."""
    names = draw(st.lists(NAME, min_size=1, max_size=3, unique=True))
    tools, values = [], {}
    for name in names:
        keys = draw(st.lists(NAME, max_size=3, unique=True))
        drawn = {key: draw(PARAMETER) for key in keys}
        required = [key for key in keys if draw(st.booleans())]
        parameters = {"type": "object", "properties": {k: s for k, (s, _) in drawn.items()}, "required": required,
                      "additionalProperties": False}
        tools.append({"type": "function", "function": {"name": name, "parameters": parameters}})
        values[name] = (drawn, required)
    calls = []
    for _ in range(draw(st.integers(1, 3))):
        name = draw(st.sampled_from(names))
        drawn, required = values[name]
        arguments = {k: draw(strategy) for k, (_, strategy) in drawn.items() if k in required or draw(st.booleans())}
        calls.append(ToolCall(name, arguments))
    return tools, calls


@settings(max_examples=30, deadline=None)
@given(tools_and_calls(), st.sampled_from(TEXT_FORMS), st.sampled_from(["required", "auto"]))
def test_written_calls_are_accepted_and_parse_back(drawn, form, choice):
    """Every form's writer -> its format's grammar accepts -> its parser returns the same calls (and the limits)."""
    tools, calls = drawn
    family, format = FAMILIES[form], FORMS.get(form, form)
    if family.arguments == "xml":
        assume(not any("\n</parameter>\n" in str(v) for c in calls for v in c.arguments.values()))
    text = write_calls(family, calls)
    constraint = tool_constraint(tools, choice, format=format)
    assert ebnf_accepts(constraint.spec, text), text
    assert parse_tool_calls(text, tools, choice, format=format) == ("", calls)
    assert validate_output(constraint, text) is None
    one = tool_constraint(tools, "required", format=format, parallel_tool_calls=False)
    assert ebnf_accepts(one.spec, text) == (len(calls) == 1)
    at_most_two = tool_constraint(tools, "required", format=format, max_tool_calls=2)
    assert ebnf_accepts(at_most_two.spec, text) == (len(calls) <= 2)


@settings(max_examples=15, deadline=None)
@given(tools_and_calls(), st.sampled_from([f for f in TEXT_FAMILIES if f != "harmony"]), st.text("abc .,!?\n", max_size=20))
def test_auto_is_free_text_then_calls_to_the_end_or_calls_alone_where_they_lead(drawn, format, prose):
    tools, calls = drawn
    family = resolve(format)
    assume(family.trigger not in prose and prose.strip())
    if family.arguments == "xml":
        assume(not any("\n</parameter>\n" in str(v) for c in calls for v in c.arguments.values()))
    text = write_calls(family, calls)
    auto = tool_constraint(tools, "auto", format=format)
    assert ebnf_accepts(auto.spec, prose) and ebnf_accepts(auto.spec, text)
    # calls after text: where the family's calls lead the answer, never (vLLM's parser would read them as text)
    assert ebnf_accepts(auto.spec, prose + text) != family.leading
    assert not ebnf_accepts(auto.spec, prose + text + " and more")  # calls exactly, to the end
    assert parse_tool_calls(prose + text, tools, "auto", format=format) == (prose.strip(), calls)
    assert not ebnf_accepts(tool_constraint(tools, "required", format=format).spec, prose + text)


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city"], "additionalProperties": False}}}


@pytest.mark.parametrize("format, text", [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}'),
    ("pythonic", '[get_weather(city="Paris", days=3)]'),
])
def test_each_family_reads_what_its_template_writes(format, text):
    """The spelling each model's chat template writes (Qwen 2.5/3, Qwen3-Coder, Llama 3.1, Llama 4)."""
    constraint = tool_constraint([WEATHER], "required", format=format)
    assert ebnf_accepts(constraint.spec, text)
    assert parse_tool_calls(text, [WEATHER], "required", format=format)[1] == [ToolCall("get_weather", {"city": "Paris", "days": 3})]
    assert write_calls(FAMILIES[format], [ToolCall("get_weather", {"city": "Paris", "days": 3})]) == text


@pytest.mark.parametrize("format, bad", [
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "<parameter=days>\nthree\n</parameter>\n</function>\n</tool_call>"),  # an integer is digits
    ("pythonic", '[get_weather(city=3)]'),  # a string is a quoted literal
    ("pythonic", '[get_weather(days=3)]'),  # city is required
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "k"}}\n</tool_call>'),
])
def test_argument_values_are_typed_by_the_schema(format, bad):
    constraint = tool_constraint([WEATHER], "required", format=format)
    assert not ebnf_accepts(constraint.spec, bad)
    assert validate_output(constraint, bad) is not None


def test_whitespace_cap_is_configurable():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city":     "Paris"}}\n</tool_call>'
    assert ebnf_accepts(tool_constraint([WEATHER], "required", format="hermes", whitespace=5).spec, text)
    assert not ebnf_accepts(tool_constraint([WEATHER], "required", format="hermes", whitespace=4).spec, text)
    assert not ebnf_accepts(tool_constraint([WEATHER], "required", format="hermes").spec, text)  # 2 by default
    trailing = '{"name": "get_weather", "parameters": {"city": "Paris"}}     '
    assert not ebnf_accepts(tool_constraint([WEATHER], "required", format="llama3_json").spec, trailing)


def test_harmony_auto_is_the_final_channel_or_calls():
    auto = tool_constraint([WEATHER], "auto", format="harmony")
    call = write_calls(FAMILIES["harmony"], [ToolCall("get_weather", {"city": "Oslo"})])
    assert call == '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>'
    assert ebnf_accepts(auto.spec, call) and ebnf_accepts(auto.spec, "<|channel|>final<|message|>It is sunny.")
    assert not ebnf_accepts(auto.spec, "It is sunny.")
    assert parse_tool_calls("<|channel|>final<|message|>It is sunny.", [WEATHER], "auto", format="harmony") == (
        "It is sunny.", [])


def test_deepseek_v3_accepts_and_reads_both_forms():
    constraint = tool_constraint([WEATHER], "required", format="deepseek_v3")
    for form in ("deepseek_v3.0", "deepseek_v3.1"):
        text = write_calls(FAMILIES[form], [ToolCall("get_weather", {"city": "Oslo"})])
        assert ebnf_accepts(constraint.spec, text)
        assert parse_tool_calls(text, [WEATHER], "required", format="deepseek_v3")[1] == [ToolCall("get_weather", {"city": "Oslo"})]
    v30 = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
           '{"city": "Oslo"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
    assert write_calls(FAMILIES["deepseek_v3.0"], [ToolCall("get_weather", {"city": "Oslo"})]) == v30
    mixed = v30.replace("<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
    assert not ebnf_accepts(constraint.spec, mixed)  # one form per answer


def test_tools_with_response_format_is_calls_or_the_schema():
    response = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    for format in ("hermes", "pythonic", "json"):
        constraint = tool_constraint([WEATHER], "auto", format=format, response_format=response)
        call = write_calls(FAMILIES[format], [ToolCall("get_weather", {"city": "Oslo"})]) if format != "json" \
            else json.dumps([{"name": "get_weather", "arguments": {"city": "Oslo"}}])
        assert ebnf_accepts(constraint.spec, call) and ebnf_accepts(constraint.spec, '{"answer": 42}')
        assert not ebnf_accepts(constraint.spec, '{"answer": "x"}') and not ebnf_accepts(constraint.spec, "Hi")
        assert validate_output(constraint, '{"answer": 42}') is None
    with pytest.raises(ConstraintError, match="response_format= with tool_choice='required'"):
        tool_constraint([WEATHER], "required", format="hermes", response_format=response)


def test_named_choice_is_one_call_of_that_tool():
    search = {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}
    named = {"type": "function", "function": {"name": "search"}}
    for format in TEXT_FAMILIES:
        constraint = tool_constraint([WEATHER, search], named, format=format)
        family = FAMILIES[resolve(format).name]
        assert ebnf_accepts(constraint.spec, write_calls(family, [ToolCall("search", {"q": "x"})]))
        assert not ebnf_accepts(constraint.spec, write_calls(family, [ToolCall("get_weather", {"city": "x"})]))
        assert not ebnf_accepts(constraint.spec, write_calls(family, [ToolCall("search", {"q": "x"})] * 2))


@pytest.mark.parametrize("format", ["hermes", "llama3_json", "qwen3_coder"])
def test_a_keyword_no_engine_enforces_is_refused_naming_the_tool_and_pointer(format):
    tool = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"items": {"type": "array", "items": {"type": "integer"},
                                                   "contains": {"const": 3}, "minContains": 2}}}}}
    with pytest.raises(ConstraintError, match=r"tool .pick.*(contains|minContains).* at #/properties/items"):
        tool_constraint([tool], "required", format=format)


@pytest.mark.parametrize("format, schema, pointer", [
    ("qwen3_coder", {"type": "string", "pattern": "^[a-z]+$"}, "#/properties/x/pattern"),
    ("pythonic", {"type": "string", "pattern": "^a+$"}, "#/properties/x/pattern"),
    ("pythonic", {"anyOf": [{"type": "string"}, {"type": "integer"}]}, "#/properties/x"),
])
def test_what_xml_and_python_spellings_cannot_enforce_is_refused(format, schema, pointer):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": schema}}}}
    with pytest.raises(ConstraintError, match=f"tool 'f'.* at {pointer}"):
        tool_constraint([tool], "required", format=format)


def test_bare_names_must_be_identifiers_and_options_are_checked():
    odd = {"type": "function", "function": {"name": "get-weather", "parameters": {"type": "object"}}}
    with pytest.raises(ConstraintError, match="identifier"):
        tool_constraint([odd], "required", format="pythonic")
    for name, key in (("f", "from"), ("f", "a-b"), ("class", "x")):  # ast would not read `from=1` or `class(...)`
        tool = {"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "properties": {key: {"type": "integer"}}}}}
        with pytest.raises(ConstraintError, match="identifier"):
            tool_constraint([tool], "required", format="pythonic")
    xml = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a>b": {"type": "integer"}}}}}
    with pytest.raises(ConstraintError, match="parameter=NAME"):
        tool_constraint([xml], "required", format="qwen3_coder")
    emails = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"to": {"type": "string", "format": "email"}}}}}
    with pytest.raises(ConstraintError, match="format"):
        tool_constraint([emails], "required", format="qwen3_coder")  # raw XML text would not enforce it
    assert tool_constraint([odd], "required", format="hermes") is not None
    assert tool_constraint([odd], "required", format="kimi_k2") is not None  # OpenAI's rule for bare names
    with pytest.raises(ConstraintError, match="OpenAI's rule"):
        tool_constraint([{"type": "function", "function": {"name": "a b", "parameters": {"type": "object"}}}],
                        "required", format="qwen3_coder")
    with pytest.raises(ConstraintError, match="max_tool_calls=0"):
        tool_constraint([WEATHER], "required", format="hermes", max_tool_calls=0)
    with pytest.raises(ConstraintError, match="needs a tokenizer with the \\[TOOL_CALLS\\]"):
        tool_constraint([WEATHER], "required", format="mistral")


def test_parsed_calls_are_valid_against_the_tools():
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew\nYork\n</parameter>\n</function>\n</tool_call>"
    content, calls = parse_tool_calls("Sure.\n" + text, [WEATHER], "auto", format="qwen3_coder")
    assert content == "Sure." and calls == [ToolCall("get_weather", {"city": "New\nYork"})]
    jsonschema.validate(calls[0].arguments, WEATHER["function"]["parameters"])
    with pytest.raises(ValueError, match="not one of the tools"):
        parse_tool_calls("[other(a=1)]", [WEATHER], "required", format="pythonic")


def test_hermes_auto_also_reads_blocks_that_drift_from_the_template():
    """Today's reading kept: whitespace around the JSON, keys in any order, arguments as a JSON string."""
    text = ('Sure. <tool_call> {"arguments": "{\\"city\\": \\"Oslo\\"}", "name": "get_weather"} </tool_call> '
            "<tool_call>not json</tool_call>")
    content, calls = parse_tool_calls(text, [WEATHER], "auto", format="hermes")
    assert calls == [ToolCall("get_weather", {"city": "Oslo"})] and content == "Sure.  <tool_call>not json</tool_call>"
    assert not ebnf_accepts(tool_constraint([WEATHER], "auto", format="hermes").spec, text)  # the grammar: the template's
    with pytest.raises(ValueError):
        parse_tool_calls(text[6:], [WEATHER], "required", format="hermes")  # forced answers are read strictly


def test_an_untyped_python_value_is_any_literal_ast_reads():
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"description": "anything"}}, "required": ["x"]}}}
    constraint = tool_constraint([tool], "required", format="pythonic")
    for text, value in (('[f(x=[1, {"k": None}, True])]', [1, {"k": None}, True]), ('[f(x="a\\"b")]', 'a"b')):
        assert ebnf_accepts(constraint.spec, text)
        assert parse_tool_calls(text, [tool], "required", format="pythonic")[1] == [ToolCall("f", {"x": value})]
    for text in ("[f(x=true)]", '[f(x="a\\/b")]', "[f(x={1: 2})]"):  # JSON's spellings Python reads otherwise
        assert not ebnf_accepts(constraint.spec, text)


def test_bounded_numbers_and_strings_in_xml_and_python_arguments():
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 1, "maximum": 10}, "s": {"type": "string", "maxLength": 3}},
        "required": ["n", "s"], "additionalProperties": False}}}
    xml = tool_constraint([tool], "required", format="qwen3_coder")
    python = tool_constraint([tool], "required", format="pythonic")
    for n, s, ok in ((3, "abc", True), (11, "abc", False), (0, "ab", False), (3, "abcd", False)):
        for constraint, family in ((xml, "qwen3_coder"), (python, "pythonic")):
            text = write_calls(FAMILIES[family], [ToolCall("f", {"n": n, "s": s})])
            assert ebnf_accepts(constraint.spec, text) == ok, (family, text)
    assert ebnf_accepts(python.spec, '[f(n=3, s="\\n\\t\\"")]')  # an escape is one character
    assert not ebnf_accepts(xml.spec, write_calls(FAMILIES["qwen3_coder"], [ToolCall("f", {"n": 3, "s": "a\nb"})]))


# What the four formats of the release before the families wrote (json.dumps spellings, its own whitespace):
# today's grammars still take it and today's parsers still read it to the same calls.
BEFORE = {
    "json": ('[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]', "required"),
    "hermes": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>', "required"),
    "llama3": ('{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}', "required"),
}


@pytest.mark.parametrize("format", list(BEFORE))
def test_the_answers_of_the_formats_before_the_families_are_still_taken_and_read(format):
    text, choice = BEFORE[format]
    assert validate_output(tool_constraint([WEATHER], choice, format=format), text) is None
    assert parse_tool_calls(text, [WEATHER], choice, format=format) == (
        "", [ToolCall("get_weather", {"city": "Paris", "days": 3})])
    # mistral's is a token stream (its [TOOL_CALLS] is a control token): test_tool_calls_tokens.py; as text it reads
    mistral = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]'
    assert parse_tool_calls(mistral, [WEATHER], "auto", format="mistral")[1] == [
        ToolCall("get_weather", {"city": "Paris", "days": 3})]
