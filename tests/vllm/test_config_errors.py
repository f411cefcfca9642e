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
        scheduler_config=types.SimpleNamespace(scheduler_cls=ncv.SCHEDULER_CLS),
        model_config=types.SimpleNamespace(logits_processors=[ncv.VALIDATOR], logprobs_mode="raw_logprobs",
                                           max_logprobs=20),
    )
    base.update(over)
    return types.SimpleNamespace(**base)


def test_check_config():
    from neuron_constrain.vllm.config import ConfigError, check_config

    check_config(_config())
    # served now: ngram speculation, tensor parallelism
    check_config(_config(speculative_config=types.SimpleNamespace(method="ngram", rejection_sample_method="standard")))
    check_config(_config(parallel_config=types.SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=1)))
    with pytest.raises(ConfigError, match="use method 'ngram'"):
        check_config(_config(speculative_config=types.SimpleNamespace(method="eagle", rejection_sample_method="standard")))
    with pytest.raises(ConfigError, match="pipeline-parallel-size 1"):
        check_config(_config(parallel_config=types.SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=2)))
    with pytest.raises(ConfigError, match="VLLM_USE_V2_MODEL_RUNNER=0"):
        check_config(_config(use_v2_model_runner=True))
    with pytest.raises(ConfigError, match="--logits-processors neuron_constrain.vllm.validate:RequestValidator"):
        check_config(_config(model_config=types.SimpleNamespace(logits_processors=None, logprobs_mode="raw_logprobs",
                                                                max_logprobs=20)))
    with pytest.raises(ConfigError, match="--scheduler-cls neuron_constrain.vllm.scheduler.NeuronConstrainScheduler"):
        check_config(_config(scheduler_config=types.SimpleNamespace(scheduler_cls=None)))
    with pytest.raises(ConfigError, match="raw_logprobs"):
        check_config(_config(model_config=types.SimpleNamespace(logits_processors=[ncv.VALIDATOR],
                                                                logprobs_mode="processed_logprobs", max_logprobs=20)))
    # --max-logprobs -1 (the whole vocabulary) is served: the logprobs program returns whole rows too
    check_config(_config(model_config=types.SimpleNamespace(logits_processors=[ncv.VALIDATOR],
                                                            logprobs_mode="raw_logprobs", max_logprobs=-1)))


def test_lm_head_not_found():
    from neuron_constrain.vllm.config import ConfigError
    from neuron_constrain.vllm.lm_head import find_lm_head

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


def test_no_sampling_parameter_is_refused_by_the_validator():
    """What the validator refused before issue 45 (HTTP 400 where stock vLLM answers) now passes
    (the requests themselves are served in test_parity.py)."""
    from vllm import SamplingParams

    from neuron_constrain.vllm.validate import RequestValidator

    for params in [
        SamplingParams(temperature=0.7, top_p=0.9, top_k=50, min_p=0.1, seed=3, n=2),
        SamplingParams(prompt_logprobs=1), SamplingParams(logprobs=5, logprob_token_ids=[1, 2, 3, 4, 5]),
        SamplingParams(temperature=1.0, top_k=ncv.MAX_TOP_K + 1),
        SamplingParams(logit_bias={i: 1.0 for i in range(ncv.MAX_BIAS_TOKENS + 1)}),
        SamplingParams(allowed_token_ids=[1, 2]), SamplingParams(bad_words=["a b", "c"]),
        SamplingParams(thinking_token_budget=4),
        SamplingParams(min_tokens=3, stop_token_ids=list(range(100, 101 + ncv.MAX_STOP_TOKEN_IDS))),
    ]:
        RequestValidator.validate_params(params)


def test_requests_past_the_program_widths_run_on_the_wide_program():
    """A model with 6 EOS ids: a request within the widths (the most stop ids, biases, top_k the
    program holds) runs on the narrow program with every stop id; one past any width on the wide one."""
    from vllm import SamplingParams

    from neuron_constrain.vllm.batch_layout import request_needs
    from neuron_constrain.vllm.config import model_eos_ids
    from neuron_constrain.vllm.head import HeadPrograms

    eos = [2, 3, 4, 5, 6, 7]
    model_config = types.SimpleNamespace(hf_config=types.SimpleNamespace(eos_token_id=2), skip_tokenizer_init=True,
                                         try_get_generation_config=lambda: {"eos_token_id": eos})
    assert model_eos_ids(model_config) == set(eos)
    head = HeadPrograms(torch.zeros(2000, 8), None, vocab_size=2000, buckets=[1], eos_token_id=2,
                        max_stop_tokens=ncv.MAX_STOP_TOKEN_IDS + len(eos), max_bias_tokens=ncv.MAX_BIAS_TOKENS,
                        max_penalty_tokens=16, max_top_k=ncv.MAX_TOP_K)

    def needs(**kwargs):
        params = SamplingParams(**kwargs)
        params.update_from_generation_config({"eos_token_id": eos}, eos_token_id=2)  # what vLLM's frontend does
        return params, request_needs(params, [1, 5], head, None)

    params, fits = needs(min_tokens=5, stop_token_ids=list(range(1000, 1000 + ncv.MAX_STOP_TOKEN_IDS)),
                         logit_bias={i: 1.0 for i in range(ncv.MAX_BIAS_TOKENS)}, top_k=ncv.MAX_TOP_K)
    assert not fits.wide and sorted(fits.rows.stops.tolist()) == sorted(params.all_stop_token_ids)
    for kwargs in (dict(min_tokens=5, stop_token_ids=list(range(1000, 1001 + ncv.MAX_STOP_TOKEN_IDS))),
                   dict(logit_bias={i: 1.0 for i in range(ncv.MAX_BIAS_TOKENS + 1)}), dict(top_k=ncv.MAX_TOP_K + 1)):
        params, past = needs(**kwargs)
        assert past.wide, kwargs
    assert not needs(top_k=2000)[1].wide and not needs(top_k=-1)[1].wide  # top_k >= vocab or off: no cut


def test_counters_thread_survives_any_write_error(tmp_path, caplog):
    """A counters write that raises (here a TypeError from a value JSON cannot encode) is logged with
    its type, and the writer thread still writes the next snapshot."""
    import json
    import logging
    import time

    from neuron_constrain.vllm.counters import CountersFile

    snapshots = iter([{"bad": object()}, {"steps": 2}])
    path = tmp_path / "counters.json"
    counters = CountersFile(str(path), lambda: next(snapshots), period=0.01)
    with caplog.at_level(logging.WARNING, logger="vllm.neuron_constrain"):
        counters.notify()
        deadline = time.monotonic() + 5
        while counters.failures == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        counters.notify()
        while not (path.exists() and path.read_text().endswith("}")) and time.monotonic() < deadline:
            time.sleep(0.01)
    assert counters.failures == 1 and "TypeError" in caplog.text
    assert json.loads(path.read_text()) == {"steps": 2}
    assert counters._thread.is_alive()
