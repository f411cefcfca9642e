"""xgrammar's integers spelled every way JSON Schema counts as an integer.

    markers = IntegerMarkers()
    spec = markers.schema(spec)          # each integer node with a range or a step: a marker while xgrammar converts
    text = markers.substitute(text)      # the marker's rule: xgrammar's own rule for the node, then ``(\\.0+)?``;
                                         # ``basic_integer``: every integral spelling below

JSON Schema's ``integer`` is any number whose value is an integer: ``1.0``, ``-0``, ``-0.0``, ``1e2`` and
``1.5e+16`` are integers (``json.dumps`` writes floats so). xgrammar 0.2.8 writes ``-?(0|[1-9][0-9]*)`` only.
Here an integer with no other keyword (``basic_integer``: the node alone, each ``integer`` of a type list)
takes ``-?INT(\\.0+)?`` and the exponent forms whose value is provably an integer: ``-?INT(\\.D{k})?[eE]+?N``
with ``N >= k`` (``k <= 16``: every float ``json.dumps`` writes). An integer node with ``minimum`` /
``maximum`` / ``exclusive*`` / ``multipleOf`` keeps xgrammar's rule for it (converted alone) followed by
``(\\.0+)?``: the value is the digits' value, so the range and the step hold as they did. Narrower than
JSON Schema, never wider: no exponent beside a range or a step, no negative exponent (``100e-2``), no
fraction with trailing zeros before an exponent (``1.50e1``), no ``-0`` beside a range or a step.
"""
from __future__ import annotations

import json
import re

import xgrammar as xgr

_MARKER = "ncinteger{}x"
_PREFIX = "ncinteger{}_"
_NUMERIC = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"})
_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
                          "writeOnly"})
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|[A-Za-z_][A-Za-z0-9_]*')
_RULE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*) ::= (.*)$", re.MULTILINE)
MAX_FRACTION = 16  # fraction digits before an exponent taken (json.dumps writes at most 16)


def _at_least(k: int) -> str:
    """EBNF of the decimal numbers >= ``k`` (``0 <= k <= 99``), leading zeros left to the caller."""
    if k == 0:
        return "[0-9]+"
    tens, ones = divmod(k, 10)
    if tens == 0:
        return f"([{k}-9] | ([1-9] [0-9]+))"
    alternatives = [f'("{tens}" [{ones}-9])', "([1-9] [0-9] [0-9]+)"]
    if tens < 9:
        alternatives.append(f"([{tens + 1}-9] [0-9])")
    return "(" + " | ".join(alternatives) + ")"


_EXPONENTS = " | ".join(
    [f'([eE] "+"? {_at_least(0)})'] + [f'("." [0-9]{{{k},{k}}} [eE] "+"? "0"* {_at_least(k)})'
                                        for k in range(1, MAX_FRACTION + 1)])
INTEGRAL_RULES = (
    'ncinteger_int ::= (("0") | ([1-9] [0-9]*))\n'
    'ncinteger_zeros ::= ("" | ("." "0"+))\n'
    f"ncinteger_exponent ::= ({_EXPONENTS})\n"
)
BASIC_INTEGER = 'basic_integer ::= (("-"? ncinteger_int (ncinteger_zeros | ncinteger_exponent)))'


def _is_marked(node) -> bool:
    """A number or integer node with a range or a step and nothing else that asserts."""
    return (isinstance(node, dict) and node.get("type") in ("integer", "number") and bool(_NUMERIC & set(node))
            and set(node) <= _NUMERIC | _ANNOTATIONS | {"type"}
            and all(isinstance(node[k], (int, float)) and not isinstance(node[k], bool) for k in _NUMERIC & set(node)))


def _takes_zero(node: dict) -> bool:
    """Whether 0 satisfies the node's range (every step divides 0)."""
    return (node.get("minimum", 0) <= 0 <= node.get("maximum", 0) and node.get("exclusiveMinimum", -1) < 0
            < node.get("exclusiveMaximum", 1))


def _rules(text: str) -> dict[str, str]:
    return {match.group(1): match.group(2) for match in _RULE.finditer(text)}


def _renamed(body: str, names, prefix: str) -> str:
    return _TOKEN.sub(lambda m: prefix + m.group(0) if m.group(0) in names else m.group(0), body)


def _reachable(rules: dict[str, str], start: str = "root") -> list[str]:
    seen, stack = [start], [start]
    while stack:
        for token in _TOKEN.findall(rules[stack.pop()]):
            if token in rules and token not in seen:
                seen.append(token)
                stack.append(token)
    return seen


class IntegerMarkers:
    """Each integer (number) node with a range or a step replaced by a string marker while xgrammar converts the
    schema, then written back as xgrammar's rule for the node followed by ``(\\.0+)?`` (for an integer), or
    ``-0(\\.0+)?`` where the range holds 0 (the module docstring)."""

    def __init__(self):
        self.nodes: list[dict] = []

    def schema(self, schema):
        """``schema`` with each integer node that has a range or a step replaced by a marker (a copy)."""
        if isinstance(schema, list):
            return [self.schema(item) for item in schema]
        if not isinstance(schema, dict):
            return schema
        if _is_marked(schema):
            self.nodes.append({k: v for k, v in schema.items() if k not in _ANNOTATIONS})
            return {"type": "string", "pattern": "^" + _MARKER.format(len(self.nodes) - 1) + "$"}
        return {key: value if key in ("enum", "const", "default", "examples") else self.schema(value)
                for key, value in schema.items()}

    def substitute(self, text: str) -> str | None:
        """``text`` (xgrammar's EBNF of the marked schema) with the integral spellings; None where a marker is
        not where it was expected (the caller converts the schema unmarked: plain integers, still sound)."""
        rules = _rules(text)
        extra = []
        for index, node in enumerate(self.nodes):
            regex = f'Regex("^{_MARKER.format(index)}$", json_string=true)'
            prefix = _PREFIX.format(index)
            alone = _rules(str(xgr.Grammar.from_json_schema(json.dumps(node))))
            kept = _reachable(alone)
            extra += [f"{prefix}{name} ::= {_renamed(alone[name], kept, prefix)}" for name in kept]
            body = f"({prefix}root ncinteger_zeros)" if node["type"] == "integer" else f"({prefix}root)"
            if _takes_zero(node):  # -0 and -0.0 are 0 (xgrammar's rule has no minus zero)
                body += ' | ("-" "0" ncinteger_zeros)'
            extra.append(f"{prefix}value ::= ({body})")
            names = [name for name, body in rules.items() if body == regex]
            text = text.replace(f'"\\"" {regex} "\\""', f"{prefix}value")
            for name in names:
                text = text.replace(f'"\\"" {name} "\\""', f"{prefix}value")
                text = re.sub(rf"^{name} ::= .*$", f"{name} ::= (({prefix}value))", text, flags=re.MULTILINE)
                if re.search(rf"(?<![A-Za-z0-9_]){name}(?![A-Za-z0-9_])", text.replace(f"{name} ::=", "")):
                    return None  # the marker's rule is read somewhere else than between quotes
            if regex in text:
                return None
        return integral(text, extra)


def integral(text: str, extra=()) -> str:
    """xgrammar's EBNF ``text`` with ``basic_integer`` taking every integral spelling, plus ``extra`` rules."""
    if "basic_integer ::=" not in text and not extra:
        return text
    text = re.sub(r"^basic_integer ::= .*$", BASIC_INTEGER, text, flags=re.MULTILINE)
    return text.rstrip("\n") + "\n" + INTEGRAL_RULES + "".join(line + "\n" for line in extra)
