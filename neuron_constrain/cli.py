"""``neuron-constrain`` command line: rewrite saved programs (``.pt2``) and guard them in CI.

Commands: rewrite, show, diff, check, hlo, localize, generate, demo; ``build_parser`` declares them
(docs/gen_cli.py writes the reference page, docs/reference/cli.md, from it). The last two paragraphs
are the parser's epilog (``--help``):

Exit status: 0 ok; 1 a check failed, the graphs differ, localize found a culprit or generate's
answer is incomplete or invalid; 2 bad usage, unreadable input or an unexpected error (one line
naming the problem; --debug shows the traceback); 130 interrupted.

A .pt2 is read with neuron_constrain.load: nothing in it runs, and a file that would need
pickle (or is malformed) is refused with exit 2, naming the entry; --allow-pickle loads a
file you trust with torch.export.load.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
import warnings

from neuron_constrain import __version__, Error, InputError, TransformError

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2

# Passes `rewrite --passes` can run, in the order they run (their former names are taken too).
PASSES = ("tap_modules", "mask_logits")


class UsageError(Error):
    """Bad usage or unreadable input: reported as one line, exit 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own usage errors: exit 2 as well, one line
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# ----------------------------------------------------------------------------- progress and loading

class _Progress:
    """Status lines on stderr when it is a terminal; silent otherwise."""

    def __init__(self):
        self.enabled = sys.stderr.isatty()

    @contextlib.contextmanager
    def step(self, what: str):
        start = time.perf_counter()
        if self.enabled:
            print(f"{what} ...", file=sys.stderr, flush=True)
        yield
        if self.enabled:
            print(f"{what}: done in {time.perf_counter() - start:.1f}s", file=sys.stderr, flush=True)


def _check_readable(path: str) -> None:
    if not os.path.exists(path):
        raise UsageError(f"{path}: no such file; check the path (a .pt2 written by torch.export.save)")
    if os.path.isdir(path):
        raise UsageError(f"{path} is a directory; pass a .pt2 file written by torch.export.save")
    if not os.access(path, os.R_OK):
        raise UsageError(f"{path}: permission denied")


def _check_output_dir(path: str) -> None:
    out_dir = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(out_dir):
        raise UsageError(f"-o {path}: directory {out_dir} does not exist; create it first")


def load_program(path: str, progress: _Progress, debug: bool, allow_pickle: bool = False):
    """``neuron_constrain.load`` (nothing in the file runs unless ``--allow-pickle``), torch's load chatter silenced."""
    _check_readable(path)
    with progress.step(f"loading {path} ({os.path.getsize(path) / 1e6:.1f} MB)"):
        from neuron_constrain.loading import LoadError, load

        logger = logging.getLogger("torch.export")
        level = logger.level
        try:
            with warnings.catch_warnings():
                if not debug:
                    warnings.simplefilter("ignore")
                    logger.setLevel(logging.CRITICAL)
                return load(path, allow_pickle=allow_pickle)
        except LoadError as e:
            if debug:
                raise
            raise UsageError(str(e)) from e
        finally:
            logger.setLevel(level)


def _read_graph(path: str, progress: _Progress, debug: bool, allow_pickle: bool = False):
    """A canonical graph from a .pt2 or from a saved canonical text."""
    from neuron_constrain.core.canonical import canonical_text, is_canonical_text, parse_canonical

    _check_readable(path)
    with open(path, "rb") as f:
        head = f.read(64)
    if is_canonical_text(head):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        try:
            return parse_canonical(text)
        except ValueError as e:
            raise UsageError(f"{path}: {e}; regenerate it with `neuron-constrain show`") from e
    return parse_canonical(canonical_text(load_program(path, progress, debug, allow_pickle)))


# ----------------------------------------------------------------------------- commands

def _parse_passes(values: list[str] | None, taps: list[str] | None) -> list[str]:
    from neuron_constrain.core.report import FORMER_NAMES

    if values is None:
        return ["tap_modules", "mask_logits"] if taps else ["mask_logits"]
    names = [n.strip() for v in values for n in v.split(",") if n.strip()]
    if not names:
        raise UsageError(f"--passes names no pass; choose from {', '.join(PASSES)}")
    for name in names:
        if FORMER_NAMES.get(name, name) not in PASSES:
            raise UsageError(f"unknown pass {name!r}; available: {', '.join(PASSES)}")
    names = [FORMER_NAMES.get(n, n) for n in names]
    if taps and "tap_modules" not in names:
        raise UsageError("--tap configures the tap_modules pass, which --passes leaves out; add tap_modules to --passes")
    if "tap_modules" in names and not taps:
        raise UsageError("--passes tap_modules needs at least one --tap PATTERN (e.g. --tap 'model.layers.*.mlp.router')")
    return names


def _parse_empty_row(value: str) -> str | int:
    if value == "flag":
        return value
    try:
        token = int(value)
    except ValueError:
        raise UsageError(f"--empty-row {value!r}: use 'flag' or a token id (e.g. the EOS id)") from None
    if token < 0:
        raise UsageError(f"--empty-row {value}: a token id must be >= 0")
    return token


def _rewrite(args: argparse.Namespace) -> int:
    passes = _parse_passes(args.passes, args.tap)
    mask_options = {"--logit-mask": args.logit_mask, "--vocab-size": args.vocab_size, "--empty-row": args.empty_row,
                    "--tp-degree": args.tp_degree}
    given = [flag for flag, value in mask_options.items() if value is not None]
    if "mask_logits" not in passes and given:
        raise UsageError(f"{', '.join(given)} configure the mask_logits pass, which --passes leaves out; add it to --passes")
    if args.vocab_size is not None and args.vocab_size <= 0:
        raise UsageError(f"--vocab-size {args.vocab_size}: the vocabulary size must be positive")
    empty_row = _parse_empty_row(args.empty_row or "flag")
    if os.path.abspath(args.output) == os.path.abspath(args.input):
        raise UsageError(f"-o {args.output} is the input file; write the rewrite to a new path")
    _check_output_dir(args.output)

    progress = _Progress()
    program = load_program(args.input, progress, args.debug, args.allow_pickle)

    import torch

    from neuron_constrain import transform

    with progress.step("rewriting"):
        try:
            result = transform(
                program,
                logit_mask=(args.logit_mask or "packed") if "mask_logits" in passes else None,
                vocab_size=args.vocab_size,
                empty_row=empty_row,
                tp_degree=1 if args.tp_degree is None else args.tp_degree,
                taps=args.tap if "tap_modules" in passes else (),
            )
        except TransformError as e:
            if args.debug:
                raise
            raise UsageError(f"{args.input}: {e}") from e
    with progress.step(f"saving {args.output}"):
        torch.export.save(result.program, args.output)
    print(f"{args.input} -> {args.output}")
    for report in result.report.passes.values():
        print(report.summary())
    return EXIT_OK


def _show(args: argparse.Namespace) -> int:
    from neuron_constrain.core.canonical import canonical_text

    program = load_program(args.input, _Progress(), args.debug, args.allow_pickle)
    sys.stdout.write(canonical_text(program))
    return EXIT_OK


def _diff(args: argparse.Namespace) -> int:
    from neuron_constrain.core.graph_diff import diff_graphs

    progress = _Progress()
    a = _read_graph(args.a, progress, args.debug, args.allow_pickle)
    b = _read_graph(args.b, progress, args.debug, args.allow_pickle)
    result = diff_graphs(a, b, args.a, args.b)
    sys.stdout.write(result.render(args.a, args.b))
    return EXIT_OK if result.equal else EXIT_FAILED


def _check(args: argparse.Namespace) -> int:
    if args.update and not args.expect:
        raise UsageError("--update rewrites the golden file named by --expect; pass --expect GOLDEN.txt")
    if args.vocab_size is not None and args.vocab_size <= 0:
        raise UsageError(f"--vocab-size {args.vocab_size}: the vocabulary size must be positive")
    if args.expect and not args.update:
        _check_readable(args.expect)
    from neuron_constrain.core.canonical import canonical_text, parse_canonical
    from neuron_constrain.core.graph_diff import diff_graphs

    progress = _Progress()
    program = load_program(args.input, progress, args.debug, args.allow_pickle)
    from neuron_constrain.core.checks import CheckError, check_program

    with progress.step("checking"):
        try:
            failures = check_program(program, args.vocab_size)
        except CheckError as e:
            raise UsageError(str(e)) from e
        text = canonical_text(program)
    if args.expect:
        if args.update:
            with open(args.expect, "w", encoding="utf-8") as f:
                f.write(text)
            print(f"wrote {args.expect}")
        else:
            with open(args.expect, encoding="utf-8") as f:
                golden = f.read()
            if golden != text:
                try:
                    result = diff_graphs(parse_canonical(golden), parse_canonical(text), args.expect, args.input)
                    detail = result.render(args.expect, args.input)
                except ValueError as e:
                    raise UsageError(f"{args.expect}: {e}; regenerate it with --update") from e
                failures.append(
                    f"the graph differs from {args.expect} (accept the change with "
                    f"`neuron-constrain check {args.input} --expect {args.expect} --update`):\n{detail}"
                )
    for failure in failures:
        print(f"FAIL {failure}")
    if failures:
        return EXIT_FAILED
    print(f"ok: {args.input}" + (f" matches {args.expect}" if args.expect and not args.update else ""))
    return EXIT_OK


def _hlo(args: argparse.Namespace) -> int:
    import importlib.util

    from neuron_constrain.decoding.xla import INSTALL_HINTS

    if args.output is not None:
        _check_output_dir(args.output)
    progress = _Progress()
    program = load_program(args.input, progress, args.debug, args.allow_pickle)  # an unsafe file is refused first
    if importlib.util.find_spec("torch_xla") is None:
        raise UsageError(INSTALL_HINTS["torch_xla"])
    from neuron_constrain.decoding.xla import lower

    with progress.step("lowering to HLO"):
        try:
            lowering = lower(program)
        except ValueError as e:
            if args.debug:
                raise
            raise UsageError(f"{args.input}: {e}") from e
    if args.output is None:
        sys.stdout.write(lowering.text)
        return EXIT_OK
    with open(args.output, "w", encoding="utf-8") as f:
        f.write(lowering.text)
    print(f"{args.input} -> {args.output}: {len(lowering.parameters)} parameters")
    from neuron_constrain.core.program import user_input_names

    inputs = set(user_input_names(program))
    for parameter in lowering.parameters:  # the program's inputs; the rest are weights and scalars
        if parameter.name in inputs:
            print(f"  {parameter}")
    return EXIT_OK


def _localize(args: argparse.Namespace) -> int:
    for path in (args.json, args.plot):
        if path is not None:
            _check_output_dir(path)
    from neuron_constrain.loading import LoadError
    from neuron_constrain.replacement.files import load_captures
    from neuron_constrain.replacement.localization import LOGITS, load_tapped, localize

    progress = _Progress()
    try:
        captures, prompts = load_captures(args.captures)
    except LoadError as e:
        raise UsageError(str(e)) from e
    program = load_program(args.input, progress, args.debug, args.allow_pickle)
    with progress.step("localizing"):
        try:
            names = sorted({name for c in captures for name in c} - {LOGITS})
            report = localize(load_tapped(program, names), captures, prompts, atol=args.atol)
        except (InputError, TransformError) as e:
            if args.debug:
                raise
            raise UsageError(f"{args.input}: {e}") from e
    print(report.summary())
    if args.json is not None:
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(report.to_json())
        print(f"wrote {args.json}")
    if args.plot is not None and report.plot(args.plot) is not None:
        print(f"wrote {args.plot}")
    return EXIT_OK if report.culprit is None else EXIT_FAILED


def _demo(args: argparse.Namespace) -> int:
    from neuron_constrain.demo import run_demo

    return run_demo(seed=args.seed, model=args.model, compile=None if args.compile == "none" else args.compile)


def _generate(args: argparse.Namespace) -> int:
    from neuron_constrain.models import ModelNotInstalledError, load_model
    from neuron_constrain.models.answer import ask, request_from_options
    from neuron_constrain.structured import ConstraintError

    try:  # a bad file, schema, pattern or tool list fails before the model loads
        request = request_from_options(args.prompt, schema=args.schema, regex=args.regex, choice=args.choice,
                                       tools=args.tools, tool_choice=args.tool_choice, whitespace=args.whitespace,
                                       parallel_tool_calls=args.parallel_tool_calls,
                                       max_tokens=args.max_tokens)
        answer = ask(load_model(args.model), request, engine=args.engine, max_tokens=args.max_tokens,
                     compile=None if args.compile == "none" else args.compile)
    except (ConstraintError, ModelNotInstalledError, ValueError) as e:
        if args.debug:
            raise
        raise UsageError(str(e)) from e
    print(answer.text)
    if answer.value is not None:
        print("json: " + json.dumps(answer.value, ensure_ascii=False))
    if answer.tool_calls is not None:
        print("tool calls: " + json.dumps(answer.tool_calls, ensure_ascii=False))
    print(f"[{answer.finish_reason}, {answer.tokens} tokens, {answer.seconds:.1f} s]", file=sys.stderr)
    if answer.finish_reason == "error":  # its constraint was refused or the prompt does not fit: the input
        raise UsageError(answer.error)
    if answer.problem is not None:
        print(f"error: the answer is incomplete or invalid: {answer.problem}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def _add_compile(command: argparse.ArgumentParser) -> None:
    command.add_argument("--compile", choices=("auto", "none", "inductor"), default="auto",
                         help="inductor: AOTInductor packages (about twice as fast; compiled once into build/packages, "
                              "minutes, then loaded); none: eager; auto (default): the packages where built, else eager")


def _add_allow_pickle(command: argparse.ArgumentParser) -> None:
    command.add_argument("--allow-pickle", action="store_true",
                         help="the .pt2 is trusted: load it with torch.export.load, which unpickles payloads "
                              "and can run code (default: refuse anything that could)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="neuron-constrain", description=__doc__.split("\n")[0].replace("``", ""),
                     epilog=__doc__.split("\n\n", 2)[2].strip(), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true", help="on an error, show its traceback instead of one line; keep "
                        "torch's warnings and log messages")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    rewrite = sub.add_parser("rewrite", help="run the passes on a saved program and save the result")
    rewrite.add_argument("input", metavar="IN.pt2", help="the saved program (torch.export.save)")
    rewrite.add_argument("-o", "--output", metavar="OUT.pt2", required=True,
                         help="where to save the rewritten program (a new path in an existing folder)")
    rewrite.add_argument("--logit-mask", choices=("packed", "bool"), default=None,
                         help="mask format: packed int32 xgrammar bitmask (default) or bool")
    rewrite.add_argument("--vocab-size", type=int, default=None,
                         help="the tokenizer's vocabulary when the lm_head is padded past it: columns past it are "
                              "never allowed (default: the logits' width)")
    rewrite.add_argument("--empty-row", default=None, metavar="flag|TOKEN",
                         help="a mask row that allows nothing: 'flag' (default: flagged in an extra output, "
                              "logit_mask_empty) or TOKEN, the token such a row allows (e.g. the EOS id)")
    rewrite.add_argument("--tp-degree", type=int, default=None, metavar="N",
                         help="the program is one rank's step of a vocab-parallel lm_head sharded N ways: "
                              "the full mask plus a tp_rank input (default 1: not sharded)")
    rewrite.add_argument("--tap", action="append", metavar="PATTERN",
                         help="tap the outputs of modules matching PATTERN (e.g. 'model.layers.*.mlp.router', "
                              "'...router:1' for output 1) so reference tensors can replace them at run time; "
                              "repeatable")
    rewrite.add_argument("--passes", action="append", metavar="NAME[,NAME]",
                         help=f"passes to run, repeatable or comma-separated: {', '.join(PASSES)} (or their former "
                              "names; default: mask_logits, and tap_modules with --tap)")
    _add_allow_pickle(rewrite)
    rewrite.set_defaults(func=_rewrite)

    show = sub.add_parser("show", help="print the canonical text of a saved program")
    show.add_argument("input", metavar="IN.pt2", help="the saved program")
    _add_allow_pickle(show)
    show.set_defaults(func=_show)

    diff = sub.add_parser("diff", help="structural diff of two programs (.pt2 or canonical text)")
    diff.add_argument("a", metavar="A", help="a .pt2, or a canonical text (what show prints)")
    diff.add_argument("b", metavar="B", help="the other, compared with A")
    _add_allow_pickle(diff)
    diff.set_defaults(func=_diff)

    check = sub.add_parser("check", help="verify a rewritten program's invariants (and its golden text)")
    check.add_argument("input", metavar="IN.pt2", help="the rewritten program")
    check.add_argument("--expect", metavar="GOLDEN.txt", help="the canonical text must equal this file")
    check.add_argument("--update", action="store_true", help="write the canonical text to --expect instead")
    check.add_argument("--vocab-size", type=int, default=None,
                       help="the tokenizer's vocabulary: check the mask width exactly against it")
    _add_allow_pickle(check)
    check.set_defaults(func=_check)

    hlo = sub.add_parser("hlo", help="lower a saved program to HLO text with torch-xla (on its example inputs)")
    hlo.add_argument("input", metavar="IN.pt2", help="the saved program")
    hlo.add_argument("-o", "--output", metavar="OUT.hlo.txt", help="write the HLO here (default: stdout)")
    _add_allow_pickle(hlo)
    hlo.set_defaults(func=_hlo)

    localize = sub.add_parser("localize", help="find the first module that diverges from reference captures")
    localize.add_argument("input", metavar="IN.pt2", help="the device step (input_ids -> logits [B, S, V]), "
                          "tapped with capture=True or untapped")
    localize.add_argument("--captures", required=True, metavar="CAPTURES",
                          help="reference captures with their logits (save_captures of reference_captures(...))")
    localize.add_argument("--atol", type=float, default=1e-5, help="the largest local / logit error that agrees")
    localize.add_argument("--json", metavar="OUT.json", help="write the report as JSON")
    localize.add_argument("--plot", metavar="OUT.png", help="write a PNG of the errors by module (needs matplotlib)")
    _add_allow_pickle(localize)
    localize.set_defaults(func=_localize)

    generate = sub.add_parser("generate", help="one constrained (or free) answer from a real model")
    generate.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2",
                          help="smollm2: SmolLM2-135M-Instruct (converted once into build/); tiny: random weights")
    generate.add_argument("--prompt", required=True, help="the user's message (the model's chat template is applied)")
    kind = generate.add_mutually_exclusive_group()
    kind.add_argument("--schema", metavar="FILE", help="a JSON schema file: the answer is JSON valid against it")
    kind.add_argument("--regex", metavar="R", help="the answer matches this regular expression")
    kind.add_argument("--choice", metavar="A,B", help="the answer is one of these comma-separated options")
    kind.add_argument("--tools", metavar="FILE", help="a JSON list of OpenAI tools, rendered into the prompt")
    generate.add_argument("--tool-choice", metavar="required|auto|none|NAME", default=None,
                          help="with --tools: required (a call is enforced), auto (the default) or none (free text, "
                               "calls parsed), or a tool's name (a call of it is enforced)")
    generate.add_argument("--parallel-tool-calls", action="store_true",
                          help="with --tool-choice required: allow several calls (default one: SmolLM2 repeats its call)")
    generate.add_argument("--engine", choices=("auto", "xgrammar", "llguidance"), default="auto", help="the grammar engine")
    generate.add_argument("--whitespace", choices=("none", "compact", "bounded", "any"), default=None,
                          help="whitespace JSON may hold between tokens (with --schema; default compact: "
                               "the most accurate on SmolLM2, benchmarks/bench_quality.py)")
    generate.add_argument("--max-tokens", type=int, default=256, metavar="N", help="the most tokens to generate")
    _add_compile(generate)
    generate.set_defaults(func=_generate)

    demo = sub.add_parser("demo", help="structured outputs on SmolLM2 (--model tiny: the passes on random-weight decoders)")
    demo.add_argument("--seed", type=int, default=0, help="the random weights and inputs of --model tiny")
    demo.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2",
                      help="smollm2: structured outputs on SmolLM2; tiny: the passes on random-weight decoders")
    _add_compile(demo)
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with warnings.catch_warnings():
            if not args.debug:  # torch's deprecation chatter is not the user's problem
                warnings.simplefilter("ignore")
            return args.func(args)
    except UsageError as e:
        if args.debug:
            raise
        print(f"neuron-constrain {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a bug or an unforeseen input: still one line unless --debug
        if args.debug:
            raise
        print(
            f"neuron-constrain {args.command}: error: unexpected {type(e).__name__}: {e} "
            "(rerun with --debug for the traceback, and report it)",
            file=sys.stderr,
        )
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
