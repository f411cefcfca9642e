"""``Acceptor``: what the tokens a step chose do to their requests' grammars.

    Accepted(finished, failed)                   # what StructuredRuntime.accept_rows returns
    acceptor.one("r1", [t1, t2])                 # drafts + bonus; raises DisallowedTokenError, r1 unchanged
    finished, seconds = acceptor.rows(layout, batch, tokens, empty)   # one token per request
    finished = acceptor.runs(batch, runs, empty)                      # a run per request (verify steps)

Batch calls keep failures to their request: a refused token, one past the vocabulary, a
finished request given something else than a stop token, a row the graph flagged as
allowing no token: that request fails (``Requests.fail``), every other one advances.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Hashable, Sequence

import torch

from neuron_constrain.structured.errors import DisallowedTokenError, NoAllowedTokenError
from neuron_constrain.structured.runtime.layout import Layout, RequestState
from neuron_constrain.structured.runtime.reasoning import ReasoningMatcher
from neuron_constrain.structured.runtime.requests import Requests


@dataclasses.dataclass
class Accepted:
    """What ``accept_rows`` did: every request of the batch is in exactly one of these or advanced.

    Attributes:
        finished: requests this token finished (a stop token accepted).
        failed: request id -> its :class:`RequestFailedError`, each failure returned once.
    """

    finished: list  # requests this token finished (a stop token accepted)
    failed: dict  # request id -> its RequestFailedError, each failure returned once


class Acceptor:
    def __init__(self, requests: Requests, engine, *, vocab_size: int, stop_token_ids: frozenset, info):
        self.requests, self.engine = requests, engine
        self.vocab_size, self.stop_token_ids, self.info = vocab_size, stop_token_ids, info
        self._decoded: list[bytes] | None = None

    def _piece(self, token: int) -> bytes:
        if self._decoded is None:
            self._decoded = self.info.decoded_vocab
        return self._decoded[token]

    def one(self, request_id: Hashable, tokens: Sequence[int]) -> bool:
        """Advance ``request_id`` by ``tokens`` (the sampled token, or accepted drafts + bonus).

        Returns whether the request has finished (a stop token). A token its grammar
        forbids raises :class:`DisallowedTokenError` and leaves the request as it was; a
        failed request raises its error.
        """
        state = self.requests.get(request_id)
        if state.job is not None:
            self.requests.wait_for(request_id, state)
        if state.error is not None:
            raise state.error
        matcher, advanced, was_finished = state.matcher, 0, state.finished
        for token in tokens:
            token = int(token)
            refused = self.refusal(request_id, state, token)
            if refused is None and matcher is not None and not state.finished:
                if matcher.accept_token(token):
                    advanced += 1
                    state.finished = matcher.is_terminated()
                    continue
                refused = self.refused(request_id, state, token)
            if refused is not None:
                if advanced:
                    matcher.rollback(advanced)
                    state.finished = was_finished
                    self.requests.version += 1
                raise refused
            if matcher is None and not state.finished:
                state.finished = token in self.stop_token_ids
        if state.finished != was_finished:
            self.requests.version += 1  # the batch layout changes: its rows now allow only stop tokens
        return state.finished

    def refusal(self, request_id, state: RequestState, token: int) -> DisallowedTokenError | None:
        """The error for a token no request may take here (past the vocabulary; after the stop), or None."""
        if not 0 <= token < self.vocab_size:
            return DisallowedTokenError(
                f"request {request_id!r} got token {token}, past the tokenizer's {self.vocab_size} tokens "
                "(a padded lm_head column): transform the model with "
                f"vocab_size={self.vocab_size} so padded columns are never chosen",
                request_id, token,
            )
        if state.finished and token not in self.stop_token_ids:
            return DisallowedTokenError(
                f"request {request_id!r} already finished at a stop token but got token {token} "
                f"({self._piece(token)!r}); remove() finished requests or keep their rows masked to stop tokens",
                request_id, token,
            )
        return None

    def refused(self, request_id, state: RequestState, token: int) -> DisallowedTokenError:
        return DisallowedTokenError(
            f"request {request_id!r} ({state.describe()}) got token {token} "
            f"({self._piece(token)!r}), which its grammar does not allow here: the mask fed to the "
            "graph was not this request's current row (check the batch order and draft offsets), "
            "or the graph ignored the mask",
            request_id, token,
        )

    def rows(self, plan: Layout, batch: Sequence[Hashable], values: Sequence[int], empty) -> tuple[list, float]:
        """One token per request of ``batch`` laid out as ``plan``: the requests it finished and the
        engine's seconds. Every other request advanced, or failed (a refused token, one past the
        vocabulary, a row flagged empty)."""
        clock = time.perf_counter
        positions, live, matchers = plan.positions, plan.requests, plan.matchers
        finished, engine_seconds = [], 0.0
        flagged = () if empty is None else [p for p, f in enumerate(empty.tolist() if isinstance(empty, torch.Tensor) else empty) if f]
        for position in flagged:
            request_id = batch[position]
            self.requests.fail(request_id, self.requests.states[request_id], NoAllowedTokenError(
                f"request {request_id!r}: its mask row allowed no token at this step (its grammar reached a dead "
                "end, or min_tokens masked the only stop token it allowed), so its token "
                f"{values[position]} means nothing; the request ends here", request_id,
            ))
        for position in plan.others:  # unconstrained, finished and failed rows: one by one (no grammar)
            request_id = batch[position]
            state = self.requests.states[request_id]
            if state.error is None:
                token = values[position]
                refused = self.refusal(request_id, state, token)
                if refused is not None:
                    self.requests.fail(request_id, state, refused)
                elif not state.finished and token in self.stop_token_ids:
                    state.finished = True
                    finished.append(request_id)
                    self.requests.version += 1
        if matchers:
            live_tokens = values if plan.every_row_live else [values[p] for p in positions]
            vocab = self.vocab_size
            if flagged or not (0 <= live_tokens[0] < vocab if len(live_tokens) == 1  # (min/max: ~0.3 us)
                               else min(live_tokens) >= 0 and max(live_tokens) < vocab):
                keep = [i for i, (p, t) in enumerate(zip(positions, live_tokens)) if live[i].error is None and 0 <= t < vocab]
                for i in set(range(len(positions))) - set(keep):
                    if live[i].error is None:  # a token past the vocabulary: the request's own failure
                        self.requests.fail(batch[positions[i]], live[i], self.refusal(batch[positions[i]], live[i], live_tokens[i]))
                positions = [positions[i] for i in keep]
                live, matchers, live_tokens = [live[i] for i in keep], [matchers[i] for i in keep], [live_tokens[i] for i in keep]
            tick = clock()
            if self.requests.reasoning:  # reasoning requests' matchers are not the engine's: each accepts itself
                accepted = [m.accept_token(t) for m, t in zip(matchers, live_tokens)] \
                    if any(type(m) is ReasoningMatcher for m in matchers) else self.engine.batch_accept(matchers, live_tokens)
            else:
                accepted = self.engine.batch_accept(matchers, live_tokens)
            engine_seconds = clock() - tick
            stops = self.stop_token_ids
            if not stops.isdisjoint(live_tokens):  # accepting a stop token is what terminates a matcher
                for index in [i for i, token in enumerate(live_tokens) if token in stops]:
                    if accepted[index]:
                        live[index].finished = True
                        finished.append(batch[positions[index]])
                        self.requests.version += 1
            if False in accepted:  # the others advanced; these fail, naming request and token
                for index in [i for i, ok in enumerate(accepted) if not ok]:
                    request_id = batch[positions[index]]
                    self.requests.fail(request_id, live[index], self.refused(request_id, live[index], live_tokens[index]))
        return finished, engine_seconds

    def runs(self, batch: Sequence[Hashable], runs: Sequence[Sequence[int]], empty) -> list:
        """Each request of ``batch`` takes its run of tokens; returns the requests it finished."""
        finished = []
        for position, (request_id, run) in enumerate(zip(batch, runs)):
            state = self.requests.get(request_id)
            if state.error is not None:
                continue
            if empty is not None and empty[position]:
                self.requests.fail(request_id, state, NoAllowedTokenError(
                    f"request {request_id!r}: its mask row allowed no token at this step (its grammar reached a "
                    "dead end, or min_tokens masked the only stop token it allowed); the request ends here", request_id))
                continue
            was_finished = state.finished
            try:
                if self.one(request_id, run) and not was_finished:
                    finished.append(request_id)
            except DisallowedTokenError as error:
                self.requests.fail(request_id, state, error)
        return finished
