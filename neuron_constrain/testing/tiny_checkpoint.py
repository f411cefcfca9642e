"""The tiny decoder as a Hugging Face checkpoint on disk, for servers that load a folder (the
vLLM plugin's ``--model tiny``, its tests and ``bench_vllm``): ``tiny_decoder("llama")`` with
the real Mistral 7B v0.1 sentencepiece tokenizer (shipped in ``mistral_common``), written with
``save_pretrained`` — nothing is downloaded.

    python -m neuron_constrain.testing.tiny_checkpoint build/tiny-llama   # prints the directory
    python -m neuron_constrain.testing.tiny_checkpoint build/tiny-think --reasoning
    python -m neuron_constrain.testing.tiny_checkpoint build/tiny-llama3 --family llama3   # or mistral

``reasoning=True`` makes a reasoning model's checkpoint: ``<think>`` and ``</think>`` added as
single tokens (ids 32002, 32003; what vLLM's ``deepseek_r1`` reasoning parser reads), kept in
the decoded text as DeepSeek-R1's and Qwen3's tokenizers keep theirs (added, not skipped as
special: the parser splits the text at ``</think>``), and a chat template whose assistant
turn opens the thought (``...assistant\n<think>``), as DeepSeek-R1's does: the model writes
its thought, ``</think>``, then its answer.

``family`` makes the checkpoint a tool-call family's servers can load: ``"llama3"`` adds Llama 3.1's
``<|python_tag|>`` (vLLM's ``llama3_json`` parser refuses a vocabulary without it); ``"mistral"``
swaps the tokenizer for mistral-common's v3 instruct tokenizer (32768 pieces with the control tokens
``[TOOL_CALLS]``, ``[AVAILABLE_TOOLS]``...), stored as ``tokenizer.model.v3`` for vLLM's
``--tokenizer-mode mistral`` (mistral-common renders the prompt; no Hugging Face tokenizer is written).
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil

# ChatML-style template; tool calls follow the Hermes format that vLLM's `hermes`
# parser reads (<tool_call>{"name": ..., "arguments": ...}</tool_call>).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|im_start|>system\nYou may call these tools:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    "Answer a call as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] %}{% for part in message['content'] %}{{ part['text'] }}{% endfor %}{% endif %}"
    "{% if message.get('tool_calls') %}{% for call in message['tool_calls'] %}"
    "<tool_call>{\"name\": \"{{ call['function']['name'] }}\", \"arguments\": {{ call['function']['arguments'] }}}</tool_call>"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# tiny_config("llama", ...) keywords: 2 layers, 4 heads (head_dim 32: vLLM's CPU attention
# backend needs >= 32), 2 KV heads, intermediate 2 * hidden, untied lm_head
CONFIG = dict(
    vocab_size=32002,   # Mistral's 32000 pieces + <tool_call>, </tool_call>
    hidden_size=128,
    max_position_embeddings=1024,
    bos_token_id=1,
    eos_token_id=2,
)
STAMP = "neuron_constrain_tiny_model.json"
THINK_TOKENS = ["<think>", "</think>"]  # the reasoning checkpoint's thought markers
FAMILY_TOKENS = {"llama3": ["<|python_tag|>"]}  # special tokens a family's checkpoint adds (as the model's tokenizer has them)
MISTRAL_TOKENIZER = "mistral_instruct_tokenizer_240323.model.v3"  # mistral-common's v3 instruct tokenizer
MISTRAL_VOCAB = 32768
FAMILIES = ("llama3", "mistral")


def tokenizer_file(name: str = "tokenizer.model.v1") -> str:
    import mistral_common

    path = pathlib.Path(mistral_common.__file__).parent / "data" / name
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: install mistral-common (the vllm extra pins it)")
    return str(path)


def add_think_tokens(tokenizer) -> list[int]:
    """Add ``<think>`` and ``</think>`` to a Hugging Face tokenizer as single tokens kept in the
    decoded text (added, not special: as DeepSeek-R1's and Qwen3's); returns their ids."""
    from transformers import AddedToken

    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    return tokenizer.convert_tokens_to_ids(THINK_TOKENS)


def tokenizer(*, reasoning: bool = False, family: str | None = None):
    """The checkpoint's Hugging Face tokenizer (Mistral 7B v0.1's sentencepiece, ``<tool_call>`` /
    ``</tool_call>``, with ``reasoning`` the thought markers and the template opening the thought,
    with ``family`` that family's special tokens)."""
    import tempfile

    from transformers import LlamaTokenizer

    with tempfile.TemporaryDirectory() as staging:
        # LlamaTokenizer(vocab_file=...) yields a 3-token vocabulary on transformers 5;
        # from_pretrained on a folder holding tokenizer.model converts the real one.
        shutil.copy(tokenizer_file(), pathlib.Path(staging) / "tokenizer.model")
        hf = LlamaTokenizer.from_pretrained(staging)
    # Hermes-style tool-call delimiters as single special tokens (vLLM's hermes parser reads them)
    hf.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>", *FAMILY_TOKENS.get(family, ())]})
    if reasoning:
        add_think_tokens(hf)
    size = _vocab_size(reasoning, family)
    if len(hf) != size:
        raise RuntimeError(f"the Mistral tokenizer loaded with {len(hf)} tokens, expected {size}")
    hf.chat_template = CHAT_TEMPLATE.replace("assistant\n{% endif %}", "assistant\n<think>{% endif %}") \
        if reasoning else CHAT_TEMPLATE
    return hf


def _vocab_size(reasoning: bool, family: str | None) -> int:
    if family == "mistral":
        return MISTRAL_VOCAB
    return CONFIG["vocab_size"] + (len(THINK_TOKENS) if reasoning else 0) + len(FAMILY_TOKENS.get(family, ()))


def build(directory: str | os.PathLike, *, seed: int = 0, reasoning: bool = False, family: str | None = None) -> str:
    """Write the model and tokenizer into ``directory`` unless already there; return it.
    ``reasoning``: the thought markers and a chat template that opens the thought; ``family``: a tool-call
    family's checkpoint, one of :data:`FAMILIES` (above)."""
    if family is not None and (family not in FAMILIES or reasoning):
        raise ValueError(f"family={family!r}: pick one of {', '.join(FAMILIES)}, without reasoning=True")
    out = pathlib.Path(directory)
    config = dict(CONFIG, vocab_size=_vocab_size(reasoning, family))
    if (out / STAMP).exists():
        stamp = json.loads((out / STAMP).read_text())
        if stamp.get("vocab_size") != config["vocab_size"]:
            raise RuntimeError(f"{out} holds a tiny checkpoint of {stamp.get('vocab_size')} tokens, not the "
                               f"{config['vocab_size']} asked for (reasoning={reasoning}, family={family}); "
                               f"use another folder")
        return str(out)
    import torch

    from neuron_constrain.testing.decoders import tiny_decoder

    out.mkdir(parents=True, exist_ok=True)
    if family == "mistral":
        shutil.copy(tokenizer_file(MISTRAL_TOKENIZER), out / "tokenizer.model.v3")
    else:
        tokenizer(reasoning=reasoning, family=family).save_pretrained(str(out))
    model = tiny_decoder("llama", seed=seed, **config)
    with torch.no_grad():  # larger logits than the default init: fewer near-ties, more varied greedy text
        model.lm_head.weight.normal_(0.0, 0.5)
    model.save_pretrained(str(out))
    (out / STAMP).write_text(json.dumps({"seed": seed, **config}))
    return str(out)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", nargs="?", default="build/tiny-llama")
    parser.add_argument("--reasoning", action="store_true")
    parser.add_argument("--family", choices=FAMILIES)
    args = parser.parse_args()
    print(build(args.directory, reasoning=args.reasoning, family=args.family))
