"""``neuron-constrain demo``: the logit-mask pass end to end on a tiny random-weight Llama,
then structured outputs (JSON schema, regex, choice, a required tool call) generated
through it by :mod:`neuron_constrain.structured`, then replacement taps feeding a
tiny GPT-OSS the router logits of a reference model."""
from __future__ import annotations

import time

import torch

from neuron_constrain import transform
from neuron_constrain.kernels import pack_bool_mask
from neuron_constrain.testing import GreedyStep, random_ids, tiny_decoder


def _best_of(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def run_demo(seed: int = 0) -> int:
    vocab, padded = 1000, 1024
    model = tiny_decoder("llama", vocab_size=padded, seed=seed)
    step = GreedyStep(model)
    ids = random_ids(4, 8, vocab, seed=seed)
    print("== logit-mask pass on a tiny Llama greedy step (lm_head padded 1000 -> 1024)")
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
    return 0 if ok and torch.equal(plain, unconstrained) and structured_ok and taps_ok else 1


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
    print(tapped.report["taps"].summary())
    prompts = [[3, 14, 15, 92, 65], [27, 18, 28]]
    replacer = TensorReplacer(capture(LogitsStep(reference), prompts, [router], max_new_tokens=6), prompts)
    without = logit_validation(tapped, LogitsStep(reference), prompts, max_new_tokens=6)
    with_taps = logit_validation(tapped, LogitsStep(reference), prompts, max_new_tokens=6, replacer=replacer, atol=1e-4)
    print("taps off: " + without.summary())
    print("taps fed from the reference's captures: " + with_taps.summary())
    return with_taps.passed and not without.passed


DEMO_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
}
DEMO_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"location": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["location", "unit"],
            },
        },
    }
]


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
