"""Tool calls on the server: vLLM's ``--tool-call-parser`` mapped to the library's tool-call family.

    family("hermes")                                 # "hermes": the TOOL_FORMATS name that serves the parser
    params = structured_outputs(request, "hermes", tokenizer)   # the library's grammar for the request, or None
    install()                                        # every parser vLLM composes grammars with the library

vLLM builds a request's tool-call grammar from its own tables (``structural_tag_registry``) and
reads the answer with its parser, written apart from the grammar. With the plugin, a request with
tools and ``tool_choice`` ``"required"``, a named tool or ``"auto"`` (when strict: the server's
``--tool-strict-level`` is ``function`` or ``parameter``, or a tool says ``strict: true``) gets the
library's grammar for the parser's family (``structured.tool_constraint``): ``required`` and named
are calls only, in the family's own format; ``parallel_tool_calls=false`` is one call, held in the
grammar. The family of a parser is looked up by name in :data:`PARSER_FAMILIES` and served when the
library lists it in ``TOOL_FORMATS`` at run time, so a family the library adds is served without a
change here; a strict request on a parser with no family gets a 400 naming the parser, never a
call generated unconstrained. Where the family is served but the library builds no grammar for the
request (``auto``, or tools with ``response_format``, before the library builds them) the request
keeps vLLM's structural tag for the parser, which the plugin compiles with the library's keyword
policy (``policy.structural_tag``); with neither, a 400. The tool parser then reads calls from required and named answers as from ``auto``
ones (its own format; never vLLM's JSON-array reading, which assumes the JSON family).
"""
from __future__ import annotations

import functools
import inspect
import threading

from neuron_constrain.structured import ConstraintError, tools as library_tools
from neuron_constrain.structured.schema import keywords

# vLLM --tool-call-parser name -> the TOOL_FORMATS names that serve it, the first the library lists wins
PARSER_FAMILIES: dict[str, tuple[str, ...]] = {
    "hermes": ("hermes",),
    "qwen3_coder": ("qwen3_coder",),
    "qwen3_xml": ("qwen3_coder",),
    "llama3_json": ("llama3_json", "llama3"),
    "llama4_json": ("llama3_json", "llama3"),
    "pythonic": ("pythonic",),
    "llama4_pythonic": ("pythonic",),
    "mistral": ("mistral",),
    "deepseek_v3": ("deepseek_v3",),
    "deepseek_v31": ("deepseek_v3",),
    "kimi_k2": ("kimi_k2",),
    "openai": ("harmony",),
}


class ToolParserError(ConstraintError):
    """A strict tool request on a server whose ``--tool-call-parser`` has no library family."""


def family(parser: str | None) -> str:
    """The library's tool-call family serving vLLM's ``--tool-call-parser`` ``parser``.

    Args:
        parser: the parser's name as vLLM's ``--tool-call-parser`` takes it (``"hermes"``).

    Returns:
        The ``TOOL_FORMATS`` name (``"hermes"``).

    Raises:
        ToolParserError: no parser, a parser this table does not know, or one whose family the
            library does not build (yet); the message names the parser and the served ones.
    """
    formats = library_tools.TOOL_FORMATS
    served = sorted(name for name, families in PARSER_FAMILIES.items() if any(f in formats for f in families))
    for name in PARSER_FAMILIES.get(parser or "", ()):
        if name in formats:
            return name
    why = ("has no tool-call family in neuron_constrain" if parser not in PARSER_FAMILIES else
           f"maps to the family {PARSER_FAMILIES[parser][0]!r}, which this neuron_constrain does not build")
    raise ToolParserError(
        f"neuron_constrain: --tool-call-parser {parser!r} {why}, so a strict tool call cannot be enforced; "
        f"start the server with one of {', '.join(served)} (or send the request without strict tools, "
        f"tool_choice=\"auto\" and --tool-strict-level auto)"
    )


def is_strict(request, server_level: int) -> bool:
    """Whether ``request``'s tool calls must be enforced: ``required`` / named always; ``auto`` when the
    server's ``--tool-strict-level`` (``server_level``: 0 auto, 1 function, 2 parameter) is above auto or a
    tool says ``strict: true``."""
    choice = request.tool_choice
    if not request.tools or choice in ("none",):
        return False
    if choice not in ("auto", None):
        return True
    return server_level > 0 or any(getattr(getattr(t, "function", None), "strict", None) for t in request.tools)


def _dump(value):
    return value.model_dump(exclude_none=True) if hasattr(value, "model_dump") else value


def check_tool_schemas(tools: list[dict]) -> None:
    """Refuse a tool whose parameters hold a keyword xgrammar (the tool grammars' engine) does not enforce,
    naming the tool and the keyword's JSON pointer (``ConstraintError``)."""
    for tool in tools:
        function = tool.get("function") or {}
        try:
            keywords.check(function.get("parameters") or {"type": "object"}, "xgrammar")
        except ConstraintError as error:
            refused = ConstraintError(f"tool {function.get('name')!r}: {error}")
            refused.unenforced = getattr(error, "unenforced", None)  # type: ignore[attr-defined]
            raise refused from error


@functools.lru_cache(maxsize=4)
def _library_tokenizer(tokenizer):
    from neuron_constrain.structured import tokenizers

    inner = getattr(tokenizer, "tokenizer", None)
    if type(tokenizer).__name__ == "MistralTokenizer" and inner is not None:
        return tokenizers.from_mistral(inner)
    return tokenizers.from_huggingface(tokenizer)


_TOKENIZER_LOCK = threading.Lock()


def library_tokenizer(tokenizer):
    """The library's tokenizer over vLLM's (cached: building it decodes the vocabulary once)."""
    with _TOKENIZER_LOCK:
        return _library_tokenizer(tokenizer)


def library_constraint(request, parser: str, tokenizer):
    """The library's tool-call constraint for ``request`` (a ``ChatCompletionRequest``), or None where the
    library builds none for it (``auto`` or ``response_format`` beside tools, with a library that has no
    grammar for them).

    Raises:
        ToolParserError: the parser has no family (see :func:`family`).
        ConstraintError: a tool the library refuses (a keyword no engine enforces, a named tool not listed).
    """
    name = family(parser)
    tools = [_dump(t) for t in request.tools]
    check_tool_schemas(tools)
    choice = _dump(request.tool_choice) if request.tool_choice is not None else "auto"
    accepted = inspect.signature(library_tools.tool_constraint).parameters
    options = {"format": name, "tokenizer": library_tokenizer(tokenizer),
               "parallel_tool_calls": request.parallel_tool_calls is not False}
    response_format = _response_schema(request)
    if response_format is not None and choice == "auto":
        if "response_format" not in accepted:
            return None
        options["response_format"] = response_format
    return library_tools.tool_constraint(tools, choice, **options)


def _response_schema(request):
    response_format = getattr(request, "response_format", None)
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_schema" and response_format.json_schema is not None:
        return response_format.json_schema.json_schema
    return {"type": "object"} if response_format.type == "json_object" else _dump(response_format)


def structured_outputs(constraint) -> dict:
    """``StructuredOutputsParams`` keywords for a library constraint (``grammar=`` EBNF, ``json=`` a schema)."""
    if constraint.kind == "ebnf":
        return {"grammar": constraint.spec}
    if constraint.kind == "json_schema":
        return {"json": constraint.spec}
    if constraint.kind == "regex":
        return {"regex": constraint.spec}
    raise ConstraintError(f"a tool-call constraint of kind {constraint.kind!r} has no vLLM request form")


def refusal(error: ConstraintError):
    """The 400 (``VLLMValidationError``) for a tool request the library refuses."""
    from vllm.exceptions import VLLMValidationError

    parameter = "tool_choice" if isinstance(error, ToolParserError) else "tools"
    message = str(error) if str(error).startswith("neuron_constrain:") else f"neuron_constrain: {error}"
    return VLLMValidationError(message, parameter=parameter)


def served_parser(parser_cls, parser_name: str):
    """A subclass of vLLM's composed parser class whose requests with tools get the library's grammar."""
    from vllm.sampling_params import StructuredOutputsParams

    tool_parser = parser_cls.tool_parser_cls
    if tool_parser is None or getattr(parser_cls, "neuron_constrain_parser", None):
        return parser_cls
    # read required / named answers in the family's own format, as auto ones
    reader = type(tool_parser.__name__, (tool_parser,), {"supports_required_and_named": False})

    def adjust_request(self, request):
        strict = is_strict(request, int(self.tool_strict_level))
        constraint = None
        if strict:
            try:
                constraint = library_constraint(request, parser_name, self.model_tokenizer)
            except ConstraintError as error:
                raise refusal(error) from None
        request = parser_cls.adjust_request(self, request)
        if constraint is not None:
            request.structured_outputs = StructuredOutputsParams(**structured_outputs(constraint))
            request.response_format = None
        elif strict and not _vllm_enforces(request):
            raise refusal(ToolParserError(
                f"neuron_constrain: --tool-call-parser {parser_name!r}: neither neuron_constrain nor vLLM builds a "
                f"grammar for tool_choice={_dump(request.tool_choice)!r} with these options here, so the call "
                "cannot be enforced; send tool_choice=\"required\" or a named tool"))
        return request

    return type(parser_cls.__name__, (parser_cls,), {
        "tool_parser_cls": reader, "adjust_request": adjust_request, "neuron_constrain_parser": parser_name,
        "__module__": __name__})


def _vllm_enforces(request) -> bool:
    """Whether vLLM's own structural tag enforces the request's calls (after its ``adjust_request``)."""
    so = getattr(request, "structured_outputs", None)
    return so is not None and so.structural_tag is not None


def install() -> None:
    """Wrap vLLM's ``ParserManager.get_parser`` so that every parser it composes for a ``--tool-call-parser``
    is :func:`served_parser`'s (idempotent; the API server process)."""
    from vllm.parser import ParserManager

    original = ParserManager.__dict__["get_parser"].__func__
    if getattr(original, "neuron_constrain_tools", False):
        return

    def get_parser(cls, tool_parser_name=None, *args, **kwargs):
        parser_cls = original(cls, tool_parser_name, *args, **kwargs)
        if parser_cls is None or not tool_parser_name:
            return parser_cls
        return served_parser(parser_cls, tool_parser_name)

    get_parser.neuron_constrain_tools = True
    ParserManager.get_parser = classmethod(functools.wraps(original)(get_parser))
