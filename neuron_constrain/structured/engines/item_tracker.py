"""The item tracker: an engine's matcher behind a reader of the output that refuses every token completing
an item its array may not take (which arrays, and what they must meet: ``item_plan.py``).

    matcher = ItemTrackingMatcher(engine_matcher, plan, tracker_vocabulary(info), width)

The tracker reads the output's bytes as JSON (the grammar keeps them valid), notes where each item
of a tracked array starts, and when one ends (a string's closing quote, a container's closing
bracket, a literal's last letter, the byte after a number) checks it: ``uniqueItems`` compares its
value with the array's earlier items, as JSON Schema does (``1`` and ``1.0`` equal, ``true`` and
``1`` not, key order ignored); ``contains`` judges it with ``jsonschema`` and counts it against
``maxContains``, and a closing bracket is refused until ``minContains`` items matched.
``accept_token`` refuses such a token; a mask row keeps the engine's bits and clears them, trying
only tokens that can end an item (a string item: by a prefix index of what precedes each token's
first quote). One step ahead, a token after which the item equals an earlier one and the grammar
allows nothing but its end is cleared too (a string at its ``maxLength``, a number no digit may
follow, a literal's forced letters), and so is one after which a full array could only close with
its ``contains`` unmet. A dead end deeper than that fails the request; it never writes an invalid
array. Objects whose ``minProperties`` the plan counts (``Plan.min_properties``: open ones) note each
distinct name as its key closes, and their closing brace is refused until there are enough.
"""
from __future__ import annotations

import collections
import decimal
import functools
import json
import re
from typing import Sequence

import numpy as np
import torch

from neuron_constrain.structured.schema.item_plan import OTHER, Plan

_WHITESPACE = b" \t\n\r"
_LITERALS = {ord("t"): 4, ord("f"): 5, ord("n"): 4}
_WORDS = {ord("t"): b"true", ord("f"): b"false", ord("n"): b"null"}


# --------------------------------------------------------------------------- values
def canonical(value):
    """A hashable form of a JSON value under JSON Schema's equality."""
    if value is None or isinstance(value, bool):
        return ("l", value)
    if isinstance(value, (int, float, decimal.Decimal)):
        return ("n", decimal.Decimal(value))
    if isinstance(value, str):
        return ("s", value)
    if isinstance(value, list):
        return ("a", tuple(canonical(v) for v in value))
    return ("o", frozenset((k, canonical(v)) for k, v in value.items()))


def _read(text: bytes):
    try:
        return canonical(json.loads(text, parse_float=decimal.Decimal, parse_int=decimal.Decimal))
    except (ValueError, decimal.InvalidOperation):
        return None


# --------------------------------------------------------------------------- the output, read as JSON
def _least(frame) -> int:
    """The distinct names an object frame must reach (0: none counted)."""
    return next((n for kind, n in frame[2] if kind == "least"), 0)


def _asked(checks) -> list:
    """The node indices of an object frame's existential checks, in a fixed order (its met sets' order)."""
    return sorted(i for kind, i in checks if kind == "exists")


def _contained(frame) -> list:
    """The node indices of a frame's ``contains`` checks, in a fixed order (its counts' order)."""
    return sorted(c for c in frame[2] if c != "unique")


# what may follow a number without changing its value: zeros after its point, or a point and zeros (then its end)
_ZEROS = re.compile(rb"0+(?:[,\]}\s].*)?\Z", re.DOTALL)
_POINT_ZEROS = re.compile(rb"\.0*(?:[,\]}\s].*)?\Z", re.DOTALL)


class Scan:
    """Where the output stands: a stack of open containers and the scalar being written. Immutable
    apart from the shared ``text`` (bytes past ``length`` are scratch), so a state is kept per token."""

    __slots__ = ("plan", "text", "length", "stack", "string", "escape", "key", "scalar", "literal")

    def __init__(self, plan: Plan, text: bytearray):
        self.plan, self.text, self.length = plan, text, 0
        # frames: (is_array, shape, checks, seen, item_start, index, key, expect_key, counts): checks, what
        # Plan.tracked says the array must meet; seen, its items so far; counts, items each `contains` took
        self.stack: tuple = ()
        self.string = -1  # where the open string's content starts
        self.escape = False
        self.key = False  # the open string is a key
        self.scalar = -1  # where an unquoted number starts
        self.literal = 0  # letters of true/false/null still to come

    def _copy(self) -> "Scan":
        new = Scan.__new__(Scan)
        for name in Scan.__slots__:
            setattr(new, name, getattr(self, name))
        return new

    def watching(self) -> bool:
        """Whether some tracked array has an earlier item an item may now equal, or a `contains` to meet, or
        an object its names are counted for is open."""
        return any(frame[2] and (frame[3] or frame[8] or not frame[0]) for frame in self.stack)

    def fed(self, data: bytes) -> "Scan | None":
        """The state after ``data``; None if it completes an item its array may not take (a duplicate, one
        past ``maxContains``, a bracket before ``minContains``) or is not JSON that could continue here."""
        if not data:
            return self
        new = self._copy()
        text = new.text
        del text[new.length:]
        text += data
        try:
            for pos in range(new.length, new.length + len(data)):
                if not new._byte(text[pos], pos):
                    return None
        except (IndexError, ValueError):  # a bracket closing nothing, a key JSON cannot read: no grammar takes it
            return None
        new.length += len(data)
        return new

    def _byte(self, byte: int, pos: int) -> bool:
        if self.string >= 0:
            if self.escape:
                self.escape = False
            elif byte == 0x5C:
                self.escape = True
            elif byte == 0x22:
                start, self.string = self.string, -1
                if self.key:
                    self.key = False
                    frame = self.stack[-1]
                    name = json.loads(b'"' + bytes(self.text[start:pos]) + b'"')
                    names = frame[3] | {name} if frame[2] else frame[3]  # counted objects: the distinct names
                    self.stack = (*self.stack[:-1], (*frame[:3], names, *frame[4:6], name, False, frame[8]))
                    return True
                return self._end(pos + 1)
            return True
        if self.literal:
            self.literal -= 1
            return self._end(pos + 1) if not self.literal else True
        if self.scalar >= 0:
            if byte in b",]}" or byte in _WHITESPACE:
                self.scalar = -1
                if not self._end(pos):
                    return False
            else:
                return True
        if byte in _WHITESPACE or byte == 0x3A:
            return True
        if byte == 0x2C:
            if not self.stack:
                return True
            frame = self.stack[-1]
            self.stack = (*self.stack[:-1], (*frame[:5], frame[5] + 1, frame[6], not frame[0], frame[8]))
            return True
        if byte in b"]}":
            frame = self.stack[-1]
            if frame[0] and frame[8] and any(count < self.plan.contains(i)[1]
                                             for i, count in zip(_contained(frame), frame[8])):
                return False  # closed with too few items its `contains` takes
            if not frame[0] and frame[2] and (len(frame[3]) < _least(frame) or not all(frame[8])
                                              or not self._whole(frame, pos)):
                return False  # fewer distinct names than its minProperties, no member its `not` asks for, not one oneOf branch
            self.stack = self.stack[:-1]
            return self._end(pos + 1)
        if byte == 0x22 and self.stack and not self.stack[-1][0] and self.stack[-1][7]:
            self.string, self.key = pos + 1, True
            return True
        shape = self._start(pos)
        if byte in b"[{":
            is_array = byte == 0x5B
            checks = self.plan.tracked(shape) if is_array else self._object_checks(shape, pos)
            counts = (0,) * sum(1 for c in checks if c != "unique") if is_array else (
                (frozenset(),) * len(_asked(checks)))
            self.stack = (*self.stack, (is_array, shape, checks, frozenset(), -1, 0, None, not is_array, counts))
        elif byte == 0x22:
            self.string = pos + 1
        elif byte in _LITERALS:
            self.literal = _LITERALS[byte] - 1
        else:
            self.scalar = pos
        return True

    def _object_checks(self, shape, pos: int) -> frozenset:
        """What an object at ``shape`` opened at ``pos`` must meet: ``("least", n)`` distinct names, ``("exists",
        i)`` a member breaking node ``i``'s ``not``, ``("whole", i)`` node ``i``'s ``oneOf`` on its text from
        ``("from", pos)`` (a branch decides: nothing here, the engine refused it)."""
        least, asked = self.plan.min_properties(shape), self.plan.exists(shape)
        asked = sorted(asked) if isinstance(asked, frozenset) else []
        return frozenset(([("least", least)] if isinstance(least, int) and least > 0 else []) + asked
                         + [("from", pos)] * any(kind == "whole" for kind, _ in asked))

    def _whole(self, frame, pos: int) -> bool:
        """Whether the object closing at ``pos`` meets each ``oneOf`` judged on it whole."""
        start = next((p for kind, p in frame[2] if kind == "from"), None)
        return start is None or all(self.plan.whole(i, bytes(self.text[start:pos + 1]))
                                    for kind, i in frame[2] if kind == "whole")

    def _start(self, pos: int) -> frozenset:
        """A value starts at ``pos``: its shape (and, in a tracked array, where the item starts)."""
        if not self.stack:
            return self.plan.root
        frame = self.stack[-1]
        if frame[0]:
            if frame[2]:
                self.stack = (*self.stack[:-1], (*frame[:4], pos, *frame[5:]))
            return self.plan.item(frame[1], frame[5])
        name = frame[6]
        if frame[8]:  # a member an existential judges: where its value starts
            self.stack = (*self.stack[:-1], (*frame[:4], pos, *frame[5:]))
        return self.plan.member(frame[1], name if name in self.plan.names(frame[1]) else OTHER)

    def _end(self, end: int) -> bool:
        """A value ended before ``end``: False if it is an item equal to an earlier one of its array, or
        one more than a ``maxContains`` takes."""
        if not self.stack:
            return True
        frame = self.stack[-1]
        if not frame[0] and frame[8] and frame[4] >= 0:  # a member's value: the names whose last value breaks a `not`
            text, name = bytes(self.text[frame[4]:end]), frame[6]
            met = tuple(m | {name} if self.plan.breaks(i, name, text) else m - {name}
                        for i, m in zip(_asked(frame[2]), frame[8]))
            self.stack = (*self.stack[:-1], (*frame[:4], -1, *frame[5:8], met))
            return True
        if not (frame[0] and frame[2] and frame[4] >= 0):
            return True
        text = bytes(self.text[frame[4]:end])
        seen = frame[3]
        if "unique" in frame[2]:
            value = _read(text)
            if value is not None and value in seen:
                return False
            seen = seen | {value} if value is not None else seen
        counts = frame[8]
        if counts:
            counts = tuple(count + self.plan.judge(i, text) for i, count in zip(_contained(frame), counts))
            if any(self.plan.contains(i)[2] is not None and count > self.plan.contains(i)[2]
                   for i, count in zip(_contained(frame), counts)):
                return False
        self.stack = (*self.stack[:-1], (*frame[:3], seen, -1, *frame[5:8], counts))
        return True

    def unmet(self) -> bool:
        """Whether the open array has a ``contains`` its items have not met yet (it may not close here)."""
        frame = self.stack[-1] if self.stack else None
        return bool(frame and frame[0] and frame[8] and frame[4] < 0 and self.string < 0 and self.scalar < 0
                    and not self.literal
                    and any(count < self.plan.contains(i)[1] for i, count in zip(_contained(frame), frame[8])))

    def ends_unmet(self) -> str | None:
        """The kind of the scalar item being written (``"string"``, ``"number"``) if, ended here, it would
        leave a ``contains`` of its array unmet; else None."""
        frame = self.stack[-1] if self.stack else None
        if not (frame and frame[0] and frame[8] and frame[4] >= 0):
            return None
        if self.string == frame[4] + 1 and not self.escape:
            kind, text = "string", bytes(self.text[frame[4]:self.length]) + b'"'
        elif self.scalar == frame[4]:
            kind, text = "number", bytes(self.text[frame[4]:self.length])
        else:
            return None
        try:
            counts = [count + self.plan.judge(i, text) for i, count in zip(_contained(frame), frame[8])]
        except ValueError:  # not a whole value yet
            return None
        return kind if any(count < self.plan.contains(i)[1] for i, count in zip(_contained(frame), counts)) else None

    def pending(self):
        """The value of the tracked item being written if it ended here, when it equals an earlier
        one: ``("string" | "number", value)``; else None."""
        if not self.stack:
            return None
        frame = self.stack[-1]
        if not (frame[0] and frame[2] and frame[3] and frame[4] >= 0):
            return None
        if self.string == frame[4] + 1 and not self.escape:
            value = _read(bytes(self.text[frame[4]:self.length]) + b'"')
            return ("string", value) if value in frame[3] else None
        if self.scalar == frame[4]:
            value = _read(bytes(self.text[frame[4]:self.length]))
            return ("number", value) if value in frame[3] else None
        if self.literal:  # its last letters are forced: the literal it spells is as good as written
            value = _read(_WORDS[self.text[frame[4]]])
            return ("literal", value) if value in frame[3] else None
        return None

    def open_string(self):
        """``(content, seen strings)`` while a tracked string item is being written with no escape
        in it yet (the fast path); else None."""
        frame = self.stack[-1] if self.stack else None
        if frame is None or not (frame[0] and frame[2] and frame[4] >= 0 and self.string == frame[4] + 1):
            return None
        content = bytes(self.text[self.string:self.length])
        if b"\\" in content:
            return None
        return content, [v[1].encode("utf-8", "surrogatepass") for v in frame[3] if v[0] == "s"]

    def mode(self) -> str:
        if self.string >= 0:
            return "string"
        if self.literal:
            return "literal"
        if self.scalar >= 0:
            return "number"
        return "between"


# --------------------------------------------------------------------------- the vocabulary, indexed
class TrackerVocabulary:
    """Each token's bytes, and the token sets the tracker tries first."""

    def __init__(self, pieces: Sequence[bytes], vocab_size: int, stop_ids: Sequence[int]):
        self.pieces = [bytes(p) for p in pieces] + [b""] * (vocab_size - len(pieces))
        for stop in stop_ids:
            if stop < vocab_size:
                self.pieces[stop] = b""
        size = vocab_size
        self.before_quote: dict[bytes, list[int]] = collections.defaultdict(list)  # fast string path
        self.opening: dict[bytes, list[int]] = collections.defaultdict(list)  # '"' + text, no quote or escape after
        self.whole: dict[bytes, int] = {}
        flags = {name: np.zeros(size, dtype=bool) for name in (
            "quote", "slow_quote", "close", "number_end", "between", "starts_quote", "starts_end", "starts_close",
            "reopen")}
        numberish = re.compile(rb"^[-0-9.eE+]+$")
        complete_number = re.compile(rb"[0-9][,\]}\s]")
        for token, piece in enumerate(self.pieces):
            if not piece:
                continue
            self.whole.setdefault(piece, token)
            quote = piece.find(b'"')
            if quote >= 0:
                flags["quote"][token] = True
                after = piece[quote + 1:]
                if b"\\" in piece[:quote] or any(b not in b",]}: \t\n\r" for b in after):
                    flags["slow_quote"][token] = True
                else:
                    self.before_quote[piece[:quote]].append(token)
            if b"]" in piece or b"}" in piece:
                flags["close"][token] = True
            if any(b in b",]} \t\n\r" for b in piece) or numberish.match(piece):
                flags["number_end"][token] = True
            bare = piece.lstrip(b" \t\n\r")
            if piece.count(b'"') >= 2 or flags["close"][token] or numberish.match(bare) \
                    or complete_number.search(piece) or any(w.startswith(bare) or w in bare for w in _WORDS.values()):
                flags["between"][token] = True
            elif bare[:1] == b'"' and b"\\" not in bare:
                self.opening[bare[1:]].append(token)
            flags["starts_quote"][token] = piece[:1] == b'"'
            flags["starts_end"][token] = piece[:1] in (b",", b"]", b"}", b" ", b"\t", b"\n", b"\r")
            flags["starts_close"][token] = bare[:1] == b"]"
            flags["reopen"][token] = re.search(rb"[\[{].*[\]}]", piece, re.DOTALL) is not None  # "{}", "[]", ...
        self.flags = flags
        self.size = size
        self.reopen = np.flatnonzero(flags["reopen"])


@functools.lru_cache(maxsize=4)
def tracker_vocabulary(info) -> TrackerVocabulary:
    return TrackerVocabulary(info.decoded_vocab, info.vocab_size, info.stop_token_ids)


def _allowed(words: np.ndarray, size: int) -> np.ndarray:
    return np.unpackbits(words.view(np.uint8), bitorder="little")[:size].astype(bool)


# --------------------------------------------------------------------------- the matcher
class ItemTrackingMatcher:
    """An engine's matcher (``grammar``) with the tracker in front: the runtime's matcher protocol."""

    fills_itself = True  # the runtime fills and accepts it row by row, never through an engine's batch call

    def __init__(self, grammar, plan: Plan, vocabulary: TrackerVocabulary, width: int):
        self.grammar, self.plan, self.vocabulary = grammar, plan, vocabulary
        self.scan = Scan(plan, bytearray())
        self._history: list[Scan] = []
        self._scratch = torch.zeros((1, width), dtype=torch.int32)

    def fill_next_token_bitmask(self, buffer: torch.Tensor, row: int = 0) -> bool:
        result = self.grammar.fill_next_token_bitmask(buffer, row)
        scan = self.scan
        words = buffer[row].numpy().view(np.uint32)
        if not scan.watching():
            if self.plan.counted or self.plan.contained or self.plan.existing or self.plan.wholes:  # an object or array opened and closed in one token
                reopen = self.vocabulary.reopen
                for token in reopen[(words[reopen >> 5] >> (reopen & 31).astype(np.uint32)) & 1 == 1].tolist():
                    if scan.fed(self.vocabulary.pieces[token]) is None:
                        words[token >> 5] &= np.uint32(0xFFFFFFFF ^ (1 << (token & 31)))
            return result
        allowed = _allowed(words, self.vocabulary.size)
        for token in self._refused(scan, allowed):
            words[token >> 5] &= np.uint32(0xFFFFFFFF ^ (1 << (token & 31)))
        return result

    def _refused(self, scan: Scan, allowed: np.ndarray) -> list[int]:
        vocabulary, flags, refused = self.vocabulary, self.vocabulary.flags, []
        mode = scan.mode()
        top = scan.stack[-1] if scan.stack else None
        top_tracked = top is not None and top[0] and top[2]
        fast = scan.open_string() if top_tracked and mode == "string" and not top[8] else None
        if not top_tracked:
            candidates = np.zeros_like(allowed)
        elif fast is not None:
            content, seen = fast
            candidates = allowed & flags["slow_quote"]
            for value in seen:
                if value.startswith(content):
                    rest = value[len(content):]
                    refused += [t for t in vocabulary.before_quote.get(rest, ()) if allowed[t]]
                    whole = vocabulary.whole.get(rest)
                    if rest and whole is not None and allowed[whole] and b'"' not in rest and b"\\" not in rest:
                        candidates[whole] = True  # may leave a duplicate only its closing quote can end
        elif mode == "string":
            candidates = allowed & flags["quote"]
        elif mode == "literal":
            candidates = allowed.copy()
        elif mode == "number":
            candidates = allowed & flags["number_end"]
        else:  # between items: a whole item in one token, or the start of one that may end as a duplicate
            candidates = allowed & flags["between"]
            for value in (v[1].encode("utf-8", "surrogatepass") for v in top[3] if v[0] == "s"):
                for token in vocabulary.opening.get(value, ()):
                    candidates[token] = allowed[token]
        if any(frame[2] and (frame[3] or frame[8]) for frame in scan.stack[:-1]) or (top_tracked and top[8]) \
                or (top is not None and not top[0] and top[2]):
            candidates |= allowed & flags["close"]  # an outer item ends at a bracket; an unmet contains may not close
        full = self.plan.max_items(top[1]) if top_tracked and top[8] else None
        for token in np.flatnonzero(candidates).tolist():
            after = scan.fed(vocabulary.pieces[token])
            if after is None:
                refused.append(token)
                continue
            pending = after.pending()
            if pending is not None and (pending[0] == "literal" or self._only_ends(token, pending[0], after)):
                refused.append(token)
            elif full is not None and after.stack and after.stack[-1][5] + 1 >= full and (
                    (after.unmet() and self._only_ends(token, "close"))
                    or ((kind := after.ends_unmet()) is not None and self._only_ends(token, kind, after))):
                refused.append(token)  # the array is full, and its contains unmet: only a bracket it may not take
        return refused

    def _only_ends(self, token: int, kind: str, scan: Scan | None = None) -> bool:
        """Whether, after ``token``, the grammar allows only tokens that end the item being written, or (a
        number: ``scan`` after the token) that only spell its value again: an integer's integral spelling
        (``15`` -> ``15.0``) keeps the value, so the item can still only end as it is."""
        if not self.grammar.accept_token(token):
            return False
        try:
            if self.grammar.is_terminated():
                return False
            self.grammar.fill_next_token_bitmask(self._scratch, 0)
            after = _allowed(self._scratch.numpy()[0].view(np.uint32), self.vocabulary.size)
            ends = self.vocabulary.flags[{"string": "starts_quote", "close": "starts_close"}.get(kind, "starts_end")]
            others = np.flatnonzero(after & ~ends)
            if kind != "number" or scan is None or not others.size:
                return not others.size
            text = bytes(scan.text[scan.scalar:scan.length]) if scan.scalar >= 0 else b""
            keeps = _ZEROS if b"." in text else _POINT_ZEROS
            return all(keeps.match(self.vocabulary.pieces[other]) for other in others.tolist())
        finally:
            self.grammar.rollback(1)

    def accept_token(self, token: int) -> bool:
        token = int(token)
        if not 0 <= token < self.vocabulary.size:
            return False
        after = self.scan.fed(self.vocabulary.pieces[token])
        if after is None or not self.grammar.accept_token(token):
            return False
        self._history.append(self.scan)
        self.scan = after
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > len(self._history):
            raise ValueError(f"rollback({num_tokens}) past the {len(self._history)} tokens this matcher took")
        self.grammar.rollback(num_tokens)
        if num_tokens:
            self.scan = self._history[-num_tokens]
            del self._history[-num_tokens:]

    def is_terminated(self) -> bool:
        return self.grammar.is_terminated()
