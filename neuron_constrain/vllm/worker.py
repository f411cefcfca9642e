"""vLLM v1 CPU worker and model runner whose every token comes from the rewritten head.

``--worker-cls neuron_constrain.vllm.worker.NeuronConstrainWorker`` (with
``--logits-processors neuron_constrain.vllm.validate:RequestValidator``, which applies the
library's structured-outputs policy per request, in the frontend).

Per step: vLLM's forward runs as usual; where ``execute_model`` calls the model's
``compute_logits`` the runner keeps the hidden rows instead (so the lm_head runs once,
inside the head program). ``sample_tokens(grammar_output)`` receives the scheduler's
compact grammar bitmask: the runner reorders it into batch rows (-1 rows for requests
without a constraint, and with speculative decoding one row per draft position at
vLLM's speculative offsets, as ``vllm/v1/structured_output/utils.py`` does), fills the
program's inputs from the persistent batch (temperature, top-k/p, penalties,
min_tokens, logit_bias, the thinking budget, min_p, per-request noise from seeded
generators, the draft tokens to verify), ANDs ``allowed_token_ids`` and ``bad_words``
into the mask rows (``token_bans.py``) and calls the bucket's program (its wide program
when a request needs more candidates, biases or stop ids than the program holds), which
returns the tokens each row emits (drafts verified in the program). When a request in
the batch asked for logprobs (or ``logprob_token_ids``), the bucket's logprobs program
runs on the same rows (``logprobs.py``); prompt logprobs are vLLM's own (its runner calls
the model's lm_head on the prompt rows after the step). vLLM's host-side
``apply_grammar_bitmask``, its ``Sampler`` and its ``RejectionSampler`` are not called
for any token.

Speculative decoding (``--speculative-config`` with ``method: ngram``): request ``i``
owns ``1 + d_i`` rows (its ``d_i`` drafts, then the bonus position). Each row gets its
own grammar row, its own position-dependent processor inputs (min_tokens counts the
drafts before it; penalties see the output plus the drafts before it, as vLLM's
rejection sampler does) and its own noise. The program's output is laid out as vLLM's
rejection sampler's: ``[requests, max drafts + 1]`` with -1 where nothing is emitted.

Tensor parallelism: every rank holds the full hidden rows (vLLM all-reduces them), so
each rank gathers the vocab-parallel lm_head shards once at load and runs the same
head program on the same inputs: identical tokens on every rank, no collective per
step (see docs/guides/vllm.md for the measured alternative).

Host work per step is kept small: inputs are written through numpy views of the
program's tensors, per-request constants (min_tokens stop ids, logit_bias arrays, min_p,
the prompt's unique ids) are computed once per request, a sparse processor's inputs are
reset only when a row used them, noise is drawn only for rows that sample (256 numbers
for an unseeded top-k/top-p row; a vocabulary's worth for a full-vocabulary race or a
seeded row), and the counters file is written by a thread, not by the step.
"""
from __future__ import annotations

import logging
import os
import time

import numpy as np
import torch

from neuron_constrain.vllm import (
    ALL_ALLOWED_ENV, MAX_BIAS_TOKENS, MAX_STOP_TOKEN_IDS, MAX_TOP_K, METRICS_ENV, check_vllm_version,
)

check_vllm_version()

from vllm.v1.outputs import SamplerOutput  # noqa: E402
from vllm.v1.worker.cpu_model_runner import CPUModelRunner  # noqa: E402
from vllm.v1.worker.cpu_worker import CPUWorker  # noqa: E402

from neuron_constrain.core.processor_interface import Thinking  # noqa: E402
from neuron_constrain.processors.rows import ProcessorInputs, write_rows  # noqa: E402
from neuron_constrain.vllm.batch_layout import BatchLayout, RequestNeeds, request_needs, spread  # noqa: E402
from neuron_constrain.vllm.config import (  # noqa: E402
    ConfigError, no_custom_logits_processors_with_speculation, check_config, model_eos_ids,
)
from neuron_constrain.vllm.counters import CountersFile  # noqa: E402
from neuron_constrain.vllm.head import NO_TOKEN, TOP_P_OFF, HeadPrograms, buckets_for  # noqa: E402
from neuron_constrain.vllm.lm_head import tensor_parallel_rank, find_lm_head, gather_vocab_shards, time_all_gathers  # noqa: E402
from neuron_constrain.vllm.logprobs import logprobs_program_k, logprobs_tensors  # noqa: E402

log = logging.getLogger("vllm.neuron_constrain")  # under vLLM's logger: its handlers print it

_SAMPLING_EPS = 1e-5  # vLLM's: temperature below it is greedy


def _exponential(noise: torch.Tensor) -> None:
    """Exponential(1) draws in place, as minus the log of uniform draws in [0, 1): torch's ``exponential_``
    takes about 5x as long on the CPU (0.64 ms against 0.13 ms for a 32,768-token row, one thread). A
    draw of 0 gives +inf noise: a token that cannot win the race, never one that must. Seeded rows keep
    ``exponential_`` on the request's generator (vLLM's own stream)."""
    noise.uniform_().log_().neg_()


class NeuronConstrainModelRunner(CPUModelRunner):
    def __init__(self, vllm_config, device):
        check_config(vllm_config)
        with no_custom_logits_processors_with_speculation(vllm_config):
            super().__init__(vllm_config, device)
        self._nc_capture = False
        self._nc_grammar = None
        self._nc_all_allowed = os.environ.get(ALL_ALLOWED_ENV, "") == "1"
        self._nc_warm_compilations = None
        # fill_seconds: host time filling the program's inputs; head_seconds: running the sampling program;
        # logprob_seconds: running the logprobs program; draft_rows / drafts_accepted: speculative rows verified
        # wide_steps: steps on a wide program; banned_rows: rows allowed_token_ids / bad_words narrowed
        self._nc_stats = {"steps": 0, "rows": 0, "constrained_rows": 0, "sampled_rows": 0, "draft_rows": 0,
                          "drafts_accepted": 0, "logprob_steps": 0, "wide_steps": 0, "banned_rows": 0,
                          "fill_seconds": 0.0, "head_seconds": 0.0, "logprob_seconds": 0.0}
        self._nc_rows: dict[str, tuple[object, RequestNeeds]] = {}  # req_id -> (its SamplingParams, its needs)
        # per (bucket, wide): views of the program's inputs, what they hold, the groups whose rows are not neutral
        self._nc_views: dict[tuple, dict[str, np.ndarray]] = {}
        self._nc_dirty: dict[tuple, set[str]] = {}
        self._nc_processor_inputs: dict[tuple, ProcessorInputs] = {}
        reasoning = getattr(vllm_config, "reasoning_config", None)
        self._nc_thinking = Thinking(reasoning.reasoning_start_token_ids, reasoning.reasoning_end_token_ids) \
            if reasoning is not None and reasoning.enabled else None
        path = os.environ.get(METRICS_ENV) or None
        self._nc_rank = tensor_parallel_rank()
        if path and self._nc_rank:  # with tensor parallelism each rank writes its own file
            path = f"{path}.rank{self._nc_rank}"
        self._nc_counters = CountersFile(path, self._counters) if path else None
        if self._nc_all_allowed:
            log.warning("neuron_constrain: %s=1: feeding an ALL-ALLOWED mask (negative control; grammars are NOT "
                        "enforced)", ALL_ALLOWED_ENV)

    # ------------------------------------------------------------------ model + head
    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        weight, bias = find_lm_head(self.model)
        tp_size = self.vllm_config.parallel_config.tensor_parallel_size
        weight, bias = gather_vocab_shards(weight, bias, tp_size)
        vocab = self.model_config.get_vocab_size()
        eos = self._eos_token_id()
        eos_ids = model_eos_ids(self.model_config) | {eos}
        self._nc_stop_width = MAX_STOP_TOKEN_IDS + len(eos_ids)
        spec = self.vllm_config.speculative_config
        self._nc_num_spec = spec.num_speculative_tokens if spec is not None else 0
        max_rows = self.scheduler_config.max_num_seqs * (1 + self._nc_num_spec)
        self.head = HeadPrograms(
            weight, bias, vocab_size=vocab, buckets=buckets_for(max_rows),
            eos_token_id=eos, max_stop_tokens=self._nc_stop_width, max_bias_tokens=MAX_BIAS_TOKENS,
            max_penalty_tokens=min(self.model_config.max_model_len, vocab), max_top_k=MAX_TOP_K,
            logprobs_k=logprobs_program_k(getattr(self.model_config, "max_logprobs", 20)),
        )
        self.head.warm_up()
        self._nc_warm_compilations = self.head.compilations
        self._nc_all_gather_ms = None
        if tp_size > 1:
            self._nc_all_gather_ms = time_all_gathers(self.scheduler_config.max_num_seqs, vocab, MAX_TOP_K)
            log.info("neuron_constrain: tensor-parallel all-gather per step would take %s ms (candidates / logits)",
                     self._nc_all_gather_ms)
        log.info("neuron_constrain: head ready, buckets %s, %d program(s) built in %.1fs; every token is sampled "
                 "by the rewritten head (tp=%d, speculative tokens=%d, stop ids per row=%d)", self.head.buckets,
                 self.head.compilations, self.head.build_seconds, tp_size, self._nc_num_spec, self._nc_stop_width)
        original = self.model.compute_logits

        def compute_logits(hidden_states, *args, **kwargs):
            if self._nc_capture:  # the head program runs the lm_head on these rows
                return hidden_states
            return original(hidden_states, *args, **kwargs)

        self.model.compute_logits = compute_logits
        if self._nc_counters is not None:
            self._nc_counters.write()

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
        # ``logits`` are the hidden rows compute_logits handed back (one per request, or per draft position).
        self.input_batch.update_async_output_token_ids()
        hidden = logits
        start = time.perf_counter()
        layout = BatchLayout(self.input_batch.num_reqs, spec_decode_metadata)
        rows = layout.rows
        assert hidden.shape[0] == rows, (hidden.shape, rows)
        bucket = self.head.bucket(rows)
        needs = [self._request_needs(req_id) for req_id in self.input_batch.req_ids[:layout.requests]]
        wide = any(need.wide for need in needs)
        inputs = self.head.inputs_for(bucket, wide)
        views = self._views(bucket, wide)
        inputs.hidden[:rows].copy_(hidden)
        if rows < bucket:
            inputs.hidden[rows:].zero_()
        self._fill_mask(views["logit_mask"], layout)
        batch = self.input_batch
        want_logprobs = batch.max_num_logprobs is not None or bool(batch.logprob_token_ids)
        grammar_mask = self._ban_tokens(inputs.logit_mask, layout, needs, keep_grammar_mask=want_logprobs)
        self._fill_sampling(inputs, views, layout, needs, wide)
        filled = time.perf_counter()
        with torch.inference_mode():
            tokens = self.head.run(bucket, wide)[:rows]
        ran = time.perf_counter()
        stats = self._nc_stats
        stats["fill_seconds"] += filled - start
        stats["head_seconds"] += ran - filled
        stats["steps"] += 1
        stats["rows"] += rows
        stats["wide_steps"] += wide
        logprobs = None
        if want_logprobs:
            logprobs = self._logprobs(bucket, wide, tokens, layout, grammar_mask)
            stats["logprob_steps"] += 1
            stats["logprob_seconds"] += time.perf_counter() - ran
        if layout.draft is None:
            sampled = tokens.to(torch.int32).unsqueeze(-1)
        else:  # vLLM's rejection-sampler layout: [requests, max drafts + 1], -1 where nothing is emitted
            width = int(layout.num_draft.max()) + 1
            sampled = torch.full((layout.requests, width), NO_TOKEN, dtype=torch.int32)
            sampled.numpy()[layout.req, layout.pos] = tokens.numpy()
            is_draft = layout.draft >= 0
            stats["draft_rows"] += int(is_draft.sum())
            stats["drafts_accepted"] += int((tokens.numpy()[is_draft] == layout.draft[is_draft]).sum())
            if logprobs is not None:
                logprobs = spread(logprobs, layout, width)
        self._notify_counters()
        return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=logprobs)

    def _logprobs(self, bucket: int, wide: bool, tokens: torch.Tensor, layout: BatchLayout, grammar_mask):
        """vLLM's LogprobsTensors for the emitted tokens (``logprobs.py``), from the logprobs program
        on the step's rows and the grammar's mask."""
        rows = tokens.shape[0]
        target = self.head.logprob_tokens[bucket]
        target[:rows] = tokens.clamp(min=0)  # a row that emits nothing: token 0, dropped by vLLM (as its own)
        target[rows:] = 0
        with torch.inference_mode():
            outputs = self.head.run_logprobs(bucket, wide, grammar_mask)
        batch = self.input_batch
        index = batch.req_id_to_index
        by_request = {index[r]: ids for r, ids in batch.logprob_token_ids.items() if index.get(r, rows) < layout.requests}
        by_row = {int(r): by_request[int(i)] for r, i in enumerate(layout.req) if int(i) in by_request}
        return logprobs_tensors(outputs, target[:rows], batch.max_num_logprobs, by_row)

    def _views(self, bucket: int, wide: bool = False) -> dict[str, np.ndarray]:
        """numpy views sharing memory with the bucket's program inputs (cheap per-row writes)."""
        key = (bucket, wide)
        views = self._nc_views.get(key)
        if views is None:
            inputs = self.head.inputs_for(bucket, wide)
            views = {name: getattr(inputs, name).numpy()
                     for name in ("greedy", "full", "top_k", "top_p", "rank_noise", "logit_mask", "draft",
                                  "first_row", "uniform")}
            views.update({name: t.numpy() for name, t in inputs.processors.items()})
            self._nc_views[key] = views
            program = (self.head.wide_programs if wide else self.head.programs)[bucket]
            description = ProcessorInputs.from_report(program.report["process_logits"])
            self._nc_processor_inputs[key] = description
            self._nc_dirty[key] = set(description.groups)  # reset on first use
        return views

    def _ban_tokens(self, mask: torch.Tensor, layout: BatchLayout, needs: list[RequestNeeds], *,
                    keep_grammar_mask: bool) -> torch.Tensor | None:
        """AND each row's allowed_token_ids / bad_words into its mask row; returns the grammar's mask
        as it was (for the logprobs program, whose raw logprobs vLLM takes before these bans) when
        ``keep_grammar_mask`` and some row changed, else None."""
        rows = [r for r in range(layout.rows) if needs[layout.req[r]].bans is not None]
        if not rows:
            return None
        kept = mask.clone() if keep_grammar_mask else None
        words = mask.numpy()
        outputs = self.input_batch.req_output_token_ids
        for r in rows:
            i = int(layout.req[r])
            drafts = layout.drafts_of[i][: layout.pos[r]] if layout.drafts_of is not None else ()
            needs[i].bans.apply(words[r], outputs[i], drafts)
        self._nc_stats["banned_rows"] += len(rows)
        return kept

    def _fill_mask(self, mask: np.ndarray, layout: BatchLayout) -> None:
        """The scheduler's compact bitmask (``1 + d_i`` rows per structured request, in its own
        order) into head rows: request ``i``'s position ``j`` is row ``start[i] + j``."""
        mask[:] = -1
        grammar_output, scheduler_output = self._nc_grammar or (None, None)
        if grammar_output is None or self._nc_all_allowed:
            return
        index = self.input_batch.req_id_to_index
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens if scheduler_output is not None else {}
        compact, batch_rows = [], []
        compact_row = 0
        for req_id in grammar_output.structured_output_request_ids:
            span = 1 + len(spec_tokens.get(req_id, ()))
            i = index.get(req_id)
            if i is not None and i < layout.requests:
                first = int(layout.start[i])
                compact.extend(range(compact_row, compact_row + span))
                batch_rows.extend(range(first, first + span))
            compact_row += span
        if batch_rows:
            mask[batch_rows] = grammar_output.grammar_bitmask[compact]
            self._nc_stats["constrained_rows"] += len(batch_rows)

    def _request_needs(self, req_id: str) -> RequestNeeds:
        """What a request's params give its processor rows, program and mask rows, once per request."""
        params = self.requests[req_id].sampling_params
        cached = self._nc_rows.get(req_id)
        if cached is None or cached[0] is not params:
            if len(self._nc_rows) > 4 * self.scheduler_config.max_num_seqs + 16:
                self._nc_rows = {k: v for k, v in self._nc_rows.items() if k in self.requests}
            cached = self._nc_rows[req_id] = (params, request_needs(
                params, self.requests[req_id].prompt_token_ids, self.head, self._nc_thinking))
        return cached[1]

    def _fill_sampling(self, inputs, views: dict[str, np.ndarray], layout: BatchLayout, needs: list[RequestNeeds],
                       wide: bool) -> None:
        batch = self.input_batch
        rows, req, pos = layout.rows, layout.req, layout.pos
        n = layout.requests
        bucket = inputs.hidden.shape[0]
        dirty = self._nc_dirty[(bucket, wide)]
        max_top_k = self.head.vocab_size if wide else self.head.max_top_k
        temperature = batch.temperature_cpu[:n][req]
        greedy = temperature < _SAMPLING_EPS
        top_k = batch.top_k_cpu[:n][req]
        top_p = batch.top_p_cpu[:n][req]
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
        # the drafts to verify: row r verifies draft[r] (-1: none); its request's rows start at first_row
        views["first_row"][:rows] = layout.start[req]
        views["first_row"][rows:] = np.arange(rows, bucket)
        views["draft"][:] = NO_TOKEN
        if layout.draft is not None:
            views["draft"][:rows] = layout.draft
        # noise: only rows that sample, and only what they read. Unseeded: a whole row for a
        # full-vocabulary race, else the first max_top_k entries (the race among the sorted
        # candidates, by rank). Seeded: the whole row from the request's own generator, in token
        # order (as vLLM's sampler draws it), then the row's draft-acceptance draw.
        generators = batch.generators
        seeded = np.zeros(rows, dtype=bool)
        for i in generators:
            if i < n:
                seeded |= req == i
        rank_noise = views["rank_noise"]
        rank_noise[:] = True
        rank_noise[:rows] = ~seeded
        sampled = np.flatnonzero(~greedy)
        self._nc_stats["sampled_rows"] += len(sampled)
        if len(sampled):
            noise = inputs.noise
            unseeded = sampled[~seeded[sampled]]
            cut_rows = unseeded[~full[unseeded]]
            if len(cut_rows) > 1:
                _exponential(noise[: int(cut_rows.max()) + 1, :max_top_k])
            elif len(cut_rows):
                _exponential(noise[int(cut_rows[0]), :max_top_k])
            for r in unseeded[full[unseeded]]:
                _exponential(noise[int(r)])
            drafted = sampled[layout.draft[sampled] >= 0] if layout.draft is not None else sampled[:0]
            if len(drafted):
                inputs.uniform[torch.from_numpy(drafted[~seeded[drafted]])] = torch.rand(int((~seeded[drafted]).sum()))
            for r in sampled[seeded[sampled]]:
                gen = generators[int(req[r])]
                noise[int(r)].exponential_(generator=gen)
                if layout.draft is not None and layout.draft[r] >= 0:
                    inputs.uniform[int(r)] = torch.rand((), generator=gen)
            # a whole-vocabulary row's recovered token is never its draft: +inf noise there (race term 0)
            for r in drafted[full[drafted]]:
                noise[int(r), int(layout.draft[r])] = float("inf")
        # per-request processors (rows computed once per request), then the sampler's temperature
        # (written after: the min_p group's reset covers the temperature input too)
        write_rows(views, self._nc_processor_inputs[(bucket, wide)], [need.rows for need in needs], req=req, pos=pos,
                   outputs=batch.req_output_token_ids[:n], dirty=dirty, drafts_of=layout.drafts_of)
        views["temperature"][:rows] = np.where(greedy, 1.0, temperature)
        views["temperature"][rows:] = 1.0

    # ------------------------------------------------------------------ counting
    def _notify_counters(self) -> None:
        if self._nc_counters is not None:
            self._nc_counters.notify()

    def _counters(self) -> dict:
        return {
            **self._nc_stats,
            "compilations": self.head.compilations,
            "compilations_after_warmup": self.head.compilations - (self._nc_warm_compilations or 0),
            "wide_compilations": self.head.wide_compilations,
            "buckets": self.head.buckets,
            "calls_per_bucket": {str(k): v for k, v in dict(self.head.calls).items()},
            "logprob_calls_per_bucket": {str(k): v for k, v in dict(self.head.logprob_calls).items()},
            "all_allowed_mask": self._nc_all_allowed,
            "num_speculative_tokens": self._nc_num_spec,
            "tensor_parallel_size": self.vllm_config.parallel_config.tensor_parallel_size,
            "rank": self._nc_rank,
            "stop_ids_per_row": self._nc_stop_width,
            "tp_all_gather_ms": self._nc_all_gather_ms,
            "pid": os.getpid(),
        }


class NeuronConstrainWorker(CPUWorker):
    """vLLM's CPU worker with :class:`NeuronConstrainModelRunner` as its model runner."""

    def init_device(self):
        check_config(self.vllm_config)
        with no_custom_logits_processors_with_speculation(self.vllm_config):
            super().init_device()
        self.model_runner = NeuronConstrainModelRunner(self.vllm_config, torch.device("cpu"))
