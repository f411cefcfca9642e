"""The tokenizer protocol the structured runtime and ``generate`` take, adapters for the
tokenizers users have, and an audit of a grammar-engine tokenizer info a user builds.

    tok = from_huggingface(AutoTokenizer.from_pretrained(path))   # fast or slow; BPE or sentencepiece
    tok = from_mistral(MistralTokenizer.from_file("tekken.json")) # or a path: Tekken json, sentencepiece .model
    tok.info            a RawVocabulary (the VocabularyInfo every engine reads): control tokens never text (b"\\xff<name>")
    tok.encode(text)    the tokenizer's own encoding of plain text (no BOS/EOS)
    tok.decode(ids)     the text of generated ids, control tokens dropped (what the grammar saw)
    tok.eos_id, tok.stop_token_ids, tok.special_ids, tok.vocab_size, tok.control_token("[TOOL_CALLS]")
    audit(info, tok, vocab_size=V)   raises TokenizerInfoError naming the tokens and the fix

The protocol is duck-typed: ``generate`` needs ``info``, ``encode``, ``decode`` and
``eos_id`` (``neuron_constrain.testing.Vocabulary`` has them too); the runtime needs
``info``, which each engine converts to its own form (``engines/``). Why control tokens must be
special: ``xgrammar.TokenizerInfo.from_huggingface``
on Mistral's Tekken and sentencepiece v3 tokenizers marks none of their 1000 / 750
control tokens special, so ``<s>`` or ``[INST]`` is allowed inside a JSON string, the
grammar validates it as text, and the tokenizer's decode drops it: the text returned
is not the text validated. Every adapter here builds the info from the raw pieces with
each control token's piece ``b"\\xff" + name``: 0xFF never occurs in UTF-8, so no text
grammar (JSON, regex, EBNF) can ever match it, while a grammar can still name it by id
(``Token(9)``: Mistral's ``[TOOL_CALLS]``). (A ``b""`` piece makes xgrammar mark a token
special, which also keeps it out of text, but then its matcher refuses ``Token(id)``.)

Sentencepiece decoders strip the leading space of the first piece ("▁Hello" ->
"Hello"); the grammar saw " Hello". ``decode`` therefore decodes after an anchor token
and drops the anchor's text, so the returned text is exactly the continuation the
grammar matched (what an incremental detokenizer shows).
"""
from __future__ import annotations

import dataclasses
import functools
import os
from typing import Callable, Iterable, Protocol, Sequence, runtime_checkable

from neuron_constrain.core.errors import Error
from neuron_constrain.structured.engines.xgrammar.grammars import huggingface_pieces


CONTROL_MARK = b"\xff"  # never in UTF-8: a piece holding it is never grammar text


def never_text(piece: bytes) -> bool:
    """Whether no text grammar can match a token with this piece (empty, or not UTF-8 at all)."""
    return piece == b"" or CONTROL_MARK in piece


class TokenizerInfoError(Error, ValueError):
    """A grammar-engine tokenizer info disagrees with its tokenizer or model."""


@runtime_checkable
class VocabularyInfo(Protocol):
    """The vocabulary as the grammar engines read it, whichever engine: each token's bytes
    (control tokens never text), the model's vocabulary size, the stop and special tokens.
    ``Tokenizer.info`` is one (a :class:`RawVocabulary`); a user-built ``xgrammar.TokenizerInfo``
    is one too."""

    vocab_size: int
    stop_token_ids: Sequence[int]
    special_token_ids: Sequence[int]
    decoded_vocab: Sequence[bytes]


@dataclasses.dataclass(frozen=True, eq=False)
class RawVocabulary:
    """A :class:`VocabularyInfo` from each token's raw bytes: special tokens are the empty pieces
    and the ids past the pieces (the lm_head's padding columns), as an engine reading raw bytes
    takes them. Build with :meth:`from_pieces`."""

    decoded_vocab: tuple[bytes, ...]
    vocab_size: int
    stop_token_ids: tuple[int, ...]
    special_token_ids: tuple[int, ...]

    @classmethod
    def from_pieces(cls, pieces: Sequence[bytes], *, vocab_size: int, stop_token_ids: Sequence[int]) -> "RawVocabulary":
        pieces = tuple(bytes(p) for p in pieces)
        special = [i for i, piece in enumerate(pieces) if piece == b""] + list(range(len(pieces), vocab_size))
        return cls(pieces, int(vocab_size), tuple(int(i) for i in stop_token_ids), tuple(special))


@runtime_checkable
class TokenizerLike(Protocol):
    """What ``generate`` and :class:`StructuredRuntime` read from a tokenizer."""

    info: VocabularyInfo
    eos_id: int

    def encode(self, text: str) -> list[int]:
        """Text to token ids (reasoning markers and prompts given as text).

        Args:
            text: the text.

        Returns:
            Its token ids.
        """

    def decode(self, ids: Sequence[int]) -> str:
        """Generated token ids to text.

        Args:
            ids: the ids.

        Returns:
            Their text, control tokens dropped.
        """


class Tokenizer:
    """A real tokenizer behind the protocol. Build with :func:`from_huggingface` or :func:`from_mistral`.

    Args:
        pieces: ``pieces[i]``, the bytes token ``i`` adds to the text (``b""`` for control tokens).
        special_ids: the control tokens: never text inside a grammar.
        stop_token_ids: the tokens that end an answer (the first is ``eos_id``).
        encode: text -> token ids.
        decode: token ids -> text (control tokens dropped).
        names: printable names (control tokens: ``"[INST]"``) for messages.
        vocab_size: the model's vocabulary, when wider than ``pieces``.
        source: where it came from, for messages.

    Raises:
        TokenizerInfoError: a ``vocab_size`` narrower than ``pieces``, or no stop token.
    """

    def __init__(
        self,
        pieces: Sequence[bytes],
        *,
        special_ids: Iterable[int],
        stop_token_ids: Sequence[int],
        encode: Callable[[str], list[int]],
        decode: Callable[[list[int]], str],
        names: Sequence[str] | None = None,
        vocab_size: int | None = None,
        source: str = "",
    ):
        self.special_ids = frozenset(int(i) for i in special_ids)
        self.pieces = [b"" if i in self.special_ids else bytes(p) for i, p in enumerate(pieces)]
        self.names = list(names) if names is not None else [p.decode("utf-8", "replace") for p in pieces]
        self.vocab_size = len(self.pieces) if vocab_size is None else int(vocab_size)
        if self.vocab_size < len(self.pieces):
            raise TokenizerInfoError(
                f"vocab_size={self.vocab_size} is smaller than the tokenizer's {len(self.pieces)} tokens; "
                "pass the model's vocab_size (the lm_head may be wider than the tokenizer, never narrower)"
            )
        self.stop_token_ids = tuple(int(i) for i in stop_token_ids)
        if not self.stop_token_ids:
            raise TokenizerInfoError("the tokenizer has no EOS token; pass stop_token_ids=[<eos id>]")
        self.eos_id = self.stop_token_ids[0]
        self._encode, self._decode = encode, decode
        self.source = source
        self._controls = {self.names[i]: i for i in sorted(self.special_ids) if i < len(self.names)}
        self._anchor = None  # (id, text): a plain token decoded in front of generated ids

    @functools.cached_property
    def info(self) -> RawVocabulary:
        """The vocabulary the engines read, from the raw pieces; control tokens are ``b"\\xff" + name``: never text."""
        pieces = [
            CONTROL_MARK + self.names[i].encode("utf-8", "replace") if i in self.special_ids else piece
            for i, piece in enumerate(self.pieces)
        ]
        return RawVocabulary.from_pieces(pieces, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids)

    def encode(self, text: str) -> list[int]:
        """Text to token ids, by the wrapped tokenizer.

        Args:
            text: the text.

        Returns:
            Its token ids.
        """
        return list(self._encode(text))

    def decode(self, ids: Sequence[int]) -> str:
        """The text of generated ids as a continuation: decoded after a plain token, so a leading space a
        tokenizer strips at the start of a text is kept.

        Args:
            ids: the ids; those past the tokenizer's pieces (lm_head padding) are dropped.

        Returns:
            Their text, control tokens (EOS included) dropped.
        """
        ids = [int(i) for i in ids if int(i) < len(self.pieces)]
        if self._anchor is None:
            anchor = next((i for i, p in enumerate(self.pieces) if p == b"a"), None)
            self._anchor = (anchor, None if anchor is None else self._decode([anchor]))
        anchor, prefix = self._anchor
        if anchor is None:
            return self._decode(ids)
        text = self._decode([anchor] + ids)
        return text[len(prefix):] if text.startswith(prefix) else self._decode(ids)

    def control_token(self, name: str) -> int | None:
        """A control token's id.

        Args:
            name: its printable name (``"[TOOL_CALLS]"``).

        Returns:
            Its id, or None where the tokenizer has no such control token.
        """
        return self._controls.get(name)

    def __repr__(self) -> str:
        return f"Tokenizer({self.source}, {len(self.pieces)} tokens, {len(self.special_ids)} special, eos={self.eos_id})"


def from_huggingface(
    tokenizer, *, vocab_size: int | None = None, stop_token_ids: Sequence[int] | None = None
) -> Tokenizer:
    """Any Hugging Face tokenizer (fast or slow; byte-level BPE, sentencepiece byte fallback, tiktoken).

    Special (never text inside a grammar): every added token marked special, ``all_special_ids``,
    and every token whose ``decode(..., skip_special_tokens=True)`` is empty.

    Args:
        tokenizer: a ``transformers`` tokenizer.
        vocab_size: the model's (lm_head) size, when wider than the tokenizer.
        stop_token_ids: the tokens that end an answer; default the tokenizer's EOS.

    Returns:
        The tokenizer in the library's protocol (``info``, ``encode``, ``decode``, ``eos_id``).

    Raises:
        TokenizerInfoError: ``vocab_size`` narrower than the tokenizer, or no EOS token and no
            ``stop_token_ids``.
    """
    size = len(tokenizer)
    # xgrammar's decoding of each piece (byte-level, byte fallback, raw) is right for text tokens.
    pieces = huggingface_pieces(tokenizer, size)
    special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    special.update(i for i in tokenizer.all_special_ids if i is not None)
    # Decoded after an anchor token: alone, a sentencepiece "▁" decodes to "" (its space stripped).
    anchor = next((i for i, p in enumerate(pieces) if p == b"a"), None)
    front = [] if anchor is None else [anchor]
    empty = tokenizer.decode(front, skip_special_tokens=True)
    backend = getattr(tokenizer, "_tokenizer", None)  # a fast tokenizer's Rust tokenizer: 8x faster in bulk
    batch = backend.decode_batch if hasattr(backend, "decode_batch") else tokenizer.batch_decode
    decoded = batch([front + [i] for i in range(size)], skip_special_tokens=True)
    special.update(i for i, text in enumerate(decoded) if text == empty)
    names = tokenizer.convert_ids_to_tokens(list(range(size)))
    if stop_token_ids is None:
        if tokenizer.eos_token_id is None:
            raise TokenizerInfoError(
                f"{type(tokenizer).__name__} has no eos_token_id; pass stop_token_ids=[<eos id>]"
            )
        stop_token_ids = [tokenizer.eos_token_id]
    return Tokenizer(
        pieces,
        special_ids=special,
        stop_token_ids=stop_token_ids,
        encode=lambda text: tokenizer.encode(text, add_special_tokens=False),
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        names=[n if isinstance(n, str) else "" for n in names],
        vocab_size=vocab_size,
        source=type(tokenizer).__name__,
    )


def mistral_data_file(name: str) -> str:
    """The path of a tokenizer file the ``mistral-common`` package ships.

    Args:
        name: the file's name (``"tekken_240911.json"``, ``"tokenizer.model.v1"``, ...).

    Returns:
        Its path.

    Raises:
        FileNotFoundError: the package ships no such file (the error names its folder)."""
    import mistral_common

    path = os.path.join(os.path.dirname(mistral_common.__file__), "data", name)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"mistral-common has no data file {name!r}; see {os.path.dirname(path)}")
    return path


def from_mistral(tokenizer, *, vocab_size: int | None = None) -> Tokenizer:
    """A ``mistral-common`` tokenizer in the library's protocol.

    Args:
        tokenizer: a ``MistralTokenizer``, its inner Tekkenizer / SentencePieceTokenizer, or a
            path to a Tekken ``.json`` or sentencepiece ``.model`` file.
        vocab_size: the model's (lm_head) size, when wider than the tokenizer.

    Returns:
        The tokenizer (``info``, ``encode``, ``decode``, ``eos_id``), control tokens marked special.

    Raises:
        TypeError: not a mistral-common tokenizer or a path to one.
        TokenizerInfoError: ``vocab_size`` narrower than the tokenizer."""
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer

    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = MistralTokenizer.from_file(str(tokenizer))
    if isinstance(tokenizer, MistralTokenizer):
        tokenizer = tokenizer.instruct_tokenizer.tokenizer
    n = tokenizer.n_words
    if isinstance(tokenizer, Tekkenizer):
        controls = range(tokenizer.num_special_tokens)
        pieces = [b""] * len(controls) + [tokenizer.id_to_byte_piece(i) for i in range(len(controls), n)]
        names = [tokenizer.id_to_piece(i) for i in controls] + [p.decode("utf-8", "replace") for p in pieces[len(controls):]]
        source = f"Tekken {tokenizer.version.value}"
    else:  # sentencepiece: control and unknown tokens are special; <0xNN> pieces are bytes
        model = tokenizer._model
        controls = [i for i in range(n) if model.IsControl(i) or model.IsUnknown(i)]
        names = [model.id_to_piece(i) for i in range(n)]
        pieces = [
            bytes([int(name[3:5], 16)]) if model.IsByte(i) else name.replace("\u2581", " ").encode()
            for i, name in enumerate(names)
        ]
        source = f"sentencepiece {tokenizer.version.value}"
    return Tokenizer(
        pieces,
        special_ids=controls,
        stop_token_ids=[tokenizer.eos_id],
        encode=lambda text: tokenizer.encode(text, bos=False, eos=False),
        decode=lambda ids: tokenizer.decode(ids),  # SpecialTokenPolicy.IGNORE: control tokens dropped
        names=names,
        vocab_size=vocab_size,
        source=source,
    )


def _listed(tokenizer: Tokenizer, ids: list[int], limit: int = 6) -> str:
    shown = ", ".join(f"{i} {tokenizer.names[i]!r}" if i < len(tokenizer.names) else str(i) for i in ids[:limit])
    return shown + (f" and {len(ids) - limit} more" if len(ids) > limit else "")


def audit(info: VocabularyInfo, tokenizer: Tokenizer, *, vocab_size: int | None = None) -> None:
    """Refuse a tokenizer info that would let the grammar validate text the tokenizer does not return.

    Checks, in order: the info's vocab size against the model's (``vocab_size``, else
    the tokenizer's); every control token of ``tokenizer`` never text in ``info``
    (special, or a non-UTF-8 piece); every token the tokenizer decodes to nothing the
    same; every other token's piece equal to the tokenizer's.

    Args:
        info: the vocabulary the engines would read.
        tokenizer: the tokenizer whose decode the answers go through.
        vocab_size: the model's vocabulary; default the tokenizer's.

    Raises:
        TokenizerInfoError: the first check that fails, naming the tokens and the fix.
    """
    fix = "build it with the tokenizer's own .info (neuron_constrain.structured.from_huggingface / from_mistral)"
    want = tokenizer.vocab_size if vocab_size is None else vocab_size
    if info.vocab_size != want:
        raise TokenizerInfoError(
            f"the tokenizer info has vocab_size={info.vocab_size} but the model has {want} logits; "
            f"build it with vocab_size={want} (the model's, padding columns included)"
        )
    special = set(info.special_token_ids)
    decoded = info.decoded_vocab
    special.update(i for i, piece in enumerate(decoded) if never_text(piece))
    controls = sorted(i for i in tokenizer.special_ids if i not in special)
    if controls:
        raise TokenizerInfoError(
            f"{len(controls)} control tokens are not special in the tokenizer info ({_listed(tokenizer, controls)}): "
            f"the grammar would allow them as text and the tokenizer's decode drops them; {fix}"
        )
    silent = [i for i, p in enumerate(tokenizer.pieces) if p == b"" and i not in special]
    if silent:
        raise TokenizerInfoError(
            f"{len(silent)} tokens decode to nothing but the tokenizer info gives them text ({_listed(tokenizer, silent)}); "
            f"mark them special (a b'' piece, or b'\\xff' + name) or {fix}"
        )
    differ = [i for i, p in enumerate(tokenizer.pieces) if p and i not in special and decoded[i] != p]
    if differ:
        shown = "; ".join(f"{i}: info {decoded[i]!r}, tokenizer {tokenizer.pieces[i]!r}" for i in differ[:4])
        raise TokenizerInfoError(
            f"{len(differ)} tokens decode differently in the tokenizer info and the tokenizer ({shown}); "
            f"the info was built for another tokenizer or vocab type: {fix}"
        )


class _WithInfo:
    """A tokenizer seen with a user-built (audited) tokenizer info."""

    def __init__(self, tokenizer, info: VocabularyInfo):
        self._tokenizer, self.info = tokenizer, info

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


class _InfoOnly:
    """A bare vocabulary info (e.g. an ``xgrammar.TokenizerInfo``) seen through the tokenizer protocol."""

    def __init__(self, info: VocabularyInfo):
        self.info = info


def with_info(tokenizer, tokenizer_info: VocabularyInfo | None = None):
    """``tokenizer`` as the runtime reads it (``.info``): a bare info (``RawVocabulary``, ``TokenizerInfo``), or a
    tokenizer with a user-built info, audited against it first."""
    if not hasattr(tokenizer, "info") and (isinstance(tokenizer, RawVocabulary) or
                                           all(hasattr(type(tokenizer), a) for a in VocabularyInfo.__annotations__)):
        tokenizer = _InfoOnly(tokenizer)  # a bare info (read from its class: xgrammar's properties build lists)
    if tokenizer_info is None:
        return tokenizer
    if not hasattr(tokenizer, "special_ids"):
        raise TypeError(
            "tokenizer_info= is audited against the tokenizer's control tokens: pass a tokenizer from "
            "from_huggingface / from_mistral, or pass the info alone as the tokenizer"
        )
    audit(tokenizer_info, tokenizer)
    return _WithInfo(tokenizer, tokenizer_info)
