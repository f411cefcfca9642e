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

Host work per step is kept small: inputs are written through numpy views of the
program's tensors, per-request constants (min_tokens stop ids, logit_bias arrays, min_p,
the prompt's unique ids) are computed once per request, a sparse processor's inputs are
reset only when a row used them, noise is drawn only for rows that sample (256 numbers
for an unseeded top-k/top-p row; a vocabulary's worth for a full-vocabulary race or a
seeded row), and the counters file is written by a thread, not by the step.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time

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
_METRICS_PERIOD_S = 0.05  # the counters file trails the last step by about this much


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
        self._nc_warm_compilations = None
        # fill_seconds: host time filling the program's inputs; head_seconds: running the program
        self._nc_stats = {"steps": 0, "rows": 0, "constrained_rows": 0, "sampled_rows": 0,
                          "fill_seconds": 0.0, "head_seconds": 0.0}
        self._nc_consts: dict[str, _RequestConsts] = {}
        self._nc_views: dict[int, dict[str, np.ndarray]] = {}
        self._nc_dirty: dict[int, set[str]] = {}  # per bucket: sparse processor inputs not neutral now
        self._nc_metrics_event = threading.Event()
        self._nc_metrics_thread = None
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
        start = time.perf_counter()
        bucket = self.head.bucket(rows)
        inputs = self.head.inputs[bucket]
        views = self._views(bucket)
        inputs.hidden[:rows].copy_(hidden)
        if rows < bucket:
            inputs.hidden[rows:].zero_()
        self._fill_mask(views["logit_mask"], rows)
        self._fill_sampling(inputs, views, rows)
        filled = time.perf_counter()
        with torch.inference_mode():
            tokens = self.head.run(bucket)[:rows]
        stats = self._nc_stats
        stats["fill_seconds"] += filled - start
        stats["head_seconds"] += time.perf_counter() - filled
        stats["steps"] += 1
        stats["rows"] += rows
        self._write_metrics()
        return SamplerOutput(sampled_token_ids=tokens.to(torch.int32).unsqueeze(-1), logprobs_tensors=None)

    def _views(self, bucket: int) -> dict[str, np.ndarray]:
        """numpy views sharing memory with the bucket's program inputs (cheap per-row writes)."""
        views = self._nc_views.get(bucket)
        if views is None:
            inputs = self.head.inputs[bucket]
            views = {name: getattr(inputs, name).numpy()
                     for name in ("greedy", "full", "top_k", "top_p", "rank_noise", "logit_mask")}
            views.update({name: t.numpy() for name, t in inputs.processors.items()})
            self._nc_views[bucket] = views
            self._nc_dirty[bucket] = {"min_tokens", "logit_bias", "min_p", "penalties"}  # reset on first use
        return views

    def _fill_mask(self, mask: np.ndarray, rows: int) -> None:
        mask[:] = -1
        grammar_output, scheduler_output = self._nc_grammar or (None, None)
        if grammar_output is None or self._nc_all_allowed:
            return
        index = self.input_batch.req_id_to_index
        # No speculative rows (refused at start): batch row = the request's index.
        compact, batch_rows = [], []
        for compact_row, req_id in enumerate(grammar_output.structured_output_request_ids):
            row = index.get(req_id)
            if row is not None and row < rows:
                compact.append(compact_row)
                batch_rows.append(row)
        if batch_rows:
            mask[batch_rows] = grammar_output.grammar_bitmask[compact]
            self._nc_stats["constrained_rows"] += len(batch_rows)

    def _request_consts(self, req_id: str) -> _RequestConsts:
        """Per-request constants of the head's inputs, computed once per request."""
        params = self.requests[req_id].sampling_params
        consts = self._nc_consts.get(req_id)
        if consts is None or consts.params is not params:
            if len(self._nc_consts) > 4 * self.scheduler_config.max_num_seqs + 16:
                self._nc_consts = {k: v for k, v in self._nc_consts.items() if k in self.requests}
            consts = self._nc_consts[req_id] = _RequestConsts(params, self.requests[req_id].prompt_token_ids)
        return consts

    def _fill_sampling(self, inputs, views: dict[str, np.ndarray], rows: int) -> None:
        batch = self.input_batch
        bucket = inputs.hidden.shape[0]
        dirty = self._nc_dirty[bucket]
        max_top_k = self.head.max_top_k
        temperature = batch.temperature_cpu[:rows]
        greedy = temperature < _SAMPLING_EPS
        top_k = batch.top_k_cpu[:rows]
        top_p = batch.top_p_cpu[:rows]
        no_cut = (top_k >= self.head.vocab_size) | (top_k <= 0)
        full = no_cut & (top_p >= 1.0)
        views["greedy"][:rows] = greedy
        views["greedy"][rows:] = True
        views["full"][:rows] = full
        views["full"][rows:] = True
        views["top_k"][:rows] = np.where(no_cut, max_top_k, top_k)
        views["top_k"][rows:] = max_top_k
        views["top_p"][:rows] = np.where(top_p >= 1.0, TOP_P_OFF, top_p)
        views["top_p"][rows:] = TOP_P_OFF
        views["temperature"][:rows] = np.where(greedy, 1.0, temperature)
        views["temperature"][rows:] = 1.0
        # noise: only rows that sample, and only what they read. Unseeded: a whole row for a
        # full-vocabulary race, else the first max_top_k entries (the race among the sorted
        # candidates, by rank). Seeded: the whole row from the request's own generator, in token
        # order (as vLLM's sampler draws it).
        generators = batch.generators
        rank_noise = views["rank_noise"]
        rank_noise[:] = True
        for i in generators:
            if i < rows:
                rank_noise[i] = False
        sampled = np.flatnonzero(~greedy)
        self._nc_stats["sampled_rows"] += len(sampled)
        if len(sampled):
            noise = inputs.noise
            unseeded = [int(i) for i in sampled if int(i) not in generators]
            if unseeded:
                cut_rows = [i for i in unseeded if not full[i]]
                if len(cut_rows) > 1:
                    noise[: max(cut_rows) + 1, :max_top_k].exponential_()
                elif cut_rows:
                    noise[cut_rows[0], :max_top_k].exponential_()
                for i in unseeded:
                    if full[i]:
                        noise[i].exponential_()
            for i, gen in generators.items():
                if i < rows and not greedy[i]:
                    noise[i].exponential_(generator=gen)
        # per-request processors: rows that use one (constants cached per request); the rest neutral
        req_ids = batch.req_ids[:rows]
        consts = [self._request_consts(req_id) for req_id in req_ids]
        outputs = batch.req_output_token_ids
        min_tokens = [i for i, c in enumerate(consts) if c.min_tokens and len(outputs[i] or ()) < c.min_tokens]
        if min_tokens or "min_tokens" in dirty:
            views["min_tokens_remaining"][:] = 0
            views["min_tokens_stop_ids"][:] = -1
            for i in min_tokens:
                c = consts[i]
                views["min_tokens_remaining"][i] = c.min_tokens - len(outputs[i] or ())
                views["min_tokens_stop_ids"][i, : len(c.stops)] = c.stops
            self._mark(dirty, "min_tokens", min_tokens)
        bias = [i for i, c in enumerate(consts) if c.bias_ids is not None]
        if bias or "logit_bias" in dirty:
            views["logit_bias_ids"][:] = -1
            views["logit_bias_values"][:] = 0.0
            for i in bias:
                c = consts[i]
                views["logit_bias_ids"][i, : len(c.bias_ids)] = c.bias_ids
                views["logit_bias_values"][i, : len(c.bias_ids)] = c.bias_values
            self._mark(dirty, "logit_bias", bias)
        min_p = [i for i, c in enumerate(consts) if c.min_p]
        if min_p or "min_p" in dirty:
            views["min_p"][:] = 0.0
            for i in min_p:
                views["min_p"][i] = consts[i].min_p
            self._mark(dirty, "min_p", min_p)
        # penalties (vLLM: repetition over prompt + output, frequency/presence over output)
        rep, freq, pres = (batch.repetition_penalties_cpu[:rows], batch.frequency_penalties_cpu[:rows],
                           batch.presence_penalties_cpu[:rows])
        active = np.flatnonzero((rep != 1.0) | (freq != 0.0) | (pres != 0.0))
        if len(active) or "penalties" in dirty:
            views["penalty_repetition"][:] = 1.0
            views["penalty_frequency"][:] = 0.0
            views["penalty_presence"][:] = 0.0
            views["penalty_token_ids"][:] = -1
            views["penalty_token_counts"][:] = 0
            if len(active):
                views["penalty_repetition"][:rows] = rep
                views["penalty_frequency"][:rows] = freq
                views["penalty_presence"][:rows] = pres
            width = views["penalty_token_ids"].shape[1]
            for i in active:
                output = np.asarray(outputs[i] or (), dtype=np.int64)
                output = output[output >= 0]
                prompt = consts[i].prompt_unique
                if len(output):
                    out_ids, out_counts = np.unique(output, return_counts=True)
                    ids = np.union1d(prompt, out_ids)[:width]
                    counts = np.zeros(len(ids), dtype=np.int32)
                    counts[np.searchsorted(ids, out_ids).clip(max=len(ids) - 1)] = out_counts
                else:
                    ids, counts = prompt[:width], 0
                views["penalty_token_ids"][i, : len(ids)] = ids
                views["penalty_token_counts"][i, : len(ids)] = counts
            self._mark(dirty, "penalties", active)

    @staticmethod
    def _mark(dirty: set, name: str, rows) -> None:
        if len(rows):
            dirty.add(name)
        else:
            dirty.discard(name)

    # ------------------------------------------------------------------ counting
    def _write_metrics(self, force: bool = False) -> None:
        """Counters to ``NEURON_CONSTRAIN_VLLM_METRICS``: the step only sets a flag; a writer thread
        rewrites the file (atomically) at most every ``_METRICS_PERIOD_S`` while steps run."""
        if self._nc_metrics_path is None:
            return
        if force:
            self._dump_metrics()
            return
        if self._nc_metrics_thread is None:
            self._nc_metrics_thread = threading.Thread(target=self._metrics_loop, name="nc-metrics", daemon=True)
            self._nc_metrics_thread.start()
        self._nc_metrics_event.set()

    def _metrics_loop(self) -> None:
        while True:
            self._nc_metrics_event.wait()
            time.sleep(_METRICS_PERIOD_S)
            self._nc_metrics_event.clear()
            try:
                self._dump_metrics()
            except OSError as e:  # never take the engine down for a counters file
                log.warning("neuron_constrain: could not write %s: %s", self._nc_metrics_path, e)

    def _dump_metrics(self) -> None:
        data = {
            **self._nc_stats,
            "compilations": self.head.compilations,
            "compilations_after_warmup": self.head.compilations - (self._nc_warm_compilations or 0),
            "buckets": self.head.buckets,
            "calls_per_bucket": {str(k): v for k, v in dict(self.head.calls).items()},
            "all_allowed_mask": self._nc_all_allowed,
            "pid": os.getpid(),
        }
        tmp = f"{self._nc_metrics_path}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, self._nc_metrics_path)


class _RequestConsts:
    """What the head's per-request inputs need from a request's ``SamplingParams`` (fixed per request)."""

    __slots__ = ("params", "min_tokens", "stops", "bias_ids", "bias_values", "min_p", "prompt_unique")

    def __init__(self, params, prompt_token_ids):
        self.params = params
        self.min_tokens = int(params.min_tokens or 0)
        self.stops = (np.asarray(sorted(params.all_stop_token_ids)[:MAX_STOP_TOKENS], dtype=np.int64)
                      if self.min_tokens else None)
        self.bias_ids = self.bias_values = None
        if params.logit_bias:
            items = list(params.logit_bias.items())[:MAX_BIAS_TOKENS]
            self.bias_ids = np.asarray([int(t) for t, _ in items], dtype=np.int64)
            self.bias_values = np.asarray([float(v) for _, v in items], dtype=np.float32)
        self.min_p = float(params.min_p or 0.0)
        self.prompt_unique = np.unique(np.asarray(prompt_token_ids or [], dtype=np.int64))


class NeuronConstrainWorker(CPUWorker):
    """vLLM's CPU worker with :class:`NeuronConstrainModelRunner` as its model runner."""

    def init_device(self):
        check_config(self.vllm_config)
        super().init_device()
        self.model_runner = NeuronConstrainModelRunner(self.vllm_config, torch.device("cpu"))
