"""``transform_decoder`` (the structured-outputs switch) and ``generate``, a greedy loop.

    tok = from_mistral(mistral_data_file("tekken_240911.json"))      # the tokenizer protocol
    runtime = StructuredRuntime.for_model(model, tok, max_rows=8)    # reuse it: grammars stay cached
    result = generate(model, prompts, constraints, 64, tokenizer=tok, runtime=runtime)
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Sequence

import torch

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


def generate(
    transformed: Transformed,
    prompts: Sequence[str | Sequence[int]],
    constraints: Sequence[Constraint | None],
    max_new_tokens: int,
    *,
    tokenizer: TokenizerLike,
    runtime: StructuredRuntime | None = None,
    compile_timeout: float | None = None,
    engine: str = "xgrammar",
    pipelined: bool = False,
) -> GenerateResult:
    """Greedy decoding of a batch with per-request constraints (no KV cache: each step
    recomputes over the last tokens; a graph exported with a static sequence length
    sees a window of that many tokens, left-padded with the stop token).

    ``tokenizer``: the protocol of ``tokenizers.py`` (``info``, ``encode``, ``decode``,
    ``eos_id``): ``from_huggingface(...)``, ``from_mistral(...)``, or the toy
    ``Vocabulary``. ``runtime``: reuse one across calls (compiled grammars stay cached;
    without it each call builds a runtime and pays the engine's warm-up). Requests
    whose grammar is still compiling are not scheduled until it is ready; one whose
    grammar fails or exceeds ``compile_timeout`` ends with ``finish_reason="error"``
    while the others run. Finished requests leave the batch between steps. Constrained
    requests on a graph without a mask input raise :class:`StructuredOutputsDisabledError`
    before any step. ``engine``: the grammar engine of the runtime built here
    (``"xgrammar"`` | ``"llguidance"``; a passed ``runtime`` has its own). A schema
    accepted with ``unenforced="allow"`` lists the keywords on ``Generation.unenforced``
    and a finished output is validated against the schema (``Generation.violation``).
    ``pipelined``: fill each step's masks while the model's body runs (the graph cut at
    the mask, ``neuron_constrain.pipeline``); the same tokens as the serial loop.
    """
    if len(prompts) != len(constraints):
        raise ValueError(f"{len(prompts)} prompts but {len(constraints)} constraints; pass one constraint (or None) per prompt")
    step = PipelinedStep(split_step(transformed)) if pipelined else None
    owned = runtime is None
    if owned:
        runtime = StructuredRuntime.for_model(transformed, tokenizer, max_rows=max(1, len(prompts)), engine=engine)
    window = _sequence_length(transformed)
    sequences = [list(tokenizer.encode(p)) if isinstance(p, (str, bytes)) else [int(t) for t in p] for p in prompts]
    call = next(_CALLS)
    ids = [("generate", call, index) for index in range(len(prompts))]  # unique in a shared runtime
    added = []
    try:
        for request_id, constraint in zip(ids, constraints):
            runtime.add(request_id, constraint, timeout=compile_timeout)
            added.append(request_id)
        generated: list[list[int]] = [[] for _ in prompts]
        errors: dict[int, str] = {}
        waiting = list(range(len(prompts)))  # not finished, not failed
        host, fill = [], []
        while waiting and max_new_tokens > 0:
            ready = set(runtime.ready([ids[i] for i in waiting]))
            for index in waiting:
                error = runtime.error(ids[index]) if ids[index] not in ready else None
                if error is not None:
                    errors[index] = str(error)
            waiting = [i for i in waiting if i not in errors]
            active = [i for i in waiting if ids[i] in ready]
            if not active:
                if waiting:
                    runtime.wait([ids[i] for i in waiting])
                continue
            batch = [ids[i] for i in active]
            length = window or max(len(sequences[i]) for i in active)
            rows = [([tokenizer.eos_id] * length + sequences[i])[-length:] for i in active]
            inputs = torch.tensor(rows, dtype=torch.long)
            empty = None
            if step is not None:  # the fill runs while the body does
                tokens = step((inputs,), fill=lambda: {"logit_mask": runtime.step(batch)})
            else:
                mask = runtime.step(batch)
                tokens, flags = transformed.run(inputs) if mask is None else transformed.run(inputs, logit_mask=mask)
                empty = flags.get("logit_mask")
            step_host, step_fill = runtime.last_step_seconds, runtime.last_fill_seconds
            accepted = runtime.accept_rows(batch, tokens, empty=empty)
            host.append(step_host + runtime.last_accept_seconds)
            fill.append(step_fill + runtime.last_accept_engine_seconds)
            failed = {ids.index(request_id) for request_id in accepted.failed}
            for index, request_id in zip(active, batch):
                if request_id in accepted.failed:
                    errors[index] = str(accepted.failed[request_id])
            for index, token in zip(active, tokens.tolist()):
                if index not in failed:
                    generated[index].append(token)
                    sequences[index].append(token)
            done = set(accepted.finished)
            waiting = [i for i in waiting if i not in failed and ids[i] not in done and len(generated[i]) < max_new_tokens]
        unenforced = {i: runtime.unenforced(ids[i]) for i in range(len(prompts)) if i not in errors}
    finally:
        for request_id in added:
            runtime.remove(request_id)
        if owned:
            runtime.close()
        if step is not None:
            step.close()
    outputs = []
    for index, tokens in enumerate(generated):
        stopped = bool(tokens) and tokens[-1] in runtime.stop_token_ids
        prompt = sequences[index][: len(sequences[index]) - len(tokens)]
        reason = "error" if index in errors else "stop" if stopped else "length"
        text = tokenizer.decode(tokens[:-1] if stopped else tokens)
        generation = Generation(index, prompt, tokens, text, reason, errors.get(index))
        if unenforced.get(index):  # accepted unenforced keywords: validate, never return it as if valid
            generation.unenforced = [u.describe() for u in unenforced[index]]
            if reason == "stop":
                generation.violation = post_validate(constraints[index].spec, text)
        outputs.append(generation)
    return GenerateResult(outputs, host, fill)
