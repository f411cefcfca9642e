"""Reasoning models: a free (or separately constrained) thought, then the answer's grammar.

    reasoning = Reasoning(start="<think>", end="</think>", budget=64)     # strings or token ids
    result = generate(model, prompts, constraints, 256, tokenizer=tok, reasoning=reasoning)
    result.outputs[0].reasoning, result.outputs[0].text                   # the thought, the answer

As vLLM's structured-output manager does with a reasoning parser: a request is in its thought
from its first token until the end marker, unless its prompt already closed a thought (its last
end marker after its last start marker); the answer's grammar starts after the end marker. A
``budget`` caps the thought the way vLLM's ``thinking_token_budget`` does (the rule is the
thinking-budget processor's, :class:`~neuron_constrain.core.processor_interface.Thinking`: counted
from the start marker, the prompt's or the model's; once spent, the end marker's next token is
the only one allowed). ``thought``: a grammar for the thought's text (the end marker allowed
where it may end); ``grammar_in_thought=True``: the answer's grammar holds from the first token
(vLLM's ``enable_in_reasoning``), the markers only split the text.

:class:`ReasoningMatcher` is the request's matcher for the runtime: in the thought it writes -1
rows (or the thought grammar's), a forced end token as a one-token row (so jump-forward decodes
it as a forced run and drafts are checked against it), then it is the answer's matcher; every
accept is undone by ``rollback`` across the boundary (drafts, jump-forward lookahead).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
import torch

from neuron_constrain.core.processor_interface import Thinking, Thought
from neuron_constrain.structured.constraints import Constraint

__all__ = ["Reasoning", "ReasoningMatcher", "matcher_for"]


@dataclasses.dataclass(frozen=True)
class Reasoning:
    """How a request reasons before it answers: a thought between markers, then the answer.

    Args:
        start: the thought's start marker, as text or token ids.
        end: its end marker; the answer's grammar starts at the token after it.
        budget: thought tokens allowed (counted from the start marker, the prompt's or the
            model's); once spent, the end marker is the only token allowed. ``None``: no cap.
        thought: a grammar for the thought's text (the end marker allowed where it may end).
        grammar_in_thought: the answer's grammar holds from the first token (vLLM's
            ``enable_in_reasoning``); the markers only split the text.

    Raises:
        ValueError: a budget that is not an int >= 0, or ``grammar_in_thought`` with a thought
            grammar or a budget.
    """

    start: str | Sequence[int] = "<think>"
    end: str | Sequence[int] = "</think>"
    budget: int | None = None
    thought: Constraint | None = None
    grammar_in_thought: bool = False

    def __post_init__(self):
        if self.budget is not None and (isinstance(self.budget, bool) or not isinstance(self.budget, int)
                                        or self.budget < 0):
            raise ValueError(f"Reasoning(budget={self.budget!r}): pass an int >= 0 (thought tokens), or None")
        if self.grammar_in_thought and (self.thought is not None or self.budget is not None):
            raise ValueError("Reasoning(grammar_in_thought=True) constrains the thought by the answer's grammar, which "
                             "never allows the end marker: pass no thought grammar and no budget with it")

    def thinking(self, tokenizer, vocab_size: int | None = None) -> Thinking:
        """The markers as token ids, in the thinking-budget rule's form.

        Args:
            tokenizer: encodes a marker given as text (its ``encode``); unused for token ids.
            vocab_size: every id must be below it, where given.

        Returns:
            The start and end markers' ids.

        Raises:
            ValueError: a text marker and a tokenizer without ``encode``, a marker that encodes to no token,
                or ids outside the vocabulary.
        """
        ids = []
        for name, marker in (("start", self.start), ("end", self.end)):
            if isinstance(marker, str) and not callable(getattr(tokenizer, "encode", None)):
                raise ValueError(f"Reasoning({name}={marker!r}) is text, but the tokenizer has no encode(): pass the "
                                 "marker's token ids, or the tokenizer itself")
            tokens = list(tokenizer.encode(marker)) if isinstance(marker, str) else [int(t) for t in marker]
            if not tokens:
                raise ValueError(f"Reasoning({name}={marker!r}) encodes to no token; pass the marker's token ids")
            bad = [t for t in tokens if vocab_size is not None and not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"Reasoning({name}={marker!r}): ids {bad} are outside the tokenizer's {vocab_size} "
                                 "tokens")
            ids.append(tokens)
        return Thinking(*ids)

    def divide(self, thinking: Thinking, prompt: Sequence[int], tokens: Sequence[int]) -> tuple[list | None, list]:
        """An output's tokens split into its thought and its answer.

        Args:
            thinking: the markers' ids (:meth:`thinking`).
            prompt: the request's prompt tokens (a prompt that closed a thought starts with the answer).
            tokens: the output's tokens.

        Returns:
            ``(thought, answer)``: the thought without its end marker (None when the prompt had closed the
            thought, or the answer's grammar held from the start), the answer after it (empty while the
            thought never ended).
        """
        tokens = list(tokens)
        if self.grammar_in_thought or closed(thinking, prompt):
            return None, tokens
        width = len(thinking.end)
        for at in range(len(tokens) - width + 1):
            if tuple(tokens[at:at + width]) == thinking.end:
                return tokens[:at], tokens[at + width:]
        return tokens, []


def closed(thinking: Thinking, prompt: Sequence[int]) -> bool:
    """Whether the prompt already closed a thought: its last end marker after its last start marker."""
    text = list(prompt)
    for at in range(len(text) - 1, -1, -1):
        if tuple(text[at:at + len(thinking.start)]) == thinking.start:
            return False
        if tuple(text[at:at + len(thinking.end)]) == thinking.end:
            return True
    return False


def matcher_for(reasoning: Reasoning, tokenizer, vocab_size: int, prompt: Sequence[int], stop_ids: Sequence[int],
                width: int):
    """One request's ``(answer matcher, thought matcher) -> ReasoningMatcher`` (what ``Requests.add`` takes as
    ``reasoning``), its markers encoded once (``Reasoning.thinking``: a ValueError for markers that do not encode)."""
    thinking, prompt = reasoning.thinking(tokenizer, vocab_size), list(prompt)

    def matcher(answer, thought) -> ReasoningMatcher:
        return ReasoningMatcher(thinking, reasoning.budget, prompt, answer=answer, thought=thought, stop_ids=stop_ids,
                                width=width)

    return matcher


class ReasoningMatcher:
    """One request's thought, then its answer's matcher (the runtime's matcher protocol).

    ``answer``: the answer's matcher (``None``: an unconstrained answer); ``thought``: the thought
    grammar's matcher or ``None``; ``stop_ids``: the tokenizer's stop tokens; ``width``: words a
    mask row has. Each accepted token pushes a snapshot of the state before it (and which grammar
    took it), so ``rollback`` undoes any number of tokens, across the end of the thought too.
    """

    def __init__(self, thinking: Thinking, budget: int | None, prompt: Sequence[int], *, answer, thought,
                 stop_ids: Sequence[int], width: int):
        self.thinking, self.budget, self.answer, self.thought = thinking, budget, answer, thought
        self.stop_ids = frozenset(stop_ids)
        self.state: Thought = thinking.after(prompt)  # the budget's count (from the start marker)
        self.in_thought = not closed(thinking, prompt)
        self.closing = 0  # end-marker tokens written to close a grammar-constrained thought (the rest are forced)
        self.terminated = False  # a stop token ended the request (in its thought, or an unconstrained answer)
        self._history: list[tuple] = []  # per token: (in_thought, state, closing, terminated, thought took, answer took)
        self._stop_row = np.zeros(width, dtype=np.uint32)
        for token in self.stop_ids:
            self._stop_row[token >> 5] |= np.uint32(1 << (token & 31))

    def _forced(self) -> int | None:
        """The one token the thought allows next: the budget's, or the end marker's rest once closing."""
        if self.closing:
            return self.thinking.end[self.closing]
        return self.thinking.forced(self.state, self.budget)

    # ------------------------------------------------------------------ the matcher protocol
    def fill_next_token_bitmask(self, buffer: torch.Tensor, row: int = 0) -> bool:
        words = buffer[row].numpy().view(np.uint32)
        if self.is_terminated():  # (a finished grammar fills nothing: the request may only stop)
            words[:] = self._stop_row
        elif not self.in_thought:
            if self.answer is not None:
                return self.answer.fill_next_token_bitmask(buffer, row)
            words[:] = 0xFFFFFFFF
        elif (forced := self._forced()) is not None:
            words[:] = 0
            words[forced >> 5] = np.uint32(1 << (forced & 31))
        elif self.thought is None:
            words[:] = 0xFFFFFFFF
        else:
            self.thought.fill_next_token_bitmask(buffer, row)
            if (words & self._stop_row).any():  # the thought may end here: with the end marker, not a stop token
                words &= ~self._stop_row
                first = self.thinking.end[0]
                words[first >> 5] |= np.uint32(1 << (first & 31))
        return True

    def accept_token(self, token: int) -> bool:
        token = int(token)
        if self.terminated:
            return False
        snapshot = (self.in_thought, self.state, self.closing, self.terminated)
        if not self.in_thought:
            if self.answer is not None:
                if not self.answer.accept_token(token):
                    return False
                self._history.append((*snapshot, False, True))
                return True
            self._history.append((*snapshot, False, False))
            self.terminated = token in self.stop_ids
            return True
        forced, took = self._forced(), False
        if forced is not None:
            if token != forced:
                return False
            self.closing = self.closing + 1 if self.closing else 0
        elif self.thought is not None:
            if token == self.thinking.end[0] and len(self.thinking.end) > 1:
                self.closing = 1  # (allowed only where the thought grammar may end)
            elif token != self.thinking.end[0]:
                if not self.thought.accept_token(token):
                    return False
                took = True
        self._history.append((*snapshot, took, False))
        self.state = self.thinking.advance(self.state, token, self.budget)
        if self.state.tail[-len(self.thinking.end):] == self.thinking.end:
            self.in_thought, self.closing = False, 0  # the answer starts after the end marker
        elif token in self.stop_ids and self.thought is None:
            self.terminated = True  # a stop token in a free thought ends the request, as it would unconstrained
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > len(self._history):
            raise ValueError(f"rollback({num_tokens}) past the {len(self._history)} tokens this matcher took")
        answer_tokens = thought_tokens = 0
        snapshot = None
        for _ in range(num_tokens):
            *snapshot, took_thought, took_answer = self._history.pop()
            answer_tokens += took_answer
            thought_tokens += took_thought
        if answer_tokens:
            self.answer.rollback(answer_tokens)
        if thought_tokens:
            self.thought.rollback(thought_tokens)
        if snapshot is not None:
            self.in_thought, self.state, self.closing, self.terminated = snapshot

    def is_terminated(self) -> bool:
        if self.terminated:
            return True
        return not self.in_thought and self.answer is not None and self.answer.is_terminated()

    @property
    def inner(self):
        """The matcher whose forced text jump-forward's canonical mode may read: the answer's, once
        the thought is over (``None`` inside the thought, where only forced end tokens are forced)."""
        return None if self.in_thought or self.terminated else self.answer
