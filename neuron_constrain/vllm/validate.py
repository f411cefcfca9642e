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
"""
from __future__ import annotations

import torch

from neuron_constrain.vllm import check_vllm_version

check_vllm_version()

from vllm.exceptions import VLLMValidationError  # noqa: E402

from neuron_constrain.vllm import admission, tool_calls  # noqa: E402
from vllm.v1.sample.logits_processor import LogitsProcessor  # noqa: E402

admission.install()  # the verdict off the API server's event loop, before vLLM's own checks
tool_calls.install()  # requests with tools get the library's grammar for the --tool-call-parser's family


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
