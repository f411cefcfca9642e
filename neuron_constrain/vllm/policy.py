"""The library's structured-outputs policy, applied to what vLLM hands a grammar backend.

    kind, spec = request_constraint(params.structured_outputs, limits)   # vLLM's kind and text, nesting checked
    constraint = from_vllm("json", '{"type": "object", ...}', whitespace="none")   # a library Constraint
    engine = admit(constraint, limits)  # "xgrammar" | "llguidance", or ConstraintError naming keyword and pointer
    violation(constraint, text)         # None, or why a finished answer does not satisfy its constraint
    limits = server_limits()            # the library's Limits with the server's defaults and --limit flags
    family("hermes")                    # the library's tool-call family serving a --tool-call-parser
    library_constraint(request, "hermes", tokenizer)   # a tools request's grammar, in the family's format

No vLLM import: the frontend (``validate.py``, before any token) and the engine core's
grammar backend (``grammar_backend.py``) both call these. ``admit`` is the verdict of the
library's own ``engine="auto"`` (``structured.engines.AutoEngine.compile``: xgrammar where
it enforces every keyword, llguidance for the rest, refused with both reasons otherwise),
run on a 257-token byte vocabulary: the verdict never depends on the vocabulary, and the
compilation takes milliseconds. The engine core compiles the same constraint again with
the model's vocabulary and reaches the same verdict (same code, same keyword tables).
Both bound what a request may cost with the server's :class:`Limits` (``server_limits``:
the library's with ``compile_seconds`` 10, changed by ``--limit name=N`` on the launcher or
``NEURON_CONSTRAIN_LIMITS``): the structural limits are checked before anything reads
the constraint, a schema no value satisfies is refused, and the verdict's xgrammar
compilation runs in worker processes killed past the time and memory limits.

What the structured package could take over: ``admit`` is "which engine would ``auto``
choose for this constraint, or why none" without a tokenizer; ``structural_tag`` is here
because ``xgrammar.grammars.compile_grammar`` passes a structural tag to xgrammar as is (its JSON
schemas' bounded strings keep xgrammar's string class, which admits raw control
characters) and has no keyword policy for the schemas inside it.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import threading

from neuron_constrain.structured import ConstraintError, choice, ebnf, json_schema, regex, tools as library_tools
from neuron_constrain.structured import validate_output
from neuron_constrain.structured.schema import keywords, limits as limits_, satisfiable
from neuron_constrain.structured.schema.algebra import lengths
from neuron_constrain.structured.constraints import Constraint
from neuron_constrain.structured.schema.limits import DESCRIPTIONS, LimitError, Limits
from neuron_constrain.structured.engines.xgrammar.grammars import lark_to_ebnf, structural_tag_ebnf

# vLLM's StructuredOutputOptions names (vllm/v1/structured_output/backend_types.py), lower case, in the order
# vLLM's get_structured_output_key reads them
KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
LIMITS_ENV = "NEURON_CONSTRAIN_LIMITS"  # "name=value,...": the server's limits (serve.py's --limit writes it)
# a server answers a request's constraint within seconds; a grammar's fill may pass 50 ms on 3 tokens in a
# row at most (fill_budget.STRIKES): xgrammar's fills of ordinary grammars reach 20-56 ms on single tokens
# (the first character of a length-bounded string, 32k- and 131k-token vocabularies), never on three in a row
SERVER_LIMITS = Limits(compile_seconds=10.0, fill_ms=50.0)
# a token named by id in xgrammar's EBNF (a control token of a tool-call grammar: "Token(32000)")
TOKEN_REFERENCE = re.compile(r"(?<=[(\s|])Token\(\s*\d+(?:\s*,\s*\d+)*\s*\)")
VERDICT_PROCESSES = 4  # xgrammar worker processes for the verdicts (the admission's two lanes of two threads)
# compiled once as a server starts (admission and engine core), off any request's path: the first compile's
# one-time costs (lazy imports, a worker's start, xgrammar's first grammar) are paid before the first request
WARM_SCHEMA = json.dumps({"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
                          "required": ["name"]})


def server_limits() -> Limits:
    """The server's limits: :data:`SERVER_LIMITS` with what ``NEURON_CONSTRAIN_LIMITS`` sets
    (``"enum_values=10000,compile_seconds=20"``; ValueError naming a wrong one)."""
    return Limits.parse(os.environ.get(LIMITS_ENV, ""), SERVER_LIMITS)


def request_constraint(so, limits: Limits) -> tuple[str, str]:
    """``(kind, text)`` of a request's structured outputs (vLLM's ``StructuredOutputsParams``), as
    vLLM's ``get_structured_output_key`` reads them; a schema or choice list vLLM holds as a dict or
    list is checked for nesting (iteratively) before it is written as text."""
    for kind in KINDS:
        value = getattr(so, kind, None)
        if kind == "json_object":
            if value:
                return kind, ""
            continue
        if value is None:
            continue
        if not isinstance(value, str):
            limits_.check_document(value, limits)
            value = json.dumps(value)
        return kind, value
    raise ConstraintError("no structured-output constraint in the request")


def from_vllm(kind: str, spec, *, whitespace: str = "none") -> Constraint:
    """The library constraint for a vLLM structured-output request: ``kind`` one of :data:`KINDS`
    (vLLM's request type), ``spec`` its text. ``whitespace``: ``"none"`` when the server disables
    whitespace (``disable_any_whitespace``), else ``"any"`` — what vLLM's xgrammar backend compiles."""
    if kind == "json":  # integers spelled plainly, bounded strings without escapes, as vLLM's grammars write
        return json_schema(spec, whitespace=whitespace, integral=False, escapes=False)  # them: greedy tokens stay stock's
    if kind == "json_object":  # vLLM's xgrammar backend compiles json_object as this schema
        return json_schema({"type": "object"}, whitespace=whitespace, integral=False, escapes=False)
    if kind == "regex":
        return regex(spec)
    if kind == "choice":
        return choice(json.loads(spec) if isinstance(spec, str) else spec)
    if kind == "grammar":
        if _is_lark(spec):  # vLLM takes Lark too; xgrammar converts it to its own EBNF
            spec = lark_to_ebnf(spec)
        return ebnf(spec)
    if kind == "structural_tag":
        return structural_tag(spec)
    raise ConstraintError(f"unknown structured-output kind {kind!r}; one of {', '.join(KINDS)}")


def _is_lark(grammar: str) -> bool:
    """vLLM's heuristic (``grammar_is_likely_lark``): no ``::=`` rule anywhere."""
    return "::=" not in grammar


def structural_tag(spec) -> Constraint:
    """A structural tag (vLLM's tool calls with ``tool_choice="auto"``) as an xgrammar EBNF constraint:
    the JSON schemas inside it go through the keyword policy (xgrammar is the only engine that takes
    structural tags), and bounded strings get JSON's string class, as ``json_schema`` does."""
    data = json.loads(spec) if isinstance(spec, str) else spec
    for path, schema in _tag_schemas(data):
        try:
            keywords.check(schema, "xgrammar")
        except ConstraintError as error:
            item = getattr(error, "unenforced", None)
            where = f"{path}{item.path[1:]}" if item is not None else path
            refused = ConstraintError(f"a tool's JSON schema: {error} (at {where} of the structural tag)")
            refused.unenforced = item  # type: ignore[attr-defined]
            raise refused from error
    text = structural_tag_ebnf(data, spec)
    return Constraint("ebnf", text)


def _tag_schemas(node, path: str = "#"):
    """(pointer, schema) for every JSON schema inside a structural tag (legacy ``schema`` or
    ``{"type": "json_schema", "json_schema": ...}``)."""
    if isinstance(node, dict):
        if node.get("type") == "json_schema" and isinstance(node.get("json_schema"), dict):
            yield f"{path}/json_schema", node["json_schema"]
            return
        for key, value in node.items():
            if key == "schema" and isinstance(value, dict):
                yield f"{path}/schema", value
            else:
                yield from _tag_schemas(value, f"{path}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _tag_schemas(value, f"{path}/{i}")


def has_token_references(constraint: Constraint) -> bool:
    """Whether an EBNF constraint names tokens by id: its answer's text alone cannot be checked by a text
    matcher (a control token is not its spelling)."""
    return constraint.kind == "ebnf" and isinstance(constraint.spec, str) and bool(TOKEN_REFERENCE.search(constraint.spec))


def verdict_form(constraint: Constraint) -> Constraint:
    """The constraint the verdict compiles: token references written as a literal (the verdict's byte
    vocabulary has no token 32000; which engine enforces a grammar does not depend on the token named)."""
    if not has_token_references(constraint):
        return constraint
    return dataclasses.replace(constraint, spec=TOKEN_REFERENCE.sub('"\\\\x00"', constraint.spec))


# --------------------------------------------------------------------------- the verdict
class _Bytes:
    """A 256-byte vocabulary plus EOS, behind the tokenizer protocol: enough to compile any
    constraint and learn which engine takes it."""

    def __init__(self):
        from neuron_constrain.structured import Tokenizer

        pieces = [bytes([i]) for i in range(256)] + [b""]
        self.tokenizer = Tokenizer(pieces, special_ids=[256], stop_token_ids=[256], names=[""] * 256 + ["eos"],
                                   encode=lambda text: list(text.encode("utf-8")),
                                   decode=lambda ids: bytes(i for i in ids if i < 256).decode("utf-8", "replace"))


_LOCK = threading.Lock()


_SERVED: dict = {}  # "engine": the verdicts' engine on the served model's vocabulary, once the API server built it


def serve_on(engine) -> None:
    """Judge constraints on ``engine`` from now on: the served model's vocabulary, built as the engine
    core's backend builds its own (``grammar_backend.served_engine``). Its xgrammar grammars go to the disk
    cache whatever their compile time, so the engine core loads each of them instead of compiling it again
    (the cache keys agree: the same constraint, vocabulary and code)."""
    if engine.xgrammar.disk_cache is not None:
        engine.xgrammar.disk_cache.min_seconds = 0.0
    _SERVED["engine"] = engine


def verdict_engine(limits: Limits):
    """The engine the verdicts compile on: the served model's (:func:`serve_on`) once there is one with these
    limits, else ``auto`` on a byte vocabulary; xgrammar in worker processes either way (bounded strings on
    xgrammar, as the engine core's ``grammar_backend.LibraryBackend``)."""
    served = _SERVED.get("engine")
    return served if served is not None and served.limits == limits else _byte_engine(limits)


@functools.lru_cache(maxsize=4)
def _byte_engine(limits: Limits):
    from neuron_constrain.structured.engines import AutoEngine

    return AutoEngine(_Bytes().tokenizer, limits=limits, compile_processes=VERDICT_PROCESSES,
                      narrow_bounded_strings=True, race=False)


_VERDICTS: dict = {}  # (constraint key, limits) -> the engine admit() chose, or its ConstraintError
_SHORTEST: dict = {}  # constraint key -> the shortest answer's characters (fewest_tokens)
_SHORTEST_ANSWER = {"json_schema": satisfiable.shortest, "regex": lengths.fewest}  # kind -> its lower bound


def _remember(table: dict, key, value):
    """``table[key] = value``, the oldest entry dropped past 512; returns ``value``."""
    with _LOCK:
        if len(table) >= 512:
            table.pop(next(iter(table)))
        table[key] = value
    return value


def cached_verdict(constraint: Constraint, limits: Limits = SERVER_LIMITS) -> str | None:
    """The verdict :func:`admit` gave ``constraint`` already (raising its error), or ``None``; the
    structural limits are checked first."""
    limits_.check(constraint, limits)
    with _LOCK:
        hit = _VERDICTS.get((constraint.key, limits))
    if isinstance(hit, ConstraintError):
        raise hit
    return hit


def admit(constraint: Constraint, limits: Limits = SERVER_LIMITS) -> str:
    """The engine the library's ``auto`` compiles ``constraint`` on ("xgrammar" or "llguidance"), or
    its ``ConstraintError``: a limit passed (``LimitError``, checked before anything else reads the
    constraint), a schema no value satisfies, a keyword no engine enforces (``error.unenforced``:
    keyword, JSON pointer) or a constraint neither engine reads. Cached per constraint (512 verdicts)."""
    hit = cached_verdict(constraint, limits)
    if hit is not None:
        return hit
    key = (constraint.key, limits)
    engine = verdict_engine(limits)
    try:  # the byte vocabulary has no control token to name: token references written as literals there
        result = engine.compile(constraint if engine is _SERVED.get("engine") else verdict_form(constraint)).engine
    except ConstraintError as error:
        result = error
    _remember(_VERDICTS, key, result)
    if isinstance(result, ConstraintError):
        raise result
    return result


def refusal_message(error: ConstraintError) -> str:
    """The 400's text: the limit and the flag that raises it, or the keyword and its JSON pointer
    first when the policy refused one."""
    if isinstance(error, LimitError):
        at = f" at {error.where}" if error.where else ""
        return (f"neuron_constrain: the request's constraint is over the server's limit {error.limit}="
                f"{error.maximum:g} ({DESCRIPTIONS[error.limit]}{at}: {error.value}); send a smaller constraint, "
                f"or start the server with `--limit {error.limit}=N` (python -m neuron_constrain.vllm.serve; or "
                f"{LIMITS_ENV}={error.limit}=N) to raise it")
    item = getattr(error, "unenforced", None)
    detail = " ".join(str(error).split())
    if item is not None:
        return (f"neuron_constrain: the schema's `{item.keyword}` at {item.path} is not enforced by any grammar "
                f"engine here (xgrammar, llguidance); remove or rewrite it. Details: {detail}")
    return f"neuron_constrain: this structured-output constraint cannot be compiled: {detail}"


def fewest_tokens(constraint: Constraint) -> tuple[int, int] | None:
    """``(characters, tokens)``: the shortest answer a JSON schema (``satisfiable.shortest``, compact) or a regex
    (``lengths.fewest``) admits and the fewest tokens of the served vocabulary that could write it (no token
    writes more characters than its longest piece has bytes); None for other kinds, where nothing is known, or
    before the served vocabulary is known (:func:`serve_on`: a byte vocabulary would count one character a
    token)."""
    engine = _SERVED.get("engine")
    if engine is None or constraint.kind not in _SHORTEST_ANSWER:
        return None
    with _LOCK:
        least = _SHORTEST.get(constraint.key)
    if least is None:  # once a constraint: a schema's is a fixed point over it (MaskBench: 0.13 ms median, 5.5 ms most)
        least = _remember(_SHORTEST, constraint.key, _SHORTEST_ANSWER[constraint.kind](constraint.spec))
    if least == float("inf") or least == 0:
        return None  # no value (the verdict refuses it, by name), or nothing known
    longest = _longest_piece(engine.tokenizer)
    return int(least), -(-int(least) // longest)


@functools.lru_cache(maxsize=4)
def _longest_piece(tokenizer) -> int:
    return max(1, max(len(piece) for piece in tokenizer.pieces))


def too_few_tokens_message(characters: int, tokens: int, max_tokens: int) -> str:
    return (f"neuron_constrain: max_tokens={max_tokens} cannot hold any answer this constraint admits: the shortest "
            f"is {characters:,} characters, at least {tokens:,} tokens of the served model's vocabulary; raise "
            f"max_tokens, or relax the constraint (a smaller minLength, minItems, repetition count, ...)")


def over_budget_message(seconds: float, budget: float) -> str:
    """Why a request whose grammar's work (its mask fill, and its accept) took ``seconds`` for one token (over
    ``budget``) was stopped."""
    return (f"its grammar's mask fill and accept took {seconds * 1e3:.0f} ms for one token, over the server's per-token "
            f"budget fill_ms={budget * 1e3:g} (an ambiguous grammar's work grows with its text); simplify the "
            f"grammar, or start the server with `--limit fill_ms=N` ({LIMITS_ENV}=fill_ms=N) to raise it")


# --------------------------------------------------------------------------- after generation
def violation(constraint: Constraint, text: str) -> str | None:
    """``None`` if the finished ``text`` satisfies ``constraint``; else why not (the library's
    ``validate_output``, which does not trust the engine: ``jsonschema`` for JSON, ``re`` for
    regex, membership for choice, a fresh xgrammar matcher for EBNF)."""
    try:
        return validate_output(constraint, text)
    except Exception:  # noqa: BLE001 - a validator that cannot run (a pattern Python's re does not read,
        return None    # jsonschema not installed) is not evidence of a violation


# --------------------------------------------------------------------------- tool calls (validate.py serves them)
# vLLM --tool-call-parser name -> the TOOL_FORMATS names that serve it, the first the library lists wins
PARSER_FAMILIES: dict[str, tuple[str, ...]] = {
    "hermes": ("hermes",),
    "qwen3_coder": ("qwen3_coder",),
    "qwen3_xml": ("qwen3_coder",),
    "llama3_json": ("llama3_json", "llama3"),
    "llama4_json": ("llama3_json", "llama3"),
    "pythonic": ("pythonic",),
    "llama4_pythonic": ("pythonic",),
    "mistral": ("mistral",),
    "deepseek_v3": ("deepseek_v3",),
    "deepseek_v31": ("deepseek_v3",),
    "kimi_k2": ("kimi_k2",),
    "openai": ("harmony",),
}


class ToolParserError(ConstraintError):
    """A strict tool request on a server whose ``--tool-call-parser`` has no library family."""


def family(parser: str | None) -> str:
    """The library's tool-call family serving vLLM's ``--tool-call-parser`` ``parser``.

    Args:
        parser: the parser's name as vLLM's ``--tool-call-parser`` takes it (``"hermes"``).

    Returns:
        The ``TOOL_FORMATS`` name (``"hermes"``).

    Raises:
        ToolParserError: no parser, a parser this table does not know, or one whose family the
            library does not build (yet); the message names the parser and the served ones.
    """
    formats = library_tools.TOOL_FORMATS
    served = sorted(name for name, families in PARSER_FAMILIES.items() if any(f in formats for f in families))
    for name in PARSER_FAMILIES.get(parser or "", ()):
        if name in formats:
            return name
    why = ("has no tool-call family in neuron_constrain" if parser not in PARSER_FAMILIES else
           f"maps to the family {PARSER_FAMILIES[parser][0]!r}, which this neuron_constrain does not build")
    raise ToolParserError(
        f"neuron_constrain: --tool-call-parser {parser!r} {why}, so a strict tool call cannot be enforced; "
        f"start the server with one of {', '.join(served)} (or send the request without strict tools, "
        f"tool_choice=\"auto\" and --tool-strict-level auto)"
    )


def is_strict(request, server_level: int) -> bool:
    """Whether ``request``'s tool calls must be enforced: ``required`` / named always; ``auto`` when the
    server's ``--tool-strict-level`` (``server_level``: 0 auto, 1 function, 2 parameter) is above auto or a
    tool says ``strict: true``."""
    choice = request.tool_choice
    if not request.tools or choice in ("none",):
        return False
    if choice not in ("auto", None):
        return True
    return server_level > 0 or any(getattr(getattr(t, "function", None), "strict", None) for t in request.tools)


def plain(value):
    """A request's pydantic field (a tool, a named tool choice) as plain JSON data; other values as they are."""
    return value.model_dump(exclude_none=True) if hasattr(value, "model_dump") else value


@functools.lru_cache(maxsize=4)
def _library_tokenizer(tokenizer):
    from neuron_constrain.structured import tokenizers

    inner = getattr(tokenizer, "tokenizer", None)
    if type(tokenizer).__name__ == "MistralTokenizer" and inner is not None:
        return tokenizers.from_mistral(inner)
    return tokenizers.from_huggingface(tokenizer)


_TOKENIZER_LOCK = threading.Lock()


def library_tokenizer(tokenizer):
    """The library's tokenizer over vLLM's (cached: building it decodes the vocabulary once)."""
    with _TOKENIZER_LOCK:
        return _library_tokenizer(tokenizer)


def library_constraint(request, parser: str, tokenizer):
    """The library's tool-call constraint for ``request`` (a ``ChatCompletionRequest``): the calls in the
    parser's family (``auto``: free text, then calls; with ``response_format``: calls, or the response's JSON).

    Raises:
        ToolParserError: the parser has no family (see :func:`family`).
        ConstraintError: a tool the library refuses (a keyword no engine enforces, named with the tool and
            its pointer; a named tool not listed).
    """
    choice = plain(request.tool_choice) if request.tool_choice is not None else "auto"
    response_format = _response_schema(request)
    return library_tools.tool_constraint(
        [plain(t) for t in request.tools], choice, format=family(parser), tokenizer=library_tokenizer(tokenizer),
        parallel_tool_calls=request.parallel_tool_calls is not False,
        **({"response_format": response_format} if response_format is not None and choice == "auto" else {}))


def _response_schema(request):
    response_format = getattr(request, "response_format", None)
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_schema" and response_format.json_schema is not None:
        return response_format.json_schema.json_schema
    return {"type": "object"} if response_format.type == "json_object" else plain(response_format)


def structured_outputs(constraint) -> dict:
    """``StructuredOutputsParams`` keywords for a library constraint (``grammar=`` EBNF, ``json=`` a schema)."""
    if constraint.kind == "ebnf":
        return {"grammar": constraint.spec}
    if constraint.kind == "json_schema":
        return {"json": constraint.spec}
    if constraint.kind == "regex":
        return {"regex": constraint.spec}
    raise ConstraintError(f"a tool-call constraint of kind {constraint.kind!r} has no vLLM request form")
