"""``neuron-constrain demo``: the logit-mask pass end to end on a tiny random-weight Llama."""
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
    transformed = transform(step, (ids,), dynamic_shapes=({0: torch.export.Dim("batch")},), vocab_size=vocab)
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
    unconstrained_s = _best_of(lambda: step(ids))
    print(f"step time constrained/unconstrained: {constrained_s / unconstrained_s:.3f}")
    return 0 if ok and torch.equal(plain, unconstrained) else 1
