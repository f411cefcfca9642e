"""A byte-level toy vocabulary (a ``RawVocabulary`` + encode/decode), teacher forcing
through a grammar engine, and a tool to call.

    vocab = toy_tokenizer()                  # all 256 bytes, JSON pieces, words, then the stop token
    force(engine, compiled, tokens)          # whether the grammar takes tokens (+ a stop token)
"""
from __future__ import annotations

from typing import Sequence

import torch

from neuron_constrain.structured.tokenizers import RawVocabulary


_JSON_PIECES = (
    '{"', '"}', '":', '",', '":"', '","', '"]', '["', '[{', '}]', '},', '},{', '{}', '[]', '":[', '":{',
    '": ', ', "', '\\"', '\\n', '  ', '    ', 'true', 'false', 'null', '.0', '.5', '-1', '0.', '1.',
)


_WORDS = (
    "name", "id", "age", "type", "value", "items", "tags", "city", "email", "count", "price", "score",
    "status", "title", "user", "users", "data", "description", "enabled", "location", "unit", "query",
    "arguments", "function", "parameters", "celsius", "fahrenheit", "yes", "no", "red", "green", "blue",
    "the", "and", "ing", "tion", "er", "on", "in", "at", "es", "ed", "or", "an", "is", "it", "to",
    "weather", "get", "search", "street", "zip", "country", "address", "active", "level", "mode",
    "min", "max", "first", "last", "date", "time", "size", "small", "large", "medium", "ok", "error",
)


class Vocabulary:
    """A byte-level vocabulary: its ``info`` (a ``RawVocabulary``) plus greedy longest-match encoding.

    ``pieces[i]`` is the bytes of token ``i``; the stop token is ``b""`` (an empty piece
    is special, so it never matches text). A real tokenizer's ``from_huggingface(...).info``,
    or a user-built ``xgrammar.TokenizerInfo``, plugs into :class:`StructuredRuntime` the same way.

    Args:
        pieces: ``pieces[i]``, the bytes of token ``i``; the stop token's is ``b""``.
        eos_id: the stop token.

    Raises:
        ValueError: ``eos_id`` is not a token of ``pieces``, or a piece appears twice.
    """

    def __init__(self, pieces: Sequence[bytes], *, eos_id: int):
        self.pieces = [bytes(p) for p in pieces]
        if not 0 <= eos_id < len(self.pieces):
            raise ValueError(f"eos_id={eos_id} is not a token of this {len(self.pieces)}-piece vocabulary")
        self.eos_id = eos_id
        self.vocab_size = len(self.pieces)
        self._ids: dict[bytes, int] = {}
        for i, piece in enumerate(self.pieces):
            if piece and piece in self._ids:
                raise ValueError(f"piece {piece!r} appears twice (ids {self._ids[piece]} and {i}); pieces must be unique")
            if piece:
                self._ids[piece] = i
        self._longest = max(len(p) for p in self.pieces)
        self.info = RawVocabulary.from_pieces(self.pieces, vocab_size=self.vocab_size, stop_token_ids=[eos_id])

    def encode(self, text: str | bytes) -> list[int]:
        """Greedy longest-match encoding.

        Args:
            text: text (encoded as UTF-8) or bytes.

        Returns:
            The token ids.

        Raises:
            ValueError: a byte no piece starts with (the vocabulary lacks single bytes).
        """
        data = text.encode() if isinstance(text, str) else text
        ids, at = [], 0
        while at < len(data):
            for size in range(min(self._longest, len(data) - at), 0, -1):
                token = self._ids.get(data[at:at + size])
                if token is not None:
                    ids.append(token)
                    at += size
                    break
            else:
                raise ValueError(f"byte {data[at]:#x} at offset {at} has no token; a byte vocabulary needs all 256 single bytes")
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """The text of token ids, the stop token dropped.

        Args:
            ids: the ids.

        Returns:
            Their bytes decoded as UTF-8 (invalid sequences replaced).
        """
        return b"".join(self.pieces[i] for i in ids if i != self.eos_id).decode("utf-8", errors="replace")


def toy_tokenizer(size: int | None = None):
    """A byte-level vocabulary written here, no download: all 256 single bytes, common
    JSON pieces (``{"``, ``":``, ``",``, ``true``, ...), two-digit numbers, words with
    and without a leading space or quote, then the stop token (an empty piece).

    Args:
        size: pad to exactly this many tokens with unique 4-letter filler words (stand-ins for a
            large BPE vocabulary, e.g. ``size=128256`` for Llama 3's).

    Returns:
        A :class:`Vocabulary` (the tokenizer protocol); its ``eos_id`` is the stop token.

    Raises:
        ValueError: a ``size`` smaller than the base tokens.
    """
    texts = list(_JSON_PIECES) + [f"{n:02d}" for n in range(100)]
    for word in _WORDS:
        texts += [word, " " + word, '"' + word, '"' + word + '"', word.capitalize()]
    pieces = [bytes([b]) for b in range(256)]
    seen = set(pieces)
    for text in texts:
        piece = text.encode()
        if piece not in seen:
            seen.add(piece)
            pieces.append(piece)
    eos_id = len(pieces)
    pieces.append(b"")
    if size is not None:
        if size < len(pieces):
            raise ValueError(f"the toy vocabulary has {len(pieces)} base tokens; size={size} cannot hold them")
        letters = "abcdefghijklmnopqrstuvwxyz"
        index = 0
        while len(pieces) < size:
            n, word = index, ""
            for _ in range(4):
                n, digit = divmod(n, 26)
                word += letters[digit]
            index += 1
            piece = word.encode()
            if piece not in seen:
                seen.add(piece)
                pieces.append(piece)
    return Vocabulary(pieces, eos_id=eos_id)


def force(engine, compiled, tokens: Sequence[int], *, buffer: torch.Tensor | None = None,
          times: list | None = None, stop: bool = True) -> bool:
    """Teacher forcing through a grammar engine: whether a fresh matcher of ``compiled``
    takes ``tokens`` and then a stop token (``stop=False``: whether they are a prefix),
    each one checked against the mask filled before it (the bit the graph reads) and by
    ``accept_token``.

    Args:
        engine: a grammar engine (``structured.engines``).
        compiled: a constraint it compiled.
        tokens: the tokens to force.
        buffer: the mask buffer to fill (default: a fresh one).
        times: per token taken, ``(fill + accept seconds, fill seconds)`` is appended.
        stop: also require a stop token after ``tokens``.

    Returns:
        Whether the grammar took them.

    Raises:
        Exception: the error of a fill that failed (the engine's, as ``batch_fill`` reports it).
    """
    import time

    clock = time.perf_counter
    buffer = torch.zeros((1, engine.width), dtype=torch.int32) if buffer is None else buffer
    words = buffer.numpy()
    matcher = engine.matcher(compiled)
    tail = [engine.stop_token_ids[0]] if stop else []
    for token in list(tokens) + tail:
        start = clock()
        failures = engine.batch_fill([matcher], buffer, [0])
        fill = clock() - start
        if failures:
            raise failures[0][1]
        if not (int(words[0, token >> 5]) >> (token & 31)) & 1:
            return False
        start = clock()
        accepted = matcher.accept_token(token)
        if times is not None:
            times.append((fill + clock() - start, fill))
        if not accepted:
            return False
    return matcher.is_terminated() if stop else True


def weather_tool(max_location: int = 10, *, strict: bool = True) -> dict:
    """An OpenAI function tool (``get_weather(location, unit)``) for tests and the demo.

    Args:
        max_location: bounds the location string, so a random model's answer ends.
        strict: its parameters refuse properties they do not list (``additionalProperties: false``).

    Returns:
        The tool, as OpenAI's ``tools`` list takes it.
    """
    parameters = {
        "type": "object",
        "properties": {"location": {"type": "string", "maxLength": max_location},
                       "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["location", "unit"],
    }
    if strict:
        parameters["additionalProperties"] = False
    return {"type": "function", "function": {"name": "get_weather", "parameters": parameters}}
