"""Two grammar engines behind one mask contract: xgrammar and llguidance.

    engine = make_engine("llguidance", tokenizer)    # or "xgrammar"; tokenizer: .info (+ .encode, .names)
    compiled = engine.compile(json_schema(schema))    # ConstraintError (one line) if refused or malformed
    compiled.unenforced                               # keywords accepted but not enforced (opt-in only)
    matcher = engine.matcher(compiled)                # xgrammar GrammarMatcher's method names:
    matcher.fill_next_token_bitmask(buffer, row)      #   int32 [rows, ceil(V/32)], LSB first, 1 = allowed
    matcher.accept_token(t) -> bool                   #   False: refused, state unchanged
    matcher.rollback(n); matcher.is_terminated()      #   terminated = a stop token was accepted
    engine.batch_fill([m0, m1], buffer, [0, 3])       # many rows in one call

Both engines write the same packed rows the graph's ``logit_mask`` takes; control
tokens are never allowed, stop tokens only where the grammar may end. Every
constraint kind works on both: JSON schema, any JSON, regex, choice and EBNF (xgrammar's
dialect; for llguidance it is converted to Lark here, one character per lexeme, which
keeps EBNF's context-free meaning exactly; lookaheads are dropped, xgrammar's builtins
refused with the fix). Before a JSON schema is compiled, :mod:`keywords` decides which
of its keywords this engine would not enforce and refuses them by default.

llguidance's matcher differs from xgrammar's in three ways the wrapper hides: a refused
token puts it in a permanent error state (we test with ``try_consume_tokens``), it is
"stopped" as soon as only EOS may follow (xgrammar terminates only when the stop token
is accepted), and a stop token accepted while stopped is not counted by its rollback.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import re
import threading
import weakref
from typing import Any, Sequence

import torch
import xgrammar as xgr

from neuron_constrain.structured import keywords
from neuron_constrain.structured.constraints import Constraint, ConstraintError

ENGINES = ("xgrammar", "llguidance")
_ACCEPT = xgr.GrammarMatcher.accept_token
_CACHE_SIZE = 64  # compiled grammars kept per engine (same constraint text -> same grammar)


@dataclasses.dataclass(frozen=True, eq=False)
class Compiled:
    """A constraint compiled for one engine; ``unenforced`` lists what it will not enforce."""

    engine: str
    constraint: Constraint
    grammar: Any  # xgrammar CompiledGrammar | llguidance LLMatcher (a template, deep-copied per request)
    unenforced: tuple[keywords.Unenforced, ...] = ()


def make_engine(name: str, tokenizer, *, fill_threads: int = 1):
    """The engine called ``name`` (one of :data:`ENGINES`) for ``tokenizer``'s vocabulary."""
    if name == "xgrammar":
        return XGrammarEngine(tokenizer, fill_threads=fill_threads)
    if name == "llguidance":
        return LLGuidanceEngine(tokenizer, fill_threads=fill_threads)
    raise ValueError(f"unknown grammar engine {name!r}; pick one of {', '.join(ENGINES)}")


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


class _Engine:
    name = ""

    def __init__(self, tokenizer, *, fill_threads: int = 1):
        info = tokenizer.info
        self.tokenizer = tokenizer
        self.info = info
        self.vocab_size = info.vocab_size
        self.width = (self.vocab_size + 31) // 32
        self.stop_token_ids = tuple(info.stop_token_ids)
        if not self.stop_token_ids:
            raise ValueError("the tokenizer info has no stop token; build it with stop_token_ids=[<eos id>]")
        self.fill_threads = fill_threads
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()  # the runtime compiles on a thread pool

    def compile(self, constraint: Constraint) -> Compiled:
        """``constraint`` compiled (cached by ``constraint.key``); raises :class:`ConstraintError`."""
        key = constraint.key
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return dataclasses.replace(compiled, constraint=constraint)
        unenforced = ()
        if constraint.kind == "json_schema":
            unenforced = keywords.check(constraint.spec, self.name, constraint.unenforced)
        compiled = self._compile(constraint, unenforced)
        with self._lock:
            self._cache[key] = compiled
            if len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def close(self) -> None:
        """Stop the engine's fill threads, if it has any."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size})"


# ------------------------------------------------------------------------------ xgrammar
class _RowFillers:
    """``threads - 1`` long-lived threads that fill mask rows beside the calling thread.

    xgrammar's matcher releases the GIL while it fills a row, so rows taken one at a
    time from one shared iterator (``next`` on it is atomic under the GIL) fill in
    parallel, and a costly row (milliseconds inside a long string) is balanced by the
    cheap ones whichever thread takes it. Measured on 2 cores at batches 32 and 64 of
    real schemas (``bench_host.py``): 1.04-1.39x one thread, where xgrammar's own
    ``BatchGrammarMatcher(max_threads=2)`` was 0.63-0.80x; rows cost 1.1-1.8x more
    each when both cores fill, and waking a thread costs ~25 us each way on that VM.
    Waits are bounded; a worker's error is raised on the calling thread.
    """

    def __init__(self, threads: int, timeout: float = 120.0):
        self.timeout = timeout
        self._claims, self._buffer = iter(()), None
        self._errors: list[BaseException] = []
        self._closed = False
        self._broken = ""  # set when a fill thread did not finish in time
        self._starts = [threading.Lock() for _ in range(threads - 1)]
        self._dones = [threading.Lock() for _ in range(threads - 1)]
        for start, done in zip(self._starts, self._dones):
            start.acquire()
            done.acquire()
            threading.Thread(target=self._work, args=(start, done), daemon=True, name="grammar-fill").start()

    def _drain(self) -> None:
        buffer = self._buffer
        for matcher, row in self._claims:
            matcher.fill_next_token_bitmask(buffer, row)

    def _work(self, start: threading.Lock, done: threading.Lock) -> None:
        while True:
            start.acquire()
            if self._closed:
                return
            try:
                self._drain()
            except BaseException as error:  # noqa: BLE001 - raised by fill() on the calling thread
                self._errors.append(error)
            finally:
                done.release()

    def fill(self, matchers: Sequence, buffer: torch.Tensor, rows: Sequence[int]) -> None:
        if self._closed or self._broken:
            raise RuntimeError(self._broken or "the engine's fill threads were closed; make a new runtime")
        self._claims, self._buffer = iter(list(zip(matchers, rows))), buffer
        for start in self._starts:
            start.release()
        try:
            self._drain()
        finally:  # join the threads even when this thread's row failed (its error wins)
            for done in self._dones:
                if not done.acquire(timeout=self.timeout):
                    self._broken = (f"a grammar fill thread did not finish within {self.timeout} s; this "
                                    "runtime no longer fills in parallel: make a new runtime")
                    raise TimeoutError(self._broken)
            errors, self._errors = self._errors, []
        if errors:
            raise errors[0]

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            for start in self._starts:
                start.release()


class XGrammarEngine(_Engine):
    """xgrammar: the compiled grammar of ``Constraint.compile``; its matcher is xgrammar's own."""

    name = "xgrammar"

    def __init__(self, tokenizer, *, fill_threads: int = 1):
        super().__init__(tokenizer, fill_threads=fill_threads)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1)
        self._fillers = _RowFillers(fill_threads) if fill_threads > 1 else None
        # One thread: one call for all rows, so the GIL is released once, not once per row, while a
        # pipelined step traces the body on another thread (as fast as per-row calls when alone).
        self._batch = xgr.BatchGrammarMatcher(max_threads=1)
        if self._fillers is not None:  # the threads hold the fillers, not the engine: stop them with it
            weakref.finalize(self, self._fillers.close)

    def close(self) -> None:
        if self._fillers is not None:
            self._fillers.close()

    def _compile(self, constraint, unenforced) -> Compiled:
        return Compiled(self.name, constraint, constraint.compile(self.compiler), unenforced)

    def matcher(self, compiled: Compiled) -> xgr.GrammarMatcher:
        return xgr.GrammarMatcher(compiled.grammar)

    def batch_fill(self, matchers: Sequence, buffer: torch.Tensor, rows: Sequence[int]) -> None:
        if len(matchers) == 1:  # the batch API costs ~65 us more for one row
            matchers[0].fill_next_token_bitmask(buffer, rows[0])
        elif self._fillers is None:
            self._batch.batch_fill_next_token_bitmask(list(matchers), buffer, list(rows))
        else:  # xgrammar's BatchGrammarMatcher(max_threads=2) filled slower than one thread
            self._fillers.fill(matchers, buffer, rows)

    def batch_accept(self, matchers: Sequence, tokens: Sequence[int]) -> list[bool]:
        # Row by row: xgrammar's batch_accept_token took 1.3x as long at batch 32.
        return list(map(_ACCEPT, matchers, tokens))


# ------------------------------------------------------------------------------ llguidance
_LLG_TOKENIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _import_llguidance():
    try:
        import llguidance
        import llguidance.torch  # noqa: F401  (registers the torch helpers)
    except ImportError as error:
        raise ImportError(
            "engine='llguidance' needs the llguidance package: pip install 'neuron-constrain[llguidance]'"
        ) from error
    return llguidance


_ANCHOR = "\n"


class _Pieces:
    """What ``llguidance.TokenizerWrapper`` reads: pieces, special ids, EOS, and an encoder."""

    def __init__(self, tokenizer, info):
        own = getattr(tokenizer, "pieces", None)  # tokenizers.Tokenizer / testing.Vocabulary: no decode pass
        pieces = list(own) if own is not None else list(info.decoded_vocab)
        pieces += [b""] * (info.vocab_size - len(pieces))
        special = set(info.special_token_ids) | set(info.stop_token_ids)
        special.update(i for i, p in enumerate(pieces) if not p)
        names = getattr(tokenizer, "names", None)
        seen, self.tokens = set(), []
        for i, piece in enumerate(pieces):
            if i in special:  # llguidance names special tokens "<...>", each once
                name = names[i] if names is not None and i < len(names) else ""
                name = "<" + name.strip("<>[]|") + ">" if name else f"<|special_{i}|>"
                if name in seen:
                    name = f"<|special_{i}|>"
                seen.add(name)
                piece = name.encode()
            self.tokens.append(piece)
        self.special_token_ids = sorted(special)
        self.eos_token_id = info.stop_token_ids[0]
        self.bos_token_id = None
        self._encode = getattr(tokenizer, "encode", None)
        if self._encode is None:  # llguidance tokenizes the text a grammar forces with it
            raise ValueError(
                "engine='llguidance' needs the tokenizer itself (its encode()), not a bare TokenizerInfo: pass "
                "tokenizers.from_huggingface(...) / from_mistral(...)"
            )

    def __call__(self, text):
        """Tokens of ``text`` as it continues a sequence. llguidance forces the canonical
        tokens of the text a grammar fixes; a sentencepiece encoder adds a dummy-prefix
        space at the start of an encode, so the text is encoded after an anchor
        (``"\n"``) whose own tokens are then dropped."""
        text = text if isinstance(text, str) else text.decode("utf-8", "replace")
        anchor = list(self._encode(_ANCHOR))
        ids = list(self._encode(_ANCHOR + text))
        if ids[: len(anchor)] == anchor:
            return ids[len(anchor):]
        return list(self._encode(text))  # the anchor merged with the text: no better split is known


def _llg_tokenizer(tokenizer):
    """The llguidance tokenizer of ``tokenizer`` (built once per tokenizer object: ~0.3 s at 131k)."""
    llg = _import_llguidance()
    try:
        cached = _LLG_TOKENIZERS.get(tokenizer)
    except TypeError:
        cached = None
    if cached is not None:
        return cached
    info = tokenizer.info
    built = llg.LLTokenizer(llg.TokenizerWrapper(_Pieces(tokenizer, info)), n_vocab=info.vocab_size,
                            eos_token=list(info.stop_token_ids))
    try:
        _LLG_TOKENIZERS[tokenizer] = built
    except TypeError:
        pass
    return built


class LLGuidanceEngine(_Engine):
    """llguidance: JSON schema / regex / Lark grammars; matchers wrapped to xgrammar's behaviour."""

    name = "llguidance"

    def __init__(self, tokenizer, *, fill_threads: int = 1):
        super().__init__(tokenizer, fill_threads=fill_threads)
        self._llg = _import_llguidance()
        self.lltokenizer = _llg_tokenizer(tokenizer)
        self._executor = None
        self._row_bytes = self.width * 4

    def grammar_text(self, constraint: Constraint, *, options: dict | None = None) -> str:
        """The llguidance grammar (its serialized form) of ``constraint``; ``options``: extra JSON options
        (``lenient``, ``coerce_one_of``: only with keywords the caller lists as unenforced)."""
        llg, kind, spec = self._llg, constraint.kind, constraint.spec
        if kind == "json_schema":
            spec = keywords.without_unknown_formats(spec, self.name)  # listed by keywords.check, or annotations
            if constraint.strict:  # xgrammar's strict_mode, spelled in JSON schema
                spec = _strict(spec)
            return llg.LLMatcher.grammar_from_json_schema(spec, overrides={**_json_options(constraint), **(options or {})})
        if kind == "json":  # xgrammar's builtin JSON grammar: an object or array, any whitespace
            return llg.LLMatcher.grammar_from_json_schema({"type": ["object", "array"]},
                                                          overrides={"whitespace_flexible": True})
        if kind == "regex":
            return llg.LLMatcher.grammar_from_regex(spec)
        if kind == "choice":
            return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(_lark_chars(o) for o in spec))
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

    def _compile(self, constraint, unenforced) -> Compiled:
        options: dict = {}
        template, message = self._template(constraint, options)
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
        return Compiled(self.name, constraint, template, unenforced)

    def matcher(self, compiled: Compiled) -> "LLGuidanceMatcher":
        return LLGuidanceMatcher(compiled.grammar.deep_copy(), self.stop_token_ids)

    def batch_fill(self, matchers: Sequence, buffer: torch.Tensor, rows: Sequence[int]) -> None:
        if self.fill_threads == 1 or len(matchers) == 1:
            # Row by row: llguidance's LLExecutor(num_threads=1) took 1.9x as long at batch 32 on Tekken.
            for matcher, row in zip(matchers, rows):
                matcher.fill_next_token_bitmask(buffer, row)
            return
        if buffer.dtype != torch.int32 or buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise ValueError("llguidance fills a contiguous int32 CPU buffer [rows, ceil(V/32)]")
        if self._executor is None:
            self._executor = self._llg.LLExecutor(num_threads=self.fill_threads)
        self._executor.unsafe_compute_mask_ptr(
            [(m.inner, int(r)) for m, r in zip(matchers, rows)], buffer.data_ptr(), self._row_bytes, buffer.shape[0]
        )

    def batch_accept(self, matchers: Sequence, tokens: Sequence[int]) -> list[bool]:
        return [m.accept_token(t) for m, t in zip(matchers, tokens)]


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

    __slots__ = ("inner", "_stops", "_terminated", "_stop_counted")

    def __init__(self, inner, stop_token_ids: Sequence[int]):
        self.inner = inner
        self._stops = frozenset(stop_token_ids)
        self._terminated = False
        self._stop_counted = False  # llguidance counted the accepted stop token (it was not stopped yet)

    def fill_next_token_bitmask(self, buffer: torch.Tensor, row: int = 0) -> bool:
        if buffer.dtype is not torch.int32 or not buffer.is_cpu or not buffer.is_contiguous():
            raise ValueError(f"the mask buffer must be a contiguous int32 CPU tensor, got {buffer.dtype} on {buffer.device}")
        size = buffer.shape[-1] * 4
        self.inner.unsafe_compute_mask_ptr(buffer.data_ptr() + row * size, size)
        return True

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

    def is_completed(self) -> bool:
        return self._terminated or self.inner.is_accepting()

    def reset(self) -> None:
        self.inner.reset()
        self._terminated = False


# ------------------------------------------------------------------------------ EBNF -> Lark
def _lark_chars(text: str) -> str:
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
    parts, k = [], 0
    while k < len(items):
        if k + 2 < len(items) and items[k] is not None and items[k + 1] is None and items[k + 2] is not None:
            parts.append(_regex_char(items[k]) + "-" + _regex_char(items[k + 2]))
            k += 3
        else:
            parts.append(_regex_char("-" if items[k] is None else items[k]))
            k += 1
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
                out.append(_lark_chars("".join(_unescape(text[1:-1], text))))
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



# ------------------------------------------------------------------------------ teacher forcing
def force(engine, compiled: Compiled, tokens: Sequence[int], *, buffer: torch.Tensor | None = None,
          times: list | None = None, stop: bool = True) -> bool:
    """Whether a fresh matcher of ``compiled`` takes ``tokens`` and then a stop token (``stop=False``:
    whether they are a prefix), each one checked against the mask filled before it (the bit the
    graph reads) and by ``accept_token``.

    ``times``: per token taken, ``(fill + accept seconds, fill seconds)`` is appended.
    """
    import time

    clock = time.perf_counter
    buffer = torch.zeros((1, engine.width), dtype=torch.int32) if buffer is None else buffer
    words = buffer.numpy()
    matcher = engine.matcher(compiled)
    tail = [engine.stop_token_ids[0]] if stop else []
    for token in list(tokens) + tail:
        start = clock()
        engine.batch_fill([matcher], buffer, [0])
        fill = clock() - start
        if not (int(words[0, token >> 5]) >> (token & 31)) & 1:
            return False
        start = clock()
        accepted = matcher.accept_token(token)
        if times is not None:
            times.append((fill + clock() - start, fill))
        if not accepted:
            return False
    return matcher.is_terminated() if stop else True
