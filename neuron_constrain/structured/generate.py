"""``transform_decoder`` (the structured-outputs switch) and ``generate``, a greedy loop.

    tok = from_mistral(mistral_data_file("tekken_240911.json"))      # the tokenizer protocol
    runtime = StructuredRuntime.for_model(model, tok, max_rows=8)    # reuse it: grammars stay cached
    result = generate(model, prompts, constraints, 64, tokenizer=tok, runtime=runtime)
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Sequence

import torch

from neuron_constrain.decoding import CachedDecoder
from neuron_constrain.pipeline import PipelinedStep, split_step
from neuron_constrain.structured.constraints import Constraint
from neuron_constrain.structured.keywords import post_validate
from neuron_constrain.structured.runtime import StructuredRuntime
from neuron_constrain.structured.tokenizers import TokenizerLike
from neuron_constrain.transform import Transformed, transform


def transform_decoder(model, example_inputs, *, vocab_size: int, enable_structured_outputs: bool = True, **kwargs) -> Transformed:
    """``transform`` with the structured-outputs switch.

    True: the graph gains the packed ``logit_mask`` input (unconstrained traffic feeds
    ``-1`` rows through the same compiled graph, so the first constrained request
    costs no recompilation). False: no mask input and no mask work; a
    :class:`StructuredRuntime` built for it refuses constrained requests.
    """
    if enable_structured_outputs:
        return transform(model, example_inputs, logit_mask="packed", vocab_size=vocab_size, **kwargs)
    return transform(model, example_inputs, logit_mask=None, **kwargs)


@dataclasses.dataclass
class Generation:
    request_id: int
    prompt: list[int]
    tokens: list[int]  # generated, the stop token included when it came
    text: str  # tokenizer.decode(tokens): the generated text, control/stop tokens dropped
    finish_reason: str  # "stop" | "length" | "error" (its grammar failed to compile, or timed out)
    error: str | None = None  # why, for "error"
    unenforced: list[str] = dataclasses.field(default_factory=list)  # "keyword at #/path" not enforced (opt-in)
    violation: str | None = None  # with unenforced keywords: the finished output's schema violation, if any
    seconds: float | None = None  # from its first model step (the prefill) to its last; None if never scheduled


@dataclasses.dataclass
class GenerateResult:
    outputs: list[Generation]
    step_host_seconds: list[float]  # runtime step + accept, per decode step (xgrammar included)
    step_fill_seconds: list[float]  # xgrammar's part of it (fill, accept)


def _sequence_length(transformed: Transformed) -> int | None:
    """The static token dimension of the graph's first input, or None if it is dynamic."""
    spec = transformed.program.graph_signature.user_inputs[0]
    node = next(n for n in transformed.program.graph.nodes if n.op == "placeholder" and n.name == spec)
    size = node.meta["val"].shape[-1]
    return size if isinstance(size, int) else None


_CALLS = itertools.count()


class _Calls:
    """The requests of one ``generate`` call: their ids in the runtime, token sequences
    (prompt + generated), generated tokens, errors and stops; and ``step``, one model
    step of some of them (mask, run, accept) shared by both loops."""

    def __init__(self, runtime: StructuredRuntime, sequences: list[list[int]]):
        call = next(_CALLS)
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

    def fail_unready(self, waiting: list[int]) -> tuple[list[int], set]:
        """Record the compile errors among ``waiting``; return the rest and the ready ids."""
        ready = set(self.runtime.ready([self.ids[i] for i in waiting]))
        for index in waiting:
            error = self.runtime.error(self.ids[index]) if self.ids[index] not in ready else None
            if error is not None:
                self.errors[index] = str(error)
        return [i for i in waiting if i not in self.errors], ready

    def step(self, indices: list[int], run) -> None:
        """``run(mask_kwargs) -> (tokens, empty_rows)`` for the requests ``indices``, then accept."""
        runtime = self.runtime
        batch = [self.ids[i] for i in indices]
        began = time.perf_counter()
        mask = runtime.step(batch)
        tokens, flags = run({} if mask is None else {"logit_mask": mask})
        self.accept(indices, batch, tokens, flags.get("logit_mask"), began)

    def accept(self, indices, batch, tokens, empty, began: float) -> None:
        runtime = self.runtime
        for index in indices:
            self.started.setdefault(index, began)
        step_host, step_fill = runtime.last_step_seconds, runtime.last_fill_seconds
        accepted = runtime.accept_rows(batch, tokens, empty=empty)
        self.host.append(step_host + runtime.last_accept_seconds)
        self.fill.append(step_fill + runtime.last_accept_engine_seconds)
        for index, request_id, token in zip(indices, batch, tokens.tolist()):
            if request_id in accepted.failed:
                self.errors[index] = str(accepted.failed[request_id])
            else:
                self.generated[index].append(token)
                self.sequences[index].append(token)
        self.stopped.update(self.index[r] for r in accepted.finished)
        now = time.perf_counter()
        for index in indices:
            self.ended[index] = now

    def done(self, index: int, max_new_tokens: int) -> bool:
        return index in self.errors or index in self.stopped or len(self.generated[index]) >= max_new_tokens


def _recompute_loop(transformed: Transformed, calls: _Calls, max_new_tokens: int, pipelined: bool, eos_id: int) -> None:
    """No KV cache: every step recomputes over the last tokens (a graph exported with a
    static sequence length sees a window of that many, left-padded with the stop token)."""
    runtime, window = calls.runtime, _sequence_length(transformed)
    step = PipelinedStep(split_step(transformed)) if pipelined else None
    try:
        waiting = list(range(len(calls.sequences)))  # not finished, not failed
        while waiting and max_new_tokens > 0:
            waiting, ready = calls.fail_unready(waiting)
            active = [i for i in waiting if calls.ids[i] in ready]
            if not active:
                if waiting:
                    runtime.wait([calls.ids[i] for i in waiting])
                continue
            length = window or max(len(calls.sequences[i]) for i in active)
            inputs = torch.tensor([([eos_id] * length + calls.sequences[i])[-length:] for i in active], dtype=torch.long)
            if step is not None:  # the fill runs while the body does
                batch, began = [calls.ids[i] for i in active], time.perf_counter()
                tokens = step((inputs,), fill=lambda: {"logit_mask": runtime.step(batch)})
                calls.accept(active, batch, tokens, None, began)
            else:
                calls.step(active, lambda mask: transformed.run(inputs, **mask))
            waiting = [i for i in waiting if not calls.done(i, max_new_tokens)]
    finally:
        if step is not None:
            step.close()


def _cached_loop(decoder: CachedDecoder, calls: _Calls, max_new_tokens: int) -> None:
    """Prefill each request once into a free cache row, then one-token steps of every
    row; a request whose grammar is still compiling joins when it is ready (a row is
    free), a finished one leaves its row (the rows after it move down)."""
    runtime, sequences = calls.runtime, calls.sequences
    rows: list[int] = []  # the request in each cache row, in row order
    pending = list(range(len(sequences))) if max_new_tokens > 0 else []

    def retire() -> None:
        keep = [r for r, i in enumerate(rows) if not calls.done(i, max_new_tokens) and len(sequences[i]) <= decoder.max_len]
        decoder.keep_rows(keep)
        rows[:] = [rows[r] for r in keep]

    while pending or rows:
        pending, ready = calls.fail_unready(pending)
        for index in pending:
            if len(sequences[index]) > decoder.max_len:
                calls.errors[index] = (f"the prompt has {len(sequences[index])} tokens but the decoder's cache holds "
                                       f"{decoder.max_len}; export it with max_len >= {len(sequences[index]) + 1}")
        pending = [i for i in pending if i not in calls.errors]
        joining = [i for i in pending if calls.ids[i] in ready][: decoder.max_batch - len(rows)]
        if joining:
            pending = [i for i in pending if i not in joining]
            start = len(rows)
            rows += joining
            calls.step(joining, lambda mask: decoder.run_prefill(
                [sequences[i] for i in joining], range(start, start + len(joining)), **mask))
        retire()
        if not rows:
            if pending:
                runtime.wait([calls.ids[i] for i in pending])
            continue
        last = torch.tensor([[sequences[i][-1]] for i in rows], dtype=torch.long)
        positions = [len(sequences[i]) - 1 for i in rows]  # the last token is not in the cache yet
        calls.step(list(rows), lambda mask: decoder.run_step(last, positions, **mask))
        retire()


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
) -> GenerateResult:
    """Greedy decoding of a batch with per-request constraints.

    ``model``: a :class:`~neuron_constrain.decoding.CachedDecoder` (KV cache:
    ``export_decoder`` or ``neuron_constrain.models``): each request is prefilled once
    and then costs one one-token step per output token; at most ``max_batch`` requests
    run at once, the rest join as rows free up. Or a :class:`Transformed` step without a
    cache (``input_ids -> token``), for a model that cannot export one: every step
    recomputes the whole sequence.

    ``tokenizer``: the protocol of ``tokenizers.py`` (``info``, ``encode``, ``decode``,
    ``eos_id``): ``from_huggingface(...)``, ``from_mistral(...)``, or the toy
    ``Vocabulary``. ``runtime``: reuse one across calls (compiled grammars stay cached;
    without it each call builds a runtime and pays the engine's warm-up). Requests
    whose grammar is still compiling are not scheduled until it is ready; one whose
    grammar fails or exceeds ``compile_timeout``, whose mask row allows nothing, or
    whose prompt does not fit the cache ends with ``finish_reason="error"`` while the
    others run. Finished requests leave the batch between steps; a request reaching
    the end of the cache ends with ``"length"``. Constrained requests on a graph without
    a mask input raise :class:`StructuredOutputsDisabledError` before any step.
    ``engine``: the grammar engine of the runtime built here (``"auto"``, the runtime's
    default, | ``"xgrammar"`` | ``"llguidance"``; a passed ``runtime`` has its own). A schema accepted
    with ``unenforced="allow"`` lists the keywords on ``Generation.unenforced`` and a
    finished output is validated against the schema (``Generation.violation``).
    ``pipelined``: fill each step's masks while the model's body runs (the graph cut at
    the mask, ``neuron_constrain.pipeline``; uncached steps only); the same tokens as the serial loop.
    """
    if len(prompts) != len(constraints):
        raise ValueError(f"{len(prompts)} prompts but {len(constraints)} constraints; pass one constraint (or None) per prompt")
    cached = isinstance(model, CachedDecoder)
    if cached and pipelined:
        raise ValueError("pipelined=True cuts an uncached step at its mask; a CachedDecoder's steps run serially: "
                         "drop pipelined=, or pass a Transformed step")
    owned = runtime is None
    if owned:
        rows = model.max_batch if cached else max(1, len(prompts))
        runtime = StructuredRuntime.for_model(model, tokenizer, max_rows=rows, engine=engine)
    elif cached and runtime.max_rows < model.max_batch:
        raise ValueError(f"the runtime has {runtime.max_rows} rows but the decoder runs up to {model.max_batch} "
                         f"requests at once; build it with max_rows={model.max_batch}")
    sequences = [list(tokenizer.encode(p)) if isinstance(p, (str, bytes)) else [int(t) for t in p] for p in prompts]
    calls = _Calls(runtime, sequences)
    added = []
    try:
        for request_id, constraint in zip(calls.ids, constraints):
            runtime.add(request_id, constraint, timeout=compile_timeout)
            added.append(request_id)
        if cached:
            _cached_loop(model, calls, max_new_tokens)
        else:
            _recompute_loop(model, calls, max_new_tokens, pipelined, tokenizer.eos_id)
        unenforced = {i: runtime.unenforced(calls.ids[i]) for i in range(len(prompts)) if i not in calls.errors}
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
        text = tokenizer.decode(tokens[:-1] if stopped else tokens)
        generation = Generation(index, prompt, tokens, text, reason, calls.errors.get(index))
        if index in calls.started:
            generation.seconds = calls.ended[index] - calls.started[index]
        if unenforced.get(index):  # accepted unenforced keywords: validate, never return it as if valid
            generation.unenforced = [u.describe() for u in unenforced[index]]
            if reason == "stop":
                generation.violation = post_validate(constraints[index].spec, text)
        outputs.append(generation)
    return GenerateResult(outputs, calls.host, calls.fill)
