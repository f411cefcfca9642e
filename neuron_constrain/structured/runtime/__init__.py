"""The per-token runtime: requests, the compile cache, the mask buffer, accept, jump-forward, reasoning,
``StructuredRuntime`` and ``generate`` (public through ``neuron_constrain.structured``). It reaches the grammar
engines through their contract (``engines/base.py``)."""
__all__ = ["accept", "compile_cache", "fill", "fill_budget", "generate", "jump_forward", "lanes", "layout", "mask_buffer",
           "reasoning", "requests", "structured_runtime"]
