"""Schema rewrites that keep a schema's meaning (every engine), and the narrowing some engines need.

    schema = normalize(schema)      # same instances valid, in the form engines compile
    schema = distribute(schema)     # siblings of anyOf/oneOf/allOf moved into the branches (same meaning)
    schema = narrow(schema)         # enum/const filtered by their sibling assertions (same meaning)

``normalize`` (all engines): ``true`` subschemas become ``{}``; integer-valued limits written
``2.0`` become ``2``; an empty ``patternProperties`` is dropped (it matches no name); every ``$ref`` into the same document (``$id``-relative, ``$anchor``, a
URN or absolute URI naming this document, JSON-pointer escapes ``~0`` ``~1`` ``%22``) is rewritten
to a plain root pointer ``#/...`` (an alias under ``$defs`` where the pointer needs escapes), and
the sub-resource ``$id`` / ``$anchor`` it resolved are dropped. A ``$ref`` to another document
is left as written: no engine enforces it (keywords.py refuses it by name; nothing is fetched).

``distribute`` (xgrammar, which drops the siblings of a combinator): ``{A, anyOf: [B, C]}``
becomes ``{anyOf: [{A, B}, {A, C}]}`` (``oneOf`` alike; ``allOf: [B, C]`` with ``A`` becomes
``{A, B, C}``) where no keyword collides; otherwise the node is left and the policy refuses it.

``narrow`` (xgrammar, which compiles an ``enum`` / ``const`` alone and drops its siblings): an
``enum`` / ``const`` beside other assertions keeps only the values that satisfy them (checked with
``jsonschema``), the meaning kept. (An untyped node is no longer typed by its assertions, which refused
``5`` for ``{"maxLength": 2}``: ``values.split_types`` splits it by instance type first.)
"""
from __future__ import annotations

import copy
import urllib.parse

# Keywords that assert something of one instance type only (JSON Schema 2020-12, plus the earlier drafts' spellings).
FAMILIES = {
    "string": frozenset({"minLength", "maxLength", "pattern", "format"}),
    "number": frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}),
    "array": frozenset({"items", "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems", "contains",
                        "minContains", "maxContains", "unevaluatedItems"}),
    "object": frozenset({"properties", "required", "additionalProperties", "patternProperties", "minProperties",
                         "maxProperties", "propertyNames", "dependentRequired", "dependentSchemas", "dependencies",
                         "unevaluatedProperties"}),
}
FAMILY_TYPES = {"string": ("string",), "number": ("integer", "number"), "array": ("array",), "object": ("object",)}
# Keywords whose subschemas a valid value may need to fail: where a narrower subschema could widen what a schema accepts.
NEGATING = frozenset({"not", "if", "oneOf"})
# Keywords that assert something of any instance; with FAMILIES, the vocabulary the allowlists judge.
GENERIC = frozenset({"type", "enum", "const", "allOf", "anyOf", "oneOf", "not", "if", "$ref", "$dynamicRef",
                     "$recursiveRef"})
VOCABULARY = GENERIC | frozenset().union(*FAMILIES.values())
LIMITS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties", "minContains",
          "maxContains")

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONE = ("additionalProperties", "unevaluatedProperties", "propertyNames", "contains", "additionalItems",
               "unevaluatedItems", "not", "if", "then", "else", "contentSchema", "items")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")


def escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def children(node: dict):
    """``(pointer suffix, container, key)`` of every subschema position directly under ``node``."""
    for key in _SCHEMA_MAPS:
        value = node.get(key)
        if isinstance(value, dict):
            for name in value:
                yield f"/{key}/{escape(name)}", value, name
    for key in _SCHEMA_ONE:
        if key in node and not isinstance(node[key], list):
            yield f"/{key}", node, key
    for key in _SCHEMA_LISTS:
        value = node.get(key)
        if isinstance(value, list):
            for index in range(len(value)):
                yield f"/{key}/{index}", value, index
    dependencies = node.get("dependencies")
    if isinstance(dependencies, dict):
        for name, sub in dependencies.items():
            if isinstance(sub, (dict, bool)):
                yield f"/dependencies/{escape(name)}", dependencies, name


def walk(schema, path: str = "#"):
    """Every schema object in ``schema`` with its JSON pointer (``#`` is the root), in preorder.
    Iterative (no recursion however deep the schema); a node's children are read after the
    caller had it, so a caller may rewrite a node before its subschemas are visited."""
    if not isinstance(schema, dict):
        return
    yield path, schema
    stack = [(path, children(schema))]
    while stack:
        base, pending = stack[-1]
        for suffix, container, key in pending:
            node = container[key]
            if isinstance(node, dict):
                yield base + suffix, node
                stack.append((base + suffix, children(node)))
                break
        else:
            stack.pop()


def declared_types(node: dict) -> frozenset | None:
    kind = node.get("type")
    if isinstance(kind, str):
        return frozenset({kind})
    if isinstance(kind, list) and all(isinstance(k, str) for k in kind):
        return frozenset(kind)
    return None


# --------------------------------------------------------------------------- normalize
def normalize(schema):
    """``schema`` in the form engines compile, its meaning kept (a deep copy; see the module docstring)."""
    schema = copy.deepcopy(schema)
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        return schema
    _true_subschemas(schema)
    for _, node in walk(schema):
        for key in LIMITS:
            value = node.get(key)
            if isinstance(value, float) and value.is_integer() and value >= 0:
                node[key] = int(value)
        if node.get("patternProperties") == {}:  # no pattern: no name matched, none evaluated
            del node["patternProperties"]
    _local_refs(schema)
    return schema


def _true_subschemas(node: dict) -> None:
    for _, container, key in list(children(node)):
        if container[key] is True and key not in ("additionalProperties", "items", "unevaluatedItems",
                                                  "unevaluatedProperties", "additionalItems"):
            container[key] = {}
        elif isinstance(container[key], dict):
            _true_subschemas(container[key])


def _resources(schema: dict):
    """Absolute URI of every ``$id`` and ``$anchor`` -> the pointer of its node; each node's base URI."""
    root_base = schema.get("$id") if isinstance(schema.get("$id"), str) else ""
    targets, bases = {urllib.parse.urldefrag(root_base)[0]: "#"}, {}

    def visit(node, path, base):
        if isinstance(node.get("$id"), str) and path != "#":
            base = urllib.parse.urljoin(base, node["$id"])
            targets.setdefault(urllib.parse.urldefrag(base)[0], path)
        bases[path] = base
        for key in ("$anchor", "$dynamicAnchor"):
            if isinstance(node.get(key), str):
                targets.setdefault(urllib.parse.urldefrag(base)[0] + "#" + node[key], path)
        for suffix, container, key in children(node):
            if isinstance(container[key], dict):
                visit(container[key], path + suffix, base)
    visit(schema, "#", root_base)
    return targets, bases


def _node_at(schema: dict, pointer: str):
    node = schema
    for part in pointer.lstrip("#").split("/")[1:]:
        part = urllib.parse.unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return None
    return node


_PLAIN = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-$/#")


def _local_refs(schema: dict) -> None:
    targets, bases = _resources(schema)
    aliases: dict[str, str] = {}
    rewrote = False
    for path, node in list(walk(schema)):
        ref = node.get("$ref")
        if not isinstance(ref, str):
            continue
        resolved = urllib.parse.urljoin(bases.get(path, ""), ref) if bases.get(path) else ref
        uri, fragment = urllib.parse.urldefrag(resolved)
        if uri not in targets:
            continue  # another document: left for the policy to refuse by name
        if fragment and not fragment.startswith("/"):
            pointer = targets.get(uri + "#" + fragment)
            if pointer is None:
                continue  # an anchor nobody declares: unresolvable, refused by the policy
        else:
            pointer = targets[uri] + fragment
        target = _node_at(schema, pointer)
        if target is None or not isinstance(target, (dict, bool)):
            continue
        if set(pointer) <= _PLAIN:
            node["$ref"] = pointer
        else:
            name = aliases.setdefault(pointer, f"__ref{len(aliases)}")
            node["$ref"] = f"#/$defs/{name}"
        rewrote = rewrote or node["$ref"] != ref
    if aliases:
        defs = schema.setdefault("$defs", {})
        for pointer, name in aliases.items():
            defs[name] = _node_at(schema, pointer)  # the same object: meaning shared, written once per use
    if rewrote or aliases:
        for path, node in walk(schema):
            if path != "#":
                node.pop("$id", None)
                node.pop("$anchor", None)


# --------------------------------------------------------------------------- xgrammar's rewrites
_ANNOTATIONS_AT_NODE = frozenset({"$defs", "definitions", "$schema", "$id", "$anchor", "$comment", "title",
                                  "description", "default", "examples"})


_UNEVALUATED = frozenset({"unevaluatedItems", "unevaluatedProperties"})

# Keywords whose meaning depends on a neighbour in the same schema object: `additionalProperties`
# sees only its own object's `properties`/`patternProperties`, `items` only its `prefixItems`,
# `min/maxContains` only their `contains`, `then`/`else` only their `if`, `dependent*` name the
# object's properties; `unevaluated*` sees everything its object and its applicators evaluate. A
# rewrite that merges or moves keywords moves a unit whole, or does not apply.
ADJACENT = (
    frozenset({"properties", "patternProperties", "additionalProperties"}),
    frozenset({"prefixItems", "items", "additionalItems"}),
    frozenset({"contains", "minContains", "maxContains"}),
    frozenset({"if", "then", "else"}),
    frozenset({"dependentSchemas", "dependentRequired", "dependencies", "properties"}),
)


def splits_a_unit(first, second) -> bool:
    """Whether putting the keywords of ``first`` beside those of ``second`` (schema objects, or
    keyword sets) would change what one means: a unit with members on both sides, or
    ``unevaluated*`` on either side of anything that evaluates."""
    a, b = set(first), set(second)
    if (_UNEVALUATED & a and b - _ANNOTATIONS_AT_NODE) or (_UNEVALUATED & b and a - _ANNOTATIONS_AT_NODE):
        return True
    return any(unit & a and unit & b for unit in ADJACENT)


def distribute(schema):
    """Siblings of ``anyOf``/``oneOf`` moved into every branch, ``allOf`` branches merged, where no keyword
    collides and no adjacency unit (``ADJACENT``, ``unevaluated*``) would be split or joined."""
    for _, node in list(walk(schema)):
        if _UNEVALUATED & set(node):
            continue
        branches = node.get("allOf")
        if isinstance(branches, list) and all(isinstance(b, dict) for b in branches):
            merged = {k: v for k, v in node.items() if k != "allOf"}
            if all(not _merge_into(merged, b) for b in branches):
                node.clear()
                node.update(merged)
        for key in ("anyOf", "oneOf"):
            branches = node.get(key)
            siblings = {k: v for k, v in node.items() if k in VOCABULARY and k not in ("anyOf", "oneOf")}
            if not isinstance(branches, list) or not siblings or not all(isinstance(b, dict) for b in branches):
                continue
            if any(set(b) & set(siblings) or splits_a_unit(b, siblings) for b in branches) or (
                    "anyOf" in node and "oneOf" in node):
                continue
            node[key] = [{**copy.deepcopy(siblings), **b} for b in branches]
            for k in siblings:
                del node[k]
    return schema


def _merge_into(merged: dict, branch: dict) -> bool:
    """Merge ``branch`` into ``merged``; True if a keyword collided or an adjacency unit would be joined
    (then ``merged`` is not usable)."""
    if splits_a_unit({k for k in merged if k in VOCABULARY}, {k for k in branch if k in VOCABULARY}):
        return True
    for key, value in branch.items():
        if key in merged and key not in _ANNOTATIONS_AT_NODE:
            return True
        if key in ("$defs", "definitions") and key in merged:
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return False


def narrow(schema, validate_value) -> None:
    """``enum`` / ``const`` beside other assertions filtered by them (``validate_value(node, v)``), the siblings
    dropped (same meaning; untyped nodes are split by type first, ``values.split_types``)."""
    for _, node in walk(schema):
        for key in ("enum", "const"):
            if key not in node:
                continue
            rest = {k: v for k, v in node.items() if k in VOCABULARY and k != key}
            if not rest or {"$ref", "anyOf", "oneOf", "allOf", "not", "if"} & set(rest):
                continue
            values = node[key] if key == "enum" else [node[key]]
            if not isinstance(values, list):
                continue
            kept = [v for v in values if validate_value(rest, v)]
            for k in rest:
                del node[k]
            node["enum"] = kept
            node.pop("const", None)


ONE_MORE_NAME_CAP = 64  # optional names a closed object's `minProperties` may be written out over


def min_properties_as_required(schema) -> None:
    """``minProperties`` on a closed object (``additionalProperties: false``, no ``patternProperties``), for an
    engine that counts properties only where every declared one is required (llguidance): dropped where the
    required names reach it, and where it asks one name more, written as which optional name that is
    (``{"minProperties": 1, "properties": {a, b}}`` -> ``allOf: [{anyOf: [{required: [a]}, {required: [b]}]}]``,
    at most :data:`ONE_MORE_NAME_CAP` of them). The same values are valid, objects or not (``required`` asserts
    nothing of other types); a name whose schema is ``false`` is never written, so it offers no branch."""
    for _, node in walk(schema):
        count, properties, required = node.get("minProperties"), node.get("properties"), node.get("required", [])
        if (not isinstance(count, int) or isinstance(count, bool) or not isinstance(properties, dict)
                or not isinstance(required, list) or node.get("additionalProperties") is not False
                or "patternProperties" in node):
            continue
        named = {name for name in required if isinstance(name, str)}
        have = len(named & set(properties))
        optional = [name for name, sub in properties.items() if name not in named and sub is not False]
        if count <= have:
            del node["minProperties"]
        elif count == have + 1 and 0 < len(optional) <= ONE_MORE_NAME_CAP:
            del node["minProperties"]
            node.setdefault("allOf", []).append({"anyOf": [{"required": [name]} for name in optional]})
