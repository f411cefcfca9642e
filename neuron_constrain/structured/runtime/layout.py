"""Where each request of a batch lives in the mask buffer: a pure function of the batch and
the requests' states (``lay_out``), reused while neither changes.

    layout = lay_out(["r2", "r0", "r1"], states, drafts={"r0": [t1, t2]}, max_rows=64, version=7)
    rows   r2 | r0 r0+t1 r0+t1+t2 | r1       one row per logits row, batch order
    layout.fill_rows     rows a live grammar fills every step (drafted requests: layout.drafts)
    layout.free_rows     unconstrained requests: -1 (every token allowed)
    layout.stop_rows     finished or failed constrained requests: only stop tokens

Nothing here touches a buffer or a grammar: the runtime writes ``free_rows`` and
``stop_rows`` once per layout and fills the rest every step. Every constrained request
must be resolved (compiled or failed) before it is laid out; the runtime waits for the
ones still compiling first.
"""
from __future__ import annotations

import dataclasses
import itertools
import operator
from typing import Hashable, Mapping, Sequence

from neuron_constrain.structured.constraints import Constraint
from neuron_constrain.structured.errors import BatchLayoutError, RequestFailedError


@dataclasses.dataclass(slots=True, eq=False)  # slots: fewer memory reads per row; eq=False: identity
class RequestState:
    """One request as the runtime tracks it."""

    constraint: Constraint | None
    matcher: object | None = None  # the engine's matcher once the grammar is ready
    answer: object | None = None  # the engine's matcher of its answer (``matcher`` itself, or inside a reasoning one)
    finished: bool = False  # it took a stop token, or failed: its rows allow only stop tokens
    job: object | None = None  # its compilation while pending (compile_cache.CompileJob)
    added: float = 0.0  # when add() admitted it (perf_counter)
    timeout: float = 0.0  # its compile time limit, counted from when compiling started
    error: RequestFailedError | None = None  # why it failed: set once, never replaced
    reported: bool = False  # its failure was returned by an accept_rows() already
    unenforced: tuple = ()  # keywords.Unenforced the engine accepted but does not enforce (opt-in)
    forced_seconds: float = 0.0  # host time finding its jump-forward runs
    reasoning: object | None = None  # a reasoning request: (answer matcher, thought matcher) -> its matcher

    @property
    def pending(self) -> bool:
        return self.job is not None

    def describe(self) -> str:
        """What the request is constrained by, for its errors."""
        if self.constraint is not None:
            return self.constraint.describe() + (" after its thought" if self.reasoning is not None else "")
        return "a thought, then an unconstrained answer"


@dataclasses.dataclass(slots=True)
class Layout:
    """One batch laid out in the buffer (reused by ``step`` and ``accept_rows`` while
    ``version`` and ``key`` are the runtime's)."""

    version: int
    key: tuple  # the batch
    rows: int  # mask rows, drafts included
    matchers: list  # live constrained rows without drafts: filled every step, accepted in one batch call
    fill_rows: list[int]  # their mask rows
    positions: list[int]  # their positions in the batch
    requests: list[RequestState]  # their states
    free_rows: list[int] = dataclasses.field(default_factory=list)  # unconstrained rows: -1
    stop_rows: list[int] = dataclasses.field(default_factory=list)  # finished / failed rows: stop tokens only
    others: list[int] = dataclasses.field(default_factory=list)  # positions of unconstrained, finished, failed requests
    drafts: list[tuple[int, int, RequestState, Sequence[int]]] = dataclasses.field(default_factory=list)
    # ^ live requests with drafts: (position, first row, state, draft tokens); they own 1 + len(draft) rows
    every_row_live: bool = dataclasses.field(init=False)  # then the batch's tokens are the live tokens

    def __post_init__(self):
        self.every_row_live = len(self.positions) == len(self.key)


_MATCHER, _FINISHED = operator.attrgetter("matcher"), operator.attrgetter("finished")
_NONES = itertools.repeat(None)


def lay_out(batch: Sequence[Hashable], states: Mapping[Hashable, RequestState],
            drafts: Mapping[Hashable, Sequence[int]] | None, *, max_rows: int, version: int,
            rows_per_request: int | None = None) -> Layout:
    """The layout of ``batch`` (request ``i`` owns row ``i`` when there are no drafts).

    ``rows_per_request``: every request owns exactly that many rows (a verify step of fixed
    shape ``[B, k + 1]``); rows past a request's drafts are padding (-1, never read)."""
    key = tuple(batch)
    if len(set(key)) != len(key):
        raise BatchLayoutError(f"the batch {list(batch)} names a request twice; each request owns one slot")
    if not drafts and not rows_per_request:
        return _one_row_each(key, states, max_rows, version)
    return _laid_out(key, states, drafts or {}, rows_per_request, max_rows, version)


def _laid_out(key: tuple, states, drafts: Mapping, rows_per_request: int | None, max_rows: int, version: int) -> Layout:
    """One pass over the batch: each request's rows (``1 + len(draft)``, or ``rows_per_request``)."""
    layout = Layout(version, key, 0, [], [], [], [])
    row = 0
    for position, request_id in enumerate(key):
        state = _state(states, request_id)
        draft = drafts.get(request_id) or ()
        end = row + (rows_per_request or 1 + len(draft))
        if 1 + len(draft) > (rows_per_request or 1 + len(draft)):
            raise BatchLayoutError(
                f"request {request_id!r} has {len(draft)} drafts but each request owns {rows_per_request} rows; "
                f"pass at most {rows_per_request - 1} drafts a request (or a larger verify bucket)")
        if end > max_rows:
            raise _too_many_rows(key, drafts, max_rows, rows_per_request)
        padding = range(row + 1 + len(draft), end)
        if state.constraint is None and state.matcher is None:  # unconstrained (finished or not): -1
            layout.free_rows.extend(range(row, end))
            layout.others.append(position)
        elif state.finished:  # a stop token accepted, or failed
            layout.stop_rows.extend(range(row, end))
            layout.others.append(position)
        elif draft:
            layout.drafts.append((position, row, state, draft))
            layout.free_rows.extend(padding)
        else:
            layout.matchers.append(state.matcher)
            layout.fill_rows.append(row)
            layout.positions.append(position)
            layout.requests.append(state)
            layout.free_rows.extend(padding)
        row = end
    layout.rows = row
    return layout


def _one_row_each(key: tuple, states: Mapping[Hashable, RequestState], max_rows: int, version: int) -> Layout:
    """Without drafts: one pass sorts the requests into live rows and the rest (the
    per-step cost when requests join and finish every few steps)."""
    if len(key) > max_rows:
        raise _too_many_rows(key, None, max_rows)
    live = list(map(states.get, key))
    # The usual batch: every row constrained, compiled and running, sorted by map alone.
    # (Identity tests through operator.is_: `None in` would call each object's __eq__.)
    every_row_live = not any(map(operator.is_, live, _NONES))
    if every_row_live:
        matchers = list(map(_MATCHER, live))
        every_row_live = not any(map(operator.is_, matchers, _NONES)) and not any(map(_FINISHED, live))
    if every_row_live:
        positions = list(range(len(key)))
        return Layout(version, key, len(key), matchers, positions, positions, live)
    return _laid_out(key, states, {}, None, max_rows, version)


def _state(states: Mapping[Hashable, RequestState], request_id: Hashable) -> RequestState:
    state = states.get(request_id)
    if state is None:
        raise BatchLayoutError(f"request {request_id!r} is not in the runtime; add() it before scheduling it")
    if state.pending:
        raise BatchLayoutError(f"request {request_id!r} is still compiling; lay it out once it is ready or failed")
    return state


def _too_many_rows(batch: Sequence[Hashable], drafts, max_rows: int, rows_per_request: int | None = None) -> BatchLayoutError:
    total = len(batch) + sum(len(drafts.get(r, ())) for r in batch) if drafts else len(batch)
    total = len(batch) * rows_per_request if rows_per_request else total
    return BatchLayoutError(
        f"this batch needs {total} mask rows ({len(batch)} requests + draft tokens) but the runtime "
        f"was built with max_rows={max_rows}; build it with max_rows>={total} (the compiled "
        "graph's largest batch, draft rows included)"
    )
