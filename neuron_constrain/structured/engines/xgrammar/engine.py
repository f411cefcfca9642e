"""xgrammar behind the engine contract: its own ``GrammarMatcher`` is the matcher.

    engine = XGrammarEngine(tokenizer, fill_threads=1)
    compiled = engine.compile(json_schema(schema))     # the keyword policy, then xgrammar.grammars.compile_grammar
    engine.batch_fill(matchers, buffer, rows)          # one BatchGrammarMatcher call (1 thread),
                                                       # or RowFillers (fill_threads > 1)

xgrammar's matcher already keeps the contract: it refuses an out-of-range row or a
buffer of the wrong dtype/width, its mask and ``accept_token`` agree, and it releases
the GIL while it fills.
"""
from __future__ import annotations

import concurrent.futures
import json
import threading
import time
import weakref
from typing import Sequence

import torch
import xgrammar as xgr

from neuron_constrain.structured.schema import keywords as K, patterns
from neuron_constrain.structured.schema.prepare import Prepared
from neuron_constrain.structured.engines.base import (CompiledGrammar, GrammarEngine, encode_continuation, fill_each,
                                                      fills_itself)
from neuron_constrain.structured.engines.xgrammar.disk_cache import DiskCache
from neuron_constrain.structured.engines.xgrammar.fill_threads import RowFillers
from neuron_constrain.structured.engines.xgrammar.grammars import (compile_grammar, parse_constraint, writes_escapes,
                                                                  xgrammar_info)
from neuron_constrain.structured.engines.xgrammar.worker import shared_workers

_ACCEPT = xgr.GrammarMatcher.accept_token


# --------------------------------------------------------------------------- what xgrammar 0.2.8 enforces
def _branch_key(branch):
    """What tells a oneOf branch apart: its single JSON type, or its literal values."""
    if not isinstance(branch, dict):
        return None
    if "const" in branch:
        return ("values", (json.dumps(branch["const"], sort_keys=True),))
    if isinstance(branch.get("enum"), list):
        return ("values", tuple(json.dumps(v, sort_keys=True) for v in branch["enum"]))
    kind = branch.get("type")
    if isinstance(kind, str):
        return ("type", ("number",) if kind == "integer" else (kind,))
    return None


def _discriminated(branches) -> bool:
    """Object branches told apart by one required property with distinct const values."""
    names = None
    for branch in branches:
        props = branch.get("properties") if isinstance(branch, dict) else None
        if not isinstance(props, dict):
            return False
        consts = {k for k, v in props.items() if isinstance(v, dict) and "const" in v and k in branch.get("required", ())}
        names = consts if names is None else names & consts
    for name in sorted(names or ()):
        values = [json.dumps(b["properties"][name]["const"], sort_keys=True) for b in branches]
        if len(set(values)) == len(values):
            return True
    return False


def _one_of_overlaps(node, root):
    """xgrammar keeps oneOf exact only for provably disjoint branches (else anyOf, with a warning)."""
    branches = node.get("oneOf")
    if not isinstance(branches, list) or len(branches) < 2:
        return None
    keys = [_branch_key(b) for b in branches]
    if all(k is not None for k in keys) and len({k[0] for k in keys}) == 1:
        seen: set = set()
        for _, values in keys:
            if seen & set(values):
                return "branches that may overlap: xgrammar compiles them as anyOf"
            seen |= set(values)
        return None
    if _discriminated(branches):
        return None
    return "branches not provably disjoint (distinct types or literals, or a const discriminator): compiled as anyOf"


# xgrammar compiles a node holding one of these alone, dropping every sibling assertion
# (``rewrite.distribute`` / ``narrow`` first move siblings where the meaning allows).
_ALONE = ("$ref", "anyOf", "oneOf", "enum", "const")


def _compiled_alone(keyword: str):
    def unless(node, root):
        present = [k for k in _ALONE if k in node]
        if not present or (present == [keyword]):
            return None
        first = present[0] if present[0] != keyword else present[1]
        return f"beside `{first}`, which xgrammar compiles alone (its sibling assertions are dropped)"
    return unless


def _required_in_properties(node, root):
    required, properties = node.get("required"), node.get("properties") or {}
    if isinstance(required, list) and any(name not in properties for name in required):
        return "names a key absent from `properties` (xgrammar does not require it)"
    return None


def _escaped_names(node, root):
    """xgrammar tells a declared property from an additional key by the name's raw characters (and a
    non-ASCII character by one byte of it): beside additional properties a name JSON writes with an
    escape (a quote, a backslash, a control character) or with non-ASCII characters is taken as an
    additional key, its value unchecked by the property's schema."""
    properties = node.get("properties")
    if not isinstance(properties, dict) or node.get("additionalProperties") is False:
        return None
    escaped = [name for name in properties if any(c in '"\\' or not 0x20 <= ord(c) < 0x7F for c in name)]
    if escaped:
        return (f"the property name {escaped[0]!r} is written with a JSON escape or non-ASCII characters: beside "
                "additional properties xgrammar does not tell it from an additional key")
    return None


def _names_alone(node, root):
    """xgrammar 0.2.8 writes any key `propertyNames` takes with any value, dropping the node's `properties`,
    `additionalProperties` and `unevaluatedProperties` (``{"a": "x"}`` taken where `a` must be an integer)."""
    beside = [k for k in ("properties", "additionalProperties", "unevaluatedProperties", "patternProperties") if k in node]
    return f"beside `{beside[0]}`, which xgrammar drops there" if beside else None


def _regions_written(node, root):
    """xgrammar writes an additional key as any string (one a pattern owns, or a declared name, again):
    ``patternProperties`` only where ``pattern_members`` closed the object, each region written out."""
    return None if node.get("additionalProperties") is False else (
        "its regions could not be written out (a cap, or `unevaluatedProperties`/`propertyNames` beside): "
        "xgrammar would write an additional key as any string")


def _no_pattern(node, root):
    return "beside `pattern`, which xgrammar keeps alone (it warns)" if "pattern" in node else None


def _integer_multiple(node, root):
    value, kinds = node.get("multipleOf"), K.rewrite.declared_types(node) or frozenset()
    if isinstance(value, int) and not isinstance(value, bool) and value > 0 and kinds <= {"integer", "null"}:
        return None
    return "only an integer multipleOf of an integer type (a fractional step, or a number type, is not enforced)"


def _allof_single(node, root):
    branches = node.get("allOf")
    if not isinstance(branches, list) or len(branches) > 1:
        return "branches sharing a keyword are not intersected"
    if branches and K.rewrite.splits_a_unit(node, branches[0]):  # xgrammar merges the branch into the node
        return "its branch holds one half of an adjacency unit (e.g. `properties` beside `additionalProperties`)"
    first = branches[0] if branches and isinstance(branches[0], dict) else {}
    alone = [k for k in _ALONE if k in first]
    if alone and (K.rewrite.VOCABULARY - {"allOf"}) & set(node):  # merged, it would drop the node's own
        return f"its branch holds `{alone[0]}`, which xgrammar compiles alone once merged: the node's assertions are dropped"
    return None


# Measured by random walks through each format's masks (testing/schemas.py ``walks``), not assumed: xgrammar's
# own grammars for `date` (February 30th), `ipv4` (leading zeros), `email` (any `\X` escape in a quoted local
# part: not JSON) and `json-pointer` / `relative-json-pointer` (raw quotes and control characters: not JSON)
# write values the referee refuses, so they are off the list (``schema/formats.py`` writes every format with a
# grammar there as its pattern before an engine reads the schema: this list is what is left to xgrammar).
_FORMATS = frozenset({"date-time", "time", "duration", "hostname", "ipv6", "uri", "uri-reference", "uri-template",
                      "uuid"})


def _entries():
    def on(keyword, where, *conditions):
        return K.Enforced(keyword, where, K.both(_compiled_alone(keyword), *conditions))
    string, number = K.typed("string", "xgrammar"), K.typed("number", "xgrammar")
    array, obj = K.typed("array", "xgrammar"), K.typed("object", "xgrammar")
    typed_where = "typed"
    return (
        on("type", "not beside `$ref`/`anyOf`/`oneOf`/`enum`/`const` (siblings are moved into them)"),
        on("enum", "alone (sibling assertions filter its values first)"),
        on("const", "alone (sibling assertions filter it first)"),
        on("anyOf", "alone (siblings moved into the branches)"),
        on("oneOf", "provably disjoint branches, alone", _one_of_overlaps),
        on("allOf", "one branch (branches without shared keywords are merged)", _allof_single),
        on("$ref", "a pointer into the document, alone (`$id`/`$anchor` refs rewritten to pointers)", K.local_ref),
        on("minLength", f"{typed_where}, not beside `pattern`", string, _no_pattern, K.count("minLength")),
        on("maxLength", f"{typed_where}, not beside `pattern`", string, _no_pattern, K.count("maxLength")),
        on("pattern", typed_where, string),
        on("format", f"{typed_where}; the formats below", string, K.known_format("xgrammar", _FORMATS)),
        *(on(k, typed_where, number, K.number(k)) for k in ("minimum", "maximum", "exclusiveMinimum",
                                                             "exclusiveMaximum")),
        on("multipleOf", "an integer step on an integer type", number, _integer_multiple),
        on("items", f"{typed_where}, a schema", array, K.schema_items),
        on("prefixItems", typed_where, array),
        on("unevaluatedItems", f"{typed_where}, with no `allOf` beside it", array,
           lambda node, root: "beside `allOf`" if "allOf" in node else None),
        on("minItems", typed_where, array, K.count("minItems")),
        on("maxItems", typed_where, array, K.count("maxItems")),
        on("properties", f"{typed_where}; a name written with a JSON escape or non-ASCII characters only with `additionalProperties: false`",
           obj, _escaped_names),
        on("patternProperties", f"{typed_where}; each name's region written out, the object closed (without "
           "`unevaluatedProperties`/`propertyNames` beside)", obj, _regions_written),
        on("additionalProperties", typed_where, obj),
        on("required", f"{typed_where}, each name listed in `properties`", obj, _required_in_properties),
        on("minProperties", f"{typed_where}; above 1 only with `additionalProperties: false`", obj, K.distinct_keys,
           K.count("minProperties")),
        on("maxProperties", typed_where, obj, K.count("maxProperties")),
        on("propertyNames", f"{typed_where}, without `properties`/`additionalProperties` beside it", obj, _names_alone),
    )


ENFORCES = K.register(K.Allowlist(
    "xgrammar", _entries(), _FORMATS,
    rewrites=("distribute", "split_types", "pattern_members", "narrow", "values", "integral"),
    regex=frozenset({patterns.CONTROLS_WITHOUT_ESCAPES}),  # the library writes the JSON escapes (pattern_text.to_ebnf)
    evidence="tests/structured/test_soundness.py (the differential test) and tests/structured/test_keywords.py's probes, xgrammar 0.2.8",
    pattern_form="EBNF written by the library (`pattern_text.to_ebnf`), over the JSON-escaped text",
))


class XGrammarEngine(GrammarEngine):
    """xgrammar: the grammars of ``xgrammar/grammars.py`` on one compiler; its matcher is xgrammar's own."""

    name = "xgrammar"

    def __init__(self, tokenizer, *, fill_threads: int = 1, fill_timeout: float = 120.0, limits=None,
                 compile_processes: int = 0):
        super().__init__(tokenizer, fill_threads=fill_threads, fill_timeout=fill_timeout, limits=limits)
        self.compiler = xgr.GrammarCompiler(xgrammar_info(self.info), max_threads=1)
        # compile_processes > 0: each compilation in a worker process, killed past limits.compile_seconds
        # and capped at limits.compile_memory_mb (xgrammar/worker.py, shared by the engines of one
        # vocabulary); 0: on the calling thread, unbounded
        self.workers = shared_workers(xgrammar_info(self.info), processes=compile_processes,
                                      memory_mb=self.limits.compile_memory_mb) if compile_processes else None
        self.fillers = RowFillers(fill_threads, fill_timeout) if fill_threads > 1 else None
        self.disk_cache = DiskCache.from_environment()  # compiled grammars on disk (disk_cache.py); None: off
        self._tokenizer_digest: str | None = None  # the disk cache's key part for this vocabulary, taken once
        self.compiles = 0  # grammars compiled (not loaded from the disk cache)
        self._later, self._later_lock = None, threading.Lock()  # compile_later's threads, started on first use
        # One thread: one call for all rows, so the GIL is released once, not once per row, while a
        # pipelined step traces the body on another thread (as fast as per-row calls when alone).
        self._batch = xgr.BatchGrammarMatcher(max_threads=1)
        if self.fillers is not None:  # the threads hold the fillers, not the engine: stop them with it
            weakref.finalize(self, self.fillers.close)

    def close(self) -> None:
        if self.fillers is not None:
            self.fillers.close()
        if self._later is not None:
            self._later.shutdown(wait=False, cancel_futures=True)

    enforces = ENFORCES

    def wait_ready(self) -> None:
        if self.workers is not None:
            self.workers.wait_ready()

    def compile(self, constraint, *, policy: str | None = None) -> CompiledGrammar:
        """``narrowed`` also lists the bounded strings written without escapes (:meth:`narrowed_strings`)."""
        view, unenforced = self.view(constraint, policy)
        grammar = self._compile_or_load(view.constraint)
        original = constraint.constraint if isinstance(constraint, Prepared) else constraint
        return CompiledGrammar(self.name, original, grammar, unenforced, view.narrowed + self.narrowed_strings(view),
                               view.plan)

    @staticmethod
    def narrowed_strings(view) -> tuple[str, ...]:
        """The pointers of ``view``'s bounded strings (``minLength``/``maxLength``) written without escapes (a quote,
        a backslash or a newline inside refused): past ``grammars.STRING_CHAIN_COUNTS`` characters, or every one
        where the constraint asks for xgrammar's own class (``json_schema(..., escapes=False)``)."""
        if not view.bounded_strings:
            return ()
        nodes = dict(K.walk(view.schema))
        return tuple(path for path in view.bounded_strings if not view.constraint.escapes or not writes_escapes(
            nodes[path].get("minLength", 0), nodes[path].get("maxLength")))

    def _compile_or_load(self, job):
        """xgrammar's grammar of ``job``: from the disk cache where an entry loads, else compiled (and stored
        there when the compile took ``disk_cache.min_seconds`` or more)."""
        key, info = None, xgrammar_info(self.info)
        if self.disk_cache is not None:
            if self._tokenizer_digest is None:
                self._tokenizer_digest = self.disk_cache.tokenizer_digest(info.serialize_json())
            key = self.disk_cache.key(job.key, self._tokenizer_digest)
            grammar = self.disk_cache.load(key, lambda payload: xgr.CompiledGrammar.deserialize_json(payload, info))
            if grammar is not None:
                return grammar
        start, text = time.perf_counter(), None
        if self.workers is not None:  # the worker's JSON is what the disk cache stores: not written again here
            text = self.workers.compile_text(job, self.limits.compile_seconds)
            grammar = xgr.CompiledGrammar.deserialize_json(text, info)
        else:
            grammar = compile_grammar(self.compiler, job)
        self.compiles += 1
        if key is not None and time.perf_counter() - start >= self.disk_cache.min_seconds:
            self.disk_cache.store(key, text if text is not None else grammar.serialize_json())
        return grammar

    def compile_later(self, constraint, *, policy: str | None = None) -> concurrent.futures.Future:
        """:meth:`compile` on a thread of its own (``auto``'s race): xgrammar releases the GIL while it compiles,
        and a worker process (``compile_processes``) is waited for there."""
        with self._later_lock:
            if self._later is None:
                self._later = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="xgrammar-later")
                weakref.finalize(self, self._later.shutdown, wait=False, cancel_futures=True)
            return self._later.submit(self.compile, constraint, policy=policy)

    def parse(self, constraint) -> None:
        parse_constraint(constraint)

    def engine_matcher(self, compiled: CompiledGrammar) -> xgr.GrammarMatcher:
        return xgr.GrammarMatcher(compiled.grammar)

    def _fill_checked(self, matchers: Sequence, buffer: torch.Tensor, rows: Sequence[int]) -> list[tuple[int, BaseException]]:
        if len(matchers) == 1:  # the batch API costs ~65 us more for one row
            try:
                matchers[0].fill_next_token_bitmask(buffer, rows[0])
            except Exception as error:  # noqa: BLE001 - the request's own failure
                return [(0, error)]
            return []
        if self.fillers is not None:  # xgrammar's BatchGrammarMatcher(max_threads=2) filled slower than one thread
            return self.fillers.fill(matchers, buffer, rows)
        try:
            self._batch.batch_fill_next_token_bitmask(list(matchers), buffer, list(rows))
        except Exception:  # noqa: BLE001 - which row failed: find it row by row (the others are refilled)
            return fill_each(matchers, buffer, rows)
        return []

    def forced_tokens(self, matcher) -> list[int]:
        text = matcher.find_jump_forward_string()
        if not text:
            return []
        encode = getattr(self.tokenizer, "encode", None)
        if encode is None:
            raise ValueError("jump_forward='canonical' tokenizes the forced text: pass the tokenizer itself "
                             "(from_huggingface / from_mistral), not a bare TokenizerInfo")
        tokens = encode_continuation(encode, text)[:-1]  # the last may merge with what the model writes next
        taken = 0
        for token in tokens:
            if not matcher.accept_token(token):
                break
            taken += 1
        if taken:
            matcher.rollback(taken)
        return tokens[:taken]

    def batch_accept(self, matchers: Sequence, tokens: Sequence[int]) -> list[bool]:
        # Row by row: xgrammar's batch_accept_token took 1.3x as long at batch 32.
        if any(map(fills_itself, matchers)):
            return [matcher.accept_token(token) for matcher, token in zip(matchers, tokens)]
        return list(map(_ACCEPT, matchers, tokens))

