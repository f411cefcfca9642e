"""What each grammar engine enforces of JSON Schema (an allowlist per engine), and the policy.

    check(schema, "xgrammar")                  # ConstraintError naming keyword, JSON pointer, an engine that enforces it
    check(schema, "xgrammar", "allow")         # -> (Unenforced("oneOf", "#/properties/x/oneOf", ...), ...)
    prepare(schema, "xgrammar")                # the schema the engine compiles (rewrites that keep the meaning)
    post_validate(schema, text)                # None, or the violation (the schema's declared draft, formats on)

Never silently wrong by construction: each engine declares the keywords it enforces and where (:class:`Allowlist`,
kept beside the engine: ``engines/xgrammar/engine.py``, ``engines/llguidance/engine.py``). A schema compiles on an
engine only if every keyword of the JSON Schema vocabulary (``rewrite.VOCABULARY``), at every location, is on that
engine's list with its condition met; anything else is refused by default, naming the keyword, its JSON pointer
and an engine that enforces it there, and ``auto`` sends the schema to that engine.
Keywords outside the vocabulary (``title``, ``description``, ``$defs``, ``x-...``) assert nothing and are never
refused. Before the check, :func:`prepare` applies the rewrites that keep a schema's meaning (``rewrite.normalize``)
and the engine's own (``Allowlist.rewrites``). ``json_schema(..., unenforced="allow")`` opts in: the request
compiles, its result lists the unenforced keywords, and the final output is validated here.

The lists are measured, not assumed: ``tests/structured/test_soundness.py`` draws schemas from the whole vocabulary
and instances around them, and fails if an engine accepts an instance ``jsonschema`` calls invalid of a schema it
compiled; :func:`guarantee_table` writes the table of docs/guides/engines.md.
"""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Callable, Iterator

from neuron_constrain.structured.schema import algebra, formats, pattern_members, patterns, values
from neuron_constrain.structured.schema import rewrite as rewrite
from neuron_constrain.structured.constraints import ConstraintError

POLICIES = ("refuse", "allow")


@dataclasses.dataclass(frozen=True)
class Unenforced:
    """A keyword the engine does not enforce where it is in the schema."""

    keyword: str
    path: str  # JSON pointer into the schema, "#/properties/name/minLength"
    engine: str
    enforced_by: tuple[str, ...]  # engines that do enforce it there (may be empty)
    why: str = ""  # the condition that failed, in words ("" : the engine does not enforce it anywhere)

    def describe(self) -> str:
        return f"{self.keyword} at {self.path}"


Unless = Callable[[dict, dict], "str | None"]  # (node, root) -> why the keyword is not enforced here, or None


@dataclasses.dataclass(frozen=True)
class Enforced:
    """A keyword an engine enforces; ``unless(node, root)`` says where it does not (None: enforced)."""

    keyword: str
    where: str = "everywhere"  # in words, for the engines guide's table
    unless: Unless | None = None
    engine_decides: bool = False  # the engine refuses what it cannot enforce at compile time (not named for others)


@dataclasses.dataclass(frozen=True)
class Allowlist:
    """What one engine enforces: keywords with their conditions, the formats it has grammars for,
    the regex features beyond the plain core it enforces with the referee's meaning
    (``patterns.REFUSED`` names them; every engine gets the rewrites of ``patterns.REWRITES``),
    how a JSON-schema pattern is handed to it, and the engine's own rewrites (``prepare``)."""

    engine: str
    entries: tuple[Enforced, ...]
    formats: frozenset
    rewrites: tuple[str, ...] = ()  # "distribute", "narrow" (rewrite.py); "split_types", "values", "integral" (values.py);
    # "pattern_members", "pattern_dialects" (pattern_members.py)
    evidence: str = ""
    regex: frozenset = frozenset()  # names of patterns.REFUSED this engine enforces exactly
    pattern_form: str = ""  # in words, for the engines guide's regex table

    def entry(self, keyword: str) -> Enforced | None:
        return next((e for e in self.entries if e.keyword == keyword), None)

    def why_not(self, keyword: str, node: dict, root: dict) -> str | None:
        """None if this engine enforces ``keyword`` in ``node``; else why not, in words."""
        entry = self.entry(keyword)
        if entry is None:
            return f"{self.engine} does not enforce `{keyword}`"
        return entry.unless(node, root) if entry.unless is not None else None


def walk(schema, path: str = "#") -> Iterator[tuple[str, dict]]:
    """Every schema object in ``schema`` with its JSON pointer (``#`` is the root)."""
    return rewrite.walk(schema, path)


# --------------------------------------------------------------------------- conditions the lists share
def typed(family: str, engine: str) -> Unless:
    """The node declares a type of ``family`` (an untyped node is compiled as any value by some engines)."""
    kinds = rewrite.FAMILY_TYPES[family]

    def unless(node, root):  # a declared type outside the family: the keyword applies to nothing, nothing to enforce
        if rewrite.declared_types(node) is None:
            return f"the schema here has no `type` {' or '.join(map(repr, kinds))}: {engine} compiles it as any value"
        return None
    return unless


def both(*conditions: Unless) -> Unless:
    def unless(node, root):
        for condition in conditions:
            why = condition(node, root)
            if why:
                return why
        return None
    return unless


def local_ref(node, root) -> str | None:
    """``$ref`` is a pointer into this document (``#`` or ``#/...``) that resolves."""
    ref = node.get("$ref")
    if not isinstance(ref, str):
        return "a `$ref` that is not a string"
    if ref != "#" and not ref.startswith("#/"):
        return f"`$ref` {ref!r} points outside this document (remote references are never fetched)"
    if rewrite._node_at(root, ref) is None:
        return f"`$ref` {ref!r} does not resolve in this document"
    return None


def schema_items(node, root) -> str | None:
    """``items`` is one schema (2020-12), not draft-2019's list of tuple positions."""
    return None if isinstance(node.get("items"), (dict, bool)) else "`items` as a list (draft-2019 tuples)"


def count(keyword: str) -> Unless:
    def unless(node, root):
        value = node.get(keyword)
        return None if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else (
            f"`{keyword}` {value!r} is not a non-negative integer")
    return unless


def distinct_keys(node, root) -> str | None:
    """The engines count keys as written: an additional key may repeat (``{"b": 1, "b": 2}``), which a JSON
    reader takes as one property. ``minProperties`` above 1 only where every key is a declared property
    (each written once)."""
    value = node.get("minProperties")
    if not isinstance(value, int) or value <= 1 or (node.get("additionalProperties") is False
                                                    and "patternProperties" not in node):
        return None
    return "at least 2 with additional properties, which the engine may write twice under one name"


def number(keyword: str) -> Unless:
    def unless(node, root):
        value = node.get(keyword)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return None if ok else f"`{keyword}` {value!r} is not a number (draft-04's boolean form is not taken)"
    return unless


def known_format(engine: str, known: frozenset) -> Unless:
    def unless(node, root):
        name = node.get("format")
        if not isinstance(name, str) or name not in STANDARD_FORMATS or name in known:
            return None  # a non-standard format is an annotation
        return f"{engine} has no grammar for the standard format {name!r} here"
    return unless


# JSON Schema 2020-12's formats (7.3). Any other name is an annotation only: the spec has
# validators ignore it, so no engine or validator can enforce it and we never refuse it.
STANDARD_FORMATS = frozenset({
    "date-time", "date", "time", "duration", "email", "idn-email", "hostname", "idn-hostname", "ipv4", "ipv6",
    "uri", "uri-reference", "iri", "iri-reference", "uuid", "uri-template", "json-pointer",
    "relative-json-pointer", "regex",
})


_ALLOWLISTS: dict[str, Allowlist] = {}


def register(lists: Allowlist) -> Allowlist:
    """Called by each engine module for its own list (importing ``neuron_constrain.structured`` loads them all)."""
    _ALLOWLISTS[lists.engine] = lists
    return lists


def allowlists() -> dict[str, Allowlist]:
    """Every engine's list, by engine name."""
    return dict(sorted(_ALLOWLISTS.items()))


def allowlist(engine) -> Allowlist:
    if isinstance(engine, Allowlist):
        return engine
    if engine not in _ALLOWLISTS:
        raise ValueError(f"no allowlist for engine {engine!r}; engines: {', '.join(_ALLOWLISTS)}")
    return _ALLOWLISTS[engine]


# --------------------------------------------------------------------------- the policy
def validator(root):
    """``jsonschema``'s validator of ``root`` under its declared draft, formats asserted (the referee)."""
    import jsonschema

    cls = jsonschema.validators.validator_for(root, default=jsonschema.Draft202012Validator)
    return cls(root, format_checker=cls.FORMAT_CHECKER)


def _format_names(lists: Allowlist) -> list[str]:
    """The formats ``lists``' engine enforces: each grammar of ``formats``, as a pattern the library writes (a
    narrower one, beside `not`/`if`/`oneOf`, is the engine's own grammar or refused), then the engine's own."""
    def written(name, found):
        kind = "a narrower pattern" if found.narrower else "a pattern"
        if found.exact:
            return f"{name} ({kind}, the referee's)"
        return f"{name} ({kind}; beside not/if/oneOf: {'its own' if name in lists.formats else 'refused'})"
    return [written(name, formats.FORMATS[name]) if name in formats.FORMATS else name
            for name in sorted(set(formats.FORMATS) | lists.formats)]


def prepare(schema, engine, narrowed: list | None = None):
    """The schema ``engine`` compiles: ``algebra.lower`` (meaning kept), then :func:`engine_rewrites`
    (``prepare.Prepared`` runs the two apart: the first once per constraint, the second once per engine)."""
    lowered = algebra.lower(schema)
    return engine_rewrites(lowered, engine, narrowed) if isinstance(lowered, dict) else lowered


def engine_rewrites(lowered, engine, narrowed: list | None = None):
    """A copy of ``lowered`` (``algebra.lower``-ed, never modified) with ``engine``'s own rewrites; ``narrowed`` (a
    list) receives the pointers of formats written as narrower patterns."""
    if not isinstance(lowered, dict):
        return lowered
    lists = allowlist(engine)
    prepared = json.loads(json.dumps(lowered))  # each engine's own: its rewrites and its compile edit nodes
    if "distribute" in lists.rewrites:
        rewrite.distribute(prepared)
    if "split_types" in lists.rewrites:  # exact: one branch per instance type, nothing narrowed
        values.split_types(prepared, rewrite.walk)
    if "pattern_members" in lists.rewrites:  # each name's region explicit, the object closed
        pattern_members.explicit_regions(prepared)
    elif "pattern_dialects" in lists.rewrites:  # so where a pattern reads differently in the referee's dialect
        pattern_members.explicit_regions(prepared, where_dialects_differ=True)
    if "min_properties" in lists.rewrites:  # exact: which optional name makes up the count
        rewrite.min_properties_as_required(prepared)
    if "narrow" in lists.rewrites:
        referee = validator(prepared)
        rewrite.narrow(prepared, lambda node, value: referee.evolve(schema=node).is_valid(value))
    if "values" in lists.rewrites:  # enum/const compared by value (whitespace, integral spellings)
        values.values_as_schemas(prepared, rewrite.walk, integral_numbers="integral" in lists.rewrites)
    formats.write_patterns(prepared, formats.lengths_beside_pattern(lists.why_not), narrowed)
    return prepared


def find(schema: dict, engine, tracker=None) -> list[Unenforced]:
    """Every keyword of ``schema`` (already :func:`prepare`-d) that ``engine`` would not enforce, in schema order;
    ``tracker``: the schema's ``item_plan.Plan``, which enforces them on the host unless it says why not."""
    lists = allowlist(engine)
    others = [other for other in allowlists().values() if other.engine != lists.engine]
    found, judged = [], _judged(schema, tracker)
    for path, node in walk(schema):
        if any(path == j or path.startswith(j + "/") for j in judged):
            continue  # a `contains` the tracker judges whole (jsonschema on each item)
        for keyword in node:
            if keyword not in rewrite.VOCABULARY:
                continue
            why = lists.why_not(keyword, node, schema)
            if why is not None and tracker is not None and keyword in tracker.KEYWORDS:
                if tracker.takes(node, keyword):
                    continue  # the host's tracker enforces it (item_plan.py)
                if tracker.untracked is not None:
                    why = f"{why}; the host's tracker neither: {tracker.untracked}"
            if why is None:
                continue
            enforced_by = tuple(o.engine for o in others if o.why_not(keyword, node, schema) is None
                                and not o.entry(keyword).engine_decides)
            found.append(Unenforced(keyword, f"{path}/{rewrite.escape(keyword)}", lists.engine, enforced_by, why))
    for path, keyword, node, source in pattern_sites(schema):
        if any(path.startswith(j + "/") for j in judged) or lists.why_not(keyword, node, schema) is not None:
            continue  # the keyword itself is not enforced there: found above
        feature = unenforced_feature(parse_pattern(source, path), lists)
        if feature is not None:
            enforced_by = tuple(o.engine for o in others if o.why_not(keyword, node, schema) is None
                                and unenforced_feature(parse_pattern(source, path), o) is None)
            why = (f"{feature.name} at offset {feature.offset} of the pattern {source!r}: "
                   f"{patterns.REFUSED[feature.name]}")
            found.append(Unenforced(keyword, path, lists.engine, enforced_by, why))
    return found


def _judged(schema: dict, tracker) -> list[str]:
    """The pointers of the ``contains`` (and existential ``not``) subschemas the tracker judges itself."""
    if tracker is None:
        return []
    return [f"{path}/{k}" for path, node in walk(schema) for k in ("contains", "not") if k in node
            and tracker.takes(node, None if k == "contains" else k)]


# --------------------------------------------------------------------------- patterns
def pattern_sites(schema) -> Iterator[tuple[str, str, dict, str]]:
    """Every pattern of ``schema``: ``(JSON pointer, keyword, node, pattern)`` for each ``pattern``
    and each ``patternProperties`` key (``propertyNames`` holds a schema: its ``pattern`` is found there)."""
    for path, node in walk(schema):
        if isinstance(node.get("pattern"), str):
            yield f"{path}/pattern", "pattern", node, node["pattern"]
        keyed = node.get("patternProperties")
        if isinstance(keyed, dict):
            for key in keyed:
                yield f"{path}/patternProperties/{rewrite.escape(key)}", "patternProperties", node, key


def parse_pattern(source: str, path: str) -> "patterns.Pattern":
    """``patterns.parse``, its syntax error naming the pattern's JSON pointer."""
    try:
        return patterns.parse(source)
    except ConstraintError as error:
        raise ConstraintError(f"{error} (at {path})") from None


def unenforced_feature(pattern, engine) -> "patterns.Feature | None":
    """The first refused regex feature of ``pattern`` the engine does not enforce, or None."""
    lists = allowlist(engine)
    return next((f for f in pattern.features if f.refused and f.name not in lists.regex), None)


def map_patterns(schema, rewrite_pattern: Callable[[str], "str | None"]):
    """A copy of ``schema`` with each pattern ``p`` written ``rewrite_pattern(p)`` (None: dropped, for a
    pattern the policy listed as unenforced). Two ``patternProperties`` keys written alike hold one
    language: their schemas are kept as one ``allOf``."""
    schema = json.loads(json.dumps(schema))
    for _, node in walk(schema):
        if isinstance(node.get("pattern"), str):
            written = rewrite_pattern(node["pattern"])
            if written is None:
                del node["pattern"]
            else:
                node["pattern"] = written
        keyed = node.get("patternProperties")
        if isinstance(keyed, dict):
            out: dict = {}
            for key, sub in keyed.items():
                written = rewrite_pattern(key)
                if written is None:
                    continue
                out[written] = {"allOf": [out[written], sub]} if written in out else sub
            node["patternProperties"] = out
    return schema


def refusal(item: Unenforced, more: int) -> ConstraintError:
    """The one-line refusal of ``item`` (and ``more`` others): the keyword, its pointer, the fix."""
    others = f" ({more} more unenforced keyword{'s' if more > 1 else ''})" if more else ""
    if item.enforced_by:
        fix = f"use engine='{item.enforced_by[0]}', which enforces it"
    else:
        fix = "no engine here enforces it: remove it from the schema"
    why = f" ({item.why})" if item.why and not item.why.endswith(f"enforce `{item.keyword}`") else ""
    error = ConstraintError(
        f"{item.engine} would not enforce `{item.keyword}` at {item.path}{why}{others}; {fix}, or pass "
        "json_schema(..., unenforced='allow') to accept it (the output is then validated and a violation reported)"
    )
    error.unenforced = item  # type: ignore[attr-defined]
    return error


def check(schema: dict, engine, policy: str = "refuse", tracker=None) -> tuple[Unenforced, ...]:
    """Apply the policy to a prepared schema: ``refuse`` raises on the first unenforced keyword;
    ``allow`` returns them all. ``tracker``: as :func:`find`."""
    return apply_policy(find(schema, engine, tracker), policy)


def apply_policy(found, policy: str) -> tuple[Unenforced, ...]:
    """The policy applied to the unenforced keywords ``found``: ``refuse`` raises for the first (naming it, its
    pointer and an engine that enforces it); ``allow`` returns them all."""
    if policy not in POLICIES:
        raise ConstraintError(f"unenforced={policy!r} is not a policy; pass one of {', '.join(POLICIES)}")
    if found and policy == "refuse":
        raise refusal(found[0], len(found) - 1)
    return tuple(found)


def without_unknown_formats(schema, engine: str):
    """``schema`` without the ``format`` keywords ``engine`` does not know (a copy; the original if none).

    Non-standard formats are annotations; standard ones the engine lacks are refused by
    :func:`check` before this is used."""
    known = allowlist(engine).formats
    if not any(isinstance(n.get("format"), str) and n["format"] not in known for _, n in walk(schema)):
        return schema
    schema = json.loads(json.dumps(schema))
    for _, node in walk(schema):
        if isinstance(node.get("format"), str) and node["format"] not in known:
            del node["format"]
    return schema


def guarantee_table() -> str:
    """The engines guide's table (docs/guides/engines.md): per keyword of the vocabulary, where each engine enforces it."""
    lists = allowlists()
    names = sorted(lists)
    rows = [f"| keyword | rewritten first, for every engine (the schema algebra) | {' | '.join(names)} |",
            "|---|---|" + "---|" * len(names)]
    for keyword in sorted(rewrite.VOCABULARY, key=lambda k: (k.lstrip("$").lower())):
        cells = [algebra.REWRITES.get(keyword, "")]
        for name in names:
            entry = lists[name].entry(keyword)
            cells.append("refused" if entry is None else entry.where)
        rows.append(f"| `{keyword}` | {' | '.join(cells)} |")
    rows.append(f"| `format` names | | {' | '.join(', '.join(_format_names(lists[n])) for n in names)} |")
    return "\n".join(rows)


def regex_table() -> str:
    """The engines guide's regex table: per feature of ``patterns``, what each engine gets."""
    lists = allowlists()
    names = sorted(lists)
    rows = [f"| regex feature | {' | '.join(names)} |", "|---|" + "---|" * len(names),
            f"| a JSON-schema pattern is handed over as | {' | '.join(lists[n].pattern_form for n in names)} |"]
    for feature, how in patterns.REWRITES.items():
        rows.append(f"| {feature} | {' | '.join('rewritten: ' + how for _ in names)} |")
    for feature, why in patterns.REFUSED.items():
        cells = ["enforced" if feature in lists[n].regex else "refused" for n in names]
        rows.append(f"| {feature} ({why}) | {' | '.join(cells)} |")
    return "\n".join(rows)


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
    others = [o for o in allowlists().values() if o.engine != engine]
    found = [Unenforced(k, f"{path}/{rewrite.escape(k)}", engine, tuple(o.engine for o in others if
                                                                         o.why_not(k, node, schema) is None))
             for path, node in walk(schema) for k in sorted(names) if k in node]
    return found or [Unenforced(k, "#", engine, ()) for k in sorted(names)], option


def refuse(found: list[Unenforced]) -> None:
    """Raise the policy's refusal for the first of ``found``."""
    raise refusal(found[0], len(found) - 1)


# --------------------------------------------------------------------------- after generation
def post_validate(schema: dict, text: str) -> str | None:
    """``None`` if ``text`` is JSON valid against ``schema`` under its declared draft (``$schema``;
    2020-12 when absent) with formats asserted; else the first violation, with its path."""
    import jsonschema

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
