"""Per-request admission check, run by vLLM's frontend before the engine sees a request.

Registered as a vLLM logits processor (``--logits-processors
neuron_constrain.vllm.validate:RequestValidator``) only for its ``validate_params``
hook, which vLLM calls for every request at admission: a ``VLLMValidationError``
becomes an HTTP 400 naming the parameter, for that request alone. The worker never
raises for a request's parameters (an exception there stops the engine for all).
The processor itself does nothing to logits (the plugin's head samples every token).

No sampling parameter is refused here: the head serves every ``SamplingParams`` field
stock vLLM serves (the parity table of docs/guides/vllm.md; what vLLM refuses, its own validation
refuses first, with its 400). What it applies is the library's structured-outputs policy
(``policy.admit``) to every constrained request: a constraint past the server's limits, a
schema no value satisfies, one holding a keyword no engine enforces, or a constraint neither
engine reads, gets a 400 naming the limit (and its ``--limit`` flag) or the keyword and its
JSON pointer before any token is generated. Importing this module installs ``admission.py``'s
wrapper, which reaches that verdict off the API server's event loop first. vLLM calls
``validate_params`` after its own structured-output
validation (``InputProcessor._validate_params``: ``params.verify(...)``, then the logits
processors' hooks), so what vLLM itself refuses keeps vLLM's 400.

Importing it also wraps vLLM's ``ParserManager.get_parser`` (``install_tool_calls``): the parser composed
for ``--tool-call-parser`` gives a request with tools and ``tool_choice`` ``"required"``, a named tool or
``"auto"`` (when strict: ``--tool-strict-level`` ``function`` / ``parameter``, or a tool's ``strict: true``)
the library's grammar for the parser's family (``policy.family``, ``policy.library_constraint``):
calls only, in the family's own format, ``parallel_tool_calls=false`` one call in the grammar, and
the tool parser reads required / named answers as auto ones (its format, not vLLM's JSON array). A
strict request on a parser with no family is a 400 naming it, never a call generated unconstrained.
"""
from __future__ import annotations

import functools

import torch

from neuron_constrain.vllm import check_vllm_version

check_vllm_version()

from vllm.exceptions import VLLMValidationError  # noqa: E402

from neuron_constrain.structured import ConstraintError  # noqa: E402
from neuron_constrain.vllm import admission, policy  # noqa: E402
from vllm.v1.sample.logits_processor import LogitsProcessor  # noqa: E402

admission.install()  # the verdict off the API server's event loop, before vLLM's own checks


def check_structured(params) -> None:
    """Raise ``VLLMValidationError`` (HTTP 400) for a constrained request the library's policy refuses:
    a limit passed (named with the flag that raises it), a schema no value satisfies, a keyword no
    engine enforces (named with its JSON pointer) or a constraint no engine reads. Behind the API
    server the verdict was reached off the event loop before (``admission.py``) and is looked up."""
    so = params.structured_outputs
    if so is None or so.all_constraints_none():
        return
    admission.verdict(so, admission.admission().limits)


class RequestValidator(LogitsProcessor):
    """A no-op vLLM logits processor whose ``validate_params`` is :func:`check_structured`."""

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        check_structured(sampling_params)

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        pass

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits


# --------------------------------------------------------------------------- tool calls
def tool_refusal(error: ConstraintError):
    """The 400 (``VLLMValidationError``) for a tool request the library refuses."""
    from vllm.exceptions import VLLMValidationError

    parameter = "tool_choice" if isinstance(error, policy.ToolParserError) else "tools"
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
        strict = policy.is_strict(request, int(self.tool_strict_level))
        constraint = None
        if strict:
            try:
                constraint = policy.library_constraint(request, parser_name, self.model_tokenizer)
            except ConstraintError as error:
                raise tool_refusal(error) from None
        request = parser_cls.adjust_request(self, request)
        if constraint is not None:
            request.structured_outputs = StructuredOutputsParams(**policy.structured_outputs(constraint))
            request.response_format = None
        elif strict:  # every family a parser maps to builds required / named / auto: never reached by them
            raise tool_refusal(policy.ToolParserError(
                f"neuron_constrain: --tool-call-parser {parser_name!r}: neuron_constrain builds no grammar for "
                f"tool_choice={policy.plain(request.tool_choice)!r} with these options, so the call cannot be "
                "enforced; send tool_choice=\"required\" or a named tool"))
        return request

    return type(parser_cls.__name__, (parser_cls,), {
        "tool_parser_cls": reader, "adjust_request": adjust_request, "neuron_constrain_parser": parser_name,
        "__module__": __name__})


def install_tool_calls() -> None:
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
        if kwargs.get("tokenizer") is not None and tool_parser_name in policy.PARSER_FAMILIES:
            policy.library_tokenizer(kwargs["tokenizer"])  # at start: not in the first tool request's path
        return served_parser(parser_cls, tool_parser_name)

    get_parser.neuron_constrain_tools = True
    ParserManager.get_parser = classmethod(functools.wraps(original)(get_parser))


install_tool_calls()  # requests with tools get the library's grammar for the --tool-call-parser's family
