"""What a request's output must match: JSON schema, any JSON, regex, choice, EBNF. Each engine
compiles a :class:`Constraint` its own way (``engines/``); ``validation.py`` checks an answer."""
from __future__ import annotations

import dataclasses
import functools
import json
import re
from typing import Any, Sequence

from neuron_constrain.core.errors import Error


class ConstraintError(Error, ValueError):
    """A constraint is malformed, or an engine refuses or cannot compile it (a one-line message)."""


# xgrammar's C++ errors read "[07:18:18] /project/cpp/regex_converter.cc:83: Regex parsing error ...\n".
_CPP_PREFIX = re.compile(r"^\s*(\[[0-9:]+\]\s*)?(\S+\.(cc|h|cpp):\d+:\s*)?")


def engine_message(error: BaseException) -> str:
    """An engine's error as one clean line: no timestamp, no C++ source path, no newlines."""
    text = " ".join(str(error).split())
    return _CPP_PREFIX.sub("", text) or type(error).__name__


WHITESPACE = ("none", "compact", "bounded", "any")


@dataclasses.dataclass(frozen=True, eq=False)
class Constraint:
    """What a request's output must match. Build with the functions below (or :func:`tool_constraint`).

    Attributes:
        kind: ``"json_schema"``, ``"json"`` (any JSON), ``"regex"``, ``"choice"``, ``"ebnf"`` or
            ``"structural_tag"`` (tool calls in free text).
        spec: the schema, pattern, options or grammar.
        whitespace: JSON's whitespace mode (see :func:`json_schema`).
        strict: JSON schema: unlisted properties and items refused.
        max_whitespace: ``"bounded"``: whitespace characters a gap may hold.
        validate: tool formats: ``text -> None | reason``, the check of a finished answer (``tools.py``).
        unenforced: JSON schema keywords the engine cannot enforce: ``"refuse"`` or ``"allow"``.
        integral: JSON schema: an ``integer`` also takes its integral spellings (``1.0``, ``1e+16``) on xgrammar.
        escapes: JSON schema: a bounded string takes JSON's escapes on xgrammar where its bound allows.
    """

    kind: str  # "json_schema" | "json" | "regex" | "choice" | "ebnf" | "structural_tag"
    spec: Any = None
    whitespace: str = "compact"  # JSON: "compact" (", " and ": ") | "none" | "bounded" | "any"
    strict: bool = True  # JSON schema: xgrammar's strict_mode (unlisted properties/items refused)
    max_whitespace: int = 2  # "bounded": at most this many whitespace characters in each gap
    validate: Any = None  # tool formats: ``text -> None | reason`` (see tools.py)
    unenforced: str = "refuse"  # JSON schema keywords the engine cannot enforce: "refuse" | "allow" (keywords.py)
    integral: bool = True  # JSON schema: an integer also in its integral spellings (1.0, 1e+16) where the engine can
    escapes: bool = True  # JSON schema: a bounded string also takes JSON's escapes on xgrammar (grammars.py)

    @property
    def compact(self) -> bool:
        """Whether JSON is written with no whitespace (``whitespace="none"``)."""
        return self.whitespace == "none"

    @functools.cached_property
    def key(self) -> tuple:
        """What the compiled grammar depends on: equal keys share one compiled grammar."""
        spec = json.dumps(self.spec, sort_keys=True, ensure_ascii=False) if self.kind != "regex" else self.spec
        return (self.kind, spec, self.whitespace, self.strict, self.max_whitespace, self.unenforced, self.integral,
                self.escapes)

    def grammar_text(self) -> str:
        """The constraint as EBNF text (``"choice"`` and ``"ebnf"`` constraints).

        Returns:
            A choice's options as one EBNF rule of literals; otherwise the spec as it is (an EBNF
            constraint's grammar).
        """
        if self.kind == "choice":
            return "root ::= " + " | ".join(_ebnf_literal(option) for option in self.spec)
        return self.spec

    def describe(self) -> str:
        """The constraint in a few words, for messages.

        Returns:
            ``"any JSON"``, or its kind and the first 60 characters of its spec.
        """
        if self.kind == "json":
            return "any JSON"
        text = json.dumps(self.spec) if self.kind in ("json_schema", "choice", "structural_tag") else self.spec
        return f"{self.kind} {text[:60]}{'...' if len(text) > 60 else ''}"


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
    integral: bool = True,
    escapes: bool = True,
) -> Constraint:
    """Output is JSON valid against ``schema``.

    Args:
        schema: a JSON schema, as a dict or its JSON text; ``True``: any JSON value; ``False`` is
            refused when compiled (no value satisfies it).
        strict: refuse properties and array items the schema does not list (xgrammar's
            ``strict_mode``); ``False`` lets them through (JSON Schema's own meaning; some real
            schemas compile only so).
        whitespace: ``"compact"`` (the default: ``", "`` and ``": "`` as ``json.dumps`` writes
            them; the most accurate on SmolLM2), ``"none"`` (the fewest tokens), ``"bounded"``
            (at most ``max_whitespace`` characters a gap) or ``"any"`` (unbounded).
        max_whitespace: characters a gap may hold under ``"bounded"``.
        compact: the older spelling: ``True`` is ``"none"``, ``False`` is ``"any"``.
        unenforced: a keyword the engine would not enforce is refused (``"refuse"``, the
            default), or accepted, listed on the result and the output validated (``"allow"``).
        integral: an ``integer`` also takes the spellings JSON Schema counts as integers (``1.0``,
            ``-0.0``, ``1e+16``) on xgrammar (``False``: plain integers only, as vLLM's own grammars write
            them; the vLLM plugin's choice, so its greedy tokens stay stock vLLM's).
        escapes: a bounded string (``minLength`` / ``maxLength``) takes JSON's escapes (``"a\\"b"``) on xgrammar
            where its bound is at most ``STRING_CHAIN_COUNTS`` (64; past it, and with ``False`` at any bound,
            xgrammar's own class without escapes: narrower, listed in ``narrowed``; ``False`` is the vLLM
            plugin's choice, as vLLM's own grammars write them).

    Returns:
        The constraint; it compiles when a runtime adds a request with it.

    Raises:
        ConstraintError: the schema is not JSON, not a dict or bool, nests deeper than JSON can be
            read, or an option is not one of its values. What the schema asks (a keyword no engine
            enforces, a limit exceeded) is refused when it compiles, failing that request alone.
    """
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as error:
            raise ConstraintError(f"the JSON schema is not JSON ({error}); pass a dict or a JSON string") from error
        except RecursionError:  # Python's reader recurses per level; the depth limit (limits.py) is far below
            raise ConstraintError("the JSON schema nests deeper than Python's JSON reader can read (about 1000 "
                                  "levels); the limit on nesting is Limits.depth (64 by default)") from None
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
    return Constraint("json_schema", schema, whitespace, bool(strict), max_whitespace, unenforced=unenforced,
                      integral=bool(integral), escapes=bool(escapes))


def any_json() -> Constraint:
    """Output is any JSON object or array (OpenAI's ``response_format={"type": "json_object"}``).

    Returns:
        The constraint.
    """
    return Constraint("json", None, "any")


def regex(pattern: str) -> Constraint:
    """Output matches ``pattern`` whole (ECMA-262 syntax where Python's ``re`` reads it alike).

    Args:
        pattern: the regular expression.

    Returns:
        The constraint.

    Raises:
        ConstraintError: the pattern is not a non-empty string. A feature no engine reads the same
            way (lookaround, backreferences, ...) is refused when it compiles.
    """
    if not isinstance(pattern, str) or not pattern:
        raise ConstraintError(f"a regex constraint needs a non-empty pattern string, got {pattern!r}")
    return Constraint("regex", pattern)


def choice(options: Sequence[str]) -> Constraint:
    """Output is exactly one of ``options``.

    Args:
        options: the strings allowed, each non-empty.

    Returns:
        The constraint.

    Raises:
        ConstraintError: ``options`` is not a list of non-empty strings.
    """
    if isinstance(options, str) or not options or not all(isinstance(o, str) and o for o in options):
        raise ConstraintError(f"a choice constraint needs a list of non-empty strings, got {options!r}")
    return Constraint("choice", tuple(options))


def ebnf(grammar: str) -> Constraint:
    """Output matches an xgrammar EBNF grammar with a ``root`` rule.

    Args:
        grammar: the grammar text (``root ::= ...``).

    Returns:
        The constraint (llguidance gets it converted to Lark).

    Raises:
        ConstraintError: no grammar text with a ``root`` rule. A grammar that does not parse fails
            its request when it compiles.
    """
    if not isinstance(grammar, str) or "root" not in grammar:
        raise ConstraintError("an EBNF constraint needs grammar text with a `root ::= ...` rule")
    return Constraint("ebnf", grammar)
