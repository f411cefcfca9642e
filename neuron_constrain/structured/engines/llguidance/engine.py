"""llguidance behind the engine contract: JSON schema, regex and Lark grammars.

    engine = LLGuidanceEngine(tokenizer)               # tokenizer: .info and .encode (llguidance/tokenizer.py)
    compiled = engine.compile(json_schema(schema))     # an LLMatcher template, deep-copied per request
    matcher = engine.matcher(compiled)                 # LLGuidanceMatcher: xgrammar's methods and behaviour

Every constraint kind is spelled in llguidance's grammar: a JSON schema through its JSON
compiler (xgrammar's ``strict_mode`` written into the schema, the whitespace options
matched), regex, choice and EBNF as Lark (``ebnf_to_lark.py``). llguidance's matcher
differs from xgrammar's in four ways the wrapper hides: a refused token puts it in a
permanent error state (we test with ``try_consume_tokens``); it is "stopped" as soon as
only EOS may follow (xgrammar terminates only when the stop token is accepted); a stop
token accepted while stopped is not counted by its rollback; and in an error or dead-end
state its mask allows EOS, which ``accept_token`` then refuses — the wrapper clears such
stop bits, so mask and accept agree (a dead end allows nothing).
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Sequence

import numpy as np
import torch

from neuron_constrain.structured.schema import keywords, patterns
from neuron_constrain.structured.schema.algebra import lengths
from neuron_constrain.structured.constraints import Constraint, ConstraintError
from neuron_constrain.structured.schema.pattern_text import constraint_regex, to_regex
from neuron_constrain.structured.engines.base import CompiledGrammar, GrammarEngine, check_rows, fill_each
from neuron_constrain.structured.schema.prepare import Prepared
from neuron_constrain.structured.engines.llguidance.ebnf_to_lark import ebnf_to_lark, lark_chars
from neuron_constrain.structured.engines.llguidance.tokenizer import import_llguidance, llguidance_tokenizer


# --------------------------------------------------------------------------- what llguidance enforces
def _all_required(node, root) -> str | None:
    """llguidance 1.9 counts properties only where none is optional (it refuses the rest at compile)."""
    properties, required = node.get("properties"), node.get("required", [])
    optional = [name for name in properties or () if name not in required] if isinstance(properties, dict) else []
    return f"the property {optional[0]!r} is optional: llguidance counts properties only when all are required" if (
        optional) else None


# Its JSON compiler implements these (its json_schema.md) and fails on every other keyword
# ("Unimplemented keys"); untyped assertions apply to their own type, siblings of anyOf/$ref
# are intersected. Measured by tests/structured/test_soundness.py on llguidance 1.9.1.
_FORMATS = frozenset({"date-time", "date", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uri", "uuid"})
ENFORCES = keywords.register(keywords.Allowlist(
    "llguidance",
    (
        *(keywords.Enforced(k) for k in ("type", "enum", "const", "anyOf")),
        keywords.Enforced("oneOf", "disjoint branches (llguidance refuses the rest itself)", engine_decides=True),
        keywords.Enforced("allOf", "where llguidance can intersect the branches (it refuses the rest itself)",
                          engine_decides=True),
        keywords.Enforced("$ref", "a pointer into the document (`$id`/`$anchor` refs rewritten to pointers)",
                          keywords.local_ref),
        *(keywords.Enforced(k) for k in ("minLength", "maxLength", "pattern")),
        keywords.Enforced("format", "the formats below", keywords.known_format("llguidance", _FORMATS)),
        *(keywords.Enforced(k, "everywhere", keywords.number(k)) for k in (
            "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")),
        keywords.Enforced("items", "a schema", keywords.schema_items),
        *(keywords.Enforced(k) for k in ("prefixItems", "minItems", "maxItems", "properties",
                                         "additionalProperties", "required", "patternProperties")),
        keywords.Enforced("minProperties", "every name in `properties` required (on a closed object, at most one "
                          "above the required names is written as which optional name); above 1 only with "
                          "`additionalProperties: false` and no `patternProperties`",
                          keywords.both(keywords.count("minProperties"), _all_required, keywords.distinct_keys)),
        keywords.Enforced("maxProperties", "every name in `properties` required",
                          keywords.both(keywords.count("maxProperties"), _all_required)),
    ),
    _FORMATS,
    # enum/const arrays and objects as schemas: any whitespace (schema/values.py); an open object's patterns the
    # two dialects read differently (`$` before a last newline in Python's) written out (schema/pattern_members.py);
    # a closed object's `minProperties` one above its required names as which optional name (schema/rewrite.py)
    rewrites=("values", "pattern_dialects", "min_properties"),
    evidence="llguidance's json_schema.md; tests/structured/test_soundness.py (the differential test), llguidance 1.9.1",
    pattern_form="`^(?:...)$` in the plain syntax (`pattern_text.to_regex`), over the string's characters",
))


class LLGuidanceEngine(GrammarEngine):
    """llguidance: JSON schema / regex / Lark grammars; matchers wrapped to xgrammar's behaviour."""

    name = "llguidance"

    def __init__(self, tokenizer, *, fill_threads: int = 1, fill_timeout: float = 120.0, limits=None):
        super().__init__(tokenizer, fill_threads=fill_threads, fill_timeout=fill_timeout, limits=limits)
        self._llg = import_llguidance()
        self.lltokenizer = llguidance_tokenizer(tokenizer)
        self._executor = None

    def grammar_text(self, constraint: Constraint, *, options: dict | None = None) -> str:
        """The llguidance grammar (its serialized form) of ``constraint``; ``options``: extra JSON options
        (``lenient``, ``coerce_one_of``: only with keywords the caller lists as unenforced)."""
        llg, kind, spec = self._llg, constraint.kind, constraint.spec
        if kind == "json_schema":
            spec = keywords.without_unknown_formats(spec, self.name)  # listed by keywords.check, or annotations
            if isinstance(spec, dict):
                spec = keywords.map_patterns(spec, _pattern_regex)
            if constraint.strict:  # xgrammar's strict_mode, spelled in JSON schema
                spec = _strict(spec)
            return llg.LLMatcher.grammar_from_json_schema(spec, overrides={**_json_options(constraint), **(options or {})})
        if kind == "json":  # xgrammar's builtin JSON grammar: an object or array, any whitespace
            return llg.LLMatcher.grammar_from_json_schema({"type": ["object", "array"]},
                                                          overrides={"whitespace_flexible": True})
        if kind == "regex":
            return llg.LLMatcher.grammar_from_regex(constraint_regex(spec, self.name, ENFORCES.regex))
        if kind == "choice":
            return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(lark_chars(o) for o in spec))
        if kind == "ebnf":
            return llg.LLMatcher.grammar_from_lark(ebnf_to_lark(spec))
        if kind == "structural_tag":
            raise ConstraintError(
                "llguidance does not take xgrammar structural tags; use engine='xgrammar' for this tool format, "
                "or tool_choice='required' (a JSON schema)"
            )
        raise ConstraintError(f"unknown constraint kind {kind!r}")

    def _template(self, constraint: Constraint, options: dict):
        try:
            text = self.grammar_text(constraint, options=options)
        except ConstraintError:
            raise
        except ValueError as error:
            raise ConstraintError(
                f"llguidance could not read this {constraint.kind} constraint ({' '.join(str(error).split())[:300]})"
            ) from error
        template = self._llg.LLMatcher(self.lltokenizer, text, log_level=0)
        error = template.get_error() if template.is_error() else ""
        return template, " ".join(line.strip() for line in error.strip().splitlines()[:3] if line.strip())

    enforces = ENFORCES

    def compile(self, constraint: Constraint | Prepared, *, policy: str | None = None) -> CompiledGrammar:
        view, unenforced = self.view(constraint, policy)
        original = constraint.constraint if isinstance(constraint, Prepared) else constraint
        # what _listen and the reported-keyword loop below read: the policy this compile applies
        constraint = dataclasses.replace(view.constraint, unenforced=policy or original.unenforced)
        options: dict = {}
        template, message = self._template(constraint, options)
        narrowed = view.narrowed
        if _UNPROVEN in message and constraint.kind == "json_schema":
            # each pattern beside length bounds written as one pattern of those lengths: no proof left to llguidance
            spec, written_narrower = copy.deepcopy(constraint.spec), []
            lengths.write_bounds(spec, written_narrower)
            constraint, narrowed = dataclasses.replace(constraint, spec=spec), narrowed + tuple(written_narrower)
            template, message = self._template(constraint, options)
        if not message and constraint.strict and constraint.kind == "json_schema" and _one_of(constraint.spec):
            # strict mode closes objects, which can make overlapping oneOf branches look disjoint to llguidance
            # ({"a": 1, "b": 2} in an enum beside {"required": ["b"]}); JSON Schema judges the schema as sent
            message = self._template(dataclasses.replace(constraint, strict=False), options)[1]
        while message and constraint.kind == "json_schema":
            # llguidance refuses what it does not implement ("Unimplemented keys", non-disjoint oneOf),
            # one kind per compile: refuse it (the policy), or list it and compile without it.
            found, option = keywords.reported(constraint.spec, self.name, message)
            if not found or option in options:
                break
            if constraint.unenforced != "allow":
                keywords.refuse(found)
            options[option] = True
            unenforced = tuple(unenforced) + tuple(f for f in found if f not in unenforced)
            template, message = self._template(constraint, options)
        if message:
            raise ConstraintError(
                f"llguidance could not compile this {constraint.kind} constraint ({message[:400]}); fix the "
                "schema/pattern/grammar, or use engine='xgrammar'"
            )
        self._listen(constraint, template)
        return CompiledGrammar(self.name, original, template, unenforced, narrowed, item_checks=view.plan)

    def _listen(self, constraint: Constraint, template) -> None:
        """llguidance's warnings name what it compiled without (``Unimplemented keys`` under ``lenient``,
        an unknown format, ...): the constraint is refused here rather than compiled with part of it
        ignored, unless it opted in (``unenforced="allow"``: its output is validated afterwards)."""
        if constraint.unenforced == "allow":
            return
        for warning in template.get_grammar_warnings():
            if constraint.kind == "json_schema":
                found, _ = keywords.reported(constraint.spec, self.name, warning)
                if found:
                    keywords.refuse(found)
            raise ConstraintError(
                f"llguidance would not enforce part of this {constraint.kind} constraint (it warned: "
                f"{' '.join(warning.split())[:300]}); refused on llguidance: use engine='xgrammar' or 'auto', or "
                "remove what it ignores")

    def engine_matcher(self, compiled: CompiledGrammar) -> "LLGuidanceMatcher":
        return LLGuidanceMatcher(compiled.grammar.deep_copy(), self.stop_token_ids, self.width)

    def _fill_checked(self, matchers: Sequence, buffer: torch.Tensor, rows: Sequence[int]) -> list[tuple[int, BaseException]]:
        # batch_fill ran check_rows: our matchers write without checking again (``LLGuidanceMatcher._write``)
        if self.fill_threads == 1 or len(matchers) == 1:
            # Row by row: llguidance's LLExecutor(num_threads=1) took 1.9x as long at batch 32 on Tekken.
            failures = []
            for index, (matcher, row) in enumerate(zip(matchers, rows)):
                try:
                    if type(matcher) is LLGuidanceMatcher:
                        matcher._write(buffer, row)
                    else:  # another engine's matcher, or a caller's own: its own method (and checks)
                        matcher.fill_next_token_bitmask(buffer, row)
                except Exception as error:  # noqa: BLE001 - the request's own failure, reported with its index
                    failures.append((index, error))
            return failures
        if self._executor is None:
            self._executor = self._llg.LLExecutor(num_threads=self.fill_threads)
        try:  # the rows were checked against the buffer (batch_fill): the raw pointer stays inside it
            self._executor.unsafe_compute_mask_ptr(
                [(m.inner, int(r)) for m, r in zip(matchers, rows)], buffer.data_ptr(), self.width * 4, buffer.shape[0]
            )
        except Exception:  # noqa: BLE001 - which row failed: find it row by row
            return fill_each(matchers, buffer, rows)
        for matcher, row in zip(matchers, rows):
            matcher.agree(buffer, row)
        return []

    def forced_tokens(self, matcher: "LLGuidanceMatcher") -> list[int]:
        if matcher.is_terminated():
            return []
        return list(matcher.inner.compute_ff_tokens())  # llguidance leaves out a last token that may merge


def _one_of(schema) -> bool:
    return any("oneOf" in node for _, node in keywords.rewrite.walk(schema))


# llguidance proves a pattern beside length bounds non-empty within a fixed budget (10,000 derivative steps)
_UNPROVEN = "Unable to determine if regex is empty"


def _pattern_regex(source: str) -> str | None:
    """A JSON-schema pattern as llguidance gets it: the plain full-match text, ``^(?:...)$`` (None: a
    pattern the policy listed as unenforced, under ``unenforced="allow"``)."""
    pattern = patterns.parse(source)
    if keywords.unenforced_feature(pattern, ENFORCES) is not None:
        return None
    return to_regex(pattern, search=True, anchored=True)


def _json_options(constraint: Constraint) -> dict:
    """llguidance's JSON options for the constraint's whitespace (as xgrammar's, constraints.py)."""
    whitespace = constraint.whitespace
    if whitespace == "none":
        return {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
    if whitespace == "compact":
        return {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    if whitespace == "bounded":
        count = constraint.max_whitespace
        return {"whitespace_flexible": True, "whitespace_pattern": f"[\\x20\\x0A\\x0D\\x09]{{0,{count}}}"}
    return {"whitespace_flexible": True}


class LLGuidanceMatcher:
    """An ``llguidance.LLMatcher`` with xgrammar ``GrammarMatcher``'s methods and behaviour."""

    __slots__ = ("inner", "width", "_stops", "_clear", "_terminated", "_stop_counted", "_words", "_words_key")

    def __init__(self, inner, stop_token_ids: Sequence[int], width: int):
        self.inner, self.width = inner, width
        self._stops = tuple(stop_token_ids)
        clear: dict[int, int] = {}  # word -> the bits to keep in it (every stop bit cleared)
        for stop in self._stops:
            clear[stop >> 5] = clear.get(stop >> 5, 0xFFFFFFFF) & (0xFFFFFFFF ^ (1 << (stop & 31)))
        self._clear = tuple(clear.items())
        self._terminated = False
        self._stop_counted = False  # llguidance counted the accepted stop token (it was not stopped yet)
        self._words, self._words_key = None, None  # the buffer's words as uint32 (a memoryview), and whose

    def fill_next_token_bitmask(self, buffer: torch.Tensor, row: int = 0) -> bool:
        check_rows(buffer, (row,), self.width)  # before the raw write: it must land inside the buffer
        self._write(buffer, row)
        return True

    def _write(self, buffer: torch.Tensor, row: int) -> None:
        """The fill, for a buffer and row :func:`check_rows` accepted (``fill_next_token_bitmask``,
        ``LLGuidanceEngine.batch_fill``): llguidance writes the row through its address."""
        size = self.width * 4
        address = buffer.data_ptr()
        self.inner.unsafe_compute_mask_ptr(address + row * size, size)
        if not self.inner.is_accepting():
            self._clear_stops(buffer, address, row)

    def agree(self, buffer: torch.Tensor, row: int) -> None:
        """Clear the stop bits ``accept_token`` would refuse: it takes a stop token only where the
        grammar may end, while llguidance's mask allows EOS in an error or dead-end state too."""
        if not self.inner.is_accepting():
            self._clear_stops(buffer, buffer.data_ptr(), row)

    def _clear_stops(self, buffer: torch.Tensor, address: int, row: int) -> None:
        # The buffer's words as a memoryview, made once per buffer (``buffer.numpy()`` alone costs ~1 us).
        # The view keeps that storage alive, so no other buffer can start at its address: the same address
        # is the same memory. The row was checked against the buffer's current shape; a view made when the
        # buffer had fewer rows raises IndexError on a later row, never writes past its end: remade then.
        base = row * self.width
        for _ in range(2):
            words = self._words
            if address != self._words_key:
                words = self._words = memoryview(buffer.numpy()).cast("B").cast("I")
                self._words_key = address
            try:
                for word, keep in self._clear:
                    words[base + word] &= keep
                return
            except IndexError:
                self._words_key = None

    def accept_token(self, token: int) -> bool:
        if self._terminated:
            return False
        inner = self.inner
        if token in self._stops:
            if not inner.is_accepting():
                return False
            stopped = inner.is_stopped()
            if not inner.consume_token(token):
                return False
            self._terminated, self._stop_counted = True, not stopped
            return True
        return inner.try_consume_tokens([token]) == 1  # consume_token would leave an error state

    def rollback(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        if self._terminated:
            self._terminated = False
            if not self._stop_counted:
                num_tokens -= 1
        if num_tokens and not self.inner.rollback(num_tokens):
            raise ValueError(f"llguidance could not roll back {num_tokens} tokens: {self.inner.get_error()[:200]}")

    def is_terminated(self) -> bool:
        return self._terminated


def _strict(schema):
    """xgrammar's ``strict_mode`` spelled in JSON schema: objects with listed properties take no
    others, tuples (``prefixItems``) no extra items, unless the schema says otherwise."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
            out[key] = {k: _strict(v) for k, v in value.items()} if isinstance(value, dict) else value
        elif key in ("enum", "const", "default", "examples", "required"):
            out[key] = value
        else:
            out[key] = _strict(value)
    if isinstance(out.get("properties"), dict) and not any(
        k in out for k in ("additionalProperties", "unevaluatedProperties", "patternProperties")
    ):
        out["additionalProperties"] = False
    if isinstance(out.get("prefixItems"), list) and not any(k in out for k in ("items", "unevaluatedItems")):
        out["items"] = False
    return out
