"""The library's structured-outputs policy, applied to what vLLM hands a grammar backend.

    constraint = from_vllm("json", '{"type": "object", ...}', whitespace="none")   # a library Constraint
    engine = admit(constraint)          # "xgrammar" | "llguidance", or ConstraintError naming keyword and pointer
    violation(constraint, text)         # None, or why a finished answer does not satisfy its constraint

No vLLM import: the frontend (``validate.py``, before any token) and the engine core's
grammar backend (``grammar_backend.py``) both call these. ``admit`` is the verdict of the
library's own ``engine="auto"`` (``structured.engines.AutoEngine.compile``: xgrammar where
it enforces every keyword, llguidance for the rest, refused with both reasons otherwise),
run on a 257-token byte vocabulary: the verdict never depends on the vocabulary, and the
compilation takes milliseconds. The engine core compiles the same constraint again with
the model's vocabulary and reaches the same verdict (same code, same keyword tables).

What the structured package could take over: ``admit`` is "which engine would ``auto``
choose for this constraint, or why none" without a tokenizer; ``structural_tag`` is here
because ``xgrammar_grammars.compile_grammar`` passes a structural tag to xgrammar as is (its JSON
schemas' bounded strings keep xgrammar's string class, which admits raw control
characters) and has no keyword policy for the schemas inside it.
"""
from __future__ import annotations

import functools
import json
import threading

from neuron_constrain.structured import ConstraintError, choice, ebnf, json_schema, regex, validate_output
from neuron_constrain.structured.constraints import Constraint
from neuron_constrain.structured import keywords
from neuron_constrain.structured.engines.xgrammar_grammars import lark_to_ebnf, structural_tag_ebnf

# vLLM's StructuredOutputOptions names (vllm/v1/structured_output/backend_types.py), lower case
KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


def from_vllm(kind: str, spec, *, whitespace: str = "none") -> Constraint:
    """The library constraint for a vLLM structured-output request: ``kind`` one of :data:`KINDS`
    (vLLM's request type), ``spec`` its text. ``whitespace``: ``"none"`` when the server disables
    whitespace (``disable_any_whitespace``), else ``"any"`` — what vLLM's xgrammar backend compiles."""
    if kind == "json":
        return json_schema(spec, whitespace=whitespace)
    if kind == "json_object":  # vLLM's xgrammar backend compiles json_object as this schema
        return json_schema({"type": "object"}, whitespace=whitespace)
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


@functools.lru_cache(maxsize=1)
def _verdict_engine():
    from neuron_constrain.structured.engines import AutoEngine

    return AutoEngine(_Bytes().tokenizer)


_VERDICTS: dict = {}


def admit(constraint: Constraint) -> str:
    """The engine the library's ``auto`` compiles ``constraint`` on ("xgrammar" or "llguidance"), or
    its ``ConstraintError``: a keyword no engine enforces (``error.unenforced``: keyword, JSON pointer)
    or a constraint neither engine reads. Cached per constraint (512 verdicts)."""
    key = constraint.key
    with _LOCK:
        hit = _VERDICTS.get(key)
    if hit is not None:
        if isinstance(hit, ConstraintError):
            raise hit
        return hit
    try:
        result = _verdict_engine().compile(constraint).engine
    except ConstraintError as error:
        result = error
    with _LOCK:
        if len(_VERDICTS) >= 512:
            _VERDICTS.pop(next(iter(_VERDICTS)))
        _VERDICTS[key] = result
    if isinstance(result, ConstraintError):
        raise result
    return result


def refusal_message(error: ConstraintError) -> str:
    """The 400's text: the keyword and its JSON pointer first when the policy refused one."""
    item = getattr(error, "unenforced", None)
    detail = " ".join(str(error).split())
    if item is not None:
        return (f"neuron_constrain: the schema's `{item.keyword}` at {item.path} is not enforced by any grammar "
                f"engine here (xgrammar, llguidance); remove or rewrite it. Details: {detail}")
    return f"neuron_constrain: this structured-output constraint cannot be compiled: {detail}"


# --------------------------------------------------------------------------- after generation
def violation(constraint: Constraint, text: str) -> str | None:
    """``None`` if the finished ``text`` satisfies ``constraint``; else why not (the library's
    ``validate_output``, which does not trust the engine: ``jsonschema`` for JSON, ``re`` for
    regex, membership for choice, a fresh xgrammar matcher for EBNF)."""
    try:
        return validate_output(constraint, text)
    except Exception:  # noqa: BLE001 - a validator that cannot run (a pattern Python's re does not read,
        return None    # jsonschema not installed) is not evidence of a violation
