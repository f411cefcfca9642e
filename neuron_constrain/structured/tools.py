"""OpenAI tool calls: the names ``neuron_constrain.structured`` has always exported from here, now built in
``tool_calls/`` (one declarative description per model family: ``tool_calls/families.py``)."""
from neuron_constrain.structured.tool_calls.families import TOOL_FORMATS, ToolCall
from neuron_constrain.structured.tool_calls.grammar import tool_constraint
from neuron_constrain.structured.tool_calls.parse import parse_tool_calls
from neuron_constrain.structured.tool_calls.stream import ToolCallStream

__all__ = ["TOOL_FORMATS", "ToolCall", "ToolCallStream", "parse_tool_calls", "tool_constraint"]
