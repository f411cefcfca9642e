"""The ``numbers`` region of the differential test: numbers, integers and their spellings.

    numbers_case()              # a strategy of (schema, instances): integer / number nodes, type lists,
                                # enum / const holding numbers, untyped numeric keywords
    spelled(instance, seed)     # the instance's JSON with each number written another way, or None

JSON Schema compares numbers by value: ``1.0``, ``1e0``, ``10e-1`` and ``0.1e1`` are all the integer 1, and
``-0.0`` is 0. An engine taught to take integral spellings (``engines/xgrammar/integers.py``) must take no
spelling of a value the schema refuses: ``2.0`` above ``maximum: 1``, ``1.5e0`` for an ``integer``,
``-0.0`` below ``exclusiveMinimum: 0``. The region's instances straddle the bounds with integral floats
(``json.dumps`` writes ``2.0``, ``-0.0``, ``1e+16``), and :func:`spelled` writes each number again in
forms ``json.dumps`` never writes (a trailing zero, an exponent, a negative exponent, a leading-digit
form), judged by ``jsonschema`` on the text.
"""
from __future__ import annotations

import json

from hypothesis import strategies as st

# integral floats as json.dumps writes them (2.0, -0.0, 1e+16), integers, and fractions near them
NUMBERS = (-2, 0, 1, 2, 3, 4, 6, -2.0, -0.0, 0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 100.0, 1e16, 1.5e16, 0.5, 1.5, 2.5, -0.5)
_STEPS = (2, 3, 0.5, 1.5, 1.0, 2.0)
_BOUNDS = (-2, 0, 1, 2, 3, 0.0, -0.0, 2.0, 1.5, 4, 1e16)


def _numeric_keywords():
    bound = st.sampled_from(_BOUNDS)
    options = {"minimum": bound, "maximum": bound, "exclusiveMinimum": bound, "exclusiveMaximum": bound,
               "multipleOf": st.sampled_from(_STEPS)}
    return st.lists(st.sampled_from(sorted(options)), min_size=1, max_size=3, unique=True).flatmap(
        lambda names: st.fixed_dictionaries({name: options[name] for name in names}))


def _literal():
    number = st.sampled_from(NUMBERS)
    return st.one_of(number, st.sampled_from(("a", None, False)), st.lists(number, max_size=2),
                     st.dictionaries(st.sampled_from(("a", "b")), number, max_size=2))


def _schemas():
    kind = st.sampled_from(("integer", "number", ["integer", "null"], ["integer", "string"], ["number", "boolean"]))
    typed = st.tuples(kind, _numeric_keywords()).map(lambda pair: {"type": pair[0], **pair[1]})
    bare = st.sampled_from(({"type": "integer"}, {"type": "number"}, {"type": ["integer", "null"]}))
    untyped = st.tuples(_numeric_keywords(), st.sampled_from(({}, {"maxLength": 1}, {"maxItems": 1}))).map(
        lambda pair: {**pair[0], **pair[1]})
    enum = st.lists(_literal(), min_size=1, max_size=3).map(lambda values: {"enum": values})
    const = _literal().map(lambda value: {"const": value})
    leaf = st.one_of(typed, bare, untyped, enum, const)
    nested = st.one_of(leaf.map(lambda sub: {"type": "array", "items": sub}),
                       leaf.map(lambda sub: {"type": "object", "properties": {"a": sub}, "required": ["a"]}))
    return st.one_of(leaf, leaf, nested)


def _numbers_in(node) -> list:
    if isinstance(node, dict):
        return [x for v in node.values() for x in _numbers_in(v)]
    if isinstance(node, list):
        return [x for v in node for x in _numbers_in(v)]
    return [node] if isinstance(node, (int, float)) and not isinstance(node, bool) else []


def _instances(schema):
    """Values near the schema's own numbers (each, its integral float, one either side, half past it), wrapped
    the way the schema nests (an array's item, the object's ``a``), and random ones."""
    near = sorted({float(x) for n in _numbers_in(schema) if abs(n) < 1e15 for x in (n, n + 1, n - 1, n + 0.5, -n)}
                  | {float(int(n)) for n in _numbers_in(schema) if abs(n) < 1e15}, key=repr)
    scalar = st.one_of(st.sampled_from(NUMBERS), st.sampled_from(near or NUMBERS),
                       st.sampled_from(near or NUMBERS).map(lambda x: int(x) if isinstance(x, float) and x.is_integer() else x),
                       st.sampled_from(("a", "ab", None, True)))
    wrapped = {"array": st.lists(scalar, max_size=2), "object": st.dictionaries(st.just("a"), scalar, max_size=1)}
    kind = schema.get("type") if isinstance(schema.get("type"), str) else None
    return st.lists(st.one_of(wrapped.get(kind, scalar), scalar, st.lists(scalar, max_size=2)), min_size=10,
                    max_size=10)


def numbers_case():
    """``(schema, instances)`` of the numbers region (the module docstring)."""
    return _schemas().flatmap(lambda schema: st.tuples(st.just(schema), _instances(schema)))


def _forms(value) -> list[str]:
    """Other spellings of the number ``value``, each the same value."""
    text = json.dumps(value)
    if "e" in text or "E" in text or "inf" in text.lower() or "nan" in text.lower():
        return [text.replace("e+", "E"), text.replace("e", "0e", 1) if "." in text else text]
    sign, digits = ("-", text[1:]) if text.startswith("-") else ("", text)
    whole, _, fraction = digits.partition(".")
    shifted = (whole + fraction).lstrip("0") or "0"
    forms = [f"{sign}{digits}0" if fraction else f"{sign}{whole}.00", f"{text}e0", f"{sign}{shifted}e-{len(fraction)}",
             f"{text}E+0"]
    if whole != "0":
        forms.append(f"{sign}{whole[0]}.{(whole[1:] + fraction) or '0'}e{len(whole) - 1}")
    if whole == "0" and not fraction.strip("0"):
        forms.append("-0" if not sign else "0.0")
    return forms


def spelled(value, seed: int) -> str | None:
    """``value`` as JSON (``json.dumps``'s separators) with each number written in one of :func:`_forms`
    (picked by ``seed``), or None where it holds no number."""
    found = [False]

    def write(item, index):
        if isinstance(item, bool) or item is None or isinstance(item, str):
            return json.dumps(item, ensure_ascii=False)
        if isinstance(item, (int, float)):
            found[0] = True
            forms = _forms(item)
            return forms[(seed + index) % len(forms)]
        if isinstance(item, list):
            return "[" + ", ".join(write(x, index + i) for i, x in enumerate(item)) + "]"
        return "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {write(v, index + i)}"
                               for i, (k, v) in enumerate(item.items())) + "}"
    text = write(value, 0)
    return text if found[0] else None
