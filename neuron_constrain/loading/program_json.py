"""Program-JSON validation: the strings of ``models/<model>.json`` torch would eval, exec or call.

    check_program_json(path, "archive/models/model.json", data)   # or a LoadError naming the string

torch ``sympify``-s (``eval``) every ``expr_str``, ``ep.module()`` ``exec``-s each of
``guards_code``, and the graph calls every node target it names. Allowed: sympy
``srepr`` text of the functions torch writes (a small recursive-descent parser, no
eval), guards that only compare input shapes (an AST allow-list), and node targets
that resolve to operators or to the Python functions torch's verifier allows.
"""
from __future__ import annotations

import ast
import json
import re
from typing import Iterable

from neuron_constrain.loading.errors import OPT_IN, RESAVE, LoadError, first_line

_SYMPY_CALLS = {
    "Symbol", "Dummy", "Integer", "Rational", "Float", "Add", "Mul", "Pow", "Max", "Min", "Abs", "Mod", "floor",
    "ceiling", "Equality", "Unequality", "StrictLessThan", "LessThan", "StrictGreaterThan", "GreaterThan", "And",
    "Or", "Not", "Xor", "Piecewise", "ExprCondPair", "Tuple", "sqrt",
    # torch.utils._sympy.functions
    "FloorDiv", "ModularIndexing", "Where", "PythonMod", "CleanDiv", "CeilToInt", "FloorToInt", "CeilDiv", "LShift",
    "RShift", "PowByNatural", "FloatPow", "FloatTrueDiv", "IntTrueDiv", "IsNonOverlappingAndDenseIndicator",
    "TruncToFloat", "TruncToInt", "RoundToInt", "RoundDecimal", "ToFloat", "Identity",
}
_SYMPY_OPAQUE = re.compile(r"(OpaqueUnaryFn|BitwiseFn)_[a-z0-9_]+$")
_SYMPY_CONSTANTS = {"oo", "zoo", "nan", "true", "false", "pi", "E", "int_oo"}
_SYMPY_TOKEN = re.compile(r"\s*(?:(?P<name>[A-Za-z][A-Za-z0-9_]*)|(?P<int>-?\d{1,40})|(?P<str>'[A-Za-z0-9_.+\-]{0,64}')"
                          r"|(?P<punct>[(),=-]))")
_MAX_EXPRESSION = 20_000


def _bad_sympy(expr: str) -> str | None:
    """Why ``expr`` is not sympy ``srepr`` text torch would ``sympify`` harmlessly, or None."""
    if not isinstance(expr, str) or len(expr) > _MAX_EXPRESSION:
        return "is not a short string"
    tokens, at = [], 0
    while at < len(expr):
        match = _SYMPY_TOKEN.match(expr, at)
        if not match or match.end() == at:
            if expr[at:].strip() == "":
                break
            return f"has {expr[at:at + 20]!r}, which srepr never writes"
        tokens.append((match.lastgroup, match.group(match.lastgroup)))
        at = match.end()
    position = 0

    def peek(kind=None, value=None):
        if position >= len(tokens):
            return False
        k, v = tokens[position]
        return (kind is None or k == kind) and (value is None or v == value)

    def take(kind=None, value=None):
        nonlocal position
        if not peek(kind, value):
            raise ValueError(f"expected {value or kind} at token {position}")
        position += 1
        return tokens[position - 1][1]

    def expression(depth):
        if depth > 200:
            raise ValueError("nests too deep")
        if peek("punct", "-"):
            take()
            name = take("name")
            if name not in _SYMPY_CONSTANTS:
                raise ValueError(f"-{name} is not a sympy constant")
            return
        if peek("int") or peek("str"):
            take()
            return
        name = take("name")
        if not peek("punct", "("):
            if name not in _SYMPY_CONSTANTS:
                raise ValueError(f"{name!r} is not a sympy constant")
            return
        if name not in _SYMPY_CALLS and not _SYMPY_OPAQUE.match(name):
            raise ValueError(f"{name!r} is not a sympy function torch writes")
        take("punct", "(")
        while not peek("punct", ")"):
            if peek("name") and position + 1 < len(tokens) and tokens[position + 1] == ("punct", "="):
                keyword = take("name")
                if not re.fullmatch(r"[a-z][a-z_]*", keyword):
                    raise ValueError(f"keyword {keyword!r}")
                take("punct", "=")
                if peek("name"):
                    if take("name") not in ("True", "False", "None"):
                        raise ValueError("a keyword value must be True, False, None, a number or a string")
                else:
                    take("int") if peek("int") else take("str")
            else:
                expression(depth + 1)
            if not peek("punct", ")"):
                take("punct", ",")
        take("punct", ")")

    try:
        expression(0)
        if position != len(tokens):
            raise ValueError("trailing text")
    except ValueError as e:
        return f"is not sympy srepr text ({e})"
    return None


_GUARD_METHODS = {"size", "stride", "storage_offset", "dim", "numel"}
_GUARD_FUNCTIONS = {"Max", "Min", "FloorDiv", "Mod", "PythonMod", "Eq", "Ne", "CeilToInt", "FloorToInt", "TruncToInt",
                    "ToFloat", "IntTrueDiv", "FloatTrueDiv", "Abs", "sym_max", "sym_min", "sym_float", "sym_int"}
_GUARD_NODES = (ast.Expression, ast.Compare, ast.BoolOp, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Name, ast.Subscript,
                ast.Attribute, ast.Call, ast.Load, ast.And, ast.Or, ast.Not, ast.USub, ast.UAdd, ast.Add, ast.Sub,
                ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE,
                ast.Tuple)


def _bad_guard(code: str) -> str | None:
    """Why ``code`` is not an input-shape guard like ``L['x'].size()[0] <= 64``, or None (``ep.module()`` execs it)."""
    if not isinstance(code, str) or len(code) > _MAX_EXPRESSION:
        return "is not a short string"
    try:
        tree = ast.parse(code, mode="eval")
    except SyntaxError as e:
        return f"is not a Python expression ({e.msg})"
    for node in ast.walk(tree):
        if not isinstance(node, _GUARD_NODES):
            return f"uses {type(node).__name__}, which a shape guard never does"
        if isinstance(node, ast.Constant) and not isinstance(node.value, (int, float, str, bool)):
            return f"has the constant {node.value!r}"
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and not re.fullmatch(r"\w{0,128}", node.value):
            return f"has the string {node.value!r}"
        if isinstance(node, ast.Name) and node.id not in {"L", "math", *_GUARD_FUNCTIONS}:
            return f"names {node.id!r}"
        if isinstance(node, ast.Attribute):
            is_math = isinstance(node.value, ast.Name) and node.value.id == "math"
            if not (node.attr in _GUARD_METHODS or (is_math and node.attr in {"inf", "floor", "ceil", "trunc", "sqrt"})):
                return f"reads the attribute {node.attr!r}"
        if isinstance(node, ast.Call):
            if node.keywords or (isinstance(node.func, ast.Attribute) and node.func.attr in _GUARD_METHODS and node.args):
                return "calls with arguments a shape guard never passes"
            if not isinstance(node.func, (ast.Attribute, ast.Name)):
                return "calls something computed"
    return None


def _allowed_python_targets() -> list:
    import math
    import operator

    import torch

    found = [operator.getitem, operator.add, operator.mul, operator.sub, operator.truediv, operator.ge, operator.le,
             operator.gt, operator.lt, operator.eq, operator.ne, operator.floordiv, operator.mod, operator.and_,
             operator.or_, operator.not_, operator.pow, operator.neg, operator.abs, operator.lshift, operator.rshift,
             math.ceil, math.floor, math.trunc, round]
    # torch's verifier allowlist of Python functions (those this torch has)
    for owner, name in [(torch, "sym_int"), (torch, "sym_float"), (torch, "sym_ite"), (torch, "sym_max"),
                        (torch, "sym_min"), (torch, "sym_not"), (torch, "sym_sqrt"), (torch, "sym_sum"),
                        (torch._C, "_set_grad_enabled"), (torch.autograd.grad_mode, "set_grad_enabled"),
                        (torch.amp.autocast_mode, "_enter_autocast"), (torch.amp.autocast_mode, "_exit_autocast")]:
        if hasattr(owner, name):
            found.append(getattr(owner, name))
    return found


def _bad_target(target: str, allowed: list) -> str | None:
    """Why the node target ``target`` is not an operator (resolved the way torch's deserializer resolves it), or None."""
    import math
    import operator

    import torch

    if not isinstance(target, str):
        return "is not a string"
    if target.startswith("#"):
        return "is an extension operator torch resolves through a registry"
    if target.startswith("_operator"):
        obj, parts = operator, target.split(".")[1:]
    elif target.startswith("torch"):
        obj, parts = torch, target.split(".")[1:]
    elif target.startswith("math"):
        obj, parts = math, target.split(".")[1:]
    else:
        return None  # torch keeps it as a string: nothing is called
    if parts[:1] == ["ops"] and len(parts) < 3:
        return "is not an operator (torch.ops.<namespace>.<op>)"
    for part in parts:
        try:
            if not hasattr(obj, part):
                return None  # unresolved: torch keeps the string
            obj = getattr(obj, part)
        except Exception:
            return None
    from torch._ops import HigherOrderOperator, OpOverload, OpOverloadPacket

    if isinstance(obj, (OpOverload, OpOverloadPacket, HigherOrderOperator)):
        return None
    if any(obj is a for a in allowed):
        return None
    return f"resolves to {type(obj).__name__} {getattr(obj, '__name__', '?')!r}, not an operator the verifier allows"


def check_program_json(path: str, name: str, data: bytearray) -> None:
    """Refuse the program JSON's strings torch would eval, exec or call: expressions, guards, node targets."""
    try:
        program = json.loads(bytes(data).decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise LoadError(path, f"is not JSON ({first_line(e)}); the archive is corrupt; {RESAVE}", name) from e
    if not isinstance(program, dict):
        raise LoadError(path, f"is not a serialized exported program; {RESAVE}", name)
    guards = program.get("guards_code") or []
    if not isinstance(guards, list):
        raise LoadError(path, "has guards_code that is not a list; refusing", name)
    for guard in guards:
        reason = _bad_guard(guard)
        if reason:
            raise LoadError(path, f"has guard {str(guard)[:80]!r}, which {reason}; ep.module() would exec it; "
                                  f"refusing; {OPT_IN}", name)
    allowed = _allowed_python_targets()
    for node in _walk(program):
        if "expr_str" in node:
            reason = _bad_sympy(node["expr_str"])
            if reason:
                raise LoadError(path, f"has the symbolic expression {str(node['expr_str'])[:80]!r}, which {reason}; "
                                      f"torch would eval it with sympify; refusing; {OPT_IN}", name)
        if "target" in node and "inputs" in node and "outputs" in node:
            reason = _bad_target(node["target"], allowed)
            if reason:
                raise LoadError(path, f"has a node calling {str(node['target'])[:80]!r}, which {reason}; "
                                      f"refusing; {OPT_IN}", name)


def _walk(value) -> Iterable[dict]:
    """Every dict inside a JSON value, without recursion (deep nesting cannot overflow the stack)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            yield item
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
