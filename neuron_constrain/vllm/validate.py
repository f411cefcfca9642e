"""Per-request admission check, run by vLLM's frontend before the engine sees a request.

Registered as a vLLM logits processor (``--logits-processors
neuron_constrain.vllm.validate:RequestValidator``) only for its ``validate_params``
hook, which vLLM calls for every request at admission: a ``VLLMValidationError``
becomes an HTTP 400 naming the parameter, for that request alone. The worker never
raises for a request's parameters (an exception there stops the engine for all).
The processor itself does nothing to logits (the plugin's head samples every token).

It also applies the library's structured-outputs policy (``policy.admit``) to every
constrained request: a constraint past the server's limits, a schema no value satisfies,
one holding a keyword no engine enforces, or a constraint neither engine reads, gets a
400 naming the limit (and its ``--limit`` flag) or the keyword and its JSON pointer
before any token is generated. Importing this module installs ``admission.py``'s wrapper,
which reaches that verdict off the API server's event loop first. vLLM calls ``validate_params`` after its own structured-output
validation (``InputProcessor._validate_params``: ``params.verify(...)``, then the logits
processors' hooks), so what vLLM itself refuses keeps vLLM's 400.
"""
from __future__ import annotations

import torch

from neuron_constrain.vllm import MAX_BIAS_TOKENS, MAX_STOP_TOKEN_IDS, MAX_TOP_K, check_vllm_version

check_vllm_version()

from vllm.exceptions import VLLMValidationError  # noqa: E402

from neuron_constrain.vllm import admission  # noqa: E402
from vllm.v1.sample.logits_processor import LogitsProcessor  # noqa: E402

admission.install()  # the verdict off the API server's event loop, before vLLM's own checks


def _refuse(parameter: str, value, why: str):
    raise VLLMValidationError(
        f"neuron_constrain's vLLM plugin cannot serve {parameter}={value!r}: {why}", parameter=parameter, value=value
    )


def check_request(params) -> None:
    """Raise ``VLLMValidationError`` for sampling parameters the head cannot do.

    Runs before vLLM adds the model's EOS ids to the request's stop ids, so the
    stop-id limit is on the request's own ``stop_token_ids``; the worker sizes the
    program's stop-id input as this limit plus the model's EOS ids, so none is dropped.
    """
    if params.logprobs is not None and params.logprobs < 0:
        _refuse("logprobs", params.logprobs, "the logprobs program returns the top logprobs, not the whole "
                "vocabulary's; ask for at most 20 (the OpenAI limit)")
    if params.prompt_logprobs is not None:
        _refuse("prompt_logprobs", params.prompt_logprobs, "the head scores the sampled rows only, not the prompt's "
                "tokens (vLLM computes those outside the sampler); drop prompt_logprobs")
    if getattr(params, "logprob_token_ids", None):
        _refuse("logprob_token_ids", params.logprob_token_ids, "the logprobs program returns the top logprobs only "
                "(use logprobs / top_logprobs)")
    if params.allowed_token_ids:
        _refuse("allowed_token_ids", "[...]", "not fed to the head (use a choice or regex constraint)")
    if params.bad_words:
        _refuse("bad_words", params.bad_words, "not fed to the head (use a regex or grammar constraint)")
    if getattr(params, "thinking_token_budget", None) is not None:
        _refuse("thinking_token_budget", params.thinking_token_budget, "not fed to the head")
    if params.top_k is not None and params.top_k > MAX_TOP_K:
        _refuse("top_k", params.top_k, f"the head samples among at most {MAX_TOP_K} candidates; use top_k <= "
                f"{MAX_TOP_K} or -1")
    if params.logit_bias and len(params.logit_bias) > MAX_BIAS_TOKENS:
        _refuse("logit_bias", f"{len(params.logit_bias)} entries", f"at most {MAX_BIAS_TOKENS} per request")
    if params.min_tokens and len(params.stop_token_ids or ()) > MAX_STOP_TOKEN_IDS:
        _refuse("stop_token_ids", f"{len(params.stop_token_ids)} ids",
                f"with min_tokens at most {MAX_STOP_TOKEN_IDS} stop_token_ids per request (the model's EOS ids "
                "come on top); send fewer stop ids or drop min_tokens")


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
    """A no-op vLLM logits processor whose ``validate_params`` is :func:`check_request`."""

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        check_request(sampling_params)
        check_structured(sampling_params)

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        pass

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits
