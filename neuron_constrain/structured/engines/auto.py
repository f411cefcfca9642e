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

Routed by meaning: where xgrammar would take fewer values than the schema (its narrowing: an
untyped node compiled as one type, ``rewrite.narrow``: ``{"maxLength": 2}`` would refuse
``5``, which JSON Schema takes; a bounded string written without escapes: ``"a\\"b"`` refused),
llguidance, which keeps JSON Schema's meaning there, is tried first; xgrammar's narrowed grammar
is the fallback, and the result says so (``CompiledGrammar.narrowed``: the nodes' pointers).
``narrow_bounded_strings=True`` takes xgrammar's escape-free bounded strings as stock vLLM does
(the vLLM plugin: its greedy tokens stay stock's; llguidance forces a canonical tokenization of
text the grammar fixes, xgrammar allows any), still routing untyped nodes by meaning.

The two engines' matchers live side by side in one batch: fills and accepts go to the
engine that made each matcher.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Sequence

import torch

from neuron_constrain.structured.constraints import Constraint, ConstraintError
from neuron_constrain.structured.engines.base import CompiledGrammar, GrammarEngine
from neuron_constrain.structured.schema.limits import LimitError
from neuron_constrain.structured.schema.satisfiable import UnsatisfiableError
from neuron_constrain.structured.engines.llguidance.engine import LLGuidanceEngine, LLGuidanceMatcher
from neuron_constrain.structured.engines.xgrammar.engine import XGrammarEngine


class AutoEngine(GrammarEngine):
    """Per constraint, the first of xgrammar and llguidance that compiles and enforces it."""

    name = "auto"

    def __init__(self, tokenizer, *, fill_threads: int = 1, fill_timeout: float = 120.0, limits=None,
                 compile_processes: int = 0, narrow_bounded_strings: bool = False):
        super().__init__(tokenizer, fill_threads=fill_threads, fill_timeout=fill_timeout, limits=limits)
        self.narrow_bounded_strings = narrow_bounded_strings
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

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        strict = dataclasses.replace(constraint, unenforced="refuse") if constraint.kind == "json_schema" else constraint
        try:  # xgrammar's policy once: it routes, and xgrammar's compile takes it
            policy, narrowed = self._xgrammar_policy(strict)
        except (LimitError, UnsatisfiableError):
            raise  # the constraint's own: no engine would take it
        except ConstraintError as refused:
            policy, xgrammar_said = None, str(refused)
        if policy is not None:
            if narrowed:
                try:  # an engine exact on the whole schema first
                    return self.llguidance.compile(strict)
                except (ConstraintError, ImportError, ValueError):
                    pass
            try:
                return self.xgrammar.compile(strict, policy)
            except (LimitError, UnsatisfiableError):
                raise
            except ConstraintError as refused:
                xgrammar_said = str(refused)
        try:
            return self.llguidance.compile(constraint)
        except (ConstraintError, ImportError, ValueError) as error:
            if constraint.unenforced == "allow" and constraint.kind == "json_schema":
                return self.xgrammar.compile(constraint)  # compiles; lists what it does not enforce
            combined = ConstraintError(f"neither engine takes this constraint: llguidance: {' '.join(str(error).split())} "
                                       f"| xgrammar: {xgrammar_said}")
            combined.unenforced = getattr(error, "unenforced", None)  # a refusal (keywords.py), not a syntax error
            raise combined from error

    def wait_ready(self) -> None:
        self.xgrammar.wait_ready()

    def matcher(self, compiled: CompiledGrammar):
        return (self.llguidance if compiled.engine == "llguidance" else self.xgrammar).matcher(compiled)

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
        return (self.llguidance if isinstance(matcher, LLGuidanceMatcher) else self.xgrammar).forced_tokens(matcher)

    def _xgrammar_policy(self, constraint: Constraint):
        """xgrammar's keyword policy for ``constraint``, and whether xgrammar would take fewer values than the
        schema somewhere (an untyped node typed, a format written as a narrower pattern, a bounded string
        unless ``narrow_bounded_strings``). The policy checks the limits first: a constraint past them is
        refused here, for every engine; a keyword xgrammar would not enforce raises ``ConstraintError``."""
        prepared, unenforced, typed = self.xgrammar.keyword_policy(constraint, bounded_strings=False)
        bounded = self.xgrammar.bounded_strings(prepared, typed)
        return (prepared, unenforced, typed + bounded), bool(typed or (bounded and not self.narrow_bounded_strings))

    def close(self) -> None:
        self.xgrammar.close()
        if self._llguidance is not None:
            self._llguidance.close()
