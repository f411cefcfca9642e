"""Compiled grammars on disk, so that a restarted process answers the constraints it knows at once.

    cache = DiskCache.from_environment()            # NEURON_CONSTRAIN_GRAMMAR_CACHE=on (or a directory); else None
    key = cache.key(constraint.key(), tokenizer_json)
    grammar = cache.load(key, parse)                # parse(payload) of a sound entry, or None
    cache.store(key, compiled.serialize_json())     # then the oldest entries go past max_bytes

An entry is keyed by the constraint (its ``Constraint.key()``, after the engine's rewrites), the
tokenizer (a SHA-256 of xgrammar's serialized ``TokenizerInfo``) and the versions of xgrammar and of
this format (and of ``grammars.py``, the code that builds the grammar). Each file holds a SHA-256 of its payload on its first line: a file that does not match
(truncated, edited, a write cut short) is deleted and the grammar compiled again, never loaded. Files
are written whole (a temporary file renamed), read back as text (xgrammar's JSON, no pickle), and
used as an LRU: a hit touches its file, a store deletes the least recently used past ``max_bytes``.
Deleting the directory at any time is safe. Only grammars whose compile took at least
``min_seconds`` are stored (a small schema compiles faster than it would load).
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import pathlib
import tempfile

ENV = "NEURON_CONSTRAIN_GRAMMAR_CACHE"  # "on" (the user's cache directory), a directory, or unset/"off"
FORMAT = 1  # the layout of an entry; a new one makes every old entry a miss
XGRAMMAR = importlib.metadata.version("xgrammar")
# The code that turns a constraint into xgrammar's grammar: an entry another version of it wrote is a miss.
CODE = hashlib.sha256((pathlib.Path(__file__).with_name("grammars.py")).read_bytes()).hexdigest()
MAX_BYTES = 1 << 30  # 1 GiB
MIN_SECONDS = 0.2


def default_directory() -> pathlib.Path:
    """``$XDG_CACHE_HOME/neuron-constrain/grammars`` (``~/.cache`` without it)."""
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "neuron-constrain" / "grammars"


class DiskCache:
    """A directory of compiled grammars (see the module docstring).

    Args:
        directory: where the entries live (made on first store).
        max_bytes: the most the entries may take together; the least recently used go first.
        min_seconds: the shortest compile worth storing."""

    def __init__(self, directory: str | os.PathLike, *, max_bytes: int = MAX_BYTES, min_seconds: float = MIN_SECONDS):
        if max_bytes <= 0:
            raise ValueError(f"DiskCache(max_bytes={max_bytes}): pass a positive size")
        self.directory = pathlib.Path(directory)
        self.max_bytes, self.min_seconds = max_bytes, min_seconds
        self.hits = self.misses = self.corrupt = self.stored = 0

    @classmethod
    def from_environment(cls) -> "DiskCache | None":
        """The cache :data:`ENV` asks for: ``on`` (or ``1``): :func:`default_directory`; a path: that
        directory; unset, ``off``, ``0`` or empty: none (a test suite's timing tests would otherwise load
        what a run with raised limits compiled).

        Returns:
            The cache, or ``None``."""
        value = (os.environ.get(ENV) or "").strip()
        if value.lower() in ("", "off", "0", "false", "no"):
            return None
        return cls(default_directory() if value.lower() in ("on", "1", "true", "yes") else value)

    @staticmethod
    def tokenizer_digest(tokenizer_json: str) -> str:
        """A tokenizer's part of every key: a SHA-256 of xgrammar's ``TokenizerInfo.serialize_json()`` (megabytes
        for a large vocabulary: taken once per engine, not once per compile).

        Args:
            tokenizer_json: the serialized ``TokenizerInfo``.

        Returns:
            64 hex digits."""
        return hashlib.sha256(tokenizer_json.encode("utf-8")).hexdigest()

    @staticmethod
    def key(constraint_key: tuple, tokenizer: str) -> str:
        """The file name of an entry: a SHA-256 of the constraint's key, the tokenizer and the versions.

        Args:
            constraint_key: ``Constraint.key()`` of the constraint xgrammar compiles.
            tokenizer: the tokenizer's :meth:`tokenizer_digest`.

        Returns:
            64 hex digits."""
        text = json.dumps([FORMAT, CODE, XGRAMMAR, tokenizer, repr(constraint_key)])
        return hashlib.sha256(text.encode("utf-8")).hexdigest()

    def load(self, key: str, parse=None):
        """The entry under ``key``, checked against its checksum and read by ``parse``; an entry that fails
        either is deleted (``corrupt``) and the caller compiles again.

        Args:
            key: from :meth:`key`.
            parse: ``payload -> value`` (``CompiledGrammar.deserialize_json``); None: the payload itself.

        Returns:
            The value, or ``None`` (none stored, or a corrupt one)."""
        path = self.directory / key
        try:
            checksum, _, payload = path.read_text(encoding="utf-8").partition("\n")
        except (OSError, UnicodeDecodeError):
            self.misses += 1
            return None
        try:
            if hashlib.sha256(payload.encode("utf-8")).hexdigest() != checksum:
                raise ValueError("checksum")
            value = payload if parse is None else parse(payload)
        except Exception:  # noqa: BLE001 - whatever does not load is compiled again
            self.corrupt += 1
            self.discard(key)
            return None
        try:
            os.utime(path)  # the LRU's clock
        except OSError:
            pass
        self.hits += 1
        return value

    def discard(self, key: str) -> None:
        """Delete the entry under ``key`` (one that would not load)."""
        try:
            (self.directory / key).unlink()
        except OSError:
            pass

    def store(self, key: str, payload: str) -> None:
        """Write ``payload`` under ``key`` whole (a temporary file renamed), then trim to ``max_bytes``.
        A directory that cannot be written leaves the cache empty, never fails the compile.

        Args:
            key: from :meth:`key`.
            payload: ``CompiledGrammar.serialize_json()``."""
        text = hashlib.sha256(payload.encode("utf-8")).hexdigest() + "\n" + payload
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            handle, temporary = tempfile.mkstemp(dir=self.directory, prefix=".partial-")
            with os.fdopen(handle, "w", encoding="utf-8") as out:
                out.write(text)
            os.replace(temporary, self.directory / key)
        except OSError:
            return
        self.stored += 1
        self.trim()

    def trim(self) -> None:
        """Delete the least recently used entries until they take at most ``max_bytes``."""
        entries = []
        for path in self.directory.glob("[0-9a-f]" * 64):
            try:
                status = path.stat()
            except OSError:
                continue
            entries.append((status.st_mtime, status.st_size, path))
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries):
            if total <= self.max_bytes:
                break
            try:
                path.unlink()
            except OSError:
                continue
            total -= size
