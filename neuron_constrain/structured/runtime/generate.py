"""``generate``: requests with per-request constraints, decoded by the loop of
``neuron_constrain.decoding`` (which requests run, their model inputs, the noise) while the
structured runtime masks and accepts their tokens (``_Calls``, what the loop asks of them).

    tok = from_mistral(mistral_data_file("tekken_240911.json"))      # the tokenizer protocol
    runtime = StructuredRuntime.for_model(model, tok, max_rows=8)    # reuse it: grammars stay cached
    result = generate(model, prompts, constraints, 64, tokenizer=tok, runtime=runtime)
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Sequence

from neuron_constrain.decoding import CachedDecoder, cached_loop, recompute_loop, transform_decoder
from neuron_constrain.structured.constraints import Constraint
from neuron_constrain.structured.schema.keywords import post_validate
from neuron_constrain.structured.runtime.reasoning import Reasoning
from neuron_constrain.structured.runtime.structured_runtime import StructuredRuntime
from neuron_constrain.structured.tokenizers import TokenizerLike
from neuron_constrain.core.transform import Transformed

__all__ = ["GenerateResult", "Generation", "generate", "transform_decoder"]


@dataclasses.dataclass
class Generation:
    """One request's answer from :func:`generate`.

    Attributes:
        request_id: its index in the call's prompts.
        prompt: its prompt's token ids.
        tokens: the generated tokens, the stop token included when it came.
        text: their decode (with ``reasoning``: the answer), control and stop tokens dropped.
        finish_reason: ``"stop"``, ``"length"`` or ``"error"``.
        error: why, for ``"error"``.
        unenforced: keywords accepted with ``unenforced="allow"`` but not enforced.
        violation: with unenforced keywords, the finished output's schema violation, if any.
        seconds: from its first model step to its last (``None`` if never scheduled).
        forward_passes: model steps it took part in, its prefill included.
        forced_tokens: tokens its grammar forced, taken as drafts of a verify step.
        forced_seconds: host time finding its forced runs.
        reasoning: with ``reasoning=``, the thought's text (vLLM's ``reasoning_content``).
        engines: the grammar engines that decided its answer's tokens, in order (``auto``'s race: llguidance
            until xgrammar's grammar was ready, then xgrammar); empty without a grammar.
        moved_at: with two engines, how many tokens the first decided.
    """

    request_id: int
    prompt: list[int]
    tokens: list[int]  # generated, the stop token included when it came
    text: str  # tokenizer.decode(tokens): the generated text (with ``reasoning``: the answer), control/stop tokens dropped
    finish_reason: str  # "stop" | "length" | "error" (its grammar failed to compile, or timed out)
    error: str | None = None  # why, for "error"
    unenforced: list[str] = dataclasses.field(default_factory=list)  # "keyword at #/path" not enforced (opt-in)
    violation: str | None = None  # with unenforced keywords: the finished output's schema violation, if any
    seconds: float | None = None  # from its first model step (the prefill) to its last; None if never scheduled
    forward_passes: int = 0  # model steps it took part in (its prefill included)
    forced_tokens: int = 0  # tokens its grammar forced, accepted as drafts of a verify step (jump-forward)
    forced_seconds: float = 0.0  # host time finding its forced runs
    reasoning: str | None = None  # with ``reasoning=``: the thought's text (without its end marker), as vLLM's
    # ``reasoning_content``; ``text`` is then the answer after it (empty when the thought never ended)
    engines: tuple[str, ...] = ()  # the grammar engines that decided its answer, in order
    moved_at: int | None = None  # with two engines: the tokens the first decided


@dataclasses.dataclass
class GenerateResult:
    """What :func:`generate` returns.

    Attributes:
        outputs: one :class:`Generation` per prompt, in order.
        step_host_seconds: per decode step, the runtime's step and accept (the engine's included).
        step_fill_seconds: the engine's part of it (fill, accept).
    """

    outputs: list[Generation]
    step_host_seconds: list[float]  # runtime step + accept, per decode step (xgrammar included)
    step_fill_seconds: list[float]  # xgrammar's part of it (fill, accept)


_CALLS = itertools.count()


class _Calls:
    """The requests of one ``generate`` call: their ids in the runtime, token sequences
    (prompt + generated), generated tokens, errors and stops; and what the decode loop
    (``neuron_constrain.decoding.loop``) asks of them: who is ready, a step's masks, what
    its tokens do to the grammars (``step``, ``accept``, ``verify``), who is done."""

    def __init__(self, runtime: StructuredRuntime, sequences: list[list[int]], max_new_tokens: int,
                 jump_forward: str | None = None):
        call = next(_CALLS)
        self.max_new_tokens, self.jump_forward = max_new_tokens, jump_forward
        self.runtime = runtime
        self.ids = [("generate", call, index) for index in range(len(sequences))]  # unique in a shared runtime
        self.index = {request_id: index for index, request_id in enumerate(self.ids)}
        self.sequences = sequences
        self.generated: list[list[int]] = [[] for _ in sequences]
        self.errors: dict[int, str] = {}
        self.stopped: set[int] = set()
        self.host: list[float] = []
        self.fill: list[float] = []
        self.started: dict[int, float] = {}
        self.ended: dict[int, float] = {}
        self.passes = [0] * len(sequences)
        self.forced = [0] * len(sequences)

    def ready(self, waiting: list[int]) -> tuple[list[int], set[int]]:
        """Record the compile errors among ``waiting``; return the rest and those whose grammar is ready."""
        ready = set(self.runtime.ready([self.ids[i] for i in waiting]))
        for index in waiting:
            error = self.runtime.error(self.ids[index]) if self.ids[index] not in ready else None
            if error is not None:
                self.errors[index] = str(error)
        return [i for i in waiting if i not in self.errors], {i for i in waiting if self.ids[i] in ready}

    def wait(self, indices: list[int]) -> None:
        self.runtime.wait([self.ids[i] for i in indices])

    def mask(self, indices: list[int]):
        """The mask of a step of ``indices`` (the pipelined step fills it while the body runs)."""
        return self.runtime.step([self.ids[i] for i in indices])

    def step(self, indices: list[int], run) -> None:
        """``run(mask_kwargs) -> (tokens, empty_rows)`` for the requests ``indices``, then accept."""
        runtime = self.runtime
        batch = [self.ids[i] for i in indices]
        began = time.perf_counter()
        mask = runtime.step(batch)
        tokens, flags = run({} if mask is None else {"logit_mask": mask})
        self.accept(indices, tokens, began, flags.get("logit_mask"))

    def verify(self, indices: list[int], sizes: list[int], run) -> None:
        """One step in which each row also takes the tokens its grammar forces (jump-forward):
        ``k + 1`` positions a row (the smallest verify program, of ``sizes``, that holds the
        longest run), forced positions masked to their one token, so none is rejected, and
        the token sampled after each run is the step's new token; ``run(indices, runs,
        width, mask) -> (tokens, empty_rows)``. A run that ends its request (a forced stop
        token) needs no model output: when every row's does, nothing runs."""
        runtime = self.runtime
        batch = [self.ids[i] for i in indices]
        began = time.perf_counter()
        limits = {self.ids[i]: min(sizes[-1] - 1, self.max_new_tokens - len(self.generated[i]) - 1) for i in indices}
        forced = runtime.forced_runs(batch, limits, mode=self.jump_forward)
        runs = [forced.get(r, []) for r in batch]
        ends = [bool(run) and run[-1] in runtime.stop_token_ids for run in runs]
        taken, flagged = [list(run) for run in runs], [False] * len(batch)
        if not all(ends):
            width = min(n for n in sizes if n > max(map(len, runs)))
            mask = runtime.step(batch, dict(zip(batch, runs)), forced=True, rows_per_request=width)
            out, flags = run(indices, runs, width, mask)
            out = out.view(len(indices), width).tolist()
            empty = flags.get("logit_mask")
            for row, (request_id, forced_run) in enumerate(zip(batch, runs)):
                if out[row][: len(forced_run)] != forced_run:  # a forced position sampled another token
                    raise RuntimeError(f"the verify program returned {out[row][: len(forced_run)]} where the grammar "
                                       f"forced {forced_run} (request {request_id!r}): its logit_mask input was not applied")
                if not ends[row]:
                    taken[row].append(out[row][len(forced_run)])
                flagged[row] = empty is not None and bool(empty.view(len(indices), width)[row, : len(taken[row])].any())
        step_host, step_fill = runtime.last_step_seconds, runtime.last_fill_seconds
        tick = time.perf_counter()
        accepted = runtime.accept_runs(batch, taken, empty=flagged)
        self.host.append(step_host + time.perf_counter() - tick)
        self.fill.append(step_fill)
        used = [i for i, end in zip(indices, ends) if not end]  # the rows that read the model's output
        self.record(indices, batch, taken, accepted, began, used=used)
        for index, request_id, forced_run in zip(indices, batch, runs):
            if request_id not in accepted.failed:
                self.forced[index] += len(forced_run)

    def accept(self, indices, tokens, began: float, empty=None) -> None:
        """What a step's ``tokens`` (one a row) do to the grammars of ``indices``."""
        runtime, batch = self.runtime, [self.ids[i] for i in indices]
        step_host, step_fill = runtime.last_step_seconds, runtime.last_fill_seconds
        accepted = runtime.accept_rows(batch, tokens, empty=empty)
        self.host.append(step_host + runtime.last_accept_seconds)
        self.fill.append(step_fill + runtime.last_accept_engine_seconds)
        self.record(indices, batch, [[t] for t in tokens.tolist()], accepted, began)

    def record(self, indices, batch, taken, accepted, began: float, used=None) -> None:
        """What a step gave each of its requests: its tokens, or its failure; ``used``: the
        requests that read the model's output (default: all), whose forward passes count."""
        for index in indices:
            self.started.setdefault(index, began)
        for index in indices if used is None else used:
            self.passes[index] += 1
        for index, request_id, tokens in zip(indices, batch, taken):
            if request_id in accepted.failed:
                self.errors[index] = str(accepted.failed[request_id])
            else:
                self.generated[index].extend(tokens)
                self.sequences[index].extend(tokens)
        self.stopped.update(self.index[r] for r in accepted.finished)
        now = time.perf_counter()
        for index in indices:
            self.ended[index] = now

    def done(self, index: int) -> bool:
        return index in self.errors or index in self.stopped or len(self.generated[index]) >= self.max_new_tokens


def generate(
    model: Transformed | CachedDecoder,
    prompts: Sequence[str | Sequence[int]],
    constraints: Sequence[Constraint | None],
    max_new_tokens: int,
    *,
    tokenizer: TokenizerLike,
    runtime: StructuredRuntime | None = None,
    compile_timeout: float | None = None,
    engine: str = "auto",
    pipelined: bool = False,
    jump_forward: str | None = None,
    temperature: float | None = None,
    seed: int = 0,
    reasoning: Reasoning | None = None,
) -> GenerateResult:
    """Greedy (or sampled) decoding of a batch, each request under its own constraint.

    Requests whose grammar is still compiling are not scheduled until it is ready; finished
    requests leave the batch between steps. Whatever fails one request (its grammar does not
    compile or passes ``compile_timeout``, its mask row allows nothing, its prompt does not fit
    the cache) ends it with ``finish_reason="error"`` while the others run.

    Args:
        model: a :class:`~neuron_constrain.decoding.CachedDecoder` (``export_decoder`` or
            ``neuron_constrain.models``): each request is prefilled once, then costs one step per
            output token; at most ``max_batch`` requests run at once, the rest join as rows free
            up. Or a :class:`Transformed` step without a cache (``input_ids -> token``): every step
            recomputes the whole sequence.
        prompts: text, or token ids, one per request.
        constraints: one per prompt: a constraint, or ``None`` for a free answer.
        max_new_tokens: the most tokens each answer may have (``"length"`` past it, or at the
            cache's end).
        tokenizer: the protocol of ``tokenizers.py`` (``from_huggingface``, ``from_mistral``, or
            the toy ``Vocabulary``).
        runtime: a :class:`StructuredRuntime` to reuse across calls (compiled grammars stay
            cached); without it each call builds one.
        compile_timeout: seconds a grammar may take to compile (the runtime's default if None).
        engine: the grammar engine of the runtime built here: ``"auto"``, ``"xgrammar"`` or
            ``"llguidance"``.
        pipelined: fill each step's masks while the model's body runs (uncached steps only); the
            same tokens as the serial loop.
        jump_forward: ``"exact"`` or ``"canonical"``: the tokens a grammar forces are decoded as
            drafts of a verify step (a decoder exported with ``new_tokens=(1, 2, 4, 8)``), so a
            structured request takes fewer passes than it has tokens; ``"exact"`` gives exactly
            the tokens of step-by-step decoding.
        temperature: sample instead of the greedy argmax (a decoder exported with
            ``sampled=True``).
        seed: fixes the noise per request and output position: the same call gives the same
            tokens, with or without jump-forward.
        reasoning: every request thinks before it answers (:class:`Reasoning`); the constraint
            holds from the token after the thought's end marker.

    Returns:
        One :class:`Generation` per prompt, in order (its ``text``, ``tokens``, ``finish_reason``,
        ``error``, ``reasoning``, and counters), and the host time of each step.

    Raises:
        ValueError: a prompt without a constraint (or ``None``), an option the model cannot run
            (``pipelined`` on a cached decoder, ``temperature`` or ``jump_forward`` without the
            programs for it), a runtime with fewer rows than the decoder.
        StructuredOutputsDisabledError: constrained requests on a graph without a mask input.
    """
    if len(prompts) != len(constraints):
        raise ValueError(f"{len(prompts)} prompts but {len(constraints)} constraints; pass one constraint (or None) per prompt")
    cached = isinstance(model, CachedDecoder)
    if cached and pipelined:
        raise ValueError("pipelined=True cuts an uncached step at its mask; a CachedDecoder's steps run serially: "
                         "drop pipelined=, or pass a Transformed step")
    if temperature is not None and not (cached and model.sampled and temperature > 0):
        raise ValueError(f"temperature={temperature!r} samples through programs that take noise: pass a positive "
                         "temperature and a CachedDecoder exported with sampled=True (export_decoder / models.export)")
    if jump_forward is not None and not (cached and len(model.steps) > 1):
        raise ValueError(f"jump_forward={jump_forward!r} decodes forced tokens through a verify program: pass a "
                         "CachedDecoder exported with new_tokens=(1, 2, 4, 8) (export_decoder / models.export)")
    owned = runtime is None
    rows = (model.max_batch * (max(model.steps) if jump_forward else 1)) if cached else max(1, len(prompts))
    if owned:
        runtime = StructuredRuntime.for_model(model, tokenizer, max_rows=rows, engine=engine)
    elif cached and runtime.max_rows < rows:
        raise ValueError(f"the runtime has {runtime.max_rows} rows but the decoder runs up to {model.max_batch} "
                         f"requests at once{' of ' + str(max(model.steps)) + ' rows each' if jump_forward else ''}; "
                         f"build it with max_rows={rows}")
    sequences = [list(tokenizer.encode(p)) if isinstance(p, (str, bytes)) else [int(t) for t in p] for p in prompts]
    thinking = reasoning.thinking(tokenizer) if reasoning is not None else None
    calls = _Calls(runtime, sequences, max_new_tokens, jump_forward)
    added = []
    try:
        for request_id, constraint, sequence in zip(calls.ids, constraints, sequences):
            runtime.add(request_id, constraint, timeout=compile_timeout, reasoning=reasoning, prompt=sequence)
            added.append(request_id)
        if cached:
            cached_loop(model, calls, max_new_tokens, jump_forward, temperature=temperature, seed=seed)
        else:
            recompute_loop(model, calls, max_new_tokens, pipelined, tokenizer.eos_id)
        unenforced = {i: runtime.unenforced(calls.ids[i]) for i in range(len(prompts)) if i not in calls.errors}
        forced_seconds = [runtime.forced_seconds(request_id) for request_id in calls.ids]
        served = [runtime.engines(request_id) for request_id in calls.ids]
    finally:
        for request_id in added:
            runtime.remove(request_id)
        if owned:
            runtime.close()
    outputs = []
    for index, tokens in enumerate(calls.generated):
        stopped = bool(tokens) and tokens[-1] in runtime.stop_token_ids
        prompt = sequences[index][: len(sequences[index]) - len(tokens)]
        reason = "error" if index in calls.errors else "stop" if stopped else "length"
        body, thought = tokens[:-1] if stopped else tokens, None
        if reasoning is not None:
            thought, body = reasoning.divide(thinking, prompt, body)
            thought = None if thought is None else tokenizer.decode(thought)
        text = tokenizer.decode(body)
        generation = Generation(index, prompt, tokens, text, reason, calls.errors.get(index), reasoning=thought)
        if index in calls.started:
            generation.seconds = calls.ended[index] - calls.started[index]
        generation.forward_passes, generation.forced_tokens = calls.passes[index], calls.forced[index]
        generation.forced_seconds = forced_seconds[index]
        generation.engines, generation.moved_at = served[index]
        if unenforced.get(index):  # accepted unenforced keywords: validate, never return it as if valid
            generation.unenforced = [u.describe() for u in unenforced[index]]
            if reason == "stop":
                generation.violation = post_validate(constraints[index].spec, text)
        outputs.append(generation)
    return GenerateResult(outputs, calls.host, calls.fill)
