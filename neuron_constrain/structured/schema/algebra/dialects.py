"""Earlier drafts' spellings read as draft 2020-12 says the same thing, by the root's ``$schema``.

    schema = to_2020(schema)     # a copy, ``$schema`` now 2020-12's; 2020-12 (or none) keeps its reading

Per draft (the referee, ``jsonschema``, reads each so; 2020-12 when ``$schema`` is absent):

    items: [A, B], additionalItems: C     -> prefixItems: [A, B], items: C    (drafts 4-2019; a schema
                                             `items` makes `additionalItems` a no-op: dropped)
    dependencies: {a: [..], b: {..}}       -> dependentRequired / dependentSchemas      (drafts 4-7)
    $recursiveAnchor: true, $recursiveRef  -> $dynamicAnchor / $dynamicRef, or $ref "#" where the
                                              resource it starts in has no recursive anchor (2019-09)
    maximum: 5, exclusiveMaximum: true     -> exclusiveMaximum: 5                      (draft 4)
    id / $id: "#name"                      -> $anchor: "name"; draft 4's `id` -> `$id`
    $ref beside other keywords             -> the `$ref` alone (drafts 4-7 ignore its siblings)
    a keyword the draft does not have      -> dropped (an annotation there: `const` in draft 4, ...)

In a 2020-12 schema, ``additionalItems``, ``dependencies`` and ``$recursiveRef``/``$recursiveAnchor``
are not keywords (the referee ignores them): they are dropped as the annotations they are.
Draft 4 does not count ``1.0`` as an integer; the engines' integer grammars never write a fraction
part, so its 2020-12 reading enforces no more than draft 4 allows.
"""
from __future__ import annotations

import copy

from neuron_constrain.structured.schema import rewrite as rewrite

LATEST = "https://json-schema.org/draft/2020-12/schema"
SCHEMAS = {4: "http://json-schema.org/draft-04/schema#", 6: "http://json-schema.org/draft-06/schema#",
           7: "http://json-schema.org/draft-07/schema#", 2019: "https://json-schema.org/draft/2019-09/schema",
           2020: LATEST}
_DRAFTS = {"json-schema.org/draft-04/schema": 4, "json-schema.org/draft-06/schema": 6,
           "json-schema.org/draft-07/schema": 7, "json-schema.org/draft/2019-09/schema": 2019,
           "json-schema.org/draft/2020-12/schema": 2020}
# 2020-12 keywords (rewrite.VOCABULARY) each earlier draft lacks: annotations there.
_NEWER = {
    4: {"const", "contains", "minContains", "maxContains", "propertyNames", "if", "prefixItems", "dependentRequired",
        "dependentSchemas", "unevaluatedItems", "unevaluatedProperties", "$dynamicRef", "exclusiveMinimum",
        "exclusiveMaximum"},
    6: {"if", "prefixItems", "dependentRequired", "dependentSchemas", "unevaluatedItems", "unevaluatedProperties",
        "minContains", "maxContains", "$dynamicRef"},
    7: {"prefixItems", "dependentRequired", "dependentSchemas", "unevaluatedItems", "unevaluatedProperties",
        "minContains", "maxContains", "$dynamicRef"},
    2019: {"prefixItems", "$dynamicRef", "dependencies"},
    2020: {"additionalItems", "dependencies", "$recursiveRef"},
}
_RECURSIVE = "__recursive"  # the $dynamicAnchor name $recursiveAnchor becomes


def draft(schema) -> int:
    """The draft ``schema`` declares (4, 6, 7, 2019, 2020); 2020 when it declares none or an unknown one."""
    declared = schema.get("$schema") if isinstance(schema, dict) else None
    if not isinstance(declared, str):
        return 2020
    key = declared.split("://", 1)[-1].rstrip("#")
    return _DRAFTS.get(key, 2020)


def to_2020(schema):
    """``schema`` (a copy) in 2020-12's spelling, the same values valid."""
    version = draft(schema)
    schema = copy.deepcopy(schema)
    if not isinstance(schema, dict):
        return schema
    if version != 2020:
        schema["$schema"] = LATEST
    for _, node in list(rewrite.walk(schema)):
        _node(node, version)
    if version == 2019:
        _recursive(schema)
    return schema


def _node(node: dict, version: int) -> None:
    if version <= 7 and "$ref" in node:
        for key in [k for k in node if k in rewrite.VOCABULARY and k != "$ref"] + ["then", "else"]:
            node.pop(key, None)
    exclusive = _draft4_bounds(node) if version == 4 else {}
    for key in _NEWER[version]:
        node.pop(key, None)
    node.update(exclusive)
    if version == 4 and isinstance(node.get("id"), str):
        node["$id"] = node.pop("id")
    if version <= 7:
        _anchor_ids(node)
        if "if" not in node:
            node.pop("then", None)
            node.pop("else", None)
    if version <= 2019:
        if isinstance(node.get("items"), list):
            node["prefixItems"] = node.pop("items")
            if "additionalItems" in node:
                node["items"] = node.pop("additionalItems")
        node.pop("additionalItems", None)  # beside a schema `items`, or with no `items`: a no-op
    if version <= 7 and isinstance(node.get("dependencies"), dict):
        for name, value in node.pop("dependencies").items():
            key = "dependentRequired" if isinstance(value, list) else "dependentSchemas"
            node.setdefault(key, {})[name] = value
    if version == 2020:
        node.pop("$recursiveAnchor", None)


def _draft4_bounds(node: dict) -> dict:
    """Draft 4's boolean ``exclusiveMinimum``/``exclusiveMaximum`` (read as the referee reads them: any true
    value makes its bound exclusive) as 2020-12's numeric keywords."""
    out = {}
    for bound, flag in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        if node.pop(flag, False) and bound in node:
            out[flag] = node.pop(bound)
    return out


def _anchor_ids(node: dict) -> None:
    """Drafts 4-7 name a location with an ``$id`` that is a fragment: 2020-12's ``$anchor``."""
    ident = node.get("$id")
    if isinstance(ident, str) and "#" in ident:
        base, name = ident.split("#", 1)
        if name and not name.startswith("/"):
            node["$anchor"] = name
        if base:
            node["$id"] = base
        else:
            del node["$id"]


def _recursive(schema: dict) -> None:
    """2019-09's ``$recursiveRef: "#"`` starts at its resource's root; where that root has
    ``$recursiveAnchor: true`` it is dynamic (2020-12's ``$dynamicRef`` to a shared anchor name),
    else a plain reference to that root."""
    def visit(node, resource_dynamic: bool):
        if "$id" in node or node is schema:
            resource_dynamic = node.get("$recursiveAnchor") is True
        if node.pop("$recursiveAnchor", None) is True:
            node["$dynamicAnchor"] = _RECURSIVE
        ref = node.pop("$recursiveRef", None)
        if isinstance(ref, str):
            target = "#" + _RECURSIVE if resource_dynamic else "#"
            if resource_dynamic:
                node["$dynamicRef"] = target
            elif "$ref" in node:
                node.setdefault("allOf", []).append({"$ref": target})
            else:
                node["$ref"] = target
        for _, container, key in rewrite.children(node):
            if isinstance(container[key], dict):
                visit(container[key], resource_dynamic)
    visit(schema, schema.get("$recursiveAnchor") is True)
