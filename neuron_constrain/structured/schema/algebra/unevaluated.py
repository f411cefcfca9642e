"""``unevaluatedProperties`` / ``unevaluatedItems`` resolved statically, where the combinators fix what is
evaluated: per case of the node's applicators, the names, patterns and positions that case evaluates
are known, and the rest takes the unevaluated schema through ``additionalProperties`` / ``items``.

    {properties: {a}, allOf: [{properties: {b}}], unevaluatedProperties: false}
        -> {properties: {a}, allOf: [{properties: {b}}], ... additionalProperties beside a, b: false}
    {anyOf: [A, B], unevaluatedItems: U}
        -> anyOf [A ∧ R(A), B ∧ R(B), A ∧ B ∧ R(A ∪ B)]     R(E): {prefixItems: [{}]*|E|, items: U}

``cases(S)`` splits a schema's applicators (``allOf``, ``anyOf``, ``oneOf``, ``$ref``,
``if``/``then``/``else``, ``dependentSchemas``) into cases ``(C_i, E_i)``: S is anyOf of the C_i,
a value in C_i has at least E_i evaluated, and every valid value is in a case evaluating exactly
what S evaluates for it. ``anyOf`` takes every subset of branches that may hold together (its
annotations are the union of the valid branches'), ``oneOf`` one branch with the others negated
(``logic.complement``) unless proven disjoint, ``if`` the pair (if ∧ then, not-if ∧ else); an
applicator that evaluates everything (``additionalProperties``, ``items``, an inner
``unevaluated*``) leaves nothing unevaluated. ``R`` is a separate conjunct (its
``additionalProperties`` sees only its own ``properties``), merged only where ``logic.meet`` keeps
the meaning. Items matched by a ``contains`` are evaluated: ``items`` becomes ``anyOf [C, U]``.
Nodes are resolved innermost first, on the schema before the other rewrites change annotations;
where a case has no positive form the node is left as written (the policy refuses it).
"""
from __future__ import annotations

import dataclasses
import itertools
import json

from neuron_constrain.core.errors import Error
from neuron_constrain.structured.schema import rewrite as rewrite
from neuron_constrain.structured.schema.algebra.caps import over, site
from neuron_constrain.structured.schema.algebra.conditionals import attach
from neuron_constrain.structured.schema.algebra.disjoint import apart_beyond_empty, disjoint, empty_overlap
from neuron_constrain.structured.schema.algebra.logic import ATOMS, atoms, is_true, join, meet
from neuron_constrain.structured.schema.algebra.negation import complement

APPLICATORS = ("allOf", "anyOf", "oneOf", "$ref", "if", "then", "else", "dependentSchemas")
UNEVALUATED = ("unevaluatedProperties", "unevaluatedItems")


class Inexpressible(Error):
    """A case of the node has no positive form here."""


@dataclasses.dataclass(frozen=True)
class Seen:
    """What a case evaluates: property names and patterns (or all), leading positions, contains schemas."""

    names: frozenset = frozenset()
    patterns: frozenset = frozenset()
    all_properties: bool = False
    prefix: int = 0
    all_items: bool = False
    contains: frozenset = frozenset()  # JSON texts of the schemas

    def __or__(self, other: "Seen") -> "Seen":
        return Seen(self.names | other.names, self.patterns | other.patterns,
                    self.all_properties or other.all_properties, max(self.prefix, other.prefix),
                    self.all_items or other.all_items, self.contains | other.contains)


def own(node: dict) -> Seen:
    """What ``node``'s own keywords evaluate (when it is valid)."""
    prefix = node.get("prefixItems")
    return Seen(frozenset(node.get("properties") or {}), frozenset(node.get("patternProperties") or {}),
                "additionalProperties" in node or "unevaluatedProperties" in node,
                len(prefix) if isinstance(prefix, list) else 0,
                "items" in node or "unevaluatedItems" in node,
                frozenset([json.dumps(node["contains"], sort_keys=True)]) if "contains" in node else frozenset())


def resolve(node, judge, path: str = "#"):
    """Post-order over ``node``: each ``unevaluated*`` rewritten where its cases are fixed."""
    if not isinstance(node, dict):
        return node
    for suffix, container, key in list(rewrite.children(node)):
        container[key] = resolve(container[key], judge, path + suffix)
    if not set(UNEVALUATED) & set(node):
        return node
    keyword = next(k for k in UNEVALUATED if k in node)
    try:
        with site(keyword, path):
            return _resolve(node, judge)
    except Inexpressible:
        return node


def _resolve(node: dict, judge):
    applicators = {k: node[k] for k in APPLICATORS if k in node}
    within = atoms({k: v for k, v in node.items() if k in ("type", "enum", "const")})
    cases = cases_of(applicators, judge, frozenset(), within)
    mine = own({k: v for k, v in node.items() if k not in UNEVALUATED})
    branches = [meet(schema, _remainder(mine | seen, node)) for schema, seen in cases]
    over("branches", len(branches))
    for key in (*APPLICATORS, *UNEVALUATED):
        node.pop(key, None)
    return attach(node, json.loads(json.dumps(join(branches))))  # the cases share subschemas: unshared


def _remainder(seen: Seen, node: dict) -> dict:
    out: dict = {}
    properties, items = node.get("unevaluatedProperties"), node.get("unevaluatedItems")
    if properties is not None and not is_true(properties) and not seen.all_properties:
        if seen.names:
            out["properties"] = {name: {} for name in sorted(seen.names)}
        if seen.patterns:
            out["patternProperties"] = {pattern: {} for pattern in sorted(seen.patterns)}
        out["additionalProperties"] = properties
    if items is not None and not is_true(items) and not seen.all_items:
        if seen.prefix:
            out["prefixItems"] = [{}] * seen.prefix
        matched = [json.loads(text) for text in sorted(seen.contains)]
        out["items"] = join([*matched, items]) if matched else items
    return out


def cases_of(schema, judge, refs: frozenset, within: frozenset = ATOMS) -> list:
    """``[(C_i, E_i)]`` for ``schema`` (see the module docstring); ``within``: the types the value may have."""
    if schema is False:
        return []
    if not isinstance(schema, dict):
        return [({}, Seen())]
    base = {k: v for k, v in schema.items() if k not in APPLICATORS}
    cases = [(base, own(base))]
    for branch in schema.get("allOf") or []:
        cases = _product(cases, cases_of(branch, judge, refs, within))
    if isinstance(schema.get("$ref"), str):
        ref = schema["$ref"]
        target = judge.resolve(ref)
        if ref in refs or target is None:
            raise Inexpressible(ref)
        cases = _product(cases, cases_of(target, judge, refs | {ref}, within))
    if isinstance(schema.get("anyOf"), list):
        cases = _product(cases, _any_of(schema["anyOf"], judge, refs, within))
    if isinstance(schema.get("oneOf"), list):
        cases = _product(cases, _one_of(schema["oneOf"], judge, refs, within))
    if "if" in schema:
        cases = _product(cases, _if(schema["if"], schema.get("then", {}), schema.get("else", {}), judge, refs, within))
    for name, sub in (schema.get("dependentSchemas") or {}).items():
        present = [(meet({"required": [name]}, c), s) for c, s in cases_of(sub, judge, refs, within)]
        cases = _product(cases, [({"properties": {name: False}}, Seen()), *present])
    return cases


def _product(first: list, second: list) -> list:
    over("branches", len(first) * len(second))
    out = []
    for (c1, s1), (c2, s2) in itertools.product(first, second):
        met = meet(c1, c2)
        if met is not False:
            out.append((met, s1 | s2))
    return out


def _any_of(branches: list, judge, refs, within) -> list:
    """Every combination of cases of branches that may hold together; a combination whose evaluation
    equals that of one it extends is covered by it (dropped)."""
    per_branch = [cases_of(b, judge, refs, within) for b in branches]
    seen_of: dict = {}
    out = []
    for size in range(1, len(branches) + 1):
        for chosen in itertools.combinations(range(len(branches)), size):
            if any(disjoint(branches[i], branches[j], judge, within) for i, j in itertools.combinations(chosen, 2)):
                continue
            for picks in itertools.product(*(range(len(per_branch[i])) for i in chosen)):
                combo = tuple(zip(chosen, picks))
                seen = Seen()
                for i, k in combo:
                    seen = seen | per_branch[i][k][1]
                seen_of[combo] = seen
                if size > 1 and any(seen_of.get(combo[:m] + combo[m + 1:]) == seen for m in range(size)):
                    continue
                schema: object = {}
                for i, k in combo:
                    schema = meet(schema, per_branch[i][k][0])
                if schema is not False:
                    out.append((schema, seen))
                over("branches", len(out))
    return out


def _one_of(branches: list, judge, refs, within) -> list:
    out, emptied = [], empty_overlap(branches, judge, within)
    for i, branch in enumerate(branches):
        guard: object = emptied or {}  # [], {}, "" two branches accept: no case (apart_beyond_empty)
        for j, other in enumerate(branches):
            if j != i and not disjoint(branch, other, judge, within) and not (
                    emptied is not None and apart_beyond_empty(branch, other, judge, within)):
                negated = complement(other, judge.resolve)
                if negated is None:
                    raise Inexpressible("oneOf")
                guard = meet(guard, negated)
        out += [(meet(c, guard), s) for c, s in cases_of(branch, judge, refs, within)]
    return [(c, s) for c, s in out if c is not False]


def _if(condition, then, otherwise, judge, refs, within) -> list:
    negated = complement(condition, judge.resolve)
    if negated is None:
        raise Inexpressible("if")
    positive = _product(cases_of(condition, judge, refs, within), cases_of(then, judge, refs, within))
    negative = [(meet(negated, c), s) for c, s in cases_of(otherwise, judge, refs, within)]
    return [(c, s) for c, s in positive + negative if c is not False]
