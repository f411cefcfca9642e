"""``engine="auto"``: xgrammar where it enforces the whole constraint, llguidance for the rest.

    engine = AutoEngine(tokenizer)
    compiled = engine.compile(json_schema(schema))   # compiled.engine: "xgrammar" or "llguidance"

vLLM's ``auto`` backend makes the same choice. xgrammar is the faster engine per mask
(6.5 us against 22.6 us between masks on the MaskBench sample, ``bench_schemas.py``), so it
takes every constraint it compiles and enforces; a JSON schema holding a keyword xgrammar
would not enforce (the never-silent policy, ``keywords.py``), or a constraint xgrammar
cannot compile, goes to llguidance, which implements more of JSON Schema. Only when
neither engine takes it is the request refused, with both reasons. ``unenforced="allow"``
keeps its meaning: llguidance first for what xgrammar would not enforce, then xgrammar
with the keywords listed.

Routed by cost too: a pattern whose language the library built by automata (lookarounds, ``\\b``) and
that nests deep (``Prepared.deep_languages``: ``(?=.*\\d)[a-z\\d]{8,64}``) goes to llguidance first, as a
narrowed one does: xgrammar keeps a copy of the whole automaton per nesting level (its worker's reply grew
past 2 GiB for that one), llguidance reads it lazily in milliseconds.
So does a schema with ``patternProperties`` (xgrammar's view writes each name's region out,
``schema/pattern_members.py``): xgrammar 0.2.8 masks the first character of each key there at ~60 ms on
131k tokens (a region of any characters beside another: `^a` and the names no pattern finds), llguidance in
microseconds; xgrammar takes it where llguidance cannot (its pairwise disjointness check of the regions
gives up).

Routed by meaning: where xgrammar would take fewer values than the schema (its narrowing: a
bounded string written without escapes: ``"a\\"b"`` refused; untyped nodes are split by type,
``schema/values.py``, and keep their meaning), llguidance, which keeps JSON Schema's meaning there, is
tried first; xgrammar's narrowed grammar is the fallback, and the result says so
(``CompiledGrammar.narrowed``: the nodes' pointers). A format written as a narrower pattern is the same
pattern on both engines (``formats.write_patterns``): listed in ``narrowed`` whichever compiles it, it
routes nothing.
``narrow_bounded_strings=True`` takes xgrammar's escape-free bounded strings as stock vLLM does
(the vLLM plugin: its greedy tokens stay stock's; llguidance forces a canonical tokenization of
text the grammar fixes, xgrammar allows any).

The race (``race=True``, the default): where xgrammar would enforce the whole constraint exactly, its
compile has a long tail (seconds for some real schemas) while llguidance's is milliseconds. So both compile
at once, xgrammar on a thread of its own (``XGrammarEngine.compile_later``; in its worker process when it has
them): the compiled grammar returned is llguidance's, with xgrammar's pending as its ``successor``, and each
request's matcher is a ``race.RacingMatcher`` that moves to xgrammar once its grammar is ready and takes the
request's prefix. If xgrammar was ready first, or llguidance cannot compile it, xgrammar's grammar is
returned as before. A constraint xgrammar narrows is not raced (llguidance alone keeps its meaning). ``counts``
says how the races went; ``served(matcher)`` which engines decided a request.

The two engines' matchers live side by side in one batch: fills and accepts go to the
engine that made each matcher.

    xgrammar's view of the prepared constraint (policy "refuse"):
      refused            -> llguidance (the request's policy); failing that, under "allow": xgrammar, listed
      bounded strings, deep, or pattern keys -> llguidance; failing that: xgrammar's grammar
      exact (the race)   -> llguidance's grammar now, xgrammar's once ready (RacingMatcher)
      exact, race=False  -> xgrammar
"""
from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Sequence

import torch

from neuron_constrain.structured.constraints import Constraint, ConstraintError
from neuron_constrain.structured.engines.base import CompiledGrammar, GrammarEngine
from neuron_constrain.structured.schema.limits import LimitError
from neuron_constrain.structured.schema.rewrite import walk
from neuron_constrain.structured.schema.satisfiable import UnsatisfiableError
from neuron_constrain.structured.engines.llguidance.engine import LLGuidanceEngine, LLGuidanceMatcher
from neuron_constrain.structured.engines.item_tracker import ItemTrackingMatcher
from neuron_constrain.structured.engines.race import RacingMatcher
from neuron_constrain.structured.schema.prepare import Prepared, prepare
from neuron_constrain.structured.engines.xgrammar.engine import XGrammarEngine


def _pattern_keys(view) -> bool:
    """Whether xgrammar's view writes ``patternProperties`` keys (``schema/pattern_members.py``)."""
    return isinstance(view.schema, dict) and any(node.get("patternProperties") for _, node in walk(view.schema))


class AutoEngine(GrammarEngine):
    """Per constraint, the first of xgrammar and llguidance that compiles and enforces it."""

    name = "auto"

    def __init__(self, tokenizer, *, fill_threads: int = 1, fill_timeout: float = 120.0, limits=None,
                 compile_processes: int = 0, narrow_bounded_strings: bool = False, race: bool = True):
        super().__init__(tokenizer, fill_threads=fill_threads, fill_timeout=fill_timeout, limits=limits)
        self.narrow_bounded_strings = narrow_bounded_strings
        self.race = race  # compile on both engines at once where both are exact (False: xgrammar alone there)
        # how the races went: "races" (started on llguidance), "xgrammar_first" (xgrammar was ready first),
        # and per request that started on llguidance, "moved" (to xgrammar) or "stayed"
        self.counts: collections.Counter = collections.Counter()
        self.xgrammar = XGrammarEngine(tokenizer, fill_threads=fill_threads, fill_timeout=fill_timeout,
                                       limits=self.limits, compile_processes=compile_processes)
        self._llguidance: LLGuidanceEngine | None = None  # built on first need (~0.3 s at 131k)
        self._lock = threading.Lock()  # compilations run on the runtime's thread pool

    @property
    def llguidance(self) -> LLGuidanceEngine:
        with self._lock:
            if self._llguidance is None:
                self._llguidance = LLGuidanceEngine(self.tokenizer, fill_threads=self.fill_threads,
                                                   fill_timeout=self.fill_timeout, limits=self.limits)
            return self._llguidance

    def compile(self, constraint: Constraint | Prepared, *, policy: str | None = None) -> CompiledGrammar:
        prepared = prepare(constraint, self.limits)  # once: every engine and route below reads this one
        policy = policy or prepared.constraint.unenforced
        try:  # xgrammar's view once: it routes, and xgrammar's compile takes it
            view, _ = self.xgrammar.view(prepared, "refuse")
        except (LimitError, UnsatisfiableError):
            raise  # the constraint's own: no engine would take it
        except ConstraintError as refused:
            view, xgrammar_said = None, str(refused)
        if view is not None:
            if (self.xgrammar.narrowed_strings(view) and not self.narrow_bounded_strings) or prepared.deep_languages \
                    or _pattern_keys(view):
                try:  # an engine exact on the whole schema first; xgrammar's narrowed grammar is the fallback
                    return self.llguidance.compile(prepared, policy="refuse")
                except (ConstraintError, ImportError, ValueError):
                    pass
            elif self.race:
                return self._race(prepared)
            try:
                return self.xgrammar.compile(prepared, policy="refuse")
            except (LimitError, UnsatisfiableError):
                raise
            except ConstraintError as refused:
                xgrammar_said = str(refused)
        try:
            return self.llguidance.compile(prepared, policy=policy)
        except (ConstraintError, ImportError, ValueError) as error:
            if policy == "allow" and prepared.kind == "json_schema":
                return self.xgrammar.compile(prepared, policy="allow")  # compiles; lists what it does not enforce
            combined = ConstraintError(f"neither engine takes this constraint: llguidance: {' '.join(str(error).split())} "
                                       f"| xgrammar: {xgrammar_said}")
            combined.unenforced = getattr(error, "unenforced", None)  # a refusal (keywords.py), not a syntax error
            raise combined from error

    def _race(self, prepared: Prepared) -> CompiledGrammar:
        """Both engines take ``prepared`` exactly: xgrammar compiles on a thread of its own (its worker process
        where there is one) while llguidance compiles here. The first ready serves the first masks; requests
        started on llguidance move to xgrammar when its grammar is ready (``race.RacingMatcher``)."""
        pending = self.xgrammar.compile_later(prepared, policy="refuse")
        try:
            first = self.llguidance.compile(prepared, policy="refuse")
        except (ConstraintError, ImportError, ValueError):
            return pending.result()  # llguidance cannot: xgrammar alone, as before the race
        if pending.done() and pending.exception() is None:
            self._count("xgrammar_first")
            return pending.result()  # xgrammar was ready first: no reason to start anywhere else
        self._count("races")
        return dataclasses.replace(first, successor=pending)

    def _count(self, name: str) -> None:
        with self._lock:
            self.counts[name] += 1

    def wait_ready(self) -> None:
        self.xgrammar.wait_ready()

    def matcher(self, compiled: CompiledGrammar):
        """The compiling engine's matcher; while ``auto``'s race is on, a ``RacingMatcher`` over llguidance's that
        moves to xgrammar's (each behind its own item tracker, which replays the prefix too)."""
        pending = compiled.successor
        if pending is None:
            return (self.llguidance if compiled.engine == "llguidance" else self.xgrammar).matcher(compiled)
        if pending.done() and not pending.cancelled() and pending.exception() is None:
            return self.xgrammar.matcher(pending.result())  # the race is over: the faster engine from the start
        return RacingMatcher(self.llguidance.matcher(compiled), "llguidance", pending, self.xgrammar.matcher,
                             "xgrammar", self._count_move)

    def served(self, matcher) -> tuple[tuple[str, ...], int | None]:
        if type(matcher) is RacingMatcher:
            return matcher.engines, matcher.moved_at
        inner = matcher.grammar if type(matcher) is ItemTrackingMatcher else matcher
        return ("llguidance" if isinstance(inner, LLGuidanceMatcher) else "xgrammar",), None

    def engine_matcher(self, compiled: CompiledGrammar):
        return (self.llguidance if compiled.engine == "llguidance" else self.xgrammar).engine_matcher(compiled)

    def _count_move(self, outcome: str) -> None:
        self._count("moved" if outcome == "moved" else "stayed")

    def _fill_checked(self, matchers: Sequence, buffer: torch.Tensor, rows: Sequence[int]) -> list[tuple[int, BaseException]]:
        # batch_fill checked the buffer and rows once: each engine fills its matchers without checking again
        if self._llguidance is None:  # nothing went to llguidance yet: every matcher is xgrammar's
            return self.xgrammar._fill_checked(matchers, buffer, rows)
        if len(matchers) == 1:
            engine = self._llguidance if isinstance(matchers[0], LLGuidanceMatcher) else self.xgrammar
            return engine._fill_checked(matchers, buffer, rows)
        split = [i for i, m in enumerate(matchers) if isinstance(m, LLGuidanceMatcher)]
        if not split:
            return self.xgrammar._fill_checked(matchers, buffer, rows)
        if len(split) == len(matchers):
            return self.llguidance._fill_checked(matchers, buffer, rows)
        others = [i for i in range(len(matchers)) if not isinstance(matchers[i], LLGuidanceMatcher)]
        failures = []
        for engine, indices in ((self.llguidance, split), (self.xgrammar, others)):
            found = engine._fill_checked([matchers[i] for i in indices], buffer, [rows[i] for i in indices])
            failures += [(indices[k], error) for k, error in found]
        return sorted(failures, key=lambda failure: failure[0])

    def batch_accept(self, matchers: Sequence, tokens: Sequence[int]) -> list[bool]:
        if self._llguidance is None:
            return self.xgrammar.batch_accept(matchers, tokens)
        return super().batch_accept(matchers, tokens)

    def forced_tokens(self, matcher) -> list[int]:
        if type(matcher) is RacingMatcher:
            matcher = matcher.current  # whoever serves it now
        if type(matcher) is ItemTrackingMatcher:
            matcher = matcher.grammar  # the engine's forced text; the caller accepts it through the tracker
        return (self.llguidance if isinstance(matcher, LLGuidanceMatcher) else self.xgrammar).forced_tokens(matcher)

    def close(self) -> None:
        self.xgrammar.close()
        if self._llguidance is not None:
            self._llguidance.close()
