r"""xgrammar's integers spelled every way JSON Schema counts as an integer.

    markers = IntegerMarkers()
    spec = markers.schema(spec)               # each number node with a range or a step: a marker while converting
    text = markers.substitute(text, convert)  # the marker's rule: xgrammar's own rules for the node, spelled
                                              # every way below; ``basic_integer`` likewise

JSON Schema's ``integer`` is any number whose value is an integer: ``1.0``, ``-0``, ``-0.0``, ``1e2`` and
``1.5e+16`` are integers (``json.dumps`` writes floats so). xgrammar 0.2.8 writes ``-?(0|[1-9][0-9]*)`` only.
Here an integer with no other keyword (``basic_integer``: the node alone, each ``integer`` of a type list)
takes ``-?INT``, ``-?INT\.0+``, ``-?INT[eE]+?N`` and ``-?D\.D{1,16}[eE]+?N`` with ``N >= 16``: exponent forms
whose value is provably an integer, every spelling ``json.dumps`` writes for an integral float (``1e+16``,
``1.5e+16``). The referee (``jsonschema`` on ``json.loads``) reads a number with a fraction or an exponent as
a float, and a float past 1.8e308 as ``inf``, which is no integer: so before a fraction or an exponent at most
16 digits, and an exponent up to 291 (one digit, as ``json.dumps`` writes it: up to 307).

An integer node with ``minimum`` / ``maximum`` / ``exclusive*`` keeps xgrammar's rule for it (converted alone,
through ``convert``: refused where xgrammar warns) and takes ``\.0+`` after the digits of the same range cut
to ``[-1e15, 1e15]`` (the value is the digits' value: the range holds as it did); with ``multipleOf`` (an
integer step up to 32), ``\.0+`` after the multiples of at most 16 digits, written here (a remainder
automaton: one rule per remainder and digits left). ``-0`` and ``-0.0`` are taken wherever the range holds 0
(integer and number nodes). The rules are added only to a grammar that reads an integer (they cost compile
time). Narrower than JSON Schema, never wider: no exponent beside a range or a step, no negative exponent
(``100e-2``), no fraction before an exponent below 16 (``1.5e1``, ``1.0e2``), no fraction beside a step over
32, nothing past the bounds above.
"""
from __future__ import annotations

import json
import re

from neuron_constrain.structured.constraints import ConstraintError

_MARKER = "ncinteger{}x"
_PREFIX = "ncinteger{}_"
_NUMERIC = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"})
_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
                          "writeOnly"})
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|[A-Za-z_][A-Za-z0-9_]*')
_RULE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*) ::= (.*)$", re.MULTILINE)
MAX_FRACTION = 16  # fraction digits before an exponent of 16 or more (json.dumps writes at most 16: repr's 17 digits)
MAX_DIGITS = 16  # integer digits before a fraction or an exponent (the referee reads those as a float: finite)
MAX_EXPONENT = 291  # 16 digits and an exponent up to 291: below 1e308, a finite float
MAX_EXPONENT_ONE_DIGIT = 307  # one digit (json.dumps's scientific form) and an exponent up to 307: below 1e308
MAX_STEP = 32  # multipleOf steps up to this get fractions spelled (16 * step rules)
MAX_ZEROS = 16  # zeros after an integer's point (json.dumps writes one): bounded, so no answer runs away in zeros


def _hundreds(top: int) -> list[str]:
    """EBNF alternatives of the decimal numbers 100 to ``top`` (100 to 999)."""
    hundreds, tens, ones = top // 100, top // 10 % 10, top % 10
    found = [f'("{h}" [0-9] [0-9])' for h in range(1, hundreds)]
    found += [f'("{hundreds}{t}" [0-9])' for t in range(tens)]
    return found + [f'("{hundreds}{tens}" [0-{ones}])']


def _at_least(k: int, top: int) -> str:
    """EBNF of the decimal numbers ``k`` to ``top`` (``0 <= k <= 16``, ``100 <= top <= 999``), without leading
    zeros (the caller writes those)."""
    tens, ones = divmod(k, 10)
    one_digit = [f"[{k}-9]"] if k <= 9 else []
    two_digits = ["([1-9] [0-9])"] if tens == 0 else [f'("{tens}" [{ones}-9])', f"([{tens + 1}-9] [0-9])"]
    return "(" + " | ".join(one_digit + two_digits + _hundreds(top)) + ")"


INTEGRAL_RULES = (
    'ncinteger_int ::= (("0") | ([1-9] [0-9]*))\n'
    f'ncinteger_short ::= (("0") | ([1-9] [0-9]{{0,{MAX_DIGITS - 1}}}))\n'
    f'ncinteger_zeros ::= (("." "0"{{1,{MAX_ZEROS}}}))\n'
    f'ncinteger_exponent ::= (([eE] "+"? "0"{{0,2}} {_at_least(0, MAX_EXPONENT)}))\n'
    f'ncinteger_scientific ::= (([eE] "+"? "0"{{0,2}} {_at_least(0, MAX_EXPONENT_ONE_DIGIT)})'
    f' | ("." [0-9]{{1,{MAX_FRACTION}}} [eE] "+"? "0"{{0,2}} {_at_least(MAX_FRACTION, MAX_EXPONENT_ONE_DIGIT)}))\n'
)
BASIC_INTEGER = ('basic_integer ::= (("-"? ncinteger_int) | ("-"? ncinteger_short (ncinteger_zeros | ncinteger_exponent))'
                 ' | ("-"? [1-9] ncinteger_scientific))')
BOUND = 10 ** 15  # an integer spelled with a fraction or an exponent beside a range: at most this far from 0


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

    def substitute(self, text: str, convert) -> str | None:
        """``text`` (xgrammar's EBNF of the marked schema) with the integral spellings; None where a marker is
        not where it was expected (the caller converts the schema unmarked: plain integers, still sound).
        ``convert(schema)``: xgrammar's grammar of one node, refused where xgrammar warns (``grammars.reported``:
        a range beside ``multipleOf`` is one)."""
        rules = _rules(text)
        extra = []
        for index, node in enumerate(self.nodes):
            regex = f'Regex("^{_MARKER.format(index)}$", json_string=true)'
            prefix = _PREFIX.format(index)
            alternatives = [self._copy(convert(node), prefix + "plain_", extra)]
            if node["type"] == "integer" and "multipleOf" not in node and _clamped(node) is not None:
                try:
                    tail = self._copy(convert(_clamped(node)), prefix + "tail_", extra)
                    alternatives.append(f"({tail} ncinteger_zeros)")
                except ConstraintError:
                    pass  # xgrammar cannot write the clamped range: the plain spelling alone (narrower)
            step = node.get("multipleOf")
            if node["type"] == "integer" and set(node) == {"type", "multipleOf"} and float(step).is_integer() \
                    and 1 <= step <= MAX_STEP:
                extra += _multiples(int(step), prefix + "step_")
                alternatives.append(f'("-"? {prefix}step_root ncinteger_zeros)')
            if _takes_zero(node):  # -0 and -0.0 are 0 (xgrammar's rules have no minus zero)
                alternatives.append('("-" "0" ("" | ncinteger_zeros))')
            extra.append(f"{prefix}value ::= ({' | '.join(alternatives)})")
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

    @staticmethod
    def _copy(grammar, prefix: str, extra: list) -> str:
        """The rules of ``grammar`` reachable from its root, renamed with ``prefix``, added to ``extra``; returns
        the name of its root there."""
        alone = _rules(str(grammar))
        kept = _reachable(alone)
        extra += [f"{prefix}{name} ::= {_renamed(alone[name], kept, prefix)}" for name in kept]
        return prefix + "root"


def _multiples(step: int, prefix: str) -> list[str]:
    """EBNF rules: ``{prefix}root``, the multiples of ``step`` written in 1 to MAX_DIGITS digits (no leading zero);
    ``{prefix}{remainder}_{left}``: digits that bring the remainder so far to a multiple, at most ``left`` of them
    (only the states from which a multiple is still reachable)."""
    live = {(remainder, 0): remainder == 0 for remainder in range(step)}
    for left in range(1, MAX_DIGITS):
        for remainder in range(step):
            live[remainder, left] = remainder == 0 or any(live[(remainder * 10 + d) % step, left - 1] for d in range(10))
    rules = []
    for (remainder, left), alive in live.items():
        if not alive:
            continue
        alternatives = ['""'] if remainder == 0 else []
        alternatives += [f'("{d}" {prefix}{(remainder * 10 + d) % step}_{left - 1})' for d in range(10)
                         if left and live[(remainder * 10 + d) % step, left - 1]]
        rules.append(f"{prefix}{remainder}_{left} ::= ({' | '.join(alternatives)})")
    first = [f'("{d}" {prefix}{d % step}_{MAX_DIGITS - 1})' for d in range(1, 10) if live[d % step, MAX_DIGITS - 1]]
    rules.append(f'{prefix}root ::= ({" | ".join([chr(34) + "0" + chr(34)] + first)})')
    return rules


def _clamped(node: dict) -> dict | None:
    """``node`` with its range cut to [-BOUND, BOUND] (where a fraction or an exponent may follow its digits:
    the referee reads such a number as a float, which must stay finite), or None where nothing is left."""
    low = max([node[k] for k in ("minimum", "exclusiveMinimum") if k in node] + [-BOUND])
    high = min([node[k] for k in ("maximum", "exclusiveMaximum") if k in node] + [BOUND])
    if low > high:
        return None
    clamped = dict(node)
    for key, bound, keep in (("minimum", -BOUND, low), ("maximum", BOUND, high)):
        if keep == bound:
            clamped.pop("exclusiveMinimum" if key == "minimum" else "exclusiveMaximum", None)
            clamped[key] = bound
    return clamped


def integral(text: str, extra=()) -> str:
    """xgrammar's EBNF ``text`` with ``basic_integer`` taking every integral spelling, plus ``extra`` rules."""
    if not extra and not re.search(r"(?<![A-Za-z0-9_])basic_integer(?![A-Za-z0-9_])(?! ::=)", text):
        return text  # no integer read anywhere: the grammar as xgrammar wrote it (the rules cost compile time)
    text = re.sub(r"^basic_integer ::= .*$", BASIC_INTEGER, text, flags=re.MULTILINE)
    return text.rstrip("\n") + "\n" + INTEGRAL_RULES + "".join(line + "\n" for line in extra)
