"""A tool's arguments as a structural-tag element, typed by its schema, for each way a family spells them.

    arguments_element(family, name, parameters, whitespace=2)   # {"type": "json_schema" | "sequence", ...}
    read_xml_value(text, schema), python_arguments(source)       # the parsers' side

JSON arguments go through the library's schema policy (``prepare`` and xgrammar's view: the algebra, the
keyword table): a keyword xgrammar would not enforce, or one only the host's item tracker judges, is
refused naming the tool and the pointer. XML (``qwen3_coder``) and Python (``pythonic``) values are
written from the schema here: a string parameter is raw text up to ``\\n</parameter>`` (XML; bounded
by ``minLength`` / ``maxLength``: no newline inside, narrowed) or a double-quoted literal (Python), a
number is JSON's spelling through the policy (``minimum`` and the rest), a boolean ``true``/``false``
(Python: ``True`` / ``False``); objects and arrays are JSON (XML, as the template's ``tojson``) or
Python literals. What this spelling cannot enforce (a string ``pattern`` in raw XML text, ...) is
refused by name: soundness first.
"""
from __future__ import annotations

import ast
import json
import keyword

from neuron_constrain.structured.constraints import ConstraintError, engine_message, json_schema
from neuron_constrain.structured.engines.xgrammar.grammars import structural_tag_text
from neuron_constrain.structured.schema.prepare import prepare
from neuron_constrain.structured.schema.rewrite import walk
from neuron_constrain.structured.tool_calls import families as F

ANNOTATIONS = frozenset({"description", "title", "default", "examples", "$comment", "deprecated", "readOnly",
                         "writeOnly"})
_PY_STRING = r'"([^"\\\x00-\x1f]|\\["\\bfnrt]|\\u[0-9a-fA-F]{4})*"'
# any Python literal (an untyped value): strings with JSON's escapes, numbers, True / False / None, lists, dicts
_PY_ANY = r"""root ::= value
value ::= string | number | "True" | "False" | "None" | "[" (value (", " value)*)? "]" | "{" (string ": " value (", " string ": " value)*)? "}"
string ::= "\"" ([^"\\\0-\x1f] | "\\" ["\\bfnrt] | "\\u" [0-9a-fA-F]{4})* "\""
number ::= "-"? ("0" | [1-9] [0-9]*) ("." [0-9]+)? ([eE] [+\-]? [0-9]+)?
"""


def _const(text: str) -> dict:
    return {"type": "const_string", "value": text}


def _sequence(*elements) -> dict:
    elements = [e for e in elements if not _empty(e)]
    if not elements:
        return _const("")
    return elements[0] if len(elements) == 1 else {"type": "sequence", "elements": elements}


def _empty(element: dict) -> bool:
    return element.get("type") == "const_string" and element["value"] == ""


def _or(elements: list) -> dict:
    """One of ``elements``; an empty one makes the rest optional (xgrammar has no empty alternative)."""
    kept = [e for e in elements if not _empty(e)]
    if not kept:
        return _const("")
    one = kept[0] if len(kept) == 1 else {"type": "or", "elements": kept}
    return one if len(kept) == len(elements) else {"type": "optional", "content": one}


def refused(tool: str, path: str, why: str, fix: str) -> ConstraintError:
    """The refusal of a tool's schema: the tool, the pointer, why, the fix."""
    return ConstraintError(f"tool {tool!r}: {why} at {path}; {fix}")


def json_arguments(tool: str, parameters, whitespace: int, at: str = "") -> dict:
    """The tool's parameters through the library's schema policy, as a ``json_schema`` element.

    Args:
        tool: the tool's name (named in a refusal).
        parameters: its JSON schema.
        whitespace: the whitespace characters a gap may hold.
        at: the pointer of ``parameters`` in the tool's parameters, for a value inside them (``""``: the root).

    Returns:
        The element.

    Raises:
        ConstraintError: a keyword xgrammar would not enforce (its pointer), or a schema the policy refuses.
    """
    try:
        view = prepare(json_schema(parameters, whitespace="bounded", max_whitespace=whitespace)).view("xgrammar")
        view.unenforced("refuse")
    except ConstraintError as error:
        raise ConstraintError(f"tool {tool!r}{' at ' + at if at else ''}: {error}") from error
    if view.plan is not None:
        path = next((at for at, node in walk(view.plan.schema) if id(node) in view.plan.reached
                     and ("uniqueItems" in node or "contains" in node)), "#")
        raise refused(tool, (at or "#") + path[1:], "a keyword only the host's item tracker enforces (uniqueItems / contains)",
                      "tool arguments run no tracker: remove it from the parameters")
    element = {"type": "json_schema", "json_schema": view.schema, "max_whitespace_cnt": whitespace}
    try:  # xgrammar's tag reads less than its JSON-schema compiler (a `false` subschema): named per tool here
        structural_tag_text({"type": "structural_tag", "format": element})
    except Exception as error:  # noqa: BLE001 - xgrammar's own exception types
        raise ConstraintError(f"tool {tool!r}{' at ' + at if at else ''}: xgrammar's tool grammar cannot hold these "
                              f"parameters ({engine_message(error)}); simplify them (a property the schema forbids: "
                              "`additionalProperties: false` without it)") from error
    return element


def _extra(schema: dict, allowed: set, tool: str, path: str, spelling: str) -> None:
    for keyword in schema:
        if keyword not in allowed and keyword not in ANNOTATIONS:
            raise refused(tool, f"{path}/{keyword}", f"`{keyword}` is not enforced in {spelling} arguments",
                          "remove it, or use a family with JSON arguments (hermes, llama3_json, mistral)")


def _literal_choices(schema: dict, write, tool: str, path: str, spelling: str) -> dict | None:
    values = [schema["const"]] if "const" in schema else schema.get("enum")
    if values is None:
        return None
    _extra(schema, {"const", "enum", "type"}, tool, path, spelling)
    if not values:
        raise refused(tool, path, "an empty `enum`", "list at least one value")
    return _or([_const(write(v)) for v in values])


def _scalar(schema: dict, kind: str, tool: str, path: str, spelling: str, python: bool) -> dict:
    if kind in ("integer", "number"):  # spelled as JSON spells them: JSON's grammar, keywords through the policy
        return json_arguments(tool, schema, 1, path)  # a number has no gap: the cap is moot
    _extra(schema, {"type"}, tool, path, spelling)
    if kind == "boolean":
        return _or([_const("True"), _const("False")] if python else
                   [_const("true"), _const("false"), _const("True"), _const("False")])
    return _const("None") if python else _or([_const("null"), _const("None")])


def _kind(schema, tool: str, path: str, spelling: str) -> str:
    if not isinstance(schema, dict) or not isinstance(schema.get("type"), str):
        raise refused(tool, path, f"a value without one `type` cannot be spelled in {spelling} arguments",
                      "give the parameter one type, or use a family with JSON arguments")
    return schema["type"]


def python_value_element(schema, tool: str, path: str) -> dict:
    """A Python literal valid against ``schema`` (strings, numbers, booleans, None, lists, dicts with properties)."""
    from neuron_constrain.structured.tool_calls.families import python_value

    choices = _literal_choices(schema, python_value, tool, path, "Python") if isinstance(schema, dict) else None
    if choices is not None:
        return choices
    if isinstance(schema, dict) and not set(schema) - ANNOTATIONS or schema is True:
        return {"type": "grammar", "grammar": _PY_ANY}  # untyped: any literal is valid
    kind = _kind(schema, tool, path, "Python")
    if kind == "string":
        _extra(schema, {"type", "minLength", "maxLength"}, tool, path, "Python")
        low, high = schema.get("minLength", 0), schema.get("maxLength", "")
        return {"type": "regex", "pattern": _PY_STRING[:-2] + f"{{{low},{high}}}" + '"'}  # an escape is one character
    if kind == "array":
        _extra(schema, {"type", "items", "minItems", "maxItems"}, tool, path, "Python")
        if not isinstance(schema.get("items"), dict):
            raise refused(tool, path, "an array without an `items` schema", "give its items a schema")
        item = python_value_element(schema["items"], tool, f"{path}/items")
        low, high = schema.get("minItems", 0), schema.get("maxItems", -1)
        rest = {"type": "repeat", "min": max(low - 1, 0), "max": high - 1 if high > 0 else -1,
                "content": _sequence(_const(", "), item)}
        items = _sequence(_const("["), item, rest, _const("]"))
        return items if low > 0 else _or([_const("[]"), items]) if high != 0 else _const("[]")
    if kind == "object":
        return _object(schema, tool, path, "Python", python_value_element, "{", "}", ": ", json.dumps)
    return _scalar(schema, kind, tool, path, "Python", True)


def _object(schema, tool, path, spelling, element, begin, end, colon, write_key) -> dict:
    _extra(schema, {"type", "properties", "required", "additionalProperties"}, tool, path, spelling)
    properties = schema.get("properties") or {}
    if schema.get("additionalProperties", False) is not False or not properties:
        raise refused(tool, path, f"an object without listed `properties` cannot be spelled in {spelling} arguments",
                      "list its properties (additionalProperties: false is assumed)")
    required = set(schema.get("required", ()))
    missing = required - set(properties)
    if missing:
        raise refused(tool, f"{path}/required", f"required {sorted(missing)} not among the properties", "list them")
    # properties in the schema's order: each required one present, each other one optional; ", " between
    entries = [(key, _sequence(_const(write_key(key) + colon), element(value, tool, f"{path}/properties/{key}")))
               for key, value in properties.items()]
    return _sequence(_const(begin), _joined(entries, required, ", "), _const(end))


def _joined(entries: list, required: set, separator: str) -> dict:
    """``entries`` in order, joined by ``separator``, the optional ones optional: the first entry written
    chooses the branch, and after it each entry is ``separator element`` (optional unless required), so the
    element grows with the square of the entries, not exponentially."""
    def rest(i: int) -> list:
        return [_sequence(_const(separator), element) if key in required
                else {"type": "optional", "content": _sequence(_const(separator), element)}
                for key, element in entries[i:]]

    branches = []
    for i, (key, element) in enumerate(entries):
        branches.append(_sequence(element, *rest(i + 1)))
        if key in required:
            break
    else:
        branches.append(_const(""))
    return _or(branches)


def arguments_element(family, tool: str, parameters, whitespace: int) -> dict:
    """The structural-tag element of one tool's arguments as ``family`` spells them.

    Args:
        family: the ``ToolFamily``.
        tool: the tool's name.
        parameters: its parameters' JSON schema.
        whitespace: JSON's whitespace cap per gap.

    Returns:
        The element.

    Raises:
        ConstraintError: a keyword the spelling would not enforce, naming the tool and its pointer.
    """
    if family.arguments == "json":
        return json_arguments(tool, parameters, whitespace)
    if family.arguments == "python":
        for key in parameters.get("properties") or {}:
            if not F.IDENTIFIER.match(key) or keyword.iskeyword(key):
                raise refused(tool, f"#/properties/{key}", "a keyword argument must be a Python identifier (not a "
                              "keyword)", "rename the parameter, or use a family with JSON arguments")
        if not (parameters.get("properties") or parameters.get("required")):
            _extra(parameters, {"type", "properties", "required", "additionalProperties"}, tool, "#", "Python")
            return _const("")
        return _object(parameters, tool, "#", "Python", python_value_element, "", "", "=", str)
    return _xml_arguments(tool, parameters, whitespace)


def _xml_arguments(tool: str, parameters: dict, whitespace: int) -> dict:
    _extra(parameters, {"type", "properties", "required", "additionalProperties"}, tool, "#", "XML")
    properties = parameters.get("properties") or {}
    required = set(parameters.get("required", ()))
    entries = []
    for key, schema in properties.items():
        path = f"#/properties/{key}"
        if not key or any(char in key for char in "<>\n"):
            raise refused(tool, path, "a parameter name with <, > or a newline cannot be written in "
                          "<parameter=NAME>", "rename the parameter, or use a family with JSON arguments")
        kind = None if isinstance(schema, dict) and ("enum" in schema or "const" in schema) else _kind(schema, tool, path, "XML")
        if kind in ("object", "array"):
            value = json_arguments(tool, schema, whitespace, path)
        elif kind == "string":
            _extra(schema, {"type", "minLength", "maxLength"}, tool, path, "XML")
            if "minLength" in schema or "maxLength" in schema:  # counted: no newline inside (narrowed), so the
                low, high = schema.get("minLength", 0), schema.get("maxLength", "")  # closing tag cannot start early
                value = {"type": "regex", "pattern": f"[^\\n]{{{low},{high}}}"}
            else:
                value = {"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": "\n</parameter>\n"}
                entries.append((key, _sequence(_const(f"<parameter={key}>\n"), value)))
                continue
        elif kind is None:
            from neuron_constrain.structured.tool_calls.families import xml_value

            value = _literal_choices(schema, xml_value, tool, path, "XML")
        else:
            value = _scalar(schema, kind, tool, path, "XML", False)
        entries.append((key, _sequence(_const(f"<parameter={key}>\n"), value, _const("\n</parameter>\n"))))
    return _joined(entries, required, "")


def read_xml_value(text: str, schema):
    """A ``<parameter>`` block's text as the value its schema types it (raises ValueError if it is not one)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(schema, dict) and ("enum" in schema or "const" in schema):
        from neuron_constrain.structured.tool_calls.families import xml_value

        for value in [schema["const"]] if "const" in schema else schema["enum"]:
            if xml_value(value) == text:
                return value
        raise ValueError(f"{text!r} is none of the parameter's values")
    if kind == "string":
        return text
    if kind in ("boolean", "null"):
        words = {"true": True, "True": True, "false": False, "False": False, "null": None, "None": None}
        if text not in words:
            raise ValueError(f"{text!r} is not a {kind}")
        return words[text]
    value = json.loads(text)
    if kind == "integer" and not isinstance(value, int):
        raise ValueError(f"{text!r} is not an integer")
    return value


def python_arguments(source: str) -> list[tuple[str, dict]]:
    """``[f(a=1), g()]`` as ``[(name, arguments)]`` (raises ValueError for anything but calls of literals)."""
    try:
        tree = ast.parse(source.strip(), mode="eval").body
    except SyntaxError as error:
        raise ValueError(f"not a Python list of calls ({error.msg})") from None
    if not isinstance(tree, ast.List):
        raise ValueError("not a Python list of calls")
    calls = []
    for node in tree.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args):
            raise ValueError("an item is not a call with keyword arguments")
        try:
            calls.append((node.func.id, {k.arg: ast.literal_eval(k.value) for k in node.keywords}))
        except ValueError as error:
            raise ValueError(f"an argument of {node.func.id} is not a literal ({error})") from None
    return calls
