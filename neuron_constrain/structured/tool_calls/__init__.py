"""Tool calling: one declarative description per model family (``families``), from which the constraint
(``grammar``), the whole-answer parser (``parse``) and the streaming parser (``stream``) are derived;
``arguments`` types each family's argument spelling by the tool's schema."""
from neuron_constrain.structured.tool_calls.families import TOOL_FORMATS, ToolCall
from neuron_constrain.structured.tool_calls.grammar import tool_constraint
from neuron_constrain.structured.tool_calls.parse import parse_tool_calls
from neuron_constrain.structured.tool_calls.stream import ToolCallStream

__all__ = ["arguments", "families", "grammar", "parse", "stream"]
