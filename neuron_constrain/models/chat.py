"""Chat prompts for SmolLM2: its own ChatML template, and ChatML that renders ``tools``.

SmolLM2's template ignores ``tools``. :data:`TOOL_CHAT_TEMPLATE` is the same ChatML
(same default system prompt) with the tools listed Hermes-style in the system
message, and the call format the model is asked for, which
``tool_constraint(..., format="hermes")`` enforces and ``parse_tool_calls(...,
format="hermes")`` reads::

    <tool_call>
    {"name": "get_weather", "arguments": {"location": "Paris"}}
    </tool_call>

Assistant turns with ``tool_calls`` and ``tool`` turns render the same way, so a
server (``--chat-template build/smollm2/tool_chat_template.jinja``) can hold a
multi-turn tool conversation.
"""
from __future__ import annotations

from typing import Sequence

DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

TOOL_CHAT_TEMPLATE = (
    "{%- set ns = namespace(system='" + DEFAULT_SYSTEM + "', first=0) -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set ns.system = messages[0]['content'] -%}{%- set ns.first = 1 -%}"
    "{%- endif -%}"
    "{%- if tools -%}"
    "{%- set ns.system = ns.system + '\\n\\nYou may call one or more functions to assist with the user query. "
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -%}"
    "{%- for tool in tools -%}{%- set ns.system = ns.system + '\\n' + (tool | tojson) -%}{%- endfor -%}"
    "{%- set ns.system = ns.system + '\\n</tools>\\n\\nFor each function call, return a json object with the "
    "function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call>' -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>system\\n' + ns.system + '<|im_end|>\\n' -}}"
    "{%- for message in messages[ns.first:] -%}"
    "{%- if message['role'] == 'tool' -%}"
    "{{- '<|im_start|>tool\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') -}}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "{%- set function = call['function'] if 'function' in call else call -%}"
    "{%- set arguments = function['arguments'] if function['arguments'] is string else (function['arguments'] | tojson) -%}"
    "{{- ('\\n' if loop.first and message['content'] else ('' if loop.first else '\\n')) + '<tool_call>\\n"
    "{\"name\": \"' + function['name'] + '\", \"arguments\": ' + arguments + '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def chat_prompt(hf_tokenizer, user: str, *, system: str | None = None, tools: Sequence[dict] | None = None) -> list[int]:
    """Token ids of one user turn and the assistant's cue: the model's own template, or
    :data:`TOOL_CHAT_TEMPLATE` when ``tools`` are given.

    Args:
        hf_tokenizer: the model's Hugging Face tokenizer.
        user: the user's message.
        system: a system prompt (default: the template's own).
        tools: OpenAI tools, listed Hermes-style in the system turn.

    Returns:
        The prompt's token ids."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    template = TOOL_CHAT_TEMPLATE if tools else None
    return list(hf_tokenizer.apply_chat_template(
        messages, tools=list(tools) if tools else None, chat_template=template,
        add_generation_prompt=True, tokenize=True, return_dict=False,
    ))
