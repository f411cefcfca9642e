"""Tiny real decoders for tests, benchmarks and the demo: Hugging Face architectures
built from small configs with random weights (nothing is downloaded), the decode-step
wrappers an on-device sampler would compile, and a toy vocabulary.

    model = tiny_decoder("llama", vocab_size=1024)
    step = GreedyStep(model)                 # input_ids -> argmax of last logits
    step = SamplingStep(model, top_k=20)     # input_ids, noise -> token (top-k/top-p race)
    step = VocabShardedGreedyStep(model, rank, world_size)  # one rank's (max, index) of its vocab shard
    vocab = toy_tokenizer()                  # a byte-level test Vocabulary (a RawVocabulary info + encode)

``decoders.py``: tiny decoders and full-sequence steps; ``steps.py``: KV-cached, NxD-style and
vocab-parallel decode steps; ``vocabulary.py``: the toy vocabulary, teacher forcing, a tool;
``tiny_checkpoint.py``: the tiny Llama saved as a checkpoint folder with a real tokenizer (what
the vLLM plugin serves as ``--model tiny``; ``build(folder)``, not re-exported here so that
``python -m neuron_constrain.testing.tiny_checkpoint`` runs it once).
"""
from __future__ import annotations

from neuron_constrain.testing.decoders import (
    ARCHITECTURES,
    DraftHeadStep,
    ForcedStep,
    GreedyStep,
    LogitsStep,
    SamplingStep,
    TopKMultinomialStep,
    exponential_noise,
    random_ids,
    sample_race,
    tiny_config,
    tiny_decoder,
)
from neuron_constrain.testing.steps import (
    CachedGreedyStep,
    CachedSamplingStep,
    TokenGenerationStep,
    VocabShardedGreedyStep,
    cache_state,
    greedy_across_ranks,
    pick_across_ranks,
    sample_top_k_top_p,
)
from neuron_constrain.testing.vocabulary import Vocabulary, force, toy_tokenizer, weather_tool

__all__ = ["ARCHITECTURES", "CachedGreedyStep", "CachedSamplingStep", "DraftHeadStep", "ForcedStep", "GreedyStep", "LogitsStep", "SamplingStep", "TokenGenerationStep", "TopKMultinomialStep", "VocabShardedGreedyStep", "Vocabulary", "cache_state", "exponential_noise", "force", "greedy_across_ranks", "pick_across_ranks", "random_ids", "sample_race", "sample_top_k_top_p", "tiny_config", "tiny_decoder", "toy_tokenizer", "weather_tool"]
