"""Bad configurations fail at start with an error naming the problem (no server needed)."""
from __future__ import annotations

import types

import pytest
import torch

import neuron_constrain.vllm as ncv


def test_unsupported_vllm_version(monkeypatch):
    monkeypatch.setattr(ncv, "vllm_version", lambda: "0.31.1")
    with pytest.raises(RuntimeError, match=r"supports vLLM 0\.32\.0, found 0\.31\.1"):
        ncv.check_vllm_version()
    assert ncv.vllm_version.__name__ == "<lambda>"
    monkeypatch.undo()
    assert ncv.check_vllm_version() == "0.32.0"


def _config(**over):
    base = dict(
        speculative_config=None,
        parallel_config=types.SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        use_v2_model_runner=False,
        model_config=types.SimpleNamespace(logits_processors=[ncv.VALIDATOR], logprobs_mode="raw_logprobs"),
    )
    base.update(over)
    return types.SimpleNamespace(**base)


def test_check_config():
    from neuron_constrain.vllm.worker import ConfigError, check_config

    check_config(_config())
    with pytest.raises(ConfigError, match="speculative decoding"):
        check_config(_config(speculative_config=object()))
    with pytest.raises(ConfigError, match="tensor-parallel-size 1"):
        check_config(_config(parallel_config=types.SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=1)))
    with pytest.raises(ConfigError, match="VLLM_USE_V2_MODEL_RUNNER=0"):
        check_config(_config(use_v2_model_runner=True))
    with pytest.raises(ConfigError, match="--logits-processors neuron_constrain.vllm.validate:RequestValidator"):
        check_config(_config(model_config=types.SimpleNamespace(logits_processors=None, logprobs_mode="raw_logprobs")))


def test_lm_head_not_found():
    from neuron_constrain.vllm.worker import ConfigError, find_lm_head

    class NoHead(torch.nn.Module):
        pass

    with pytest.raises(ConfigError, match="found no lm_head weight on NoHead"):
        find_lm_head(NoHead())

    class Capped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = torch.nn.Linear(4, 8, bias=False)
            self.logits_processor = types.SimpleNamespace(scale=1.0, soft_cap=30.0)

    with pytest.raises(ConfigError, match="soft-caps"):
        find_lm_head(Capped())


def test_request_validation_names_the_parameter():
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    from neuron_constrain.vllm.validate import check_request

    check_request(SamplingParams(temperature=0.7, top_p=0.9, top_k=50, min_p=0.1, seed=3, n=2))
    for params, name in [
        (SamplingParams(logprobs=1), "logprobs"),
        (SamplingParams(prompt_logprobs=1), "prompt_logprobs"),
        (SamplingParams(temperature=1.0, top_k=ncv.MAX_TOP_K + 1), "top_k"),
        (SamplingParams(logit_bias={i: 1.0 for i in range(ncv.MAX_BIAS_TOKENS + 1)}), "logit_bias"),
        (SamplingParams(allowed_token_ids=[1, 2]), "allowed_token_ids"),
    ]:
        with pytest.raises(VLLMValidationError) as info:
            check_request(params)
        assert info.value.parameter == name
