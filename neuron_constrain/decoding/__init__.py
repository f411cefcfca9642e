"""Decoding: the decode programs and the loop that runs them.

``decoder.py``: KV-cached prefill and n-token step programs exported from a Hugging Face
``*ForCausalLM`` (:func:`export_decoder`, :class:`CachedDecoder`). ``loop.py``: the decode
loop (which requests run each step, their model inputs, verify steps, sampling noise) and
``transform_decoder``; ``structured.generate`` drives it with the grammars' masks.
``compiled.py``: the programs compiled ahead of time (:func:`compile_decoder`: AOTInductor
packages, or the programs on the XLA device).
"""
from neuron_constrain.decoding.compiled import compile_decoder
from neuron_constrain.decoding.decoder import CachedDecoder, CachedStep, KVCache, PrefillStep, export_decoder
from neuron_constrain.decoding.loop import cached_loop, recompute_loop, transform_decoder

__all__ = ["CachedDecoder", "CachedStep", "KVCache", "PrefillStep", "cached_loop", "compile_decoder", "export_decoder", "recompute_loop",
           "transform_decoder"]
