"""The contract every grammar engine implements, and the checks every engine inherits.

    engine = XGrammarEngine(tokenizer)            # tokenizer: .info (+ .encode for llguidance)
    compiled = engine.compile(constraint)         # ConstraintError (one line): refused or malformed
    compiled = engine.compile(prepared)           # or from a schema.prepare.Prepared: its steps are not run again
    matcher = engine.matcher(compiled)            # a fresh GrammarMatcher per request
    failures = engine.batch_fill(matchers, buffer, rows)   # [(index, error)] for the rows that failed
    accepted = engine.batch_accept(matchers, tokens)       # [bool] per matcher

What an engine promises (``tests/structured/test_engines.py`` runs one contract test against each):

* **Mask rows.** The mask is an int32 CPU tensor ``[rows, ceil(V/32)]``, token ``t`` is
  bit ``t % 32`` of word ``t // 32``, 1 = allowed. ``fill_next_token_bitmask(buffer, row)``
  writes row ``row`` of ``buffer`` and nothing else; a buffer of another dtype, device,
  width or layout, or a row outside ``[0, buffer.shape[0])``, is refused before anything
  is written (``batch_fill``: a ``ValueError`` from :func:`check_rows`; xgrammar's own
  matcher raises its ``RuntimeError``). Control tokens are never allowed; stop tokens
  only where the grammar may end.
* **Mask and accept agree.** Every token the row allows, ``accept_token`` takes; a stop
  token is allowed exactly when ``accept_token(stop)`` would succeed (a grammar at a dead
  end allows nothing, so the graph's empty-row flag catches it, rather than allowing a
  stop token it then refuses).
* **Accept.** ``accept_token(t) -> bool``; ``False`` leaves the state unchanged.
  ``is_terminated()`` is true once a stop token was accepted; ``rollback(n)`` undoes the
  last ``n`` accepted tokens, a stop token included.
* **Forced text.** ``forced_tokens(matcher)``: the canonical tokens of the text the grammar
  forces from here (the engine's jump-forward string / fast-forward tokens, tokenized by
  :func:`encode_continuation`), each accepted in turn; the state is left as it was.
* **Batch calls.** ``batch_fill`` fills every row it can and returns the rows that failed
  as ``(index into matchers, error)``; one matcher's failure never leaves another's row
  unfilled. ``batch_accept`` is ``accept_token`` per matcher.

Engines do not cache compiled grammars: the runtime's one compile cache
(``structured/runtime/compile_cache.py``) does, keyed by ``Constraint.key``.
"""
from __future__ import annotations

import abc
import concurrent.futures
import dataclasses
from typing import Any, Callable, ClassVar, Protocol, Sequence

import torch

from neuron_constrain.kernels import packed_width
from neuron_constrain.structured.schema import item_plan, keywords, limits as limits_
from neuron_constrain.structured.schema.prepare import EngineView, Prepared, prepare
from neuron_constrain.structured.engines import item_tracker
from neuron_constrain.structured.constraints import Constraint, ConstraintError


class GrammarMatcher(Protocol):
    """One request's grammar state (xgrammar's ``GrammarMatcher`` has exactly these methods)."""

    def fill_next_token_bitmask(self, buffer: torch.Tensor, row: int = 0) -> bool: ...

    def accept_token(self, token: int) -> bool: ...

    def rollback(self, num_tokens: int) -> None: ...

    def is_terminated(self) -> bool: ...


@dataclasses.dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A constraint compiled for one engine; ``unenforced`` lists what it will not enforce, ``narrowed``
    the JSON pointers of nodes where it takes fewer valid instances, never more (xgrammar: untyped nodes
    compiled as one type, bounded strings without escapes)."""

    engine: str
    constraint: Constraint
    grammar: Any  # xgrammar CompiledGrammar | llguidance LLMatcher (a template, deep-copied per request)
    unenforced: tuple[keywords.Unenforced, ...] = ()
    narrowed: tuple[str, ...] = ()
    item_checks: item_plan.Plan | None = None  # what the host's item tracker enforces (item_plan.py)
    # ``auto``'s race (engines/race.py): the faster engine's grammar for the same constraint, still compiling;
    # a matcher made while it is pending moves to it once it is ready and takes the request's prefix
    successor: "concurrent.futures.Future[CompiledGrammar] | None" = None

    @property
    def engines(self) -> tuple[str, ...]:
        """The engines that may serve its requests, in order: ``(engine,)``, or with the race ``auto``'s second."""
        return (self.engine,) if self.successor is None else (self.engine, "xgrammar")


def check_rows(buffer: torch.Tensor, rows: Sequence[int], width: int) -> int:
    """Refuse, before any write, a mask buffer or row an engine must not write into; returns the
    buffer's row count. Every call checks everything, reading each torch attribute once (a
    read costs 50-180 ns; the type test skips ``torch.Tensor``'s metaclass for a plain tensor):
    it runs once per ``batch_fill`` (``benchmarks/timing_host_parts.py`` times it)."""
    if (type(buffer) is not torch.Tensor and not isinstance(buffer, torch.Tensor)) \
            or buffer.dtype is not torch.int32 or not buffer.is_cpu:
        kind = f"a {buffer.dtype} tensor on {buffer.device}" if isinstance(buffer, torch.Tensor) else type(buffer).__name__
        raise ValueError(f"the mask buffer must be an int32 CPU tensor [rows, {width}], got {kind}")
    shape = buffer.shape
    if len(shape) != 2 or shape[1] != width or not buffer.is_contiguous():
        raise ValueError(
            f"the mask buffer must be a contiguous int32 tensor [rows, {width}] (ceil(vocab/32) words a row), "
            f"got shape {tuple(shape)}{'' if buffer.is_contiguous() else ', not contiguous'}"
        )
    count = shape[0]
    for row in rows:
        if not 0 <= row < count:
            raise ValueError(f"mask row {row} is outside the buffer's {count} rows; fill rows 0..{count - 1}")
    return count


class GrammarEngine(abc.ABC):
    """What the runtime needs of a grammar engine (see the module docstring for the contract)."""

    name: ClassVar[str] = ""

    def __init__(self, tokenizer, *, fill_threads: int = 1, fill_timeout: float = 120.0,
                 limits: limits_.Limits | None = None):
        self.limits = limits or limits_.DEFAULT  # checked first by every compile (limits.py)
        info = tokenizer.info
        self.tokenizer = tokenizer
        self.info = info
        self.vocab_size = info.vocab_size
        self.width = packed_width(self.vocab_size)
        self.stop_token_ids = tuple(info.stop_token_ids)
        if not self.stop_token_ids:
            raise ValueError("the tokenizer info has no stop token; build it with stop_token_ids=[<eos id>]")
        self.fill_threads = fill_threads
        self.fill_timeout = fill_timeout  # the longest wait for a fill thread (when there are several)

    @abc.abstractmethod
    def compile(self, constraint: Constraint | Prepared, *, policy: str | None = None) -> CompiledGrammar:
        """``constraint`` compiled for this engine; raises :class:`ConstraintError` (one line).

        A JSON schema holding a keyword this engine would not enforce is refused (:meth:`view`), unless the
        policy (``policy``, else the constraint's own ``unenforced``) is ``"allow"``."""

    enforces: ClassVar[keywords.Allowlist | None] = None  # what this engine enforces of JSON Schema

    def view(self, constraint: Constraint | Prepared, policy: str | None = None) -> tuple[EngineView, tuple]:
        """The never-silent policy: this engine's view of the prepared constraint (what it compiles, its
        narrowing, the item tracker's plan) and the keywords it would not enforce there, after raising for one
        (policy ``refuse``) or listing them (``allow``). Preparing checks, before anything else reads the
        constraint, its :class:`~neuron_constrain.structured.schema.limits.Limits` (``LimitError``), then
        whether a JSON schema admits any value (``satisfiable.UnsatisfiableError``); a ``Prepared`` is not
        prepared again, and each engine's view of it is computed once."""
        prepared = prepare(constraint, self.limits)
        view = prepared.view(self.enforces) if self.enforces is not None else prepared.view(self.name)
        return view, view.unenforced(policy or prepared.constraint.unenforced)

    def tracking(self, matcher, compiled: CompiledGrammar):
        """``matcher``, behind the item tracker where ``compiled`` has one."""
        if compiled.item_checks is None:
            return matcher
        vocabulary = item_tracker.tracker_vocabulary(self.info)
        return item_tracker.ItemTrackingMatcher(matcher, compiled.item_checks, vocabulary, self.width)

    def served(self, matcher) -> tuple[tuple[str, ...], int | None]:
        """The engines that decided the tokens of ``matcher`` (one this engine made), in order, and the tokens
        accepted before it moved to the second (None: it never moved)."""
        return (self.name,), None

    def wait_ready(self) -> None:
        """Until the engine can start a compilation (its compile workers started); at once by default."""

    def parse(self, constraint: Constraint) -> None:
        """Raise :class:`ConstraintError` now, before any compilation, if ``constraint`` is
        malformed and this engine can tell cheaply (without the vocabulary); by default it
        cannot, and ``compile`` finds it."""

    def matcher(self, compiled: CompiledGrammar) -> GrammarMatcher:
        """A fresh matcher at the start of ``compiled``'s grammar (behind the item tracker where it has one)."""
        return self.tracking(self.engine_matcher(compiled), compiled)

    @abc.abstractmethod
    def engine_matcher(self, compiled: CompiledGrammar) -> GrammarMatcher:
        """The engine's own fresh matcher of ``compiled``, without the item tracker."""

    def batch_fill(self, matchers: Sequence[GrammarMatcher], buffer: torch.Tensor,
                   rows: Sequence[int]) -> list[tuple[int, BaseException]]:
        """Fill ``rows[i]`` from ``matchers[i]``; returns the failures as ``(i, error)``. A matcher that
        ``fills_itself`` (the tracker's, a reasoning request's) fills its own row."""
        check_rows(buffer, rows, self.width)
        return own_rows_apart(self._fill_checked, matchers, buffer, rows)

    def _fill_checked(self, matchers: Sequence[GrammarMatcher], buffer: torch.Tensor,
                     rows: Sequence[int]) -> list[tuple[int, BaseException]]:
        """``batch_fill`` after :func:`check_rows` passed for ``buffer`` and ``rows`` (a caller
        that checked them once, ``AutoEngine``, does not pay for the check twice)."""
        return fill_each(matchers, buffer, rows)

    def batch_accept(self, matchers: Sequence[GrammarMatcher], tokens: Sequence[int]) -> list[bool]:
        if len(matchers) == 1:
            return [matchers[0].accept_token(tokens[0])]
        return [matcher.accept_token(token) for matcher, token in zip(matchers, tokens)]

    @abc.abstractmethod
    def forced_tokens(self, matcher: GrammarMatcher) -> list[int]:
        """The text the grammar forces next, tokenized canonically (jump-forward's ``canonical``
        mode), without its last token (which may merge with what follows); every token is one
        ``accept_token`` takes. The matcher's state is unchanged."""

    def close(self) -> None:
        """Stop the engine's fill threads, if it has any."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size})"


_ANCHOR = "\n"


def encode_continuation(encode: Callable[[str], list[int]], text: str | bytes) -> list[int]:
    """Tokens of ``text`` as it continues a sequence (what a grammar forces, tokenized
    canonically). A sentencepiece encoder adds a dummy-prefix space at the start of an
    encode, so the text is encoded after an anchor (``"\\n"``) whose own tokens are dropped."""
    text = text if isinstance(text, str) else text.decode("utf-8", "replace")
    anchor = list(encode(_ANCHOR))
    ids = list(encode(_ANCHOR + text))
    if ids[: len(anchor)] == anchor:
        return ids[len(anchor):]
    return list(encode(text))  # the anchor merged with the text: no better split is known


def fills_itself(matcher) -> bool:
    """A matcher no engine's batch call may take: it wraps one (``fills_itself``), and fills and accepts
    through its own methods."""
    return getattr(type(matcher), "fills_itself", False)


def own_rows_apart(fill, matchers: Sequence[GrammarMatcher], buffer: torch.Tensor,
                   rows: Sequence[int]) -> list[tuple[int, BaseException]]:
    """``fill(matchers, buffer, rows)`` for the engine's own matchers, :func:`fill_each` for those that fill
    themselves; the failures by index into ``matchers``."""
    own = [i for i, m in enumerate(matchers) if fills_itself(m)]
    if not own:
        return fill(matchers, buffer, rows)
    rest = [i for i in range(len(matchers)) if not fills_itself(matchers[i])]
    failures = [(own[k], e) for k, e in fill_each([matchers[i] for i in own], buffer, [rows[i] for i in own])]
    if rest:
        failures += [(rest[k], e) for k, e in fill([matchers[i] for i in rest], buffer, [rows[i] for i in rest])]
    return sorted(failures, key=lambda failure: failure[0])


def fill_each(matchers: Sequence[GrammarMatcher], buffer: torch.Tensor,
              rows: Sequence[int]) -> list[tuple[int, BaseException]]:
    """Row by row on this thread; a row that raises is reported and the others still filled."""
    failures = []
    for index, (matcher, row) in enumerate(zip(matchers, rows)):
        try:
            matcher.fill_next_token_bitmask(buffer, row)
        except Exception as error:  # noqa: BLE001 - the request's own failure, reported with its index
            failures.append((index, error))
    return failures
