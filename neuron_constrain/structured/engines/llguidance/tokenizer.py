"""The llguidance tokenizer of a tokenizer-protocol object (``llguidance_tokenizer(tokenizer)``).

llguidance reads every token's bytes, the special ids and EOS, and calls an encoder to
tokenize the text a grammar forces (canonically). Special tokens are named ``<...>``, each
once; tokens whose piece is empty are special too (they are never text). Built once per
tokenizer object (~0.3 s at 131k) and cached weakly.
"""
from __future__ import annotations

import weakref

from neuron_constrain.structured.engines.base import encode_continuation


def import_llguidance():
    """The ``llguidance`` module (with its torch helpers), or an ImportError naming the install."""
    try:
        import llguidance
        import llguidance.torch  # noqa: F401  (registers the torch helpers)
    except ImportError as error:
        raise ImportError(
            "engine='llguidance' needs the llguidance package: pip install llguidance==1.9.1 (a dependency of neuron-constrain)"
        ) from error
    return llguidance


_LLG_TOKENIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class _Pieces:
    """What ``llguidance.TokenizerWrapper`` reads: pieces, special ids, EOS, and an encoder."""

    def __init__(self, tokenizer, info):
        own = getattr(tokenizer, "pieces", None)  # tokenizers.Tokenizer / testing.Vocabulary: no decode pass
        pieces = list(own) if own is not None else list(info.decoded_vocab)
        pieces += [b""] * (info.vocab_size - len(pieces))
        special = set(info.special_token_ids) | set(info.stop_token_ids)
        special.update(i for i, p in enumerate(pieces) if not p)
        names = getattr(tokenizer, "names", None)
        seen, self.tokens = set(), []
        for i, piece in enumerate(pieces):
            if i in special:  # llguidance names special tokens "<...>", each once
                name = names[i] if names is not None and i < len(names) else ""
                name = "<" + name.strip("<>[]|") + ">" if name else f"<|special_{i}|>"
                if name in seen:
                    name = f"<|special_{i}|>"
                seen.add(name)
                piece = name.encode()
            self.tokens.append(piece)
        self.special_token_ids = sorted(special)
        self.eos_token_id = info.stop_token_ids[0]
        self.bos_token_id = None
        self._encode = getattr(tokenizer, "encode", None)
        if self._encode is None:  # llguidance tokenizes the text a grammar forces with it
            raise ValueError(
                "engine='llguidance' needs the tokenizer itself (its encode()), not a bare TokenizerInfo: pass "
                "tokenizers.from_huggingface(...) / from_mistral(...)"
            )

    def __call__(self, text):
        """Tokens of ``text`` as it continues a sequence: llguidance forces the canonical tokens
        of the text a grammar fixes."""
        return encode_continuation(self._encode, text)


def llguidance_tokenizer(tokenizer):
    """The llguidance tokenizer of ``tokenizer`` (built once per tokenizer object: ~0.3 s at 131k)."""
    llg = import_llguidance()
    try:
        cached = _LLG_TOKENIZERS.get(tokenizer)
    except TypeError:
        cached = None
    if cached is not None:
        return cached
    info = tokenizer.info
    built = llg.LLTokenizer(llg.TokenizerWrapper(_Pieces(tokenizer, info)), n_vocab=info.vocab_size,
                            eos_token=list(info.stop_token_ids))
    try:
        _LLG_TOKENIZERS[tokenizer] = built
    except TypeError:
        pass
    return built
