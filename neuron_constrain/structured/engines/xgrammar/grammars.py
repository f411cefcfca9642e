"""What xgrammar builds: a constraint's compiled grammar, the vocabulary xgrammar reads, and the
grammar text the rest of ``structured/`` asks of xgrammar's dialect.

    compiler = xgr.GrammarCompiler(xgrammar_info(tok.info))    # the neutral VocabularyInfo, converted once
    grammar = compile_grammar(compiler, constraint)            # a CompiledGrammar (ConstraintError: one line)
    parse_constraint(constraint)                               # a malformed regex / choice / EBNF, now
    ebnf_accepts(grammar_text, text)                           # validate_output's EBNF check
    structural_tag_text(tag), structural_tag_ebnf(data, spec), lark_to_ebnf(lark)   # tool calls, vLLM's kinds
    huggingface_pieces(hf_tokenizer, size)                     # each token's bytes, as xgrammar decodes them

xgrammar 0.2.8 writes the characters of a bounded string (``minLength`` / ``maxLength``) as a
class that admits raw control characters (invalid JSON) and no escapes; every grammar built here from a
JSON schema or a structural tag gets JSON's own string-character class instead, and a JSON schema's
bounded strings up to :data:`STRING_CHAIN_COUNTS` characters get the escapes too (:func:`escaped_strings`).
"""
from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import threading
import urllib.parse
import weakref

import xgrammar as xgr

from neuron_constrain.structured.engines.xgrammar import integers
from neuron_constrain.structured.schema import keywords, patterns, rewrite
from neuron_constrain.structured.constraints import Constraint, ConstraintError, engine_message
from neuron_constrain.structured.schema.pattern_text import constraint_regex, constraint_rules, ebnf_rules, to_ebnf

# xgrammar 0.2.8 writes the characters of a string with minLength/maxLength as this
# class, which admits raw control characters (invalid JSON: "\x06" inside a string).
# We compile with JSON's own string-character class instead.
LENGTH_STRING_CLASS = r'[^\"\\\r\n]'
# xgrammar 0.2.8's class for an unbounded string: it takes a surrogate's three bytes (ED A0 80 ..) as one
# character, which is not UTF-8 (a reader decodes three replacement characters: `maxLength: 1` broken).
BASIC_STRING_CLASS = r'[^\0-\x1f\"\\\r\n]'
BUILTIN_JSON_CLASS = r'[^\"\\\0-\x1f]'  # the same, in its builtin JSON grammar (constraint kind "json")
JSON_STRING_CLASS = r'[^\0-\x1f\"\\\ud800-\udfff]'  # JSON's string characters, encoded surrogates left out
# A bounded string up to this many characters is written with JSON's escapes as a chain of rules, one per count
# (its escapes in xgrammar's class, or a counted repetition of character-or-escape, fill at 28-45 ms a token on
# 131k tokens; the chain fills in microseconds and compiles as fast as xgrammar's own class up to 64: 1.5 s on
# Tekken, against 6.3 s and 114 MB of grammar at 255, where the class without escapes stays).
STRING_CHAIN_COUNTS = 64
_ESCAPE = '"\\\\" ([\\"\\\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F])'
_COUNTED = re.compile(r'"\\"" (\w+_characters)\{(\d+), (-?\d+)\} "\\""')

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


_STDERR = threading.Lock()  # one capture of file descriptor 2 at a time


def reported(build, *args, refuse: bool = True, **kwargs):
    """``build(*args, **kwargs)`` (an xgrammar grammar builder), refused if xgrammar writes a warning
    while it runs. xgrammar's C++ side reports what it drops ("Lookahead assertion is not
    supported and is ignored", "Anchor '^' in the middle of regex is ignored", ...) on stderr
    and carries on; the library listens on file descriptor 2 for the call, so a warning becomes
    a refusal on xgrammar (``auto`` then tries llguidance). What else was written there is
    written back, and so are the warnings where ``refuse`` is False (``unenforced="allow"``: the
    output is validated afterwards)."""
    with _STDERR:
        sys.stderr.flush()
        saved = os.dup(2)
        with tempfile.TemporaryFile() as sink:
            os.dup2(sink.fileno(), 2)
            try:
                result = build(*args, **kwargs)
            finally:
                os.dup2(saved, 2)
                os.close(saved)
                sink.seek(0)
                log = sink.read().decode("utf-8", "replace")
    warnings = [line for line in log.splitlines() if "Warning" in line] if refuse else []
    rest = "".join(line + "\n" for line in log.splitlines() if line not in warnings)
    if rest:
        sys.stderr.write(rest)
    if warnings:
        raise ConstraintError(
            f"xgrammar would not enforce part of this constraint (it warned: {engine_message(warnings[0])}); "
            "refused on xgrammar: use engine='llguidance' or 'auto', or remove what it ignores")
    return result


def compile_grammar(compiler: xgr.GrammarCompiler, constraint: Constraint) -> xgr.CompiledGrammar:
    """``constraint`` compiled by ``compiler`` as given (the engine's keyword policy is
    ``XGrammarEngine.compile``'s); raises :class:`ConstraintError` (one line)."""
    try:
        if constraint.kind == "json_schema":
            return compiler.compile_grammar(schema_grammar(constraint))
        if constraint.kind == "json":
            return compiler.compile_grammar(xgr.Grammar.from_ebnf(json_string_classes(str(
                xgr.Grammar.builtin_json_grammar()))))
        if constraint.kind == "regex":
            return compiler.compile_grammar(regex_grammar(constraint.spec))
        if constraint.kind in ("choice", "ebnf"):
            return compiler.compile_grammar(reported(xgr.Grammar.from_ebnf, constraint.grammar_text()))
        if constraint.kind == "structural_tag":
            return compiler.compile_grammar(reported(xgr.Grammar.from_structural_tag, constraint.spec))
    except ConstraintError:
        raise
    except Exception as error:  # xgrammar raises RuntimeError/ValueError with its parser's message
        raise _refused(constraint, error) from error
    raise ConstraintError(f"unknown constraint kind {constraint.kind!r}")


_MARKER = "ncpattern{}x"  # what a pattern is while xgrammar converts a schema: kept as one Regex rule


class _Markers:
    """Each pattern of a schema replaced by a marker while xgrammar converts it, then the marker's rule
    body replaced by the pattern as EBNF over the JSON-escaped text (``pattern_text.to_ebnf``).
    xgrammar's own reading of a pattern is wrong in several ways (``patterns.py``); the markers
    let it place the rules. A pattern kept as an automaton adds a rule per state (``rules``, appended to
    the grammar by :meth:`substitute`)."""

    def __init__(self):
        self.bodies: dict[str, str] = {}
        self.rules: dict[str, str] = {}
        self._by_source: dict[str, str] = {}

    def _mark(self, source: str) -> str | None:
        pattern = patterns.parse(source)
        if keywords.unenforced_feature(pattern, "xgrammar") is not None:
            return None  # the policy listed it as unenforced (unenforced="allow")
        if source not in self._by_source:
            self._by_source[source] = marker = f"^{_MARKER.format(len(self._by_source))}$"
            self.bodies[marker] = to_ebnf(pattern, search=True, json=True, rules=self.rules,
                                          prefix=f"ncpattern{len(self._by_source) - 1}s")
        return self._by_source[source]

    def schema(self, schema):
        """``schema`` with its patterns marked, its root a definition where a ``$ref`` recurses into it
        (:func:`root_as_definition`), its definitions no ``$ref`` reaches left out (xgrammar drops them, and with
        them their patterns' markers, which :meth:`substitute` would take for a pattern dropped)."""
        if not isinstance(schema, dict):
            return schema
        return keywords.map_patterns(root_as_definition(referenced_definitions(schema)), self._mark)

    def tag(self, node):
        """A structural tag with the patterns of the JSON schemas inside it marked."""
        if isinstance(node, list):
            return [self.tag(item) for item in node]
        if not isinstance(node, dict):
            return node
        if node.get("type") == "json_schema" and isinstance(node.get("json_schema"), dict):
            return {**node, "json_schema": self.schema(node["json_schema"])}
        return {key: self.schema(value) if key == "schema" else self.tag(value) for key, value in node.items()}

    def substitute(self, text: str, *, refuse: bool = True) -> str:
        for marker, body in self.bodies.items():
            rule = f'Regex("{marker}", json_string=true)'
            if rule not in text and refuse:
                raise ConstraintError("xgrammar dropped a `pattern` of this schema (beside a keyword it compiles "
                                      "instead); refused on xgrammar: use engine='llguidance' or 'auto'")
            text = text.replace(rule, body)
        return f"{text.rstrip()}\n{ebnf_rules(self.rules)}" if self.rules else text


def schema_grammar(constraint: Constraint) -> xgr.Grammar:
    """The xgrammar grammar of a ``json_schema`` constraint: patterns written by the library, JSON
    string characters fixed."""
    markers, integer_markers = _Markers(), integers.IntegerMarkers()
    spec = markers.schema(constraint.spec)
    marked = integer_markers.schema(spec) if constraint.integral else spec

    def convert(schema):
        try:
            return reported(xgr.Grammar.from_json_schema, schema, strict_mode=constraint.strict,
                            refuse=constraint.unenforced != "allow", **_whitespace_options(constraint))
        except ConstraintError:
            raise
        except Exception as error:
            raise ConstraintError(
                f"xgrammar could not convert this JSON schema ({engine_message(error)}); fix the schema"
                + (" or pass strict=False" if constraint.strict else "")
            ) from error
    grammar = convert(marked)
    text = integer_markers.substitute(str(grammar), lambda node: reported(  # integral spellings (integers.py)
        xgr.Grammar.from_json_schema, json.dumps(node), refuse=constraint.unenforced != "allow")) \
        if constraint.integral else str(grammar)
    if text is None:  # a marker where it was not expected: the integers of a range or a step spelled plainly
        grammar = convert(spec)
        text = integers.integral(str(grammar))
    # allowed: the output is validated afterwards
    fixed = markers.substitute(text, refuse=constraint.unenforced != "allow")
    if constraint.escapes:
        fixed = escaped_strings(fixed)
    fixed = json_string_classes(fixed)
    if constraint.whitespace == "none":  # xgrammar 0.2.8 separates untyped values' items with ", " even here
        fixed = fixed.replace('(", " basic_any)', '("," basic_any)').replace('(", " basic_string ', '("," basic_string ')
    return grammar if fixed == str(grammar) else xgr.Grammar.from_ebnf(fixed)


def json_string_classes(text: str) -> str:
    """``text`` (xgrammar's EBNF) with the string-character classes xgrammar writes replaced by JSON's own."""
    for written in (LENGTH_STRING_CLASS, BASIC_STRING_CLASS, BUILTIN_JSON_CLASS):
        text = text.replace(written, JSON_STRING_CLASS)
    return text


def writes_escapes(low: int, high: int | None) -> bool:
    """Whether a string of ``low`` to ``high`` (None: unbounded) characters takes JSON's escapes here."""
    return (low if high is None else high) <= STRING_CHAIN_COUNTS


def escaped_strings(text: str) -> str:
    """``text`` (xgrammar's EBNF of a JSON schema) with each bounded string of at most :data:`STRING_CHAIN_COUNTS`
    characters written with JSON's escapes: ``"\"" s_characters{1, 3} "\""`` becomes a chain of rules, ``s_0 ::=
    (char s_1) | (escape s_1)`` ... ``s_3 ::= "\""``, a rule per count (the closing quote where the count may end);
    a single character written in place gets the escape beside it. Longer ones keep xgrammar's class."""
    rules: list[str] = []

    def chain(match: re.Match) -> str:
        name, low, high = match.group(1), int(match.group(2)), int(match.group(3))
        high_or_none = None if high < 0 else high
        if not writes_escapes(low, high_or_none):
            return match.group(0)
        last = low if high_or_none is None else high
        for count in range(last + 1):
            step = count if high_or_none is None and count == last else count + 1
            body = ['"\\""'] if count >= low else []
            if high_or_none is None or count < last:
                body += [f"{JSON_STRING_CLASS} {name}_{step}", f"ncescape {name}_{step}"]
            rules.append(f"{name}_{count} ::= " + " | ".join(f"({part})" for part in body))
        return f'"\\"" {name}_0'
    text = _COUNTED.sub(chain, text)
    lines = [line if "_characters ::=" in line else line.replace(LENGTH_STRING_CLASS, f"({LENGTH_STRING_CLASS} | ncescape)")
             for line in text.splitlines()]
    if not rules and lines == text.splitlines():
        return text
    return "\n".join(lines + rules + [f"ncescape ::= {_ESCAPE}"]) + "\n"


ROOT_DEFINITION = "ncroot"
_DEFINITIONS = ("$defs", "definitions")


def root_as_definition(schema):
    """``schema`` with its root moved into ``$defs`` where a ``$ref`` is the root (``#``), the root then only
    referring to it (the pointers into its body, ``#/items``, moved with it). xgrammar 0.2.8's mask refuses a
    token that closes a value nested by recursion into its ``root`` rule together with the value around it
    (SmolLM2's ``]]`` in ``[[1]]``, ``}}}`` in ``{"a": {"a": {}}}``), though its matcher accepts it; recursion
    into any other rule is masked right. A schema without such a reference is returned as it is."""
    if not isinstance(schema, dict):
        return schema
    pointers = [node["$ref"] for _, node in rewrite.walk(schema) if isinstance(node.get("$ref"), str)]
    if "#" not in pointers:
        return schema
    copied = json.loads(json.dumps(schema))
    name = ROOT_DEFINITION
    while name in (copied.get("$defs") or {}):
        name += "_"
    for _, node in rewrite.walk(copied):
        ref = node.get("$ref")
        if isinstance(ref, str) and _into_root(ref):
            node["$ref"] = f"#/$defs/{name}{ref[1:]}"
    body = {key: value for key, value in copied.items() if key not in _DEFINITIONS}
    kept = {key: copied[key] for key in _DEFINITIONS if isinstance(copied.get(key), dict)}
    return {**kept, "$defs": {**kept.get("$defs", {}), name: body}, "$ref": f"#/$defs/{name}"}


def referenced_definitions(schema: dict) -> dict:
    """``schema`` without the root's ``$defs``/``definitions`` entries no ``$ref`` reaches from the root (they assert
    nothing); ``schema`` itself where every entry is reached."""
    containers = {key: schema[key] for key in _DEFINITIONS if isinstance(schema.get(key), dict)}
    if not containers:
        return schema
    body = {key: value for key, value in schema.items() if key not in containers}
    reached: set = set()
    pending = [body]
    while pending:
        for _, node in rewrite.walk(pending.pop()):
            ref = node.get("$ref")
            parts = ref[2:].split("/", 2) if isinstance(ref, str) and ref.startswith("#/") else []
            if len(parts) < 2:
                continue
            container, name = (urllib.parse.unquote(p).replace("~1", "/").replace("~0", "~") for p in parts[:2])
            entry = containers.get(container, {}).get(name)
            if isinstance(entry, dict) and (container, name) not in reached:
                reached.add((container, name))
                pending.append(entry)
            elif (container, name) not in reached and name in containers.get(container, {}):
                reached.add((container, name))  # a boolean definition: nothing further to reach
    if all((c, n) in reached for c, entries in containers.items() for n in entries):
        return schema
    kept = {c: {n: v for n, v in entries.items() if (c, n) in reached} for c, entries in containers.items()}
    return {**body, **kept}


def _into_root(ref: str) -> bool:
    """Whether ``ref`` points at the root or into its body (not into ``$defs``/``definitions``, spelled
    percent-encoded or not)."""
    return ref == "#" or (ref.startswith("#/") and urllib.parse.unquote(ref[2:].split("/", 1)[0]) not in _DEFINITIONS)


def regex_grammar(spec: str) -> xgr.Grammar:
    """A regex constraint's grammar: xgrammar's reading of the library's plain text, or, for a language kept
    as an automaton (too large as one expression), the library's rules, a state each."""
    rules = constraint_rules(spec, "xgrammar")
    if rules is not None:
        return reported(xgr.Grammar.from_ebnf, rules)
    return reported(xgr.Grammar.from_regex, constraint_regex(spec, "xgrammar"))


def parse_constraint(constraint: Constraint) -> None:
    """Raise :class:`ConstraintError` now if a regex / choice / EBNF is malformed: xgrammar's
    parser needs no vocabulary and takes microseconds; the token-mask compilation is what is slow."""
    try:
        if constraint.kind == "regex":
            regex_grammar(constraint.spec)
        elif constraint.kind in ("choice", "ebnf"):
            reported(xgr.Grammar.from_ebnf, constraint.grammar_text())
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
    """xgrammar's EBNF of a structural tag (a dict or its JSON), the patterns of its schemas written by
    the library and bounded strings given JSON's string class (as ``json_schema`` constraints get);
    raises xgrammar's own error."""
    markers = _Markers()
    marked = markers.tag(json.loads(tag) if isinstance(tag, str) else tag)
    text = str(reported(xgr.Grammar.from_structural_tag, json.dumps(marked)))
    return json_string_classes(markers.substitute(text))


def structural_tag_ebnf(data, spec) -> str:
    """A structural tag (``data``: parsed; ``spec``: as given) as xgrammar EBNF, patterns written by the
    library, bounded strings given JSON's string class (as ``json_schema`` constraints get)."""
    try:
        if isinstance(data, dict) and "structures" in data:  # vLLM's legacy format (begin / schema / end)
            markers = _Markers()
            items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(markers.schema(s["schema"])),
                                           end=s["end"]) for s in data["structures"]]
            text = str(reported(xgr.Grammar.from_structural_tag, items, data["triggers"]))
            text = json_string_classes(markers.substitute(text))
        else:
            text = structural_tag_text(data if isinstance(data, dict) else spec)
    except ConstraintError:
        raise
    except Exception as error:  # noqa: BLE001 - xgrammar's message
        raise ConstraintError(f"xgrammar could not read this structural tag ({' '.join(str(error).split())[:300]})") \
            from error
    try:
        xgr.Grammar.from_ebnf(text)
    except Exception as error:  # noqa: BLE001
        raise ConstraintError(f"the structural tag's grammar does not round-trip through EBNF ({error})") from error
    return text
