"""Structured outputs and tool calling on a transformed decoder, driven by xgrammar.

    vocab = toy_tokenizer()                                  # or Vocabulary(pieces, eos_id=...)
    model = transform_decoder(GreedyStep(m), (ids,), vocab_size=vocab.vocab_size,
                              dynamic_shapes=({0: Dim("batch")},))   # logit_mask input added
    result = generate(model, ["a", "b"], [json_schema(schema), None], 32, tokenizer=vocab)

Per decode step the host does (``StructuredRuntime``):

    step(batch=[r2, r0, r1], drafts={r0: [t1, t2]})
        rows  r2 | r0 r0+t1 r0+t1+t2 | r1           one row per logits row, batch order
        fill  xgrammar fills each constrained row in place in ONE reusable int32 buffer
              [max_rows, ceil(V/32)] (drafts: fill, accept draft, fill, ..., roll back);
              unconstrained rows are -1 (rewritten only when a grammar row used them)
        ->    buffer[:rows], a view: the packed mask the graph unpacks (V/8 bytes a row)
    accept(request, tokens)   advance the grammar; a token it forbids raises, naming both

There is no compact mask and no reorder copy: rows are filled where the graph reads
them. Constraints: :func:`json_schema`, :func:`any_json`, :func:`regex`,
:func:`choice`, :func:`ebnf`, and OpenAI tools through :func:`tool_constraint`
(``required``/named -> a JSON schema; ``auto``/``none`` -> free text, parsed by
:func:`parse_tool_calls`). ``enable_structured_outputs=False`` transforms without a
mask input; a constrained request is then refused, never answered unconstrained.
"""
from __future__ import annotations

import dataclasses
import json
import re
import time
from typing import Any, Hashable, Mapping, Sequence

import torch
import xgrammar as xgr

from neuron_constrain.kernels import packed_width
from neuron_constrain.passes.mask_logits_pass import MASK_INPUT
from neuron_constrain.transform import Transformed, transform

__all__ = [
    "Constraint",
    "ConstraintError",
    "DisallowedTokenError",
    "BatchLayoutError",
    "StructuredOutputsDisabledError",
    "Vocabulary",
    "StructuredRuntime",
    "Generation",
    "GenerateResult",
    "ToolCall",
    "json_schema",
    "any_json",
    "regex",
    "choice",
    "ebnf",
    "tool_constraint",
    "parse_tool_calls",
    "validate_output",
    "transform_decoder",
    "generate",
]


# ----------------------------------------------------------------------------- errors


class ConstraintError(ValueError):
    """A constraint is malformed or xgrammar cannot compile it."""


class StructuredOutputsDisabledError(ValueError):
    """A constrained request reached a model transformed without a logit mask."""


class DisallowedTokenError(ValueError):
    """A chosen token is not allowed by its request's grammar (or lies past the vocabulary)."""

    def __init__(self, message: str, request_id: Hashable, token: int):
        super().__init__(message)
        self.request_id = request_id
        self.token = token


class BatchLayoutError(ValueError):
    """A batch layout names an unknown or repeated request, or needs more rows than the buffer has."""


# ----------------------------------------------------------------------------- vocabulary


class Vocabulary:
    """A byte-level vocabulary: xgrammar's ``TokenizerInfo`` plus greedy longest-match encoding.

    ``pieces[i]`` is the bytes of token ``i``; the stop token is ``b""`` (xgrammar
    reads an empty piece as special, so it never matches text). A real tokenizer's
    ``TokenizerInfo.from_huggingface`` plugs into :class:`StructuredRuntime` the same way.
    """

    def __init__(self, pieces: Sequence[bytes], *, eos_id: int):
        self.pieces = [bytes(p) for p in pieces]
        if not 0 <= eos_id < len(self.pieces):
            raise ValueError(f"eos_id={eos_id} is not a token of this {len(self.pieces)}-piece vocabulary")
        self.eos_id = eos_id
        self.vocab_size = len(self.pieces)
        self._ids: dict[bytes, int] = {}
        for i, piece in enumerate(self.pieces):
            if piece and piece in self._ids:
                raise ValueError(f"piece {piece!r} appears twice (ids {self._ids[piece]} and {i}); pieces must be unique")
            if piece:
                self._ids[piece] = i
        self._longest = max(len(p) for p in self.pieces)
        self.info = xgr.TokenizerInfo(
            self.pieces, xgr.VocabType.RAW, vocab_size=self.vocab_size, stop_token_ids=[eos_id]
        )

    def encode(self, text: str | bytes) -> list[int]:
        data = text.encode() if isinstance(text, str) else text
        ids, at = [], 0
        while at < len(data):
            for size in range(min(self._longest, len(data) - at), 0, -1):
                token = self._ids.get(data[at:at + size])
                if token is not None:
                    ids.append(token)
                    at += size
                    break
            else:
                raise ValueError(f"byte {data[at]:#x} at offset {at} has no token; a byte vocabulary needs all 256 single bytes")
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return b"".join(self.pieces[i] for i in ids if i != self.eos_id).decode("utf-8", errors="replace")


# ----------------------------------------------------------------------------- constraints


# xgrammar 0.2.8 writes the characters of a string with minLength/maxLength as this
# class, which admits raw control characters (invalid JSON: "\x06" inside a string).
# We compile with JSON's own string-character class instead.
_LENGTH_STRING_CLASS = r'[^\"\\\r\n]'
_JSON_STRING_CLASS = r'[^\0-\x1f\"\\]'


@dataclasses.dataclass(frozen=True, eq=False)
class Constraint:
    """What a request's output must match. Build with the functions below."""

    kind: str  # "json_schema" | "json" | "regex" | "choice" | "ebnf"
    spec: Any = None
    compact: bool = True  # JSON: "," and ":" with no whitespace (else any whitespace)

    def compile(self, compiler: xgr.GrammarCompiler) -> xgr.CompiledGrammar:
        try:
            if self.kind == "json_schema":
                if self.compact:
                    grammar = xgr.Grammar.from_json_schema(self.spec, any_whitespace=False, separators=(",", ":"))
                else:
                    grammar = xgr.Grammar.from_json_schema(self.spec, any_whitespace=True)
                text = str(grammar)
                if _LENGTH_STRING_CLASS in text:
                    grammar = xgr.Grammar.from_ebnf(text.replace(_LENGTH_STRING_CLASS, _JSON_STRING_CLASS))
                return compiler.compile_grammar(grammar)
            if self.kind == "json":
                return compiler.compile_builtin_json_grammar()
            if self.kind == "regex":
                return compiler.compile_regex(self.spec)
            if self.kind in ("choice", "ebnf"):
                return compiler.compile_grammar(self.grammar_text())
        except Exception as error:  # xgrammar raises RuntimeError/ValueError with its parser's message
            raise ConstraintError(
                f"xgrammar could not compile this {self.kind} constraint ({error}); "
                "fix the schema/pattern/grammar (xgrammar's dialect) and resubmit the request"
            ) from error
        raise ConstraintError(f"unknown constraint kind {self.kind!r}")

    def grammar_text(self) -> str:
        if self.kind == "choice":
            return "root ::= " + " | ".join(_ebnf_literal(option) for option in self.spec)
        return self.spec

    def describe(self) -> str:
        if self.kind == "json":
            return "any JSON"
        text = json.dumps(self.spec) if self.kind in ("json_schema", "choice") else self.spec
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


def json_schema(schema: dict | str, *, compact: bool = True) -> Constraint:
    """Output is JSON valid against ``schema`` (``compact``: no whitespace between tokens)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as error:
            raise ConstraintError(f"the JSON schema is not JSON ({error}); pass a dict or a JSON string") from error
    if not isinstance(schema, dict):
        raise ConstraintError(f"a JSON schema is a dict, got {type(schema).__name__}")
    return Constraint("json_schema", schema, compact)


def any_json() -> Constraint:
    """Output is any JSON object or array (OpenAI's ``response_format={"type": "json_object"}``)."""
    return Constraint("json", None, False)


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


# ----------------------------------------------------------------------------- tool calling


@dataclasses.dataclass
class ToolCall:
    name: str
    arguments: dict


def _tool_functions(tools: Sequence[dict]) -> dict[str, dict]:
    functions = {}
    for index, tool in enumerate(tools or ()):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(tool, dict) and tool.get("type") == "function" and isinstance(function, dict)
                and isinstance(function.get("name"), str)):
            raise ConstraintError(
                f"tools[{index}] is not an OpenAI function tool; write "
                '{"type": "function", "function": {"name": ..., "parameters": {...JSON schema...}}}'
            )
        functions[function["name"]] = function.get("parameters") or {"type": "object"}
    return functions


def _call_schema(name: str, parameters: dict) -> dict:
    return {
        "type": "object",
        "properties": {"name": {"type": "string", "enum": [name]}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _named_tool(tool_choice) -> str | None:
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if isinstance(name, str):
            return name
    return None


def tool_constraint(tools: Sequence[dict], tool_choice: str | dict = "auto") -> Constraint | None:
    """OpenAI ``tools`` + ``tool_choice`` -> the constraint that enforces it.

    ``"required"``: a JSON array of one or more ``{"name", "arguments"}`` calls to the
    given tools. A named choice ``{"type": "function", "function": {"name": n}}``: one
    call object for ``n``. ``"auto"`` / ``"none"``: ``None`` (free text; parse it with
    :func:`parse_tool_calls`).
    """
    functions = _tool_functions(tools)
    if tool_choice in ("auto", "none", None):
        return None
    if tool_choice == "required":
        if not functions:
            raise ConstraintError('tool_choice="required" with no tools: pass tools, or use tool_choice="auto"')
        calls = [_call_schema(name, params) for name, params in functions.items()]
        return json_schema({"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}})
    name = _named_tool(tool_choice)
    if name is None:
        raise ConstraintError(
            f"tool_choice={tool_choice!r} is not one of 'auto', 'none', 'required' or "
            '{"type": "function", "function": {"name": ...}}'
        )
    if name not in functions:
        raise ConstraintError(f"tool_choice names {name!r} but the tools are {sorted(functions)}; add it to tools")
    return json_schema(_call_schema(name, functions[name]))


def _as_call(value, functions: Mapping[str, dict]) -> ToolCall | None:
    if not isinstance(value, dict) or value.get("name") not in functions:
        return None
    arguments = value.get("arguments", value.get("parameters"))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    return ToolCall(value["name"], arguments) if isinstance(arguments, dict) else None


def parse_tool_calls(text: str, tools: Sequence[dict], tool_choice: str | dict = "auto") -> tuple[str, list[ToolCall]]:
    """``(content, calls)`` from a model's answer.

    ``required``/named: the answer is the constrained JSON and is parsed whole.
    ``auto``: JSON objects ``{"name": <a tool>, "arguments"|"parameters": {...}}`` (alone
    or in arrays) are lifted out of free text; the rest is the content. ``none``: no calls.
    """
    functions = _tool_functions(tools)
    if tool_choice == "none":
        return text, []
    if tool_choice == "required" or _named_tool(tool_choice):
        value = json.loads(text)
        calls = [_as_call(v, functions) for v in (value if isinstance(value, list) else [value])]
        if not calls or None in calls:
            raise ValueError(f"the answer {text[:80]!r} is not a call to {sorted(functions)}")
        return "", calls
    decoder, calls, kept, at = json.JSONDecoder(), [], [], 0
    while at < len(text):
        start = min((i for i in (text.find("{", at), text.find("[", at)) if i >= 0), default=-1)
        if start < 0:
            break
        try:
            value, end = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            kept.append(text[at:start + 1])
            at = start + 1
            continue
        found = [_as_call(v, functions) for v in (value if isinstance(value, list) else [value])]
        if found and None not in found:
            calls.extend(found)
            kept.append(text[at:start])
        else:
            kept.append(text[at:end])
        at = end
    kept.append(text[at:])
    return "".join(kept).strip(), calls


def validate_output(constraint: Constraint, text: str) -> str | None:
    """``None`` if ``text`` satisfies ``constraint``, else why not (checked without xgrammar
    for JSON (``jsonschema``), regex (``re``) and choice; EBNF by a fresh xgrammar matcher)."""
    if constraint.kind in ("json_schema", "json"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as error:
            return f"not JSON: {error}"
        if constraint.kind == "json":
            return None if isinstance(value, (dict, list)) else f"JSON {type(value).__name__}, not an object or array"
        import jsonschema  # the `test` extra

        errors = sorted(jsonschema.Draft202012Validator(constraint.spec).iter_errors(value), key=str)
        return None if not errors else f"schema violation: {errors[0].message}"
    if constraint.kind == "regex":
        return None if re.fullmatch(constraint.spec, text) else f"does not match /{constraint.spec}/"
    if constraint.kind == "choice":
        return None if text in constraint.spec else f"not one of {list(constraint.spec)}"
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo([b"x"]), max_threads=1)  # accept_string needs no vocabulary
    matcher = xgr.GrammarMatcher(compiler.compile_grammar(constraint.spec))
    ok = matcher.accept_string(text) and matcher.is_completed()
    return None if ok else "does not match the grammar"


# ----------------------------------------------------------------------------- runtime


@dataclasses.dataclass
class _Request:
    constraint: Constraint | None
    matcher: xgr.GrammarMatcher | None
    finished: bool = False


class StructuredRuntime:
    """Per-step packed masks for a batch of requests, in one reusable buffer.

    ``vocab_size`` (of ``tokenizer_info``) sets the mask width ``ceil(V/32)``; it is
    the ``vocab_size`` the graph was transformed with, so an lm_head padded past it
    never has its padding chosen. ``step`` returns ``None`` when structured outputs
    are disabled (the graph has no mask input).
    """

    def __init__(
        self,
        tokenizer_info: xgr.TokenizerInfo,
        *,
        max_rows: int,
        enable_structured_outputs: bool = True,
        compiler: xgr.GrammarCompiler | None = None,
        fill_threads: int = 1,
    ):
        if max_rows <= 0:
            raise ValueError(f"max_rows must be positive (the largest batch, draft rows included), got {max_rows}")
        self.info = tokenizer_info
        self.vocab_size = tokenizer_info.vocab_size
        self.width = packed_width(self.vocab_size)
        self.max_rows = max_rows
        self.enabled = enable_structured_outputs
        self.stop_token_ids = frozenset(tokenizer_info.stop_token_ids)
        if not self.stop_token_ids:
            raise ValueError("the tokenizer info has no stop token; build it with stop_token_ids=[<eos id>]")
        self.compiler = compiler or xgr.GrammarCompiler(tokenizer_info, max_threads=1)
        self._batch_matcher = xgr.BatchGrammarMatcher(max_threads=fill_threads)
        # One buffer for the life of the runtime; pinned when a CUDA-like host allows it.
        self.buffer = torch.full((max_rows, self.width), -1, dtype=torch.int32)
        self._all_allowed = bytearray(b"\x01" * max_rows)  # row holds -1 everywhere
        self._views = [self.buffer[:rows] for rows in range(max_rows + 1)]  # handed out, never re-sliced
        self._words = self.buffer.numpy()  # same memory; numpy row writes cost less than torch indexing
        stop = torch.zeros(self.width * 32, dtype=torch.bool)
        stop[sorted(self.stop_token_ids)] = True
        from neuron_constrain.kernels import pack_bool_mask

        self._stop_row = pack_bool_mask(stop[: self.vocab_size])
        self._stop_words = self._stop_row.numpy()
        self._requests: dict[Hashable, _Request] = {}
        self._decoded: list[bytes] | None = None
        self.last_step_seconds = 0.0  # whole step(): layout + fills + hand-off
        self.last_fill_seconds = 0.0  # xgrammar's fill_next_token_bitmask / accept / rollback inside it
        self.last_accept_seconds = 0.0  # whole accept_rows()
        self.last_accept_xgrammar_seconds = 0.0

    @classmethod
    def for_model(cls, transformed: Transformed, tokenizer_info: xgr.TokenizerInfo, *, max_rows: int, **kwargs):
        """A runtime matched to ``transformed``: enabled iff the graph takes a logit mask of our width."""
        added = {i.name: i for i in transformed.report.inputs_added}
        runtime = cls(tokenizer_info, max_rows=max_rows, enable_structured_outputs=MASK_INPUT in added, **kwargs)
        if runtime.enabled:
            info = added[MASK_INPUT]
            if info.dtype != torch.int32:
                raise ValueError(
                    f"the graph's logit_mask is {info.describe()} but the runtime ships packed int32 rows; "
                    "transform with logit_mask='packed'"
                )
            width = int(info.shape[-1])
            if width != runtime.width:
                raise ValueError(
                    f"the graph's logit_mask has {width} words per row but the tokenizer's {runtime.vocab_size} "
                    f"tokens need {runtime.width}; transform with vocab_size={runtime.vocab_size} (the tokenizer's "
                    "vocabulary, even when the lm_head is wider)"
                )
        return runtime

    # -------------------------------------------------------------- requests join / leave
    def add(self, request_id: Hashable, constraint: Constraint | None = None) -> None:
        if request_id in self._requests:
            raise BatchLayoutError(f"request {request_id!r} is already in the runtime; remove it first or use a new id")
        if constraint is not None and not self.enabled:
            raise StructuredOutputsDisabledError(
                f"request {request_id!r} asks for a {constraint.describe()} constraint, but structured outputs are "
                "disabled: the model was transformed without a logit_mask input, so its answer could not be "
                "constrained. Transform it with enable_structured_outputs=True (transform_decoder) or "
                "logit_mask='packed' (transform) and restart, or send the request without a constraint"
            )
        matcher = None if constraint is None else xgr.GrammarMatcher(constraint.compile(self.compiler))
        self._requests[request_id] = _Request(constraint, matcher)

    def remove(self, request_id: Hashable) -> None:
        if self._requests.pop(request_id, None) is None:
            raise BatchLayoutError(f"request {request_id!r} is not in the runtime (never added, or removed already)")

    def finished(self, request_id: Hashable) -> bool:
        return self._request(request_id).finished

    def _request(self, request_id: Hashable) -> _Request:
        request = self._requests.get(request_id)
        if request is None:
            raise BatchLayoutError(f"request {request_id!r} is not in the runtime; add() it before scheduling it")
        return request

    def _piece(self, token: int) -> bytes:
        if self._decoded is None:
            self._decoded = self.info.decoded_vocab
        return self._decoded[token]

    # -------------------------------------------------------------- one decode step
    def step(self, batch: Sequence[Hashable], drafts: Mapping[Hashable, Sequence[int]] | None = None):
        """The mask for one decode step: ``buffer[:rows]``, rows in batch order, or ``None`` if disabled.

        A request with ``k`` draft tokens owns ``1 + k`` consecutive rows: row ``i`` is
        its grammar after accepting the first ``i`` drafts. Past a draft the grammar
        forbids, rows repeat the row that forbade it (the verifier rejects that draft,
        so they are never used); past an accepted stop token rows allow only stop tokens.
        A finished request's rows allow only stop tokens; unconstrained rows are ``-1``.
        """
        clock = time.perf_counter
        start = clock()
        if not self.enabled:
            for request_id in batch:
                self._request(request_id)
            self.last_step_seconds, self.last_fill_seconds = clock() - start, 0.0
            return None
        # Hot path: plain dict/list work per request; xgrammar writes the rows in place.
        requests, buffer, all_allowed, words = self._requests, self.buffer, self._all_allowed, self._words
        fill_seconds, row = 0.0, 0
        fill_matchers, fill_rows = [], []
        for request_id in batch:
            request = requests.get(request_id)
            if request is None:
                self._request(request_id)  # raises, naming the request
            draft = drafts.get(request_id) if drafts else None
            if draft:
                end = row + 1 + len(draft)
                if end > self.max_rows:
                    self._too_many_rows(batch, drafts)
                if request.matcher is None:
                    for r in range(row, end):
                        if not all_allowed[r]:
                            buffer[r].fill_(-1)
                            all_allowed[r] = 1
                else:
                    fill_seconds += self._fill(request_id, request, row, draft)
                    for r in range(row, end):
                        all_allowed[r] = 0
                row = end
                continue
            if row >= self.max_rows:
                self._too_many_rows(batch, drafts)
            matcher = request.matcher
            if matcher is None:
                if not all_allowed[row]:
                    words[row] = -1
                    all_allowed[row] = 1
            elif request.finished:
                words[row] = self._stop_words
                all_allowed[row] = 0
            else:
                fill_matchers.append(matcher)
                fill_rows.append(row)
                all_allowed[row] = 0
            row += 1
        if len(set(batch)) != len(batch):
            raise BatchLayoutError(f"the batch {list(batch)} names a request twice; each request owns one slot")
        if fill_matchers:  # one call: xgrammar loops over the rows in C++
            tick = clock()
            self._batch_matcher.batch_fill_next_token_bitmask(fill_matchers, buffer, fill_rows)
            fill_seconds += clock() - tick
        view = self._views[row]
        self.last_fill_seconds = fill_seconds
        self.last_step_seconds = clock() - start
        return view

    def _too_many_rows(self, batch, drafts) -> None:
        total = len(batch) + sum(len(drafts.get(r, ())) for r in batch) if drafts else len(batch)
        raise BatchLayoutError(
            f"this batch needs {total} mask rows ({len(batch)} requests + draft tokens) but the runtime "
            f"was built with max_rows={self.max_rows}; build it with max_rows>={total} (the compiled "
            "graph's largest batch, draft rows included)"
        )

    def _fill(self, request_id, request: _Request, row: int, draft: Sequence[int]) -> float:
        buffer, matcher = self.buffer, request.matcher
        end = row + 1 + len(draft)
        if request.finished:
            buffer[row:end] = self._stop_row
            return 0.0
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(buffer, row)
        advanced = 0
        for token in draft:
            if not 0 <= token < self.vocab_size:
                if advanced:
                    matcher.rollback(advanced)
                raise BatchLayoutError(
                    f"draft token {token} of request {request_id!r} is outside the tokenizer's "
                    f"{self.vocab_size} tokens; the drafter must propose tokens < {self.vocab_size}"
                )
            if not matcher.accept_token(token):
                break
            advanced += 1
            row += 1
            if matcher.is_terminated():
                buffer[row] = self._stop_row
                break
            matcher.fill_next_token_bitmask(buffer, row)
        if advanced:
            matcher.rollback(advanced)
        seconds = time.perf_counter() - start
        if row + 1 < end:
            buffer[row + 1:end] = buffer[row]
        return seconds

    # -------------------------------------------------------------- after sampling
    def accept(self, request_id: Hashable, tokens: Sequence[int]) -> bool:
        """Advance ``request_id`` by ``tokens`` (the sampled token, or accepted drafts + bonus).

        Returns whether the request has finished (a stop token). A token its grammar
        forbids raises :class:`DisallowedTokenError` and leaves the request as it was.
        """
        request = self._request(request_id)
        matcher, advanced = request.matcher, 0
        for token in tokens:
            token = int(token)
            if not 0 <= token < self.vocab_size:
                self._undo(request, advanced)
                raise DisallowedTokenError(
                    f"request {request_id!r} got token {token}, past the tokenizer's {self.vocab_size} tokens "
                    "(a padded lm_head column): transform the model with "
                    f"vocab_size={self.vocab_size} so padded columns are never chosen",
                    request_id, token,
                )
            if request.finished:
                if token in self.stop_token_ids:
                    continue  # a finished request padding its slot with stop tokens
                self._undo(request, advanced)
                raise DisallowedTokenError(
                    f"request {request_id!r} already finished at a stop token but got token {token} "
                    f"({self._piece(token)!r}); remove() finished requests or keep their rows masked to stop tokens",
                    request_id, token,
                )
            if matcher is None:
                request.finished = token in self.stop_token_ids
                continue
            if not matcher.accept_token(token):
                self._undo(request, advanced)
                raise DisallowedTokenError(
                    f"request {request_id!r} ({request.constraint.describe()}) got token {token} "
                    f"({self._piece(token)!r}), which its grammar does not allow here: the mask fed to the "
                    "graph was not this request's current row (check the batch order and draft offsets), "
                    "or the graph ignored the mask",
                    request_id, token,
                )
            advanced += 1
            request.finished = matcher.is_terminated()
        return request.finished

    def _undo(self, request: _Request, advanced: int) -> None:
        if advanced:
            request.matcher.rollback(advanced)
            request.finished = False

    def accept_rows(self, batch: Sequence[Hashable], tokens: torch.Tensor | Sequence[int]) -> list[Hashable]:
        """One sampled token per request of ``batch`` (no drafts); returns the requests that finished.

        A token some request's grammar forbids raises :class:`DisallowedTokenError` for
        that request (left unchanged) after the other requests have taken theirs.
        """
        clock = time.perf_counter
        start = clock()
        values = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
        if len(values) != len(batch):
            raise BatchLayoutError(f"{len(values)} tokens for a batch of {len(batch)} requests; pass one token per request")
        requests, vocab_size, stops = self._requests, self.vocab_size, self.stop_token_ids
        finished, xgrammar_seconds = [], 0.0
        live_ids, live_requests, live_matchers, live_tokens = [], [], [], []
        for request_id, token in zip(batch, values):
            request = requests.get(request_id)
            matcher = request.matcher if request is not None else None
            # Hot path: a live constrained request and an in-vocabulary token, batched below.
            if matcher is not None and not request.finished and 0 <= token < vocab_size:
                live_ids.append(request_id)
                live_requests.append(request)
                live_matchers.append(matcher)
                live_tokens.append(token)
            elif self.accept(request_id, (token,)):
                finished.append(request_id)
        if live_matchers:
            tick = clock()
            accepted = xgr.BatchGrammarMatcher.batch_accept_token(live_matchers, live_tokens)
            xgrammar_seconds += clock() - tick
            refused = None
            for request_id, request, token, ok in zip(live_ids, live_requests, live_tokens, accepted):
                if not ok:
                    refused = refused or (request_id, token)
                elif token in stops:  # accepting a stop token is what terminates a matcher
                    request.finished = True
                    finished.append(request_id)
            if refused is not None:  # the other requests advanced; this one is unchanged
                self.last_accept_xgrammar_seconds = xgrammar_seconds
                self.accept(refused[0], [refused[1]])  # raises, naming request and token
        self.last_accept_xgrammar_seconds = xgrammar_seconds
        self.last_accept_seconds = clock() - start
        return finished


# ----------------------------------------------------------------------------- model + loop


def transform_decoder(model, example_inputs, *, vocab_size: int, enable_structured_outputs: bool = True, **kwargs) -> Transformed:
    """``transform`` with the structured-outputs switch.

    True: the graph gains the packed ``logit_mask`` input (unconstrained traffic feeds
    ``-1`` rows through the same compiled graph, so the first constrained request
    costs no recompilation). False: no mask input and no mask work; a
    :class:`StructuredRuntime` built for it refuses constrained requests.
    """
    if enable_structured_outputs:
        return transform(model, example_inputs, logit_mask="packed", vocab_size=vocab_size, **kwargs)
    return transform(model, example_inputs, logit_mask=None, **kwargs)


@dataclasses.dataclass
class Generation:
    request_id: int
    prompt: list[int]
    tokens: list[int]  # generated, the stop token included when it came
    text: str  # generated text without the stop token
    finish_reason: str  # "stop" | "length"


@dataclasses.dataclass
class GenerateResult:
    outputs: list[Generation]
    step_host_seconds: list[float]  # runtime step + accept, per decode step (xgrammar included)
    step_fill_seconds: list[float]  # xgrammar's part of it (fill, accept)


def _sequence_length(transformed: Transformed) -> int | None:
    """The static token dimension of the graph's first input, or None if it is dynamic."""
    spec = transformed.program.graph_signature.user_inputs[0]
    node = next(n for n in transformed.program.graph.nodes if n.op == "placeholder" and n.name == spec)
    size = node.meta["val"].shape[-1]
    return size if isinstance(size, int) else None


def generate(
    transformed: Transformed,
    prompts: Sequence[str | Sequence[int]],
    constraints: Sequence[Constraint | None],
    max_new_tokens: int,
    *,
    tokenizer: Vocabulary,
    runtime: StructuredRuntime | None = None,
) -> GenerateResult:
    """Greedy decoding of a batch with per-request constraints (no KV cache: each step
    recomputes over the last tokens; a graph exported with a static sequence length
    sees a window of that many tokens, left-padded with the stop token).

    Finished requests leave the batch between steps. Constrained requests on a graph
    without a mask input raise :class:`StructuredOutputsDisabledError` before any step.
    """
    if len(prompts) != len(constraints):
        raise ValueError(f"{len(prompts)} prompts but {len(constraints)} constraints; pass one constraint (or None) per prompt")
    runtime = runtime or StructuredRuntime.for_model(transformed, tokenizer.info, max_rows=max(1, len(prompts)))
    window = _sequence_length(transformed)
    sequences = [list(tokenizer.encode(p)) if isinstance(p, (str, bytes)) else [int(t) for t in p] for p in prompts]
    for index, constraint in enumerate(constraints):
        try:
            runtime.add(index, constraint)
        except Exception:
            for added in range(index):
                runtime.remove(added)
            raise
    generated: list[list[int]] = [[] for _ in prompts]
    active = list(range(len(prompts)))
    host, fill = [], []
    try:
        for _ in range(max_new_tokens):
            if not active:
                break
            mask = runtime.step(active)
            step_host, step_fill = runtime.last_step_seconds, runtime.last_fill_seconds
            length = window or max(len(sequences[i]) for i in active)
            rows = [([tokenizer.eos_id] * length + sequences[i])[-length:] for i in active]
            ids = torch.tensor(rows, dtype=torch.long)
            tokens = transformed(ids) if mask is None else transformed(ids, logit_mask=mask)
            done = set(runtime.accept_rows(active, tokens))
            host.append(step_host + runtime.last_accept_seconds)
            fill.append(step_fill + runtime.last_accept_xgrammar_seconds)
            for request_id, token in zip(active, tokens.tolist()):
                generated[request_id].append(token)
                sequences[request_id].append(token)
            active = [r for r in active if r not in done]
    finally:
        for index in range(len(prompts)):
            runtime.remove(index)
    outputs = []
    for index, tokens in enumerate(generated):
        stopped = bool(tokens) and tokens[-1] in runtime.stop_token_ids
        prompt = sequences[index][: len(sequences[index]) - len(tokens)]
        outputs.append(Generation(index, prompt, tokens, tokenizer.decode(tokens), "stop" if stopped else "length"))
    return GenerateResult(outputs, host, fill)
