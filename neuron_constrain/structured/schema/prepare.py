"""One prepared form per constraint: the engine-neutral steps run once, each engine's view of it once.

    prepared = prepare(constraint, limits)   # limits, satisfiability, the schema algebra: once per constraint
    view = prepared.view(allowlist)          # one engine's rewrites, item plan and unenforced keywords: once
    view.unenforced("refuse")                # ConstraintError for the first keyword the engine would not enforce
    view.constraint                          # what the engine compiles (the keywords the host tracks taken out)

Before: every engine's compile re-ran the whole preparation (limits serialising the schema, the algebra
deep-copying it, the item plan, a `jsonschema` validator), and ``auto`` compiles on two engines, falls
back, and retries with ``unenforced="allow"``: the same work two to four times per compile. Now:

    Constraint --prepare--> Prepared(constraint, schema)        limits.check, satisfiable.check, algebra.lower
                                 |--view(xgrammar)--> EngineView  distribute/narrow/formats, Plan.of, keywords.find
                                 '--view(llguidance)-> EngineView (each memoized on the Prepared, errors too)

``Prepared`` is immutable to its readers: a view is computed under a lock the first time an engine asks,
and every later ask (routing, the race, the fallback, the ``allow`` policy, the server's verdict) gets
the same object. ``STEPS`` counts each step as it runs (the tests assert once per compile).
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import threading
from typing import Any

from neuron_constrain.structured.constraints import Constraint, ConstraintError
from neuron_constrain.structured.schema import algebra, item_plan, keywords, limits as limits_, satisfiable
from neuron_constrain.structured.schema.algebra import lookaround

STEPS: collections.Counter = collections.Counter()  # step name -> times run in this process (tests read it)


@dataclasses.dataclass(frozen=True, eq=False)
class EngineView:
    """What one engine makes of a prepared constraint.

    Attributes:
        engine: the engine's name.
        schema: the engine's schema (its own rewrites applied; the tracked keywords still in), or None.
        narrowed: JSON pointers where the engine takes fewer values than the schema (untyped nodes typed,
            formats written as a narrower pattern).
        found: the keywords the engine would not enforce, in schema order.
        plan: the item tracker's plan (``item_plan.Plan``: what the host enforces), or None.
        constraint: what the engine compiles: the constraint with ``schema`` less the tracked keywords.
    """

    engine: str
    schema: Any
    narrowed: tuple[str, ...]
    found: tuple[keywords.Unenforced, ...]
    plan: item_plan.Plan | None
    constraint: Constraint

    def unenforced(self, policy: str) -> tuple[keywords.Unenforced, ...]:
        """``keywords.apply_policy`` on :attr:`found`: ``refuse`` raises for the first keyword the engine would not
        enforce; ``allow`` returns them all."""
        return keywords.apply_policy(self.found, policy)

    @functools.cached_property
    def bounded_strings(self) -> tuple[str, ...]:
        """Pointers of the schema's bounded strings (``minLength``/``maxLength``) not already narrowed."""
        if not isinstance(self.schema, dict):
            return ()
        return tuple(path for path, node in keywords.walk(self.schema)
                     if {"minLength", "maxLength"} & set(node) and path not in self.narrowed)


@dataclasses.dataclass(frozen=True, eq=False)
class Prepared:
    """A constraint after the engine-neutral steps: ``schema`` is the JSON schema lowered by the algebra
    (None for other kinds). Engines compile from it, through :meth:`view`."""

    constraint: Constraint
    schema: Any = None
    limits: limits_.Limits = limits_.DEFAULT
    _views: dict = dataclasses.field(default_factory=dict, repr=False)
    _lock: Any = dataclasses.field(default_factory=threading.Lock, repr=False)

    @property
    def kind(self) -> str:
        return self.constraint.kind

    @functools.cached_property
    def deep_languages(self) -> tuple[str, ...]:
        """JSON pointers (``#`` for a regex constraint) of the patterns whose language was built by automata and
        nests deeper than xgrammar compiles well (``lookaround.built_deep``): ``auto`` tries llguidance first."""
        if self.kind == "regex":
            return ("#",) if lookaround.built_deep(self.constraint.spec, search=False) else ()
        if self.kind != "json_schema":
            return ()
        found = []
        for path, node in keywords.walk(self.schema):
            sources = [(f"{path}/pattern", node.get("pattern"))]
            if isinstance(node.get("patternProperties"), dict):
                sources += [(f"{path}/patternProperties", name) for name in node["patternProperties"]]
            found += [where for where, source in sources
                      if isinstance(source, str) and lookaround.built_deep(source, search=True)]
        return tuple(found)

    def view(self, engine) -> EngineView:
        """``engine``'s view (its name or ``keywords.Allowlist``), computed the first time it is asked for; a
        refusal found then (a cap of the algebra past the engine's rewrites) is raised again on every ask."""
        lists = keywords.allowlist(engine)
        with self._lock:
            if lists.engine not in self._views:
                try:
                    self._views[lists.engine] = self._make_view(lists)
                except (ConstraintError, RecursionError) as error:
                    self._views[lists.engine] = error
            found = self._views[lists.engine]
        if isinstance(found, BaseException):
            raise found
        return found

    def _make_view(self, lists: keywords.Allowlist) -> EngineView:
        if self.kind != "json_schema":
            return EngineView(lists.engine, None, (), (), None, self.constraint)
        STEPS["engine_rewrites"] += 1
        narrowed: list[str] = []
        try:
            schema = keywords.engine_rewrites(self.schema, lists, narrowed)
        except RecursionError:
            raise limits_.LimitError("depth", "too deep for Python's stack", self.limits.depth) from None
        STEPS["item_plan"] += 1
        plan = item_plan.Plan.of(schema)
        found = tuple(keywords.find(schema, lists, plan))
        compiled = schema
        if plan is not None and plan.untracked is None and plan.reached:
            compiled = plan.engine_schema()
        else:
            plan = None
        return EngineView(lists.engine, schema, tuple(narrowed), found, plan,
                          dataclasses.replace(self.constraint, spec=compiled))


def prepare(constraint: "Constraint | Prepared", limits: limits_.Limits = limits_.DEFAULT) -> Prepared:
    """``constraint`` through the engine-neutral steps, in order: its :class:`~limits.Limits` (``LimitError``),
    then, for a JSON schema, whether any value satisfies it (``satisfiable.UnsatisfiableError``) and the schema
    algebra (``algebra.lower``: the same values valid, in keywords engines enforce). A ``Prepared`` is returned
    as it is."""
    if isinstance(constraint, Prepared):
        return constraint
    STEPS["limits"] += 1
    limits_.check(constraint, limits)
    if constraint.kind != "json_schema":
        return Prepared(constraint, limits=limits)
    STEPS["satisfiable"] += 1
    satisfiable.check(constraint.spec, limits.answer_chars)
    STEPS["algebra"] += 1
    try:
        schema = algebra.lower(constraint.spec)
    except RecursionError:  # the depth limit keeps every walker within Python's stack; this is the backstop
        raise limits_.LimitError("depth", "too deep for Python's stack", limits.depth) from None
    if schema is False:
        raise ConstraintError("the schema is `false`: no output is valid; send a schema some value satisfies")
    return Prepared(constraint, schema, limits)
