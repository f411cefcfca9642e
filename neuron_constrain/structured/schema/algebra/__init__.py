"""The schema algebra: what no engine reads, rewritten into the same meaning in keywords an engine enforces.

    schema = lower(schema)      # a copy: the same values valid, fewer keywords no engine enforces

Engine-neutral; ``keywords.prepare`` runs it before each engine's own rewrites and the policy,
which still refuses, by keyword and JSON pointer, whatever no rewrite here expresses. In order:

    dialects.to_2020      draft-4/6/7/2019-09 spellings -> their 2020-12 meaning, by `$schema`
    dynamic.resolve       `$dynamicRef` -> `$ref` to copies per dynamic scope (the document fixes it)
    normalize             rewrite.normalize: `$ref`s as pointers, `true` as {}; a pattern bounding its
                          length with a lookahead (`^(?=.{1,253}$)...`) as minLength/maxLength (lengths.py)
    hoist                 every `$ref` target at `#` or directly under the root's `$defs`, so that
                          the rewrites below may move subtrees without breaking a pointer
    finite.collapse       a node with finitely many values -> the `enum` of those jsonschema accepts
    unevaluated.resolve   unevaluatedProperties/Items -> additionalProperties/items per case
    then, per node, children first:
      conditionals        allOf's plain branches merged into the node (patterns intersected,
                          bounds tightened); then/else alone, uniqueItems false, ... dropped; dependentRequired,
                          dependentSchemas, if/then/else, oneOf -> anyOf; not -> its complement
                          (a pattern's: regular.py, through automata)
      finite              contains/minContains/maxContains -> lengths or positions; uniqueItems over
                          finite item domains -> the enum of the arrays; propertyNames of a closed
                          object -> the declared names it takes; finitely many names -> closed on them
      pattern_names       overlapping patternProperties -> one disjoint pattern per set of them

Every rewrite keeps the set of valid values exactly (``tests/structured/test_schema_algebra.py`` checks it
with ``jsonschema`` against the schema as sent, and teacher-forces the engines); a rewrite whose
output would pass a size cap (``CAPS``) raises :class:`CapReached` naming the cap and the pointer.
Checks of values (``enum`` filtering, disjointness by values) are ``jsonschema``'s, in 2020-12
with the formats of the schema's own draft asserted, as ``keywords.post_validate`` judges.
"""
from __future__ import annotations

import copy
import json

from neuron_constrain.structured.schema import rewrite as rewrite
from neuron_constrain.structured.schema.algebra import (conditionals, dialects, dynamic, finite, lengths, logic, pattern_names,
                                                        regular, unevaluated)
from neuron_constrain.structured.schema.algebra.caps import CAPS, CapReached, Over

__all__ = ["CAPS", "CapReached", "REWRITES", "lower"]

# What the algebra rewrites, per keyword, for the engines guide's table (``keywords.guarantee_table``):
# where the condition fails, the keyword reaches the engines as written and their columns decide.
REWRITES = {
    "additionalItems": "drafts 4 to 2019-09 (by `$schema`): `prefixItems` / `items`",
    "dependencies": "drafts 4 to 7 (by `$schema`): `dependentRequired` / `dependentSchemas`, then as those",
    "dependentRequired": "`anyOf` over the presence cases",
    "dependentSchemas": "`anyOf` over the presence cases",
    "if": "`anyOf` of (`if` and `then`), (not `if` and `else`) where not `if` has a positive form "
          "(decided by type, `required`, `const`/`enum`, single bounds)",
    "not": "its positive complement, over type, `const`, `enum`, `required`, single bounds, `pattern` (the "
           "complement of its language, through automata); over member keywords alone: a member that breaks "
           "them, checked on the host by the library's item tracker, where the schema fixes which objects need it",
    "oneOf": "`anyOf` where the branches are proven disjoint (types, `required` against closed "
             "objects, discriminating `const`s; but for `[]`, `{}`, `\"\"`, then excluded where two accept them), "
             "else of each branch and the others' complements "
             "(a finite branch: its values the others refuse); else, over objects, `anyOf` judged whole on the host "
             "by the library's item tracker as the object closes",
    "contains": "lengths or first-match positions, where the contained schema and the items partition the items; "
                "else counted on the host by the item tracker (each item judged by `jsonschema`), where the schema "
                "fixes which arrays need it",
    "minContains": "with `contains`",
    "maxContains": "with `contains`",
    "uniqueItems": "over finite item domains: the `enum` of the arrays; else enforced on the host by the library's "
                   "item tracker, where the schema fixes which arrays need it (not a branch the engine picks)",
    "minProperties": "above 1 on an open object: counted on the host by the library's item tracker (distinct "
                     "names), where the schema fixes which objects need it",
    "allOf": "its plain branches merged into the node (patterns intersected, bounds tightened, properties met "
             "name by name)",
    "patternProperties": "overlapping patterns: one disjoint pattern per set of them, its schemas met",
    "propertyNames": "beside `additionalProperties: false`: the declared names it refuses removed, then dropped; "
                     "taking finitely many names (`false`, `enum`, `const`): the object closed on them; a `pattern` "
                     "alone: each `patternProperties` pattern met with it, the additional names one pattern more",
    "unevaluatedProperties": "`additionalProperties` per case, where the applicators fix what is evaluated",
    "unevaluatedItems": "`items` per case, where the applicators fix what is evaluated",
    "$dynamicRef": "`$ref` per dynamic scope, where the document fixes it",
    "$recursiveRef": "2019-09 (by `$schema`): `$ref` per dynamic scope",
}

# The rewrites made on each node, children first, with the keyword a cap error names.
STEPS = (
    ("allOf", conditionals.conjunction),
    ("then", conditionals.drop_vacuous),
    ("dependentSchemas", conditionals.dependencies),
    ("if", conditionals.conditional),
    ("oneOf", conditionals.one_of),
    ("not", conditionals.negation),
    ("contains", finite.contains),
    ("uniqueItems", finite.unique_items),
    ("propertyNames", finite.closed_names),
    ("patternProperties", pattern_names.disjoint_patterns),
)


# a schema without these needs only normalize
_HANDLED = conditionals.ELIMINATED | {"oneOf", "propertyNames", "allOf", "patternProperties"}


def lower(schema):
    """``schema`` (never modified) in the keywords engines enforce, where a rewrite keeps its meaning."""
    declared, order = dialects.draft(schema), logic.ORDER.set(logic.first_seen(schema))
    try:
        schema = rewrite.normalize(dynamic.resolve(dialects.to_2020(schema)))
        if not isinstance(schema, dict):
            return schema
        lengths.lookahead_bounds(schema)
        if any(_HANDLED & set(node) for _, node in rewrite.walk(schema)):
            schema = json.loads(json.dumps(schema))  # no subschema shared (normalize's aliases are): edited in place below
            hoist(schema)
            judge = Judge(schema, declared)
            schema = finite.collapse(schema, judge)
            schema = unevaluated.resolve(schema, judge)
            schema = _rewrite(schema, judge, "#")
    finally:
        logic.ORDER.reset(order)
    if not isinstance(schema, dict):
        return schema
    schema = json.loads(json.dumps(schema))  # no subschema shared (later rewrites edit nodes in place)
    for _, node in rewrite.walk(schema):
        declare_required(node)
    return schema


def declare_required(node: dict) -> None:
    """A required name missing from ``properties`` is declared there as ``{}`` where nothing else sees
    ``properties`` (no ``additionalProperties``/``unevaluatedProperties``): the same values valid, and
    engines then require it in its place (xgrammar ignores an undeclared required name)."""
    required = node.get("required")
    if not isinstance(required, list) or {"additionalProperties", "unevaluatedProperties"} & set(node):
        return
    properties = node.get("properties", {})
    missing = [name for name in required if isinstance(name, str) and name not in properties]
    if missing and isinstance(properties, dict):
        node["properties"] = {**properties, **{name: {} for name in missing}}


def _rewrite(node, judge, path: str):
    if not isinstance(node, dict):
        return node
    for suffix, container, key in list(rewrite.children(node)):
        container[key] = _rewrite(container[key], judge, path + suffix)
    for keyword, step in STEPS:
        try:
            node = step(node, path, judge)
        except Over as passed:
            raise CapReached(passed.cap, passed.count, keyword, path, passed.maximum, passed.pattern) from None
        if not isinstance(node, dict):
            return node
    return node


class Judge:
    """``jsonschema`` over the document being lowered: the referee's reading of a node and a value."""

    class Unjudged(Exception):
        """``jsonschema`` could not apply the node (a remote reference, a bad pattern)."""

    def __init__(self, root: dict, declared: int):
        import jsonschema  # keywords.py's referee too

        base = jsonschema.Draft202012Validator
        formats = jsonschema.validators.validator_for(
            {"$schema": dialects.SCHEMAS.get(declared, dialects.LATEST)}, default=base).FORMAT_CHECKER
        cls = jsonschema.validators.extend(base, {"pattern": _pattern})
        self.root = root
        self.validator = cls(root, format_checker=formats)

    def valid(self, node, value) -> bool:
        """Whether ``jsonschema`` accepts ``value`` under ``node`` (its references resolved in the document)."""
        try:
            return self.validator.evolve(schema=node).is_valid(value)
        except Exception as error:  # noqa: BLE001 - any failure of the referee: no verdict
            raise Judge.Unjudged(str(error)) from error

    def resolve(self, ref: str):
        """The schema a local pointer names (None: not local, or nothing there)."""
        if ref != "#" and not ref.startswith("#/"):
            return None
        return rewrite._node_at(self.root, ref)


def _pattern(validator, pattern, instance, schema):
    """``pattern`` as ``jsonschema`` reads it (a search), a pattern the algebra wrote as what it stands
    for (``regular.referee_match``)."""
    import jsonschema

    if isinstance(instance, str) and not regular.referee_match(pattern, instance):
        yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")


def hoist(schema: dict) -> None:
    """Every ``$ref`` pointing below the root's ``$defs``/``definitions`` entries points at a copy there."""
    targets = {}
    for _, node in rewrite.walk(schema):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/") and not _top_level(ref):
            target = rewrite._node_at(schema, ref)
            if isinstance(target, (dict, bool)):
                targets.setdefault(ref, target)
    if not targets:
        return
    names = {ref: f"__at{index}" for index, ref in enumerate(targets)}
    for _, node in rewrite.walk(schema):
        if node.get("$ref") in names:
            node["$ref"] = f"#/$defs/{names[node['$ref']]}"
    defs = schema.setdefault("$defs", {})
    for ref, target in targets.items():
        defs[names[ref]] = copy.deepcopy(target)


def _top_level(ref: str) -> bool:
    parts = ref.split("/")
    return len(parts) == 3 and parts[1] in ("$defs", "definitions")
