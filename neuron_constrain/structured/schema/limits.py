"""``Limits``: what one request may cost the host, checked before any engine reads its constraint.

    limits = Limits(enum_values=10_000)            # the defaults, one raised
    check(constraint, limits)                      # LimitError: the limit, its value, where
    check_text("json", text, limits)               # the size and nesting of a constraint still as text
    check_document(schema_dict, limits)            # the nesting and node count of a parsed one
    Limits.parse("enum_values=10000,depth=32")     # the server's form (``--limit``, NEURON_CONSTRAIN_LIMITS)

Structural limits bound what a constraint may hold (:data:`DESCRIPTIONS`); they are what
makes a grammar engine's work grow (xgrammar 0.2.8 on a 32,000-token vocabulary: a
30,000-value ``enum`` 26 s, 500 ``anyOf`` branches 15 s and 2.6 GB, 2,000 required properties
over a minute). The checks here cost a pass over the constraint: iterative (no recursion,
however deep the input), nesting first, so nothing recursive reads a constraint that
nests deeper than :attr:`Limits.depth` (at most :data:`DEPTH_CEILING`). Work limits bound
one request's compile (``compile_seconds`` from its start, ``compile_memory_mb``: the
runtime compiles xgrammar grammars in a worker process it can kill,
``engines/xgrammar/worker.py``) and each of its mask fills (``fill_ms``). A regex is bounded by what
it would cost written out (:func:`pattern_cost`: its size with each ``{n,m}`` expanded, and the
nesting and bounds of repetitions of varying parts, where xgrammar's fill grows with the text),
computed from the parsed pattern without expanding it. A refusal is a
:class:`LimitError` naming the limit, the value found and where, one request's alone. A schema
pattern with lookarounds, ``\\b`` or anchors inside is built here too (``algebra.lookaround.language``,
bounded by the algebra's caps, ``automaton_work`` among them: the steps of its automaton counted as
they are taken), so that a pattern past a cap is refused with its JSON pointer (``algebra.CapReached``)
before any engine reads the schema; the engines reuse what was built.
"""
from __future__ import annotations

import dataclasses
import json
import math

from neuron_constrain.structured.schema import patterns, rewrite as rewrite
from neuron_constrain.structured.schema.algebra import caps, lengths, lookaround
from neuron_constrain.structured.schema.algebra.automata import fold
from neuron_constrain.structured.constraints import Constraint, ConstraintError

# Python's own JSON reader and writer, copy.deepcopy and jsonschema recurse once or twice per level:
# a depth limit above this could reach Python's recursion limit (1000 frames) in code the library calls.
DEPTH_CEILING = 256

DESCRIPTIONS = {
    "spec_bytes": "bytes of a constraint's text (the JSON schema, regex, grammar or choices)",
    "depth": "nesting of objects and arrays in a JSON schema",
    "nodes": "objects and arrays in a JSON schema",
    "enum_values": "values of one `enum`, or options of a choice",
    "properties": "property names of one object (`properties` and `required`)",
    "branches": "branches of one `anyOf` / `oneOf` / `allOf`",
    "repeat": "a repetition bound: minLength/maxLength, minItems/maxItems, min/maxProperties, "
              "min/maxContains, a regex's {n,m} (nested bounds multiplied)",
    "pattern_chars": "characters of one regex (a regex constraint, `pattern`, a `patternProperties` name)",
    "pattern_size": "characters of one regex with its counted repetitions written out (each {n,m} copies what it "
                    "repeats m times; a class counts its ranges)",
    "repeat_nesting": "repetitions of one regex nested in one another, each repeating a part that varies "
                      "(`(([a-z]{1,5}){1,5}){1,5}`: 3)",
    "varying_repeat": "the bound m of a regex's {n,m} repeating a part that varies (a repetition or an alternation "
                      "inside: `([a-z]{1,3}){1,30}`: 30)",
    "number_digits": "digits of a number bound (minimum, maximum, exclusive bounds, multipleOf)",
    "ref_chain": "`$ref`s followed from one `$ref` before a schema that is not one",
    "answer_chars": "characters of the shortest value a JSON schema admits (no valid answer is shorter)",
    "compile_seconds": "seconds one compilation may take, from its start",
    "compile_memory_mb": "MiB one compilation may allocate (xgrammar's worker process)",
    "fill_ms": "milliseconds one request's mask fill may take for one token",
}


class LimitError(ConstraintError):
    """A constraint (or its compile, or a fill) past one of the :class:`Limits`: ``limit`` (its name),
    ``value`` (what was found), ``maximum`` and ``where`` (a JSON pointer, or ``""``)."""

    def __init__(self, limit: str, value, maximum, where: str = "", detail: str = ""):
        self.limit, self.value, self.maximum, self.where = limit, value, maximum, where
        at = f" at {where}" if where else ""
        super().__init__(
            f"{detail or DESCRIPTIONS[limit]}{at}: {value}, over the limit {limit}={maximum:g}; send a smaller "
            f"constraint, or raise the limit (Limits({limit}=...))")


@dataclasses.dataclass(frozen=True)
class Limits:
    """The most one request may ask: see :data:`DESCRIPTIONS`; the defaults let real schemas through
    (tool definitions, MaskBench's) and refuse what takes an engine seconds."""

    spec_bytes: int = 131_072
    depth: int = 64
    nodes: int = 4_096
    enum_values: int = 4_096
    properties: int = 1_024
    branches: int = 256
    repeat: int = 65_536
    pattern_chars: int = 4_096
    pattern_size: int = 65_536
    repeat_nesting: int = 2
    varying_repeat: int = 16
    number_digits: int = 24
    ref_chain: int = 32
    answer_chars: int = 131_072
    compile_seconds: float = 60.0
    compile_memory_mb: int = 2_048
    fill_ms: float = 50.0

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            number = (int, float) if field.type == "float" else (int,)
            if isinstance(value, bool) or not isinstance(value, number) or not value > 0:
                raise ValueError(f"Limits({field.name}={value!r}): pass a positive {field.type}")
        if self.depth > DEPTH_CEILING:
            raise ValueError(f"Limits(depth={self.depth}): at most {DEPTH_CEILING} (Python's JSON reader, deepcopy "
                             "and jsonschema recurse per level; deeper could exhaust Python's stack)")

    @classmethod
    def parse(cls, text: str, base: "Limits | None" = None) -> "Limits":
        """``"name=value,name=value"`` (spaces or commas between), over ``base`` (the defaults)."""
        fields = {f.name: f.type for f in dataclasses.fields(cls)}
        values = {}
        for item in text.replace(",", " ").split():
            name, _, value = item.partition("=")
            if name not in fields or not value:
                raise ValueError(f"limit {item!r}: write name=value, name one of {', '.join(fields)}")
            try:
                values[name] = float(value) if fields[name] == "float" else int(value)
            except ValueError:
                raise ValueError(f"limit {item!r}: {value!r} is not a{' number' if fields[name] == 'float' else 'n integer'}") \
                    from None
        return dataclasses.replace(base or cls(), **values)


DEFAULT = Limits()


# --------------------------------------------------------------------------- checks
def check_text(kind: str, text, limits: Limits = DEFAULT) -> None:
    """A constraint still as text (a server's request): its size, and for JSON kinds its nesting,
    read without parsing it (Python's JSON reader recurses per level)."""
    if not isinstance(text, (str, bytes)):
        return
    size = len(text.encode("utf-8") if isinstance(text, str) else text)
    if size > limits.spec_bytes:
        raise LimitError("spec_bytes", size, limits.spec_bytes)
    if kind in ("json", "json_schema", "structural_tag", "choice"):
        depth = text_depth(text if isinstance(text, str) else text.decode("utf-8", "replace"))
        if depth > limits.depth:
            raise LimitError("depth", depth, limits.depth)


def text_depth(text: str) -> int:
    """The deepest nesting of ``{``/``[`` in JSON text (brackets inside strings skipped)."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "}]":
            depth -= 1
    return deepest


def check(constraint: Constraint, limits: Limits = DEFAULT) -> None:
    """Raise :class:`LimitError` if ``constraint`` holds more than ``limits`` allow (the structural limits)."""
    kind, spec = constraint.kind, constraint.spec
    if kind == "json_schema":
        _schema(spec, limits)
    elif kind == "regex":
        check_text(kind, spec, limits)
        _pattern(spec, "", limits)
    elif kind == "choice":
        if len(spec) > limits.enum_values:
            raise LimitError("enum_values", len(spec), limits.enum_values)
        size = sum(len(option.encode("utf-8")) for option in spec)
        if size > limits.spec_bytes:
            raise LimitError("spec_bytes", size, limits.spec_bytes)
    elif kind in ("ebnf", "structural_tag") and isinstance(spec, str):
        check_text("ebnf", spec, limits)
        bound = repetition(spec, grammar=True)
        if bound > limits.repeat:
            raise LimitError("repeat", bound, limits.repeat, detail="a repetition bound of the grammar")


def _schema(schema, limits: Limits) -> None:
    _shape(schema, limits)
    size = len(json.dumps(schema, ensure_ascii=False).encode("utf-8"))  # recursion bounded: depth checked
    if size > limits.spec_bytes:
        raise LimitError("spec_bytes", size, limits.spec_bytes)
    if not isinstance(schema, dict):
        return
    for path, node in rewrite.walk(schema):
        _node(schema, path, node, limits)


def check_document(document, limits: Limits = DEFAULT) -> None:
    """A JSON document (dicts and lists) within the depth and node limits, read iteratively."""
    _shape(document, limits)


def _shape(document, limits: Limits) -> None:
    """The nesting and the number of objects and arrays of a JSON document, read iteratively; it
    stops at the first limit passed."""
    stack, count = ([(document, 1)] if isinstance(document, (dict, list)) else []), 0
    while stack:
        value, depth = stack.pop()
        count += 1
        if depth > limits.depth:
            raise LimitError("depth", f"more than {limits.depth} levels", limits.depth)
        if count > limits.nodes:
            raise LimitError("nodes", f"more than {limits.nodes}", limits.nodes)
        for item in value.values() if isinstance(value, dict) else value:
            if isinstance(item, (dict, list)):
                stack.append((item, depth + 1))


_NUMBER_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


def _node(root: dict, path: str, node: dict, limits: Limits) -> None:
    enum = node.get("enum")
    if isinstance(enum, list) and len(enum) > limits.enum_values:
        raise LimitError("enum_values", len(enum), limits.enum_values, f"{path}/enum")
    names = set(node["properties"]) if isinstance(node.get("properties"), dict) else set()
    if isinstance(node.get("required"), list):
        names.update(name for name in node["required"] if isinstance(name, str))
    if len(names) > limits.properties:
        raise LimitError("properties", len(names), limits.properties, path)
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(node.get(key), list) and len(node[key]) > limits.branches:
            raise LimitError("branches", len(node[key]), limits.branches, f"{path}/{key}")
    for key in rewrite.LIMITS:
        value = node.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > limits.repeat:
            raise LimitError("repeat", value, limits.repeat, f"{path}/{key}")
    for key in _NUMBER_BOUNDS:
        value = node.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and _digits(value) > limits.number_digits:
            raise LimitError("number_digits", f"{_digits(value)} digits", limits.number_digits, f"{path}/{key}")
    if isinstance(node.get("pattern"), str):
        _pattern(node["pattern"], f"{path}/pattern", limits)
    if isinstance(node.get("patternProperties"), dict):
        for name in node["patternProperties"]:
            _pattern(name, f"{path}/patternProperties", limits)
    if isinstance(node.get("$ref"), str):
        _ref_chain(root, path, node, limits)


def _digits(value) -> int:
    """Digits before the point (without writing the number out: 10**300 has 301; inf and nan: 400)."""
    if isinstance(value, float):
        if not math.isfinite(value):
            return 400
        return int(math.log10(abs(value))) + 1 if abs(value) >= 1 else 1
    return max(1, len(str(abs(value))) if value.bit_length() < 10_000 else int(value.bit_length() * 0.30103) + 1)


def _pattern(pattern: str, where: str, limits: Limits) -> None:
    if len(pattern) > limits.pattern_chars:
        raise LimitError("pattern_chars", len(pattern), limits.pattern_chars, where)
    bounded = lengths.length_lookahead(pattern) if where.endswith("/pattern") else None
    pattern = pattern if bounded is None else bounded[0]  # its length lookahead becomes minLength/maxLength
    bound = repetition(pattern)
    if bound > limits.repeat:
        raise LimitError("repeat", bound, limits.repeat, where, "a regex repetition bound (nested bounds multiplied)")
    try:
        parsed = patterns.parse(pattern)
    except ConstraintError:
        return  # a syntax error: the policy names it, with its offset
    cost = pattern_cost(parsed.tree)
    for limit, value in (("pattern_size", cost.size), ("repeat_nesting", cost.nesting),
                         ("varying_repeat", cost.varying_bound)):
        if value > getattr(limits, limit):
            raise LimitError(limit, value, getattr(limits, limit), where)
    if where:
        _built(parsed, where)


def _built(pattern: patterns.Pattern, where: str) -> None:
    """A schema pattern's language built (lookarounds, ``\\b``, inner anchors: by automata, kept for the
    engines), or :class:`caps.CapReached` naming the cap, the pattern and ``where`` (its JSON pointer)."""
    if pattern.refusal({patterns.CONTROLS_WITHOUT_ESCAPES}) is not None:
        return  # a feature no engine enforces: the policy names it
    try:
        lookaround.language(pattern, search=True)
    except ConstraintError as refused:
        if getattr(refused, "cap", None) is None:
            raise
        path, _, keyword = where.rpartition("/")
        raise caps.CapReached(refused.cap, refused.count, keyword, path or "#", refused.maximum,
                              pattern.source) from None


def _ref_chain(root: dict, path: str, node: dict, limits: Limits) -> None:
    hops, seen = 0, {id(node)}
    while isinstance(node.get("$ref"), str) and node["$ref"].startswith("#"):
        node = rewrite._node_at(root, node["$ref"])
        if not isinstance(node, dict) or id(node) in seen:
            return  # unresolvable (the policy names it) or a cycle of bare refs (satisfiable.py names it)
        seen.add(id(node))
        hops += 1
        if hops > limits.ref_chain:
            raise LimitError("ref_chain", f"more than {limits.ref_chain}", limits.ref_chain, f"{path}/$ref")


# --------------------------------------------------------------------------- what a regex costs an engine
@dataclasses.dataclass(frozen=True)
class PatternCost:
    """What a parsed regex (``patterns.parse(...).tree``) would cost written out, computed without writing it
    out: ``size`` (its counted repetitions expanded, a class counting its ranges), ``varies`` (whether it
    branches: an alternation, or a repetition of a varying count or part), ``nesting`` (the most repetitions
    of varying parts nested in one another) and ``varying_bound`` (the largest bound of a counted repetition
    of a varying part).

    Measured (``benchmarks/bench_pattern_limits.py``, SmolLM2's 49,152 tokens): xgrammar 0.2.8 compiles
    ``[a-z]{1,60000}`` in 0.35 s and a 1,000-character group repeated 600 times in 4.5 s (``pattern_size``);
    its fill grows with the text read where repetitions of varying parts nest (one fill of
    ``(([a-z]{1,5}){1,5}){1,5}){1,5}`` 1.4 s, of ``([a-z]{1,3}){1,100}`` 1.2 s, of
    ``(a|b|...|z){1,200}`` 0.15 s). llguidance fills all of these within 4 ms."""

    size: int
    varies: bool
    nesting: int
    varying_bound: int


def pattern_cost(tree) -> PatternCost:
    """The :class:`PatternCost` of a pattern tree, read iteratively (a post-order walk, no recursion).

    Args:
        tree: a tree of ``patterns.parse`` (``("chars", ranges)``, ``("seq", items)``, ``("alt", branches)``,
            ``("repeat", node, low, high)``, anchors).

    Returns:
        The cost of the pattern the tree is."""
    return fold(tree, _cost)


def _cost(node, parts: list) -> PatternCost:
    kind = node[0]
    if kind == "chars":
        return PatternCost(max(1, len(node[1])), False, 0, 0)
    if kind in ("seq", "alt"):
        return PatternCost(sum(p.size for p in parts), kind == "alt" and len(parts) > 1 or any(p.varies for p in parts),
                           max((p.nesting for p in parts), default=0), max((p.varying_bound for p in parts), default=0))
    if kind != "repeat":
        return PatternCost(0, False, 0, 0)  # anchors, refused constructs
    (body,), low, high = parts, node[2], node[3]
    copies = high if high is not None else max(low, 1)
    varies = high is None or high != low or body.varies
    repeats = high is None or high >= 2  # `?` chooses, it does not repeat
    bound = copies if body.varies and copies >= 2 else 0
    return PatternCost(body.size * copies, varies, body.nesting + (1 if varies and repeats else 0),
                       max(body.varying_bound, bound))


# --------------------------------------------------------------------------- repetition bounds
def repetition(text: str, *, grammar: bool = False) -> int:
    """The largest repetition bound ``{n}`` / ``{n,}`` / ``{n,m}`` in a regex (or an EBNF grammar's
    text: ``grammar=True`` also skips quoted strings), bounds of nested groups multiplied:
    ``((a{1,40}){1,40})`` -> 1600. Escapes and character classes are skipped. 1 when there is none."""
    groups = [1]  # the largest product inside each open group
    last = 1  # the factor of the item a quantifier would apply to
    i, size = 0, len(text)
    while i < size:
        char = text[i]
        if char == "\\":
            i, last = i + 2, 1
            groups[-1] = max(groups[-1], 1)
            continue
        if char == "[":
            i, last = _class_end(text, i), 1
            continue
        if grammar and char in "\"'":
            i, last = _string_end(text, i, char), 1
            continue
        if char == "(":
            groups.append(1)
        elif char == ")":
            inner = groups.pop() if len(groups) > 1 else 1
            groups[-1] = max(groups[-1], inner)
            last = inner
        elif char == "{":
            end = text.find("}", i)
            bound = _bound(text[i + 1:end]) if end > i else None
            if bound is not None:
                groups[-1] = max(groups[-1], last * bound)
                last = last * bound
                i = end + 1
                continue
            last = 1
        elif char not in "*+?|":
            last = 1
        i += 1
    return max(groups)


def _bound(inside: str) -> int | None:
    low, comma, high = inside.partition(",")
    low, high = low.strip(), high.strip()
    if not low.isdigit() and not (comma and not low and high.isdigit()):
        return None
    if high and not high.isdigit():
        return None
    return int(high) if high else int(low or 0)


def _class_end(text: str, start: int) -> int:
    i = start + 1
    if i < len(text) and text[i] == "^":
        i += 1
    if i < len(text) and text[i] == "]":
        i += 1
    while i < len(text) and text[i] != "]":
        i += 2 if text[i] == "\\" else 1
    return i + 1


def _string_end(text: str, start: int, quote: str) -> int:
    i = start + 1
    while i < len(text) and text[i] != quote:
        i += 2 if text[i] == "\\" else 1
    return i + 1
