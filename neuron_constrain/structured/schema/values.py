"""Values of any type, exactly: untyped and multi-typed nodes split by type, ``enum`` / ``const`` as schemas.

    split_types(schema)                 # {"maxLength": 2} -> anyOf [{type string, maxLength 2}, {type [others]}]
    values_as_schemas(schema)           # {"const": {"a": 1}} -> {type object, properties {a: integral 1}, ...}
    integral(value)                     # whether a JSON number's value is an integer (1.0, -0.0, 1e16 are)

JSON Schema applies a keyword of one instance type (``maxLength``, ``minimum``, ``required``, ...) to
instances of that type only: ``{"maxLength": 2}`` accepts ``5`` and ``[1, 2, 3]``. An engine that compiles an
untyped node as one type (xgrammar) would refuse those; :func:`split_types` writes the node as one branch per
instance type instead, each with the keywords of its own type, so no value is lost and none is added (a type
list is split the same way; a keyword of a type the node does not declare asserts nothing and is dropped).

``enum`` / ``const`` compare by value (JSON Schema's equality): ``2.0`` equals ``2``, ``{"b": 1, "a": 2}``
equals ``{"a": 2, "b": 1}``, and whitespace between tokens is not part of a value. Engines write a listed
value as its text, so :func:`values_as_schemas` writes each array / object value as a schema of its items or
properties (any whitespace; an object's properties in any order up to :data:`MAX_ORDERED` of them, past it in
the order listed: narrower than JSON Schema, which takes any order), and each integral number as ``{"type": "integer", "minimum": v, "maximum": v}`` where the engine
spells integral numbers every way (xgrammar's integer rules, ``engines/xgrammar/integers.py``). A
non-integral number stays its shortest text (``1.5``: narrower, ``1.50`` is the same value). Only small
``enum`` s are rewritten (:data:`MAX_VALUES`); a longer one keeps its values' texts (narrower, sound).
"""
from __future__ import annotations

import itertools

from neuron_constrain.structured.schema.rewrite import FAMILIES, GENERIC, VOCABULARY, declared_types

TYPES = ("null", "boolean", "object", "array", "number", "string")  # every instance type ("integer" is a number)
_FAMILY_OF = {"string": "string", "number": "number", "integer": "number", "array": "array", "object": "object"}
MAX_VALUES = 64  # enum values written as schemas at most (past it, the values' texts as listed)
MAX_ORDERED = 3  # an object value of at most this many properties takes them in any order (3! branches)
MAX_SAFE = 2 ** 53  # integral values beyond it are left as written (a float's spelling of them is not exact)


def integral(value) -> bool:
    """Whether ``value`` (a parsed JSON value) is a number whose value is an integer (``bool`` is not)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return True
    return isinstance(value, float) and value.is_integer()


def _split(node: dict) -> list[dict] | None:
    """The branches of ``node`` by instance type, or None where the node is not split (nothing to split,
    or a keyword beside that applies to any instance)."""
    typed = declared_types(node)
    if "type" in node and typed is None:
        return None
    if set(node) & (GENERIC - {"type"}):
        return None  # an applicator, enum or const: its meaning spans types, left as it is
    families = {family for family, words in FAMILIES.items() if words & set(node)}
    if not families:
        return None
    kinds = list(typed) if typed is not None else list(TYPES)
    if typed is not None and all(_FAMILY_OF.get(k) not in families for k in kinds):
        return None  # no keyword applies to a declared type: plain `type`, the engines' own
    if typed is not None and len(kinds) == 1:
        return None  # one type: the keywords of others are dropped by the caller
    branches, rest = [], []
    for kind in kinds:
        family = _FAMILY_OF.get(kind)
        if family in families:
            words = FAMILIES[family]
            branches.append({"type": kind, **{k: v for k, v in node.items() if k in words}})
        else:
            rest.append(kind)
    if rest:
        branches.append({"type": rest[0] if len(rest) == 1 else rest})
    return branches


def split_types(schema: dict, walk) -> None:
    """Every untyped or multi-typed node with keywords of some instance type split into one ``anyOf`` branch
    per type (the module docstring); in a typed node, keywords of types it does not declare are dropped.
    ``walk``: ``rewrite.walk``. A ``propertyNames`` schema judges names, which are strings: its nodes are typed
    ``string`` first (an engine writing a name from it would write ``{null: 1}`` from a non-string branch)."""
    for _, node in list(walk(schema)):
        if isinstance(node.get("propertyNames"), dict):
            _names_are_strings(node["propertyNames"], walk)
    for _, node in list(walk(schema)):
        typed = declared_types(node)
        if typed is not None and len(typed) == 1:
            family = _FAMILY_OF.get(next(iter(typed)))
            for other, words in FAMILIES.items():
                if other != family and not set(node) & (GENERIC - {"type"}):
                    for key in words & set(node):
                        del node[key]
            continue
        branches = _split(node)
        if branches is None:
            continue
        for key in [k for k in node if k in VOCABULARY]:
            del node[key]
        node["anyOf"] = branches


def _names_are_strings(names: dict, walk) -> None:
    """Each node of a ``propertyNames`` schema that is untyped, or typed ``string`` among others, typed ``string``
    alone: the same names valid (a name is a string), and no branch of another type left to split. A ``$ref`` there
    gets the type beside it too (its target may be shared with values of any type): an engine that drops a
    sibling of ``$ref`` refuses it by the policy rather than write a name from a non-string branch."""
    for _, node in list(walk(names)):
        typed = declared_types(node)
        if typed is None and "type" not in node or typed is not None and "string" in typed:
            node["type"] = "string"


def _as_schema(value, integral_numbers: bool):
    """A schema whose valid instances are the values equal to ``value``."""
    if isinstance(value, dict):
        properties = {k: _as_schema(v, integral_numbers) for k, v in value.items()}
        orders = list(itertools.permutations(properties)) if len(properties) <= MAX_ORDERED else [tuple(properties)]
        branches = [{"type": "object", "properties": {k: properties[k] for k in order}, "required": list(order),
                     "additionalProperties": False} for order in orders]
        return branches[0] if len(branches) == 1 else {"anyOf": branches}
    if isinstance(value, list):
        return {"type": "array", "prefixItems": [_as_schema(v, integral_numbers) for v in value], "items": False,
                "minItems": len(value)}
    if integral_numbers and integral(value) and abs(value) <= MAX_SAFE:
        return {"type": "integer", "minimum": int(value), "maximum": int(value)}
    return {"const": value}


def _needs_schema(value, integral_numbers: bool) -> bool:
    return isinstance(value, (dict, list)) or (integral_numbers and integral(value) and abs(value) <= MAX_SAFE)


def values_as_schemas(schema: dict, walk, *, integral_numbers: bool) -> None:
    """``enum`` / ``const`` alone in their node, holding an array, an object or (``integral_numbers``: the
    engine spells integers every way) an integral number, written as schemas (the module docstring)."""
    for _, node in list(walk(schema)):
        for key in ("enum", "const"):
            if key not in node or (set(node) & VOCABULARY) - {key}:
                continue
            values = node[key] if key == "enum" else [node[key]]
            if not isinstance(values, list) or not values or len(values) > MAX_VALUES:
                continue
            if not any(_needs_schema(v, integral_numbers) for v in values):
                continue
            del node[key]
            branches = [_as_schema(v, integral_numbers) for v in values]
            if len(branches) == 1:
                node.update(branches[0])
            else:
                node["anyOf"] = branches
