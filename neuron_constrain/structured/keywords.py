"""Which JSON-schema keywords each grammar engine would not enforce, and the policy for them.

    check(schema, "xgrammar")                  # ConstraintError naming keyword, path, an engine that enforces it
    check(schema, "xgrammar", "allow")         # -> (Unenforced("oneOf", "#/properties/x/oneOf", ...), ...)
    post_validate(schema, text)                # None, or the violation (the schema's declared draft, formats on)

Policy: by default a schema holding a keyword its engine does not enforce is refused at
compile time, never answered as if it were. ``json_schema(..., unenforced="allow")`` opts
in: the request compiles, its result lists the unenforced keywords (:class:`Unenforced`),
and the final output is validated against the schema here; a violation is reported on
the result. ``UNENFORCED`` is measured, not guessed: each rule carries its evidence, the
MaskBench files (``../shared/data/maskbench-dev``; a sample vendored in
``tests/data/maskbench``) whose invalid instances the engine accepted to the end
(``benchmarks/bench_schemas.py --unenforced allow``), and a minimal probe schema that
``tests/test_keywords.py`` runs through the engine.
"""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Callable, Iterator

from neuron_constrain.structured.constraints import ConstraintError

POLICIES = ("refuse", "allow")


@dataclasses.dataclass(frozen=True)
class Unenforced:
    """A keyword the engine accepts but does not enforce, where it is in the schema."""

    keyword: str
    path: str  # JSON pointer into the schema, "#/properties/name/minLength"
    engine: str
    enforced_by: tuple[str, ...]  # engines that do enforce it (may be empty)

    def describe(self) -> str:
        return f"{self.keyword} at {self.path}"


@dataclasses.dataclass(frozen=True)
class Rule:
    keyword: str
    when: str  # the condition, in words
    applies: Callable[[dict], bool]  # on the schema object holding the keyword
    enforced_by: tuple[str, ...]
    evidence: str  # MaskBench files / counts and the probe


# --------------------------------------------------------------------------- schema walk
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONE = ("additionalProperties", "unevaluatedProperties", "propertyNames", "contains", "additionalItems",
               "unevaluatedItems", "not", "if", "then", "else", "contentSchema")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def walk(schema, path: str = "#") -> Iterator[tuple[str, dict]]:
    """Every schema object in ``schema`` with its JSON pointer (``#`` is the root)."""
    if not isinstance(schema, dict):
        return
    yield path, schema
    for key in _SCHEMA_MAPS:
        value = schema.get(key)
        if isinstance(value, dict):
            for name, sub in value.items():
                yield from walk(sub, f"{path}/{key}/{_escape(name)}")
    for key in _SCHEMA_ONE:
        yield from walk(schema.get(key), f"{path}/{key}")
    for key in _SCHEMA_LISTS:
        value = schema.get(key)
        if isinstance(value, list):
            for index, sub in enumerate(value):
                yield from walk(sub, f"{path}/{key}/{index}")
    items = schema.get("items")
    if isinstance(items, list):
        for index, sub in enumerate(items):
            yield from walk(sub, f"{path}/items/{index}")
    else:
        yield from walk(items, f"{path}/items")
    dependencies = schema.get("dependencies")
    if isinstance(dependencies, dict):
        for name, sub in dependencies.items():
            yield from walk(sub, f"{path}/dependencies/{_escape(name)}")


# --------------------------------------------------------------------------- the table
_ASSERTIONS = frozenset({
    "type", "enum", "const", "properties", "required", "additionalProperties", "patternProperties", "items",
    "prefixItems", "minItems", "maxItems", "minLength", "maxLength", "pattern", "minimum", "maximum",
    "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "format", "allOf", "anyOf", "oneOf", "not",
    "minProperties", "maxProperties", "uniqueItems", "contains", "propertyNames", "if", "dependencies",
    "dependentRequired", "dependentSchemas", "unevaluatedProperties", "unevaluatedItems", "additionalItems",
})


def _branch_key(branch):
    """What tells a oneOf branch apart: its single JSON type, or its literal values."""
    if not isinstance(branch, dict):
        return None
    if "const" in branch:
        return ("values", (json.dumps(branch["const"], sort_keys=True),))
    if isinstance(branch.get("enum"), list):
        return ("values", tuple(json.dumps(v, sort_keys=True) for v in branch["enum"]))
    kind = branch.get("type")
    if isinstance(kind, str):
        return ("type", ("number",) if kind == "integer" else (kind,))
    return None


def _discriminated(branches) -> bool:
    """Object branches told apart by one required property with distinct const values."""
    names = None
    for branch in branches:
        props = branch.get("properties") if isinstance(branch, dict) else None
        if not isinstance(props, dict):
            return False
        consts = {k for k, v in props.items() if isinstance(v, dict) and "const" in v and k in branch.get("required", ())}
        names = consts if names is None else names & consts
    for name in sorted(names or ()):
        values = [json.dumps(b["properties"][name]["const"], sort_keys=True) for b in branches]
        if len(set(values)) == len(values):
            return True
    return False


def _one_of_overlaps(node) -> bool:
    """xgrammar keeps oneOf exact only for provably disjoint branches (else anyOf, with a warning)."""
    branches = node.get("oneOf")
    if not isinstance(branches, list) or len(branches) < 2:
        return False
    keys = [_branch_key(b) for b in branches]
    if all(k is not None for k in keys) and len({k[0] for k in keys}) == 1:
        seen: set = set()
        for _, values in keys:
            if seen & set(values):
                return True
            seen |= set(values)
        return False
    return not _discriminated(branches)


def _type_beside_combinator(node) -> bool:
    """A sibling ``type`` next to anyOf/oneOf whose branches do not all restate a type."""
    branches = [*(node.get("anyOf") or []), *(node.get("oneOf") or [])]
    return bool(branches) and any(
        not isinstance(b, dict) or not ({"type", "$ref", "const", "enum"} & set(b)) for b in branches
    )


def _required_not_in_properties(node) -> bool:
    required = node.get("required")
    return isinstance(required, list) and any(name not in (node.get("properties") or {}) for name in required)


def _format_unknown(engine: str):
    def applies(node) -> bool:
        name = node.get("format")
        return isinstance(name, str) and name in STANDARD_FORMATS and name not in ENGINE_FORMATS[engine]
    return applies


def _always(node) -> bool:
    return True


_LLG = ("llguidance",)
_PROBE = "probe PROBES[{!r}] (tests/test_keywords.py): its invalid instance accepted by {}"
_XGR = "xgrammar 0.2.8"

# engine -> keywords it accepts but does not enforce, with the condition and the evidence:
# MaskBench dev files whose invalid instances the engine accepted (bench_schemas.py
# --unenforced allow, Tekken 131k), the engine's own compile warnings, and a probe that
# tests/test_keywords.py runs on every test run (so the table cannot go stale silently).
UNENFORCED: dict[str, tuple[Rule, ...]] = {
    "xgrammar": (
        Rule("patternProperties", "always: extra keys are not checked against the patterns (and some valid "
             "keys are refused)", _always, _LLG,
             "MaskBench dev: 4 invalid instances accepted in 3 files (Handwritten---test.NoType.json 2, "
             "WashingtonPost---wp_91_Normalized.json 1, WashingtonPost---wp_93_Normalized.json 1); "
             + _PROBE.format("patternProperties", _XGR)),
        Rule("oneOf", "branches not provably disjoint (distinct types or literals, or a const discriminator): "
             "compiled as anyOf", _one_of_overlaps, (),
             "xgrammar warns 'falling back to anyOf semantics' (MaskBench dev, e.g. "
             "Synthesized---draft4_valid_oneOf_id20_subschema1_not_2.json); " + _PROBE.format("oneOf", _XGR)),
        Rule("allOf", "two or more branches: their constraints are not intersected",
             lambda n: isinstance(n.get("allOf"), list) and len(n["allOf"]) > 1, _LLG, _PROBE.format("allOf", _XGR)),
        Rule("type", "beside anyOf/oneOf whose branches do not restate a type: the sibling type is dropped",
             _type_beside_combinator, _LLG, "issue 15 (a root that came out a string); " + _PROBE.format("type", _XGR)),
        Rule("required", "names a key absent from properties", _required_not_in_properties, _LLG,
             "issue 15; " + _PROBE.format("required", _XGR)),
        Rule("minLength", "beside pattern: ignored (xgrammar warns)", lambda n: "pattern" in n, _LLG,
             "issue 15 ('Deb' for minLength 12); " + _PROBE.format("minLength", _XGR)),
        Rule("maxLength", "beside pattern: ignored (xgrammar warns)", lambda n: "pattern" in n, _LLG,
             _PROBE.format("maxLength", _XGR)),
        Rule("$ref", "with sibling assertions: the siblings are dropped", lambda n: bool(_ASSERTIONS & set(n)), _LLG,
             _PROBE.format("$ref", _XGR)),
        Rule("format", "a standard format xgrammar has no grammar for (idn-email, idn-hostname, iri, "
             "iri-reference, regex)", _format_unknown("xgrammar"), (), _PROBE.format("format", _XGR)),
        *(Rule(keyword, "always: ignored", _always, (), _PROBE.format(keyword, _XGR)) for keyword in (
            "not", "if", "dependencies", "dependentRequired", "dependentSchemas", "uniqueItems", "contains",
            "unevaluatedProperties")),
    ),
    "llguidance": (
        # llguidance refuses what it does not implement itself ("Unimplemented keys", overlapping
        # oneOf: see reported()); what it would drop quietly is a format it has no grammar for.
        Rule("format", "a standard format llguidance has no grammar for (idn-email, idn-hostname, iri, "
             "iri-reference, uri-reference, uri-template, json-pointer, relative-json-pointer, regex)",
             _format_unknown("llguidance"), ("xgrammar",),  # per format: see find()
             "llguidance 1.9.1 fails with 'Unknown format'; " + _PROBE.format("format", "llguidance once dropped")),
    ),
}


# Keywords an engine refuses itself (llguidance's "Unimplemented keys"), and the engines that enforce them.
ENFORCED_BY: dict[str, dict[str, tuple[str, ...]]] = {"llguidance": {"propertyNames": ("xgrammar",)}, "xgrammar": {}}

# JSON Schema 2020-12's formats (7.3). Any other name is an annotation only: the spec has
# validators ignore it, so no engine or validator can enforce it and we never refuse it.
STANDARD_FORMATS = frozenset({
    "date-time", "date", "time", "duration", "email", "idn-email", "hostname", "idn-hostname", "ipv4", "ipv6",
    "uri", "uri-reference", "iri", "iri-reference", "uuid", "uri-template", "json-pointer",
    "relative-json-pointer", "regex",
})
# The formats each engine builds a grammar for (measured 2026-12-01: a string invalid for each standard
# format through each engine; tests/test_keywords.py re-checks "regex" on both, refused by default).
ENGINE_FORMATS = {
    "llguidance": frozenset({"date-time", "date", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uri",
                             "uuid"}),
    "xgrammar": frozenset({"date-time", "date", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uri",
                           "uri-reference", "uri-template", "json-pointer", "relative-json-pointer", "uuid"}),
}


def without_unknown_formats(schema, engine: str):
    """``schema`` without the ``format`` keywords ``engine`` does not know (a copy; the original if none).

    Non-standard formats are annotations; standard ones the engine lacks are listed by
    :func:`check` (refused by default) before this is used."""
    known = ENGINE_FORMATS[engine]
    if not any(isinstance(n.get("format"), str) and n["format"] not in known for _, n in walk(schema)):
        return schema
    schema = json.loads(json.dumps(schema))
    for _, node in walk(schema):
        if isinstance(node.get("format"), str) and node["format"] not in known:
            del node["format"]
    return schema


def find(schema: dict, engine: str) -> list[Unenforced]:
    """Every keyword of ``schema`` that ``engine`` would not enforce (table rules), in schema order."""
    rules = UNENFORCED.get(engine)
    if rules is None:
        raise ValueError(f"no keyword table for engine {engine!r}; engines: {', '.join(UNENFORCED)}")
    found = []
    for path, node in walk(schema):
        for rule in rules:
            if rule.keyword in node and rule.applies(node):
                enforced_by = rule.enforced_by
                if rule.keyword == "format":  # per format: the engines with a grammar for it
                    enforced_by = tuple(e for e, known in ENGINE_FORMATS.items() if node["format"] in known)
                found.append(Unenforced(rule.keyword, f"{path}/{_escape(rule.keyword)}", engine, enforced_by))
    return found


def _refusal(item: Unenforced, more: int) -> ConstraintError:
    others = f" ({more} more unenforced keyword{'s' if more > 1 else ''})" if more else ""
    if item.enforced_by:
        fix = f"use engine='{item.enforced_by[0]}', which enforces it"
    else:
        fix = "no engine here enforces it: remove it from the schema"
    error = ConstraintError(
        f"{item.engine} would not enforce `{item.keyword}` at {item.path}{others}; {fix}, or pass "
        "json_schema(..., unenforced='allow') to accept it (the output is then validated and a violation reported)"
    )
    error.unenforced = item  # type: ignore[attr-defined]
    return error


def check(schema: dict, engine: str, policy: str = "refuse") -> tuple[Unenforced, ...]:
    """Apply the policy: ``refuse`` raises on the first unenforced keyword; ``allow`` returns them all."""
    if policy not in POLICIES:
        raise ConstraintError(f"unenforced={policy!r} is not a policy; pass one of {', '.join(POLICIES)}")
    found = find(schema, engine)
    if found and policy == "refuse":
        raise _refusal(found[0], len(found) - 1)
    return tuple(found)


_REPORTED = re.compile(r'Unimplemented keys: \[(.*?)\]')
_ONE_OF = "oneOf constraints are not supported"


def reported(schema: dict, engine: str, message: str) -> tuple[list[Unenforced], str]:
    """What an engine's own compile error says it does not implement, located in ``schema``, and
    the llguidance option that compiles the schema without it: ``Unimplemented keys: [...]``
    (``lenient``), a oneOf whose branches may overlap (``coerce_one_of``: as anyOf)."""
    match = _REPORTED.search(message)
    if match:
        names, option = set(json.loads("[" + match.group(1) + "]")), "lenient"
    elif _ONE_OF in message:
        names, option = {"oneOf"}, "coerce_one_of"
    else:
        return [], ""
    found = [Unenforced(k, f"{path}/{_escape(k)}", engine, ENFORCED_BY.get(engine, {}).get(k, ()))
             for path, node in walk(schema) for k in sorted(names) if k in node]
    return found or [Unenforced(k, "#", engine, ()) for k in sorted(names)], option


def refuse(found: list[Unenforced]) -> None:
    """Raise the policy's refusal for the first of ``found``."""
    raise _refusal(found[0], len(found) - 1)


# --------------------------------------------------------------------------- after generation
def post_validate(schema: dict, text: str) -> str | None:
    """``None`` if ``text`` is JSON valid against ``schema`` under its declared draft (``$schema``;
    2020-12 when absent) with formats asserted; else the first violation, with its path."""
    import jsonschema  # the `test` extra

    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        return f"not JSON: {error}"
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    validator = cls(schema, format_checker=cls.FORMAT_CHECKER)
    try:
        errors = sorted(validator.iter_errors(value), key=lambda e: (list(e.absolute_path), e.message))
    except jsonschema.exceptions.SchemaError as error:
        return f"the schema is invalid under {cls.__name__}: {error.message}"
    except Exception as error:  # an unresolvable $ref, a bad regex in the schema
        return f"the schema could not be applied ({type(error).__name__}: {error})"
    if not errors:
        return None
    first = errors[0]
    where = "/" + "/".join(str(p) for p in first.absolute_path)
    return f"schema violation at {where}: {first.message[:200]} (keyword {first.validator})"
