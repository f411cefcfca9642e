"""What a request's output must match: JSON schema, any JSON, regex, choice, EBNF;
and ``validate_output``, the check of a finished answer that does not trust the engine."""
from __future__ import annotations

import dataclasses
import functools
import json
import re
from typing import Any, Sequence

import xgrammar as xgr


class ConstraintError(ValueError):
    """A constraint is malformed or xgrammar cannot compile it (a one-line message)."""


# xgrammar's C++ errors read "[07:18:18] /project/cpp/regex_converter.cc:83: Regex parsing error ...\n".
_CPP_PREFIX = re.compile(r"^\s*(\[[0-9:]+\]\s*)?(\S+\.(cc|h|cpp):\d+:\s*)?")


def engine_message(error: BaseException) -> str:
    """An engine's error as one clean line: no timestamp, no C++ source path, no newlines."""
    text = " ".join(str(error).split())
    return _CPP_PREFIX.sub("", text) or type(error).__name__


WHITESPACE = ("none", "compact", "bounded", "any")


# xgrammar 0.2.8 writes the characters of a string with minLength/maxLength as this
# class, which admits raw control characters (invalid JSON: "\x06" inside a string).
# We compile with JSON's own string-character class instead.
LENGTH_STRING_CLASS = r'[^\"\\\r\n]'
JSON_STRING_CLASS = r'[^\0-\x1f\"\\]'


@dataclasses.dataclass(frozen=True, eq=False)
class Constraint:
    """What a request's output must match. Build with the functions below (or :func:`tool_constraint`)."""

    kind: str  # "json_schema" | "json" | "regex" | "choice" | "ebnf" | "structural_tag"
    spec: Any = None
    whitespace: str = "compact"  # JSON: "compact" (", " and ": ") | "none" | "bounded" | "any"
    strict: bool = True  # JSON schema: xgrammar's strict_mode (unlisted properties/items refused)
    max_whitespace: int = 2  # "bounded": at most this many whitespace characters in each gap
    validate: Any = None  # tool formats: ``text -> None | reason`` (see tools.py)
    unenforced: str = "refuse"  # JSON schema keywords the engine cannot enforce: "refuse" | "allow" (keywords.py)

    @property
    def compact(self) -> bool:
        return self.whitespace == "none"

    @functools.cached_property
    def key(self) -> tuple:
        """What the compiled grammar depends on: equal keys share one compiled grammar."""
        spec = json.dumps(self.spec, sort_keys=True, ensure_ascii=False) if self.kind != "regex" else self.spec
        return (self.kind, spec, self.whitespace, self.strict, self.max_whitespace, self.unenforced)

    def compile(self, compiler: xgr.GrammarCompiler) -> xgr.CompiledGrammar:
        try:
            if self.kind == "json_schema":
                return compiler.compile_grammar(self.schema_grammar())
            if self.kind == "json":
                return compiler.compile_builtin_json_grammar()
            if self.kind == "regex":
                return compiler.compile_regex(self.spec)
            if self.kind in ("choice", "ebnf"):
                return compiler.compile_grammar(self.grammar_text())
            if self.kind == "structural_tag":
                return compiler.compile_structural_tag(self.spec)
        except ConstraintError:
            raise
        except Exception as error:  # xgrammar raises RuntimeError/ValueError with its parser's message
            raise ConstraintError(
                f"xgrammar could not compile this {self.kind} constraint ({engine_message(error)}); "
                "fix the schema/pattern/grammar (xgrammar's dialect) and resubmit the request"
            ) from error
        raise ConstraintError(f"unknown constraint kind {self.kind!r}")

    def schema_grammar(self) -> xgr.Grammar:
        """The xgrammar grammar of a ``json_schema`` constraint, JSON string characters fixed."""
        try:
            grammar = xgr.Grammar.from_json_schema(self.spec, strict_mode=self.strict, **_whitespace_options(self))
        except Exception as error:
            raise ConstraintError(
                f"xgrammar could not convert this JSON schema ({engine_message(error)}); fix the schema"
                + (" or pass strict=False" if self.strict else "")
            ) from error
        text = fixed = str(grammar)
        if LENGTH_STRING_CLASS in fixed:
            fixed = fixed.replace(LENGTH_STRING_CLASS, JSON_STRING_CLASS)
        if self.whitespace == "none":  # xgrammar 0.2.8 separates untyped values' items with ", " even here
            fixed = fixed.replace('(", " basic_any)', '("," basic_any)').replace('(", " basic_string ', '("," basic_string ')
        return grammar if fixed == text else xgr.Grammar.from_ebnf(fixed)

    def grammar_text(self) -> str:
        if self.kind == "choice":
            return "root ::= " + " | ".join(_ebnf_literal(option) for option in self.spec)
        return self.spec

    def describe(self) -> str:
        if self.kind == "json":
            return "any JSON"
        text = json.dumps(self.spec) if self.kind in ("json_schema", "choice", "structural_tag") else self.spec
        return f"{self.kind} {text[:60]}{'...' if len(text) > 60 else ''}"


def _whitespace_options(constraint: Constraint) -> dict:
    if constraint.whitespace == "none":
        return {"any_whitespace": False, "separators": (",", ":")}
    if constraint.whitespace == "compact":
        return {"any_whitespace": False, "separators": (", ", ": ")}
    if constraint.whitespace == "bounded":
        return {"any_whitespace": True, "max_whitespace_cnt": constraint.max_whitespace}
    return {"any_whitespace": True}


def _ebnf_literal(text: str) -> str:
    escaped = []
    for char in text:
        if char in '"\\':
            escaped.append("\\" + char)
        elif char.isprintable():
            escaped.append(char)
        else:
            escaped.append(f"\\u{ord(char):04x}" if ord(char) < 0x10000 else f"\\U{ord(char):08x}")
    return '"' + "".join(escaped) + '"'


def json_schema(
    schema: dict | bool | str,
    *,
    strict: bool = True,
    whitespace: str | None = None,
    max_whitespace: int = 2,
    compact: bool | None = None,
    unenforced: str = "refuse",
) -> Constraint:
    """Output is JSON valid against ``schema`` (a dict; ``True``: any JSON value; ``False`` is refused
    when compiled: no value satisfies it).

    ``whitespace``: ``"compact"`` (the default: ``", "`` and ``": "`` as ``json.dumps``
    writes them; the most accurate on SmolLM2 in ``benchmarks/bench_quality.py``), ``"none"``
    (no whitespace between tokens: the fewest tokens), ``"bounded"`` (any
    whitespace, at most ``max_whitespace`` characters per gap) or ``"any"`` (unbounded:
    a random model can emit dozens of whitespace tokens). ``compact=True/False`` is the
    older spelling of ``"none"``/``"any"``. ``strict=False`` lets unlisted properties and
    extra array items through (xgrammar's ``strict_mode``; some real schemas compile only so).
    ``unenforced``: a keyword the engine would not enforce is refused (``"refuse"``, the
    default) or accepted, listed on the result and the output validated (``"allow"``);
    see ``neuron_constrain.structured.keywords``.
    """
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as error:
            raise ConstraintError(f"the JSON schema is not JSON ({error}); pass a dict or a JSON string") from error
    if not isinstance(schema, (dict, bool)):
        raise ConstraintError(f"a JSON schema is a dict (or true / false), got {type(schema).__name__}")
    if whitespace is None:
        whitespace = "compact" if compact is None else "none" if compact else "any"
    elif compact is not None:
        raise ConstraintError("pass whitespace= or compact=, not both (compact=True is whitespace='none')")
    if whitespace not in WHITESPACE:
        raise ConstraintError(f"whitespace={whitespace!r} is not one of {WHITESPACE}")
    if not isinstance(max_whitespace, int) or max_whitespace < 1:
        raise ConstraintError(f"max_whitespace={max_whitespace!r}: pass a positive int (whitespace characters per gap)")
    if unenforced not in ("refuse", "allow"):
        raise ConstraintError(f"unenforced={unenforced!r}: pass 'refuse' (the default) or 'allow'")
    return Constraint("json_schema", schema, whitespace, bool(strict), max_whitespace, unenforced=unenforced)


def any_json() -> Constraint:
    """Output is any JSON object or array (OpenAI's ``response_format={"type": "json_object"}``)."""
    return Constraint("json", None, "any")


def regex(pattern: str) -> Constraint:
    if not isinstance(pattern, str) or not pattern:
        raise ConstraintError(f"a regex constraint needs a non-empty pattern string, got {pattern!r}")
    return Constraint("regex", pattern)


def choice(options: Sequence[str]) -> Constraint:
    """Output is exactly one of ``options``."""
    if isinstance(options, str) or not options or not all(isinstance(o, str) and o for o in options):
        raise ConstraintError(f"a choice constraint needs a list of non-empty strings, got {options!r}")
    return Constraint("choice", tuple(options))


def ebnf(grammar: str) -> Constraint:
    """Output matches an xgrammar EBNF grammar with a ``root`` rule."""
    if not isinstance(grammar, str) or "root" not in grammar:
        raise ConstraintError("an EBNF constraint needs grammar text with a `root ::= ...` rule")
    return Constraint("ebnf", grammar)


def validate_output(constraint: Constraint, text: str) -> str | None:
    """``None`` if ``text`` satisfies ``constraint``, else why not (checked without xgrammar
    for JSON (``jsonschema``, with the schema's declared ``$schema`` draft, default
    2020-12), regex (``re``), choice and tool calls (parsed, arguments validated); EBNF by
    a fresh xgrammar matcher)."""
    if constraint.validate is not None:
        return constraint.validate(text)
    if constraint.kind in ("json_schema", "json"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as error:
            return f"not JSON: {error}"
        if constraint.kind == "json":
            return None if isinstance(value, (dict, list)) else f"JSON {type(value).__name__}, not an object or array"
        import jsonschema  # the `test` extra

        # The draft the schema declares ($schema): draft-04's boolean exclusiveMinimum, draft-07's
        # tuple `items` and draft-04's `dependencies` mean other things in 2020-12.
        validator = jsonschema.validators.validator_for(constraint.spec, default=jsonschema.Draft202012Validator)
        errors = sorted(validator(constraint.spec).iter_errors(value), key=str)
        return None if not errors else f"schema violation: {errors[0].message}"
    if constraint.kind == "regex":
        return None if re.fullmatch(constraint.spec, text) else f"does not match /{constraint.spec}/"
    if constraint.kind == "choice":
        return None if text in constraint.spec else f"not one of {list(constraint.spec)}"
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo([b"x"]), max_threads=1)  # accept_string needs no vocabulary
    matcher = xgr.GrammarMatcher(compiler.compile_grammar(constraint.spec))
    ok = matcher.accept_string(text) and matcher.is_completed()
    return None if ok else "does not match the grammar"
