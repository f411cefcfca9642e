"""``patternProperties`` written for an engine that reads each pattern as a key region and an additional key as
any string (xgrammar): every name's region explicit, so the engine's reading is JSON Schema's.

    {properties: {d: D}, patternProperties: {p: P}, additionalProperties: A, required: [r]}
        -> {properties: {d: D ∧ P if p finds d, r: P if p finds r, else A},
            patternProperties: {<p, not d or r>: P, <no pattern, not d or r>: A},
            additionalProperties: false}

xgrammar 0.2.8 writes a ``patternProperties`` key as ``"\\"" Regex(p) "\\""`` with its schema, but an
additional key as any string (so a name a pattern or a declared property owns could be written again
with the additional schema), a declared name with its ``properties`` schema alone (a pattern that finds it
applies too), and no name only a pattern covers as required. Here each declared name (a ``required`` one
undeclared joins them) gets the meet of every schema that applies to it (the referee's reading of the
patterns); each pattern leaves the declared names out; the names no pattern finds in either dialect
(``regular.complement_pattern``, read wide) become one more region with ``additionalProperties``'s schema,
and the object is closed. The same objects are valid; a name one dialect finds and the other does not is
in no region (never written: narrower, never wider; so, in a schema with a negation, only patterns both
dialects read alike are rewritten). Past a cap of the automata, or beside
``unevaluatedProperties`` / ``propertyNames``, the node is left as it is (the engine's policy refuses it by
name).
"""
from __future__ import annotations

import functools
import re

from neuron_constrain.structured.schema import rewrite
from neuron_constrain.structured.schema.algebra import pattern_names, regular
from neuron_constrain.structured.schema.algebra.caps import Over
from neuron_constrain.structured.schema.algebra.logic import meet
from neuron_constrain.structured.constraints import ConstraintError


def explicit_regions(schema: dict, *, where_dialects_differ: bool = False) -> None:
    """Every object node of ``schema`` with ``patternProperties`` rewritten in place (the module docstring).
    In a schema holding `not`/`if`/`oneOf` (a ``$ref`` may bring a node under one), only nodes whose patterns
    read alike in both dialects (exact, not narrower). ``where_dialects_differ`` (llguidance, which reads each
    pattern as the engines do and gives every other name ``additionalProperties``): only open objects with a
    pattern the dialects read differently (``^[a-z]+$`` finds ``"ab\n"`` in Python's, the referee's: an
    additional key there, but the pattern's schema for the referee)."""
    nodes = list(rewrite.walk(schema))
    negating = any(rewrite.NEGATING & set(node) for _, node in nodes)
    for _, node in nodes:
        table = node.get("patternProperties")
        if not isinstance(table, dict) or not table or {"unevaluatedProperties", "propertyNames"} & set(node):
            continue
        alike = all(isinstance(s, str) and pattern_names.reads_alike(s) for s in table)
        if negating and not alike:
            continue  # narrower (a name one dialect finds is in no region), which a negation could widen
        if where_dialects_differ and (alike or node.get("additionalProperties") is False):
            continue  # llguidance: each name the same in both dialects, or closed (such a name refused either way)
        try:
            written = (where_dialects_differ and node.get("additionalProperties", True) in (True, {})
                       and _read_wide(table)) or _regions(node, table)
        except (Over, ConstraintError, re.error):  # a cap; a pattern one reader refuses (the policy names it)
            continue
        if written is not None:
            node.update(written)


def _regions(node: dict, table: dict) -> dict | None:
    properties = node.get("properties", {})
    required = node.get("required", [])
    extra = node.get("additionalProperties", {})
    if not isinstance(properties, dict) or not isinstance(required, list) or not all(isinstance(p, str) for p in table):
        return None
    declared = dict(properties)
    for name in required:
        if isinstance(name, str) and name not in declared:
            found = [sub for source, sub in table.items() if regular.referee_match(source, name)]
            declared[name] = functools.reduce(meet, found) if found else extra
    for name in declared:
        if name in properties:
            for source, sub in table.items():
                if regular.referee_match(source, name):
                    declared[name] = meet(declared[name], sub)
    # the declared names exactly, in both dialects (a final `$` would also find "d\n" in Python's, `\s` differs)
    names = f"^(?:{'|'.join(_escaped(n) for n in declared)})(?!{regular.ANY_CHARACTER})" if declared else None
    unnamed = regular.complement_pattern(names) if names else None
    if names and unnamed is None:
        return None
    regions = {}
    for source, sub in table.items():
        region = source if unnamed is None else regular.intersect_patterns((source, unnamed))  # read as engines do
        if region is None:
            return None
        if region is not False and sub is not False:  # a name of a `false` region is in none: never written
            regions[region] = sub
    if extra is not False:
        rest = regular.complement_pattern("|".join([f"(?:{s})" for s in table] + ([names] if names else [])))
        if rest is None:
            return None
        if rest is not False:
            regions[rest] = extra
    kept = {name: sub for name, sub in declared.items() if sub is not False or name in required}  # (as regions)
    return {"properties": kept, "patternProperties": regions, "additionalProperties": False} if kept else \
        {"patternProperties": regions, "additionalProperties": False}


def _read_wide(table: dict) -> dict | None:
    """Each pattern of an object whose additional names take any value, written as every name either dialect finds
    (``regular.intersect_patterns``, wide; a text both read alike): such a name takes the pattern's schema, as the
    referee asks where it finds it, and any value is the additional schema's where it does not (narrower there,
    never wider). No complement is written: llguidance proves the patterns disjoint itself, within a budget the
    complement of a bounded repetition exhausts. None where two overlap, or a pattern has a feature no automaton
    reads (the regions are written then)."""
    wide = {}
    for source, sub in table.items():
        region = regular.intersect_patterns((source,), wide=True)
        if region is None:
            return None
        if region is not False:  # a pattern finding no name applies to none
            wide[region] = sub
    return None if pattern_names.overlap(tuple(wide)) else {"patternProperties": wide}


def _escaped(name: str) -> str:
    """``name`` as an ECMA-262 pattern matching it literally (the syntax characters escaped)."""
    return re.sub(r"([\\^$.*+?()\[\]{}|/-])", r"\\\1", name)
