r"""xgrammar's EBNF dialect as a Lark grammar, for llguidance (``ebnf_to_lark``).

    ebnf_to_lark('root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "x"')
    # start: ("(") r_item_1 ( (",") r_item_1 ) * (")")
    # r_item_1: /[\x{30}-\x{39}]/ | ("x")

Every literal becomes a sequence of one-character Lark literals, so llguidance's lexer
never lexes greedily across what EBNF keeps apart: the context-free meaning is exact.
Lookaheads are dropped (xgrammar requires them to hold anyway: they prune, they do not
change the language); xgrammar builtins other than ``Token(...)`` and ``Regex(...)`` are
refused with the fix.
"""
from __future__ import annotations

import json
import re

from neuron_constrain.structured.constraints import ConstraintError


def lark_chars(text: str) -> str:
    """``text`` as a sequence of one-character Lark literals (exact: no greedy lexing across them)."""
    if not text:
        return '""'
    return "(" + " ".join(json.dumps(ch, ensure_ascii=False) for ch in text) + ")"


_EBNF_TOKEN = re.compile(
    r"""\s+|\#[^\n]*                    # whitespace, comments
    |(?P<define>::=)
    |(?P<token>Token\(\s*\d+(?:\s*,\s*\d+)*\s*\))
    |(?P<regex>Regex\(\s*"(?:[^"\\]|\\.)*"\s*(?:,\s*json_string\s*=\s*(?:true|false)\s*)?\))
    |(?P<name>[A-Za-z_][A-Za-z0-9_.\-]*)
    |(?P<string>"(?:[^"\\]|\\.)*")
    |(?P<cls>\[(?:[^\]\\]|\\.)*\])
    |(?P<repeat>\{\s*\d+\s*(?:,\s*(?:-1|\d*)\s*)?\})
    |(?P<lookahead>\(=)
    |(?P<op>[()|*+?])
    """,
    re.VERBOSE,
)
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "'": "'", "[": "[", "]": "]", "-": "-",
            "0": "\0", "b": "\b", "f": "\f", "v": "\v", "/": "/", "^": "^"}


def _unescape(body: str, where: str) -> list[str]:
    out, i = [], 0
    while i < len(body):
        ch = body[i]
        if ch != "\\":
            out.append(ch)
            i += 1
            continue
        code = body[i + 1:i + 2]
        if code in ("x", "u", "U"):
            size = {"x": 2, "u": 4, "U": 8}[code]
            digits = body[i + 2:i + 2 + size]
            if len(digits) != size or not all(c in "0123456789abcdefABCDEF" for c in digits):
                raise ConstraintError(f"EBNF escape \\{code}{digits} in {where} needs {size} hex digits")
            out.append(chr(int(digits, 16)))
            i += 2 + size
        elif code in _ESCAPES:
            out.append(_ESCAPES[code])
            i += 2
        else:
            raise ConstraintError(f"unknown EBNF escape \\{code} in {where}; write the character itself")
    return out


def _regex_char(ch: str) -> str:
    return f"\\x{{{ord(ch):x}}}"


_CLASS_ITEM = re.compile(r"\\(?:x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|.)|.", re.DOTALL)


def _char_class(token: str) -> str:
    """An EBNF ``[...]`` class as a one-character Lark regex, every character hex-escaped."""
    body, negate = token[1:-1], token.startswith("[^")
    if negate:
        body = body[1:]
    items = [None if m.group(0) == "-" else _unescape(m.group(0), token)[0] for m in _CLASS_ITEM.finditer(body)]
    ranges, k = [], 0
    while k < len(items):
        if k + 2 < len(items) and items[k] is not None and items[k + 1] is None and items[k + 2] is not None:
            ranges.append((ord(items[k]), ord(items[k + 2])))
            k += 3
        else:
            ranges.append((ord("-" if items[k] is None else items[k]),) * 2)
            k += 1
    parts = []
    for low, high in ranges:  # surrogates are no text (llguidance's regex refuses them): left out
        for a, b in ((low, min(high, 0xD7FF)), (max(low, 0xE000), high)):
            if a <= b:
                parts.append(_regex_char(chr(a)) + ("" if a == b else "-" + _regex_char(chr(b))))
    if not parts:
        raise ConstraintError(f"the EBNF character class {token} is empty")
    return "/[" + ("^" if negate else "") + "".join(parts) + "]/"


def _regex_builtin(text: str) -> str:
    """xgrammar's ``Regex("...", json_string=...)`` as a Lark regex. Inside a JSON string xgrammar
    escapes what the pattern matches; we take only patterns that cannot match ``"`` or ``\\``."""
    body = re.match(r'Regex\(\s*("(?:[^"\\]|\\.)*")', text).group(1)
    pattern = json.loads(body)
    if "json_string=true" in text.replace(" ", "") and re.search(r'\.|\[\^|\\[SWD]|"|\\\\', pattern):
        raise ConstraintError(
            f"llguidance: the EBNF Regex({body}, json_string=true) may match a quote or backslash, which xgrammar "
            "escapes and this conversion does not; use engine='xgrammar'"
        )
    pattern = pattern[1:] if pattern.startswith("^") else pattern
    pattern = pattern[:-1] if pattern.endswith("$") and not pattern.endswith("\\$") else pattern
    return "/" + pattern.replace("/", "\\/") + "/"


def _skip_group(text: str, at: int) -> int:
    """The offset just past the ``)`` closing the group opened before ``at`` (strings and classes skipped)."""
    depth = 1
    while at < len(text) and depth:
        char = text[at]
        if char in "\"[":
            close = "\"" if char == "\"" else "]"
            at += 1
            while at < len(text) and text[at] != close:
                at += 2 if text[at] == "\\" else 1
        elif char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        at += 1
    if depth:
        raise ConstraintError("an EBNF lookahead `(= ...` is not closed; close it with `)`")
    return at


def ebnf_to_lark(grammar: str) -> str:
    """The Lark grammar (llguidance's dialect) of an xgrammar EBNF grammar.

    Supported: ``name ::= ...`` rules (``root`` is the start), sequences, ``|``, groups,
    ``* + ? {m} {m,} {m,n} {m,-1}``, string literals and character classes with escapes
    (``\\n \\t \\xHH \\uHHHH``...), ``Token(id)``, ``#`` comments: what users write and
    what xgrammar's structural tags (the tool-call formats) produce. Lookaheads ``(= ...)``
    are dropped (xgrammar requires them to hold whenever the rule matches: they prune, they
    do not change the language). Other xgrammar builtins (``TagDispatch``...) are refused
    with a :class:`ConstraintError` that names the fix.
    """
    tokens, at = [], 0
    while at < len(grammar):
        match = _EBNF_TOKEN.match(grammar, at)
        if match is None:
            raise ConstraintError(
                f"llguidance cannot take this EBNF: unexpected {grammar[at:at + 20]!r} at offset {at}; "
                "use engine='xgrammar' for xgrammar's full EBNF, or rewrite the grammar in the simple subset"
            )
        at = match.end()
        if match.lastgroup == "lookahead":  # an assertion that must hold anyway: it prunes, never changes the language
            at = _skip_group(grammar, at)
            continue
        if match.lastgroup:
            tokens.append((match.lastgroup, match.group(match.lastgroup)))
    rules: dict[str, list] = {}
    order: list[str] = []
    i = 0
    while i < len(tokens):
        if not (tokens[i][0] == "name" and i + 1 < len(tokens) and tokens[i + 1][0] == "define"):
            raise ConstraintError(f"EBNF rule expected at {tokens[i][1]!r}: write `name ::= expression` rules")
        name, i = tokens[i][1], i + 2
        body = []
        while i < len(tokens) and not (tokens[i][0] == "name" and i + 1 < len(tokens) and tokens[i + 1][0] == "define"):
            body.append(tokens[i])
            i += 1
        if name in rules:
            raise ConstraintError(f"EBNF rule {name!r} is defined twice; merge its alternatives with |")
        rules[name] = body
        order.append(name)
    if "root" not in rules:
        raise ConstraintError("an EBNF grammar needs a `root ::= ...` rule")
    names = {"root": "start"}
    for name in order:
        if name != "root":
            names[name] = "r_" + re.sub(r"[^a-z0-9_]", "_", name.lower()) + f"_{len(names)}"
    lines = []
    for name in order:
        out = []
        for kind, text in rules[name]:
            if kind == "name":
                if text not in names:
                    raise ConstraintError(
                        f"EBNF rule {name!r} uses {text!r}, which is not defined (xgrammar builtins are not "
                        "available on llguidance); define it, or use engine='xgrammar'"
                    )
                out.append(names[text])
            elif kind == "string":
                out.append(lark_chars("".join(_unescape(text[1:-1], text))))
            elif kind == "cls":
                out.append(_char_class(text))
            elif kind == "repeat":
                out.append(text.replace(" ", "").replace(",-1}", ",}"))  # llguidance reads {m} {m,} {m,n}
            elif kind == "regex":
                out.append(_regex_builtin(text))
            elif kind == "token":  # xgrammar's Token(id, ...): the token itself (control tokens included)
                ids = re.findall(r"\d+", text)
                out.append("(" + " | ".join(f"<[{i}]>" for i in ids) + ")")
            else:
                out.append(text)
        lines.append(f"{names[name]}: " + " ".join(out))
    return "\n".join(lines) + "\n"
