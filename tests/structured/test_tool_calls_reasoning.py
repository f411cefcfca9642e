"""Tool calls with reasoning: the thought first, then the calls; a call written inside the thought is not a call
(``Generation.text`` is the answer after the end marker, which is what ``parse_tool_calls`` reads). The tiny
decoder is test_reasoning's, built once a session: this test adds about 2 s to it."""
from neuron_constrain import structured as S
from neuron_constrain.structured.runtime.reasoning import Reasoning
from neuron_constrain.structured.tool_calls.families import ToolCall

from test_reasoning import END, _prompts, tiny_think

UNIT = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["unit"],
    "additionalProperties": False}}}
THOUGHT_CALL = '[get_weather(unit="c"), get_weather(unit="f")]'


def test_the_thought_comes_first_and_a_call_inside_it_is_not_a_call():
    hf, tok, decoder = tiny_think()
    constraint = S.tool_constraint([UNIT], "required", format="pythonic", tokenizer=tok, max_tool_calls=1)
    # the thought spells two calls; its budget fits it even spelled a character per token (the random model may)
    reasoning = Reasoning(budget=len(THOUGHT_CALL) + 2, thought=S.choice([THOUGHT_CALL]))
    (out,) = S.generate(decoder, _prompts(hf, 1), [constraint], 96, tokenizer=tok, reasoning=reasoning).outputs
    assert out.reasoning == THOUGHT_CALL and END in out.tokens and out.finish_reason == "stop"
    content, calls = S.parse_tool_calls(out.text, [UNIT], "required", format="pythonic")
    assert content == "" and len(calls) == 1 and calls[0] in (ToolCall("get_weather", {"unit": "c"}),
                                                             ToolCall("get_weather", {"unit": "f"}))
    assert S.validate_output(constraint, out.text) is None  # max_tool_calls=1 counts the answer's calls only
