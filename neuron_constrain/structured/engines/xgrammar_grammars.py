"""What xgrammar builds: a constraint's compiled grammar, the vocabulary xgrammar reads, and the
grammar text the rest of ``structured/`` asks of xgrammar's dialect.

    compiler = xgr.GrammarCompiler(xgrammar_info(tok.info))    # the neutral VocabularyInfo, converted once
    grammar = compile_grammar(compiler, constraint)            # a CompiledGrammar (ConstraintError: one line)
    parse_constraint(constraint)                               # a malformed regex / choice / EBNF, now
    ebnf_accepts(grammar_text, text)                           # validate_output's EBNF check
    structural_tag_text(tag), structural_tag_ebnf(data, spec), lark_to_ebnf(lark)   # tool calls, vLLM's kinds
    huggingface_pieces(hf_tokenizer, size)                     # each token's bytes, as xgrammar decodes them

xgrammar 0.2.8 writes the characters of a bounded string (``minLength`` / ``maxLength``) as a
class that admits raw control characters (invalid JSON); every grammar built here from a
JSON schema or a structural tag gets JSON's own string-character class instead.
"""
from __future__ import annotations

import json
import weakref

import xgrammar as xgr

from neuron_constrain.structured.constraints import Constraint, ConstraintError, engine_message

# xgrammar 0.2.8 writes the characters of a string with minLength/maxLength as this
# class, which admits raw control characters (invalid JSON: "\x06" inside a string).
# We compile with JSON's own string-character class instead.
LENGTH_STRING_CLASS = r'[^\"\\\r\n]'
JSON_STRING_CLASS = r'[^\0-\x1f\"\\]'

_INFOS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def xgrammar_info(info) -> xgr.TokenizerInfo:
    """xgrammar's ``TokenizerInfo`` of a ``VocabularyInfo`` (a user-built ``TokenizerInfo`` as is):
    each token's raw bytes, special tokens as empty pieces (never text). Built once per info."""
    if isinstance(info, xgr.TokenizerInfo):
        return info
    try:
        cached = _INFOS.get(info)
    except TypeError:  # an info that cannot be weakly referenced: built each time
        cached = None
    if cached is not None:
        return cached
    special = set(info.special_token_ids)
    pieces = [b"" if i in special else bytes(piece) for i, piece in enumerate(info.decoded_vocab)]
    built = xgr.TokenizerInfo(pieces, xgr.VocabType.RAW, vocab_size=info.vocab_size,
                              stop_token_ids=list(info.stop_token_ids))
    try:
        _INFOS[info] = built
    except TypeError:
        pass
    return built


def huggingface_pieces(tokenizer, size: int) -> list[bytes]:
    """Each token's bytes as xgrammar decodes a Hugging Face vocabulary (byte-level, byte fallback, raw)."""
    return list(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=size).decoded_vocab)[:size]


def _whitespace_options(constraint: Constraint) -> dict:
    if constraint.whitespace == "none":
        return {"any_whitespace": False, "separators": (",", ":")}
    if constraint.whitespace == "compact":
        return {"any_whitespace": False, "separators": (", ", ": ")}
    if constraint.whitespace == "bounded":
        return {"any_whitespace": True, "max_whitespace_cnt": constraint.max_whitespace}
    return {"any_whitespace": True}


def _refused(constraint: Constraint, error: BaseException) -> ConstraintError:
    return ConstraintError(
        f"xgrammar could not compile this {constraint.kind} constraint ({engine_message(error)}); "
        "fix the schema/pattern/grammar (xgrammar's dialect) and resubmit the request"
    )


def compile_grammar(compiler: xgr.GrammarCompiler, constraint: Constraint) -> xgr.CompiledGrammar:
    """``constraint`` compiled by ``compiler`` as given (the engine's keyword policy is
    ``XGrammarEngine.compile``'s); raises :class:`ConstraintError` (one line)."""
    try:
        if constraint.kind == "json_schema":
            return compiler.compile_grammar(schema_grammar(constraint))
        if constraint.kind == "json":
            return compiler.compile_builtin_json_grammar()
        if constraint.kind == "regex":
            return compiler.compile_regex(constraint.spec)
        if constraint.kind in ("choice", "ebnf"):
            return compiler.compile_grammar(constraint.grammar_text())
        if constraint.kind == "structural_tag":
            return compiler.compile_structural_tag(constraint.spec)
    except ConstraintError:
        raise
    except Exception as error:  # xgrammar raises RuntimeError/ValueError with its parser's message
        raise _refused(constraint, error) from error
    raise ConstraintError(f"unknown constraint kind {constraint.kind!r}")


def schema_grammar(constraint: Constraint) -> xgr.Grammar:
    """The xgrammar grammar of a ``json_schema`` constraint, JSON string characters fixed."""
    try:
        grammar = xgr.Grammar.from_json_schema(constraint.spec, strict_mode=constraint.strict,
                                               **_whitespace_options(constraint))
    except Exception as error:
        raise ConstraintError(
            f"xgrammar could not convert this JSON schema ({engine_message(error)}); fix the schema"
            + (" or pass strict=False" if constraint.strict else "")
        ) from error
    text = fixed = str(grammar)
    if LENGTH_STRING_CLASS in fixed:
        fixed = fixed.replace(LENGTH_STRING_CLASS, JSON_STRING_CLASS)
    if constraint.whitespace == "none":  # xgrammar 0.2.8 separates untyped values' items with ", " even here
        fixed = fixed.replace('(", " basic_any)', '("," basic_any)').replace('(", " basic_string ', '("," basic_string ')
    return grammar if fixed == text else xgr.Grammar.from_ebnf(fixed)


def parse_constraint(constraint: Constraint) -> None:
    """Raise :class:`ConstraintError` now if a regex / choice / EBNF is malformed: xgrammar's
    parser needs no vocabulary and takes microseconds; the token-mask compilation is what is slow."""
    try:
        if constraint.kind == "regex":
            xgr.Grammar.from_regex(constraint.spec)
        elif constraint.kind in ("choice", "ebnf"):
            xgr.Grammar.from_ebnf(constraint.grammar_text())
    except Exception as error:
        raise _refused(constraint, error) from error


def ebnf_accepts(grammar, text: str) -> bool:
    """Whether the EBNF ``grammar`` (xgrammar's dialect, a ``root`` rule) matches all of ``text``
    (a fresh matcher; matching a string needs no vocabulary)."""
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo([b"x"]), max_threads=1)
    matcher = xgr.GrammarMatcher(compiler.compile_grammar(grammar))
    return matcher.accept_string(text) and matcher.is_completed()


def lark_to_ebnf(grammar: str) -> str:
    """A Lark grammar in xgrammar's EBNF (vLLM takes Lark too)."""
    try:
        return str(xgr.Grammar.from_lark(grammar))
    except Exception as error:  # noqa: BLE001 - xgrammar's parser message
        raise ConstraintError(f"the Lark grammar could not be read ({' '.join(str(error).split())[:300]})") from error


def structural_tag_text(tag) -> str:
    """xgrammar's EBNF of a structural tag (a dict or its JSON), bounded strings given JSON's
    string class (as ``json_schema`` constraints get); raises xgrammar's own error."""
    return str(xgr.Grammar.from_structural_tag(tag)).replace(LENGTH_STRING_CLASS, JSON_STRING_CLASS)


def structural_tag_ebnf(data, spec) -> str:
    """A structural tag (``data``: parsed; ``spec``: as given) as xgrammar EBNF, bounded strings
    given JSON's string class (as ``json_schema`` constraints get)."""
    try:
        if isinstance(data, dict) and "structures" in data:  # vLLM's legacy format (begin / schema / end)
            items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                     for s in data["structures"]]
            text = str(xgr.Grammar.from_structural_tag(items, data["triggers"]))
            text = text.replace(LENGTH_STRING_CLASS, JSON_STRING_CLASS)
        else:
            text = structural_tag_text(spec if isinstance(spec, str) else json.dumps(spec))
    except Exception as error:  # noqa: BLE001 - xgrammar's message
        raise ConstraintError(f"xgrammar could not read this structural tag ({' '.join(str(error).split())[:300]})") \
            from error
    try:
        xgr.Grammar.from_ebnf(text)
    except Exception as error:  # noqa: BLE001
        raise ConstraintError(f"the structural tag's grammar does not round-trip through EBNF ({error})") from error
    return text
