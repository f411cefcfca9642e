"""One request to a model, as ``neuron-constrain generate`` and the demo make it: the
prompt (chat template, tools rendered Hermes-style), the constraint, the KV-cached
decoder, and the answer parsed (JSON value, tool calls).

    request = Request("Weather in Paris?", tools=tools, tool_choice="required")
    answer = ask(load_model("smollm2"), request, engine="auto", max_tokens=128)
    answer.text, answer.value, answer.tool_calls, answer.finish_reason
"""
from __future__ import annotations

import dataclasses
import json
import time
from typing import Sequence

from neuron_constrain.models.smollm2 import Loaded
from neuron_constrain.structured import Constraint, ConstraintError, choice, json_schema, parse_tool_calls, regex, tool_constraint, validate_output
from neuron_constrain.structured import generate
from neuron_constrain.structured.engines.xgrammar.engine import parse_constraint

TOOL_FORMAT = "hermes"  # how the tool chat template asks SmolLM2 to call (chat.py)


@dataclasses.dataclass
class Request:
    """A prompt and at most one kind of constraint (``tools`` with ``tool_choice``)."""

    prompt: str
    schema: dict | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    tools: Sequence[dict] | None = None
    tool_choice: str = "auto"  # "auto" | "required" | "none" | a tool's name
    whitespace: str | None = None  # JSON schema only; None: json_schema's default ("compact")
    # tool_choice="required" makes one call unless this is set: SmolLM2 otherwise repeats its call
    # until the token limit (3 of 24 tool tasks in benchmarks/bench_quality.py)
    parallel_tool_calls: bool = False
    system: str | None = None

    def constraint(self, tokenizer=None) -> Constraint | None:
        """The constraint this request asks for; :class:`ConstraintError` when it asks for two or a bad one."""
        given = [name for name in ("schema", "regex", "choice", "tools") if getattr(self, name) is not None]
        if len(given) > 1:
            raise ConstraintError(f"{' and '.join(given)} both constrain the answer: pass one")
        if self.whitespace is not None and given != ["schema"]:
            raise ConstraintError("whitespace applies to a JSON schema: pass it with a schema")
        if self.schema is not None:
            _check_schema(self.schema)
            return json_schema(self.schema, whitespace=self.whitespace)
        if self.regex is not None or self.choice is not None:
            constraint = regex(self.regex) if self.regex is not None else choice(list(self.choice))
            parse_constraint(constraint)  # a malformed pattern fails here (xgrammar's parser), before any model loads
            return constraint
        if self.tools is not None:
            return tool_constraint(self.tools, _tool_choice(self.tool_choice), format=TOOL_FORMAT, tokenizer=tokenizer,
                                   parallel_tool_calls=self.parallel_tool_calls)
        return None


def _load_json(path: str, flag: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{flag} {path}: no such file; pass a JSON file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{flag} {path}: not readable JSON ({error})") from error


def request_from_options(prompt: str, *, schema: str | None = None, regex: str | None = None, choice: str | None = None,
                         tools: str | None = None, tool_choice: str | None = None, whitespace: str | None = None,
                         parallel_tool_calls: bool = False, max_tokens: int = 256) -> Request:
    """A :class:`Request` from command-line options (file paths, ``"a,b"`` choices), checked:
    ``ValueError`` / :class:`ConstraintError` naming the option and the fix."""
    if max_tokens < 1:
        raise ValueError(f"--max-tokens {max_tokens}: generate at least 1 token")
    if tool_choice is not None and tools is None:
        raise ValueError("--tool-choice chooses among --tools FILE; pass the tools too")
    tool_list = _load_json(tools, "--tools") if tools is not None else None
    if tool_list is not None and not isinstance(tool_list, list):
        raise ValueError(f'--tools {tools}: a JSON list of OpenAI tools ([{{"type": "function", ...}}])')
    request = Request(prompt, schema=_load_json(schema, "--schema") if schema is not None else None, regex=regex,
                      choice=[o.strip() for o in choice.split(",")] if choice is not None else None,
                      tools=tool_list, tool_choice=tool_choice or "auto", whitespace=whitespace,
                      parallel_tool_calls=parallel_tool_calls)
    request.constraint()
    return request


def _check_schema(schema) -> None:
    """Refuse what is not a JSON schema at all (by its draft's meta-schema), naming the problem."""
    import jsonschema

    if not isinstance(schema, dict):
        raise ConstraintError(f"a JSON schema is an object, got {type(schema).__name__}")
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as error:
        raise ConstraintError(f"not a valid JSON schema: {error.message}") from error


def _tool_choice(value: str):
    if value in ("auto", "required", "none"):
        return value
    return {"type": "function", "function": {"name": value}}


@dataclasses.dataclass
class Answer:
    text: str
    tokens: int
    finish_reason: str
    seconds: float  # export + generation
    error: str | None = None
    value: object = None  # the parsed JSON of a schema request
    tool_calls: list | None = None  # [{"name", "arguments"}] of a tools request
    problem: str | None = None  # why the finished answer does not satisfy the constraint (never expected)


def ask(loaded: Loaded, request: Request, *, engine: str = "auto", max_tokens: int = 256,
        compile: str | None = None) -> Answer:
    """Export ``loaded`` for this one request (a cache sized to it) and generate greedily.
    ``compile="inductor"``: AOTInductor packages (the cache then in steps of 1024 slots, so
    every request of up to 1024 tokens reuses the packages compiled once); ``"auto"``: those
    packages where they are built already, else eager."""
    from neuron_constrain.models import export, prompt_ids

    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens}: pass at least 1")
    constraint = request.constraint(loaded.tokenizer)
    tools = request.tools if request.tools is not None and request.tool_choice != "none" else None
    ids = prompt_ids(loaded, request.prompt, system=request.system, tools=tools)
    start = time.perf_counter()
    step = 64 if compile is None else 1024
    decoder = export(loaded, max_batch=1, max_len=step * -(-(len(ids) + max_tokens) // step), compile=compile)
    out = generate(decoder, [ids], [constraint], max_tokens, tokenizer=loaded.tokenizer, engine=engine).outputs[0]
    answer = Answer(out.text, len(out.tokens), out.finish_reason, time.perf_counter() - start, out.error)
    if out.finish_reason != "stop":
        if constraint is not None and out.finish_reason == "length":
            answer.problem = f"it hit max_tokens={max_tokens} before the constraint was complete"
        return answer
    if constraint is not None:
        answer.problem = validate_output(constraint, out.text)
    if request.schema is not None and answer.problem is None:
        answer.value = json.loads(out.text)
    if request.tools is not None:
        _, calls = parse_tool_calls(out.text, request.tools, _tool_choice(request.tool_choice), format=TOOL_FORMAT)
        answer.tool_calls = [{"name": c.name, "arguments": c.arguments} for c in calls]
    return answer
