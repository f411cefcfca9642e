"""What the plugin checks before vLLM starts: the configuration it can serve, and the model's EOS ids.

    check_config(vllm_config)     # ConfigError naming the flag and the fix (another vLLM, pipeline parallelism, ...)
    model_eos_ids(model_config)   # every EOS id the configs and tokenizer name (sizes the stop-id input)
"""
from __future__ import annotations

import contextlib
import logging

from neuron_constrain.core.errors import Error
from neuron_constrain.vllm import SCHEDULER_CLS, VALIDATOR

log = logging.getLogger("vllm.neuron_constrain")


class ConfigError(Error, ValueError):
    """A configuration the plugin refuses at start."""


def check_config(vllm_config) -> None:
    """Refuse, at start, what the head cannot serve (raised before any request)."""
    spec = vllm_config.speculative_config
    if spec is not None:
        if spec.method != "ngram":
            raise ConfigError(
                f"neuron_constrain's vLLM plugin verifies drafts from draft-free proposers (method 'ngram'), whose "
                f"draft probability is 1; --speculative-config method {spec.method!r} proposes with draft "
                "probabilities the head's rejection rule does not read: use method 'ngram'"
            )
        if getattr(spec, "rejection_sample_method", "standard") != "standard":
            raise ConfigError(
                f"--speculative-config rejection_sample_method {spec.rejection_sample_method!r}: the plugin's head "
                "verifies drafts by vLLM's standard rule only; remove the option"
            )
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size != 1:
        raise ConfigError(
            "neuron_constrain's vLLM plugin samples on every tensor-parallel rank of one stage: use "
            f"--pipeline-parallel-size 1 (got {parallel.pipeline_parallel_size})"
        )
    if vllm_config.use_v2_model_runner:
        raise ConfigError("neuron_constrain's vLLM plugin subclasses the V1 CPU model runner: set VLLM_USE_V2_MODEL_RUNNER=0")
    model = vllm_config.model_config
    procs = [p if isinstance(p, str) else f"{p.__module__}:{p.__qualname__}" for p in (model.logits_processors or [])]
    if VALIDATOR not in procs:
        raise ConfigError(
            f"start the server with --logits-processors {VALIDATOR}: it rejects, per request and before the "
            "engine sees it, the sampling parameters the plugin's head cannot do (otherwise such a request "
            "would fail inside the worker and stop the engine for every request)"
        )
    scheduler = getattr(getattr(vllm_config, "scheduler_config", None), "scheduler_cls", None)
    scheduler = scheduler if scheduler is None or isinstance(scheduler, str) else \
        f"{scheduler.__module__}.{scheduler.__qualname__}"
    if scheduler != SCHEDULER_CLS:
        got = scheduler or "vLLM's default"
        raise ConfigError(
            f"start the server with --scheduler-cls {SCHEDULER_CLS} (got {got}): it "
            "compiles every structured request with the library's grammar engines and keyword policy, and checks "
            "finished answers; without it vLLM's own backend builds the grammars the plugin would apply"
        )
    if model.logprobs_mode not in ("raw_logprobs",):
        raise ConfigError(
            f"--logprobs-mode {model.logprobs_mode}: the plugin computes vLLM's default raw_logprobs (the logprobs "
            "of the grammar-masked logits, before any processor) in its logprobs program; leave the default"
        )


def model_eos_ids(model_config) -> set[int]:
    """Every id vLLM's frontend may add to a request's stop ids for this model: the config's and the
    generation config's ``eos_token_id`` (an int or a list) and the tokenizer's EOS."""
    ids: set[int] = set()

    def add(value):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple, set)):
            ids.update(int(v) for v in value)

    add(getattr(model_config.hf_config, "eos_token_id", None))
    try:
        add((model_config.try_get_generation_config() or {}).get("eos_token_id"))
    except Exception as e:  # a model folder without a readable generation config
        log.info("neuron_constrain: no generation config read (%s); EOS ids from the model config only", e)
    if not getattr(model_config, "skip_tokenizer_init", False):
        try:
            from vllm.tokenizers import cached_tokenizer_from_config

            add(cached_tokenizer_from_config(model_config).eos_token_id)
        except Exception as e:
            log.info("neuron_constrain: tokenizer not loaded in the worker (%s); EOS ids from the configs", e)
    return ids


@contextlib.contextmanager
def no_custom_logits_processors_with_speculation(vllm_config):
    """vLLM's model runner refuses custom logits processors with speculative decoding (its
    rejection sampler would skip them). The plugin's only one is the frontend's validator,
    whose ``validate_params`` the API server process runs from its own config; the worker
    builds its runner without it (its sampler and rejection sampler are never called)."""
    model = vllm_config.model_config
    saved = model.logits_processors
    if vllm_config.speculative_config is not None:
        model.logits_processors = None
    try:
        yield
    finally:
        model.logits_processors = saved
