"""vLLM v1 CPU worker and model runner whose every token comes from the rewritten head.

``--worker-cls neuron_constrain.vllm.worker.NeuronConstrainWorker`` (with
``--logits-processors neuron_constrain.vllm.validate:RequestValidator``, which rejects
what the head cannot do, per request, in the frontend).

Per step: vLLM's forward runs as usual; where ``execute_model`` calls the model's
``compute_logits`` the runner keeps the hidden rows instead (so the lm_head runs once,
inside the head program). ``sample_tokens(grammar_output)`` receives the scheduler's
compact grammar bitmask: the runner reorders it into batch rows (-1 rows for requests
without a constraint, as ``vllm/v1/structured_output/utils.py`` does), fills the
program's inputs from the persistent batch (temperature, top-k/p, penalties,
min_tokens, logit_bias, min_p, per-request noise from seeded generators) and calls the
bucket's program. vLLM's host-side ``apply_grammar_bitmask`` and its ``Sampler`` are
not called for any token.
"""
from __future__ import annotations

import json
import logging
import os

import numpy as np
import torch

from neuron_constrain.vllm import (
    ALL_ALLOWED_ENV, MAX_BIAS_TOKENS, MAX_STOP_TOKENS, MAX_TOP_K, METRICS_ENV, VALIDATOR, check_vllm_version,
)

check_vllm_version()

from vllm.v1.outputs import SamplerOutput  # noqa: E402
from vllm.v1.worker.cpu_model_runner import CPUModelRunner  # noqa: E402
from vllm.v1.worker.cpu_worker import CPUWorker  # noqa: E402

from neuron_constrain.vllm.head import TOP_P_OFF, HeadPrograms, buckets_for  # noqa: E402

log = logging.getLogger("vllm.neuron_constrain")  # under vLLM's logger: its handlers print it

_SAMPLING_EPS = 1e-5  # vLLM's: temperature below it is greedy


class ConfigError(ValueError):
    """A configuration the plugin refuses at start."""


def check_config(vllm_config) -> None:
    """Refuse, at start, what the head cannot serve (raised before any request)."""
    if vllm_config.speculative_config is not None:
        raise ConfigError(
            "neuron_constrain's vLLM plugin does not support speculative decoding (draft rows would need the "
            "bitmask's speculative offsets and a rejection sampler in the head); remove --speculative-config"
        )
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
        raise ConfigError(
            "neuron_constrain's vLLM plugin runs an unsharded lm_head: use --tensor-parallel-size 1 and "
            f"--pipeline-parallel-size 1 (got {parallel.tensor_parallel_size} and {parallel.pipeline_parallel_size})"
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
    if model.logprobs_mode not in ("raw_logprobs",):
        raise ConfigError(f"--logprobs-mode {model.logprobs_mode}: the plugin returns no logprobs; leave the default")


def find_lm_head(model) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The lm_head weight (and bias) of a vLLM ``*ForCausalLM``, or a clear error."""
    head = getattr(model, "lm_head", None)
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.numel() == 0:
        raise ConfigError(
            f"neuron_constrain's vLLM plugin found no lm_head weight on {type(model).__name__} "
            "(it reads model.lm_head.weight, a [vocab, hidden] matrix): this model is not supported"
        )
    processor = getattr(model, "logits_processor", None)
    scale = getattr(processor, "scale", 1.0)
    soft_cap = getattr(processor, "soft_cap", None)
    if scale != 1.0 or soft_cap is not None:
        raise ConfigError(
            f"{type(model).__name__} scales (scale={scale}) or soft-caps (soft_cap={soft_cap}) its logits; "
            "the plugin's head does not (yet): this model is not supported"
        )
    bias = getattr(head, "bias", None)
    return weight, bias if isinstance(bias, torch.Tensor) else None


class NeuronConstrainModelRunner(CPUModelRunner):
    def __init__(self, vllm_config, device):
        check_config(vllm_config)
        super().__init__(vllm_config, device)
        self._nc_capture = False
        self._nc_grammar = None
        self._nc_all_allowed = os.environ.get(ALL_ALLOWED_ENV, "") == "1"
        self._nc_metrics_path = os.environ.get(METRICS_ENV) or None
        self._nc_metrics_written = 0.0
        self._nc_warm_compilations = None
        self._nc_stats = {"steps": 0, "rows": 0, "constrained_rows": 0, "sampled_rows": 0}
        self._nc_pen_cache: dict[str, tuple[int, np.ndarray, np.ndarray]] = {}
        if self._nc_all_allowed:
            log.warning("neuron_constrain: %s=1: feeding an ALL-ALLOWED mask (negative control; grammars are NOT "
                        "enforced)", ALL_ALLOWED_ENV)

    # ------------------------------------------------------------------ model + head
    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        weight, bias = find_lm_head(self.model)
        vocab = self.model_config.get_vocab_size()
        eos = self._eos_token_id()
        self.head = HeadPrograms(
            weight, bias, vocab_size=vocab, buckets=buckets_for(self.scheduler_config.max_num_seqs),
            eos_token_id=eos, max_stop_tokens=MAX_STOP_TOKENS, max_bias_tokens=MAX_BIAS_TOKENS,
            max_penalty_tokens=min(self.model_config.max_model_len, vocab), max_top_k=MAX_TOP_K,
        )
        self.head.warm_up()
        self._nc_warm_compilations = self.head.compilations
        log.info("neuron_constrain: head ready, buckets %s, %d program(s) built in %.1fs; every token is sampled "
                 "by the rewritten head", self.head.buckets, self.head.compilations, self.head.build_seconds)
        original = self.model.compute_logits

        def compute_logits(hidden_states, *args, **kwargs):
            if self._nc_capture:  # the head program runs the lm_head on these rows
                return hidden_states
            return original(hidden_states, *args, **kwargs)

        self.model.compute_logits = compute_logits
        self._write_metrics(force=True)

    def _eos_token_id(self) -> int:
        config = self.model_config.hf_config
        eos = getattr(config, "eos_token_id", None)
        if isinstance(eos, (list, tuple)):
            eos = eos[0] if eos else None
        if eos is None:
            raise ConfigError("the model config has no eos_token_id: the head emits it for rows the mask empties")
        return int(eos)

    # ------------------------------------------------------------------ the step
    def execute_model(self, scheduler_output, intermediate_tensors=None):
        self._nc_capture = True
        try:
            return super().execute_model(scheduler_output, intermediate_tensors)
        finally:
            self._nc_capture = False

    def sample_tokens(self, grammar_output):
        state = self.execute_model_state
        self._nc_grammar = (grammar_output, state.scheduler_output if state is not None else None)
        try:
            return super().sample_tokens(None)  # None: vLLM's host-side bitmask is not applied
        finally:
            self._nc_grammar = None

    def _sample(self, logits, spec_decode_metadata):
        # ``logits`` are the hidden rows compute_logits handed back (one per request).
        assert spec_decode_metadata is None, "speculative decoding is refused at start"
        self.input_batch.update_async_output_token_ids()
        hidden = logits
        rows = hidden.shape[0]
        bucket = self.head.bucket(rows)
        inputs = self.head.inputs[bucket]
        inputs.hidden[:rows].copy_(hidden)
        if rows < bucket:
            inputs.hidden[rows:].zero_()
        self._fill_mask(inputs.logit_mask, rows)
        self._fill_sampling(inputs, rows)
        with torch.inference_mode():
            tokens = self.head.run(bucket)[:rows]
        self._nc_stats["steps"] += 1
        self._nc_stats["rows"] += rows
        self._write_metrics()
        return SamplerOutput(sampled_token_ids=tokens.to(torch.int32).unsqueeze(-1), logprobs_tensors=None)

    def _fill_mask(self, mask: torch.Tensor, rows: int) -> None:
        mask.fill_(-1)
        grammar_output, scheduler_output = self._nc_grammar or (None, None)
        if grammar_output is None or self._nc_all_allowed:
            return
        bitmask = grammar_output.grammar_bitmask
        index = self.input_batch.req_id_to_index
        # No speculative rows (refused at start): batch row = the request's index.
        for compact_row, req_id in enumerate(grammar_output.structured_output_request_ids):
            row = index.get(req_id)
            if row is not None and row < rows:
                mask[row].copy_(torch.from_numpy(bitmask[compact_row]))
                self._nc_stats["constrained_rows"] += 1

    def _fill_sampling(self, inputs, rows: int) -> None:
        batch = self.input_batch
        b = inputs.hidden.shape[0]
        temperature = batch.temperature_cpu[:rows]
        greedy = temperature < _SAMPLING_EPS
        top_k = batch.top_k_cpu[:rows]
        top_p = batch.top_p_cpu[:rows]
        no_cut = (top_k >= self.head.vocab_size) | (top_k <= 0)
        full = no_cut & (top_p >= 1.0)
        inputs.greedy.fill_(True)
        inputs.greedy[:rows].copy_(torch.from_numpy(greedy))
        inputs.full.fill_(True)
        inputs.full[:rows].copy_(torch.from_numpy(full))
        inputs.top_k.fill_(self.head.max_top_k)
        inputs.top_k[:rows].copy_(torch.from_numpy(np.where(no_cut, self.head.max_top_k, top_k).astype(np.int64)))
        inputs.top_p.fill_(TOP_P_OFF)
        inputs.top_p[:rows].copy_(torch.from_numpy(np.where(top_p >= 1.0, TOP_P_OFF, top_p).astype(np.float32)))
        p = inputs.processors
        p["temperature"].fill_(1.0)
        p["temperature"][:rows].copy_(torch.from_numpy(np.where(greedy, 1.0, temperature).astype(np.float32)))
        # noise: only rows that sample; seeded requests draw from their own generator (as vLLM's sampler does)
        sampled = np.flatnonzero(~greedy)
        self._nc_stats["sampled_rows"] += len(sampled)
        if len(sampled):
            generators = batch.generators
            if len(sampled) > len(generators):
                inputs.noise[:rows].exponential_()
            for i in sampled:
                gen = generators.get(int(i))
                if gen is not None:
                    inputs.noise[i].exponential_(generator=gen)
        # per-request processors
        p["min_tokens_remaining"].zero_()
        p["min_tokens_stop_ids"].fill_(-1)
        p["logit_bias_ids"].fill_(-1)
        p["logit_bias_values"].zero_()
        p["min_p"].zero_()
        for i, req_id in enumerate(batch.req_ids[:rows]):
            params = self.requests[req_id].sampling_params
            output = batch.req_output_token_ids[i] or []
            if params.min_tokens and len(output) < params.min_tokens:
                stops = sorted(params.all_stop_token_ids)[: p["min_tokens_stop_ids"].shape[1]]
                p["min_tokens_remaining"][i] = params.min_tokens - len(output)
                p["min_tokens_stop_ids"][i, : len(stops)] = torch.tensor(stops, dtype=torch.int64)
            if params.logit_bias:
                items = list(params.logit_bias.items())[: p["logit_bias_ids"].shape[1]]
                p["logit_bias_ids"][i, : len(items)] = torch.tensor([int(t) for t, _ in items], dtype=torch.int64)
                p["logit_bias_values"][i, : len(items)] = torch.tensor([float(v) for _, v in items])
            if params.min_p:
                p["min_p"][i] = float(params.min_p)
        # penalties (vLLM: repetition over prompt + output, frequency/presence over output)
        rep, freq, pres = (batch.repetition_penalties_cpu[:rows], batch.frequency_penalties_cpu[:rows],
                           batch.presence_penalties_cpu[:rows])
        p["penalty_repetition"].fill_(1.0)
        p["penalty_frequency"].zero_()
        p["penalty_presence"].zero_()
        p["penalty_token_ids"].fill_(-1)
        p["penalty_token_counts"].zero_()
        active = np.flatnonzero((rep != 1.0) | (freq != 0.0) | (pres != 0.0))
        if len(active):
            p["penalty_repetition"][:rows].copy_(torch.from_numpy(rep.astype(np.float32)))
            p["penalty_frequency"][:rows].copy_(torch.from_numpy(freq.astype(np.float32)))
            p["penalty_presence"][:rows].copy_(torch.from_numpy(pres.astype(np.float32)))
            width = p["penalty_token_ids"].shape[1]
            for i in active:
                req = self.requests[batch.req_ids[i]]
                prompt = np.asarray(req.prompt_token_ids or [], dtype=np.int64)
                output = np.asarray(batch.req_output_token_ids[i] or [], dtype=np.int64)
                output = output[output >= 0]
                ids = np.unique(np.concatenate([prompt, output]))[:width]
                counts = np.zeros(len(ids), dtype=np.int32)
                if len(output):
                    out_ids, out_counts = np.unique(output, return_counts=True)
                    counts[np.searchsorted(ids, out_ids).clip(max=len(ids) - 1)] = out_counts
                p["penalty_token_ids"][i, : len(ids)] = torch.from_numpy(ids)
                p["penalty_token_counts"][i, : len(ids)] = torch.from_numpy(counts)
        if b > rows:  # padding rows: neutral already (filled above); nothing to sample
            pass

    # ------------------------------------------------------------------ counting
    def _write_metrics(self, force: bool = False) -> None:
        if self._nc_metrics_path is None:
            return
        data = {
            **self._nc_stats,
            "compilations": self.head.compilations,
            "compilations_after_warmup": self.head.compilations - (self._nc_warm_compilations or 0),
            "buckets": self.head.buckets,
            "calls_per_bucket": {str(k): v for k, v in self.head.calls.items()},
            "all_allowed_mask": self._nc_all_allowed,
            "pid": os.getpid(),
        }
        tmp = f"{self._nc_metrics_path}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, self._nc_metrics_path)


class NeuronConstrainWorker(CPUWorker):
    """vLLM's CPU worker with :class:`NeuronConstrainModelRunner` as its model runner."""

    def init_device(self):
        check_config(self.vllm_config)
        super().init_device()
        self.model_runner = NeuronConstrainModelRunner(self.vllm_config, torch.device("cpu"))
