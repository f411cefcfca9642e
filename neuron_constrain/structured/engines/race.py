"""``RacingMatcher``: a request served by the engine that was ready first, moved to the faster one when it is.

    matcher = RacingMatcher(first, "llguidance", pending, make_next)   # pending: a Future of xgrammar's grammar
    matcher.fill_next_token_bitmask(buffer, row)   # llguidance's mask, until xgrammar's grammar is ready and
                                                   # takes every token accepted so far: then xgrammar's
    matcher.engines, matcher.moved_at              # ("llguidance", "xgrammar"), 12: who served it, and from when

``auto`` compiles a constraint both engines enforce exactly on both at once (``AutoEngine``): llguidance's
grammar is usually ready in milliseconds, xgrammar's in milliseconds to seconds, but its masks are faster.
The request starts on the first and, at the first fill after the second is ready, replays every token it
accepted into a fresh matcher of the second. If the second takes them all (and agrees on whether the request
ended), it decides every later token; if it refuses one (its grammar takes fewer values there, or spells the
text another way), the request stays where it is for good. So exactly one matcher decides each token, and
the one that takes over has accepted the whole prefix: a valid prefix under the one grammar stays a valid
prefix under the other, never an invalid token. Rollback (speculation, jump-forward's look-ahead, the item
tracker's one-token look-ahead) is replayed on whichever matcher serves: the one that took over accepted
the whole history, so it can roll back past the move.
"""
from __future__ import annotations

import concurrent.futures
from typing import Callable

import torch


class RacingMatcher:
    """The matcher protocol over the matcher that serves now (``current``), with the move described above."""

    fills_itself = True  # an engine's batch call never takes it: it fills through ``current``

    __slots__ = ("current", "engines", "moved_at", "_pending", "_make_next", "_next_engine", "_history", "_taken",
                 "_on_move")

    def __init__(self, first, first_engine: str, pending: concurrent.futures.Future, make_next: Callable,
                 next_engine: str, on_move: Callable[[str], None] | None = None):
        self.current = first
        self.engines: tuple[str, ...] = (first_engine,)  # who served it, in order
        self.moved_at: int | None = None  # tokens accepted before the move (None: it never moved)
        self._pending, self._make_next, self._next_engine = pending, make_next, next_engine
        self._history: list[int] = []  # the tokens taken, kept only while the race is open (the move replays them)
        self._taken = 0  # how many tokens the served matcher holds: rollback's bound
        self._on_move = on_move  # told "moved" or "stayed" once the race is decided

    def _settle(self) -> None:
        """At a fill: if the next grammar is ready, move to it when it takes the whole prefix."""
        pending = self._pending
        if pending is None or not pending.done():
            return
        self._pending = None
        history, self._history = self._history, []
        if pending.cancelled() or pending.exception() is not None:
            self._told("stayed")  # it failed (a limit, a refusal): the first engine serves to the end
            return
        candidate = self._make_next(pending.result())
        for token in history:
            if not candidate.accept_token(token):
                self._told("stayed")
                return
        if candidate.is_terminated() != self.current.is_terminated():
            self._told("stayed")
            return
        self.current, self.moved_at = candidate, len(history)
        self.engines = (*self.engines, self._next_engine)
        self._told("moved")

    def _told(self, outcome: str) -> None:
        if self._on_move is not None:
            self._on_move(outcome)

    def fill_next_token_bitmask(self, buffer: torch.Tensor, row: int = 0) -> bool:
        if self._pending is not None:
            self._settle()
        return self.current.fill_next_token_bitmask(buffer, row)

    def accept_token(self, token: int) -> bool:
        if not self.current.accept_token(token):
            return False
        self._taken += 1
        if self._pending is not None:
            self._history.append(token)
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > self._taken:
            raise ValueError(f"rollback({num_tokens}) past the {self._taken} tokens this matcher took")
        self.current.rollback(num_tokens)
        self._taken -= num_tokens
        if num_tokens and self._pending is not None:
            del self._history[-num_tokens:]

    def is_terminated(self) -> bool:
        return self.current.is_terminated()

    @property
    def racing(self) -> bool:
        """Whether the next engine may still take over."""
        return self._pending is not None
