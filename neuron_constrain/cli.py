"""``neuron-constrain`` command line: rewrite saved programs (``.pt2``) and guard them in CI.

    neuron-constrain rewrite IN.pt2 -o OUT.pt2 [--logit-mask packed|bool] [--vocab-size N]
                                              [--empty-row flag|TOKEN] [--tp-degree N] [--passes logit_mask]
    neuron-constrain show IN.pt2                      # canonical graph text
    neuron-constrain diff A B                         # .pt2 or canonical text; exit 1 if different
    neuron-constrain check IN.pt2 [--expect GOLDEN.txt [--update]]
    neuron-constrain hlo IN.pt2 [-o OUT.hlo.txt]        # HLO text via torch-xla (the mask is a parameter)
    neuron-constrain demo

Exit status: 0 ok, 1 a check failed or the graphs differ, 2 bad usage or unreadable
input (one line naming the problem; ``--debug`` shows the traceback).
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import sys
import time
import warnings
import zipfile

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2

# Passes `rewrite --passes` can run, in the order they run.
PASSES = ("taps", "logit_mask")


class UsageError(Exception):
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


def _check_archive(path: str) -> None:
    """Reject non-zip, truncated and corrupt files before torch sees them (its errors are noisy)."""
    fix = "save the program again with torch.export.save(program, path)"
    if os.path.getsize(path) == 0:
        raise UsageError(f"{path} is empty, not a .pt2 archive; {fix}")
    if not zipfile.is_zipfile(path):
        raise UsageError(f"{path} is not a .pt2 archive (not a zip file, or truncated); {fix}")
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise UsageError(f"{path} is a damaged .pt2 archive ({e}); {fix}") from e
    if bad is not None:
        raise UsageError(f"{path} is a corrupt .pt2 archive: {bad!r} fails its checksum; {fix}")


def load_program(path: str, progress: _Progress, debug: bool):
    """``torch.export.load`` with the file checked first and torch's load chatter silenced."""
    _check_readable(path)
    _check_archive(path)
    with progress.step(f"loading {path} ({os.path.getsize(path) / 1e6:.1f} MB)"):
        import torch

        logger = logging.getLogger("torch.export")
        level = logger.level
        try:
            with warnings.catch_warnings():
                if not debug:
                    warnings.simplefilter("ignore")
                    logger.setLevel(logging.CRITICAL)
                return torch.export.load(path)
        except Exception as e:
            if debug:
                raise
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UsageError(
                f"{path} is a zip archive but not a loadable exported program ({reason}); "
                "write it with torch.export.save(torch.export.export(model, args), path)"
            ) from e
        finally:
            logger.setLevel(level)


def _read_graph(path: str, progress: _Progress, debug: bool):
    """A canonical graph from a .pt2 or from a saved canonical text."""
    from neuron_constrain.canonical import canonical_text, is_canonical_text, parse_canonical

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
    return parse_canonical(canonical_text(load_program(path, progress, debug)))


# ----------------------------------------------------------------------------- commands

def _parse_passes(values: list[str] | None, taps: list[str] | None) -> list[str]:
    if values is None:
        return ["taps", "logit_mask"] if taps else ["logit_mask"]
    names = [n.strip() for v in values for n in v.split(",") if n.strip()]
    if not names:
        raise UsageError(f"--passes names no pass; choose from {', '.join(PASSES)}")
    if taps and "taps" not in names:
        raise UsageError("--tap configures the taps pass, which --passes leaves out; add taps to --passes")
    if "taps" in names and not taps:
        raise UsageError("--passes taps needs at least one --tap PATTERN (e.g. --tap 'model.layers.*.mlp.router')")
    for name in names:
        if name not in PASSES:
            raise UsageError(f"unknown pass {name!r}; available: {', '.join(PASSES)}")
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
    if "logit_mask" not in passes and given:
        raise UsageError(f"{', '.join(given)} configure the logit_mask pass, which --passes leaves out; add it to --passes")
    if args.vocab_size is not None and args.vocab_size <= 0:
        raise UsageError(f"--vocab-size {args.vocab_size}: the vocabulary size must be positive")
    empty_row = _parse_empty_row(args.empty_row or "flag")
    if os.path.abspath(args.output) == os.path.abspath(args.input):
        raise UsageError(f"-o {args.output} is the input file; write the rewrite to a new path")
    _check_output_dir(args.output)

    progress = _Progress()
    program = load_program(args.input, progress, args.debug)

    import torch

    from neuron_constrain import TransformError, transform

    with progress.step("rewriting"):
        try:
            result = transform(
                program,
                logit_mask=(args.logit_mask or "packed") if "logit_mask" in passes else None,
                vocab_size=args.vocab_size,
                empty_row=empty_row,
                tp_degree=args.tp_degree or 1,
                taps=args.tap if "taps" in passes else (),
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
    from neuron_constrain.canonical import canonical_text

    program = load_program(args.input, _Progress(), args.debug)
    sys.stdout.write(canonical_text(program))
    return EXIT_OK


def _diff(args: argparse.Namespace) -> int:
    from neuron_constrain.canonical import diff_graphs

    progress = _Progress()
    a = _read_graph(args.a, progress, args.debug)
    b = _read_graph(args.b, progress, args.debug)
    result = diff_graphs(a, b, args.a, args.b)
    sys.stdout.write(result.render(args.a, args.b))
    return EXIT_OK if result.equal else EXIT_FAILED


def check_program(program, vocab_size: int | None = None) -> list[str]:
    """Invariants of a rewritten program; returns the failures (empty: all hold)."""
    import torch
    from torch.export.graph_signature import InputKind

    from neuron_constrain.canonical import _keyword_inputs
    from neuron_constrain.passes.mask_logits_pass import MASK_INPUT, RANK_INPUT
    from torch.export.graph_signature import OutputKind
    from neuron_constrain.sites import module_path, plan_mask_points

    failures: list[str] = []
    try:
        program.validate()
    except Exception as e:  # the verifier's own message says what is wrong
        failures.append(f"torch's verifier rejects the program: {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}")

    failures += check_taps(program)
    graph = program.graph
    user_inputs = {s.arg.name for s in program.graph_signature.input_specs if s.kind == InputKind.USER_INPUT}
    if MASK_INPUT not in user_inputs and any(n.startswith("tap_") for n in user_inputs):
        return failures  # a taps-only rewrite: nothing to say about sampling
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    user_outputs = [
        o for o, s in zip(output.args[0], program.graph_signature.output_specs) if s.kind == OutputKind.USER_OUTPUT
    ]
    # A vocab-parallel program (a tp_rank input) has one rank's shard of the logits and the full mask.
    sharded = any(s.kind == InputKind.USER_INPUT and s.arg.name == RANK_INPUT for s in program.graph_signature.input_specs)
    plan = plan_mask_points(graph, user_outputs, None if sharded else vocab_size)
    if plan is None:
        raise UsageError(
            "the program has no logits (no vocabulary projection feeding a sampler or an output); "
            "check verifies decoders rewritten by `neuron-constrain rewrite`"
            + ("" if vocab_size is None else f" — or --vocab-size {vocab_size} is wider than its logits")
        )
    masks = [
        n for n in graph.nodes
        if n.op == "placeholder" and n.name == MASK_INPUT
        and any(s.kind == InputKind.USER_INPUT and s.arg.name == MASK_INPUT for s in program.graph_signature.input_specs)
    ]
    targets = [(site, kind) for site, kind in plan.sites] or [(p, "logits output") for p in plan.points]
    if not masks:
        for site, kind in targets:
            failures.append(
                f"sampling site {site.name} ({kind}) in {module_path(site) or '<root>'} is not masked: "
                f"the program has no {MASK_INPUT!r} input; rewrite it with `neuron-constrain rewrite`"
            )
        return failures

    mask = masks[0]
    for site, kind in targets:
        value = site.args[0] if plan.sites else site
        if not _depends_on(value, mask):
            failures.append(
                f"sampling site {site.name} ({kind}) in {module_path(site) or '<root>'} reads {value.name}, "
                f"which does not depend on {MASK_INPUT}: an unconstrained token can be sampled there; "
                "rewrite the original program again"
            )

    val = mask.meta.get("val")
    width = plan.width
    if not isinstance(val, torch.Tensor) or val.dim() < 1:
        failures.append(f"{MASK_INPUT} carries no tensor metadata (meta['val']); re-export and rewrite the program")
    else:
        columns = val.shape[-1]
        if val.dtype == torch.int32:
            vocab = vocab_size if vocab_size is not None else width
            want = math.ceil(vocab / 32)
            ok = columns == want if vocab_size is not None else 0 < columns and (sharded or columns <= want)
            if not ok:
                failures.append(
                    f"{MASK_INPUT} is packed int32 with {columns} columns but the logits are {width} wide"
                    + (f" and vocab_size is {vocab_size}" if vocab_size is not None else "")
                    + f": a packed mask needs ceil(V/32) = {want} columns"
                )
        elif val.dtype == torch.bool:
            want = vocab_size if vocab_size is not None else width
            ok = columns == want if vocab_size is not None else 0 < columns and (sharded or columns <= width)
            if not ok:
                failures.append(
                    f"{MASK_INPUT} is bool with {columns} columns but needs {want} (one per token"
                    + ("" if vocab_size is not None else f", at most the logits' width {width}") + ")"
                )
        else:
            failures.append(f"{MASK_INPUT} has dtype {val.dtype}; the pass makes int32 (packed) or bool masks")
    if MASK_INPUT not in _keyword_inputs(program):
        failures.append(f"{MASK_INPUT} is not a keyword input of the program; callers pass it as {MASK_INPUT}=")
    return failures


def check_taps(program) -> list[str]:
    """Every tap input pair feeds a ``where(enabled, replacement, computed)`` that all
    readers of the computed value go through (capture outputs excepted)."""
    import torch
    from torch.export.graph_signature import InputKind

    from neuron_constrain.passes.replacement_tap_pass import RANK_INPUT

    user_inputs = [s.arg.name for s in program.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    nodes = {n.name: n for n in program.graph.nodes}
    failures = []
    for name in user_inputs:
        if not name.startswith("tap_") or name.endswith("_enabled") or name == RANK_INPUT:
            continue
        enabled = nodes.get(name + "_enabled")
        if enabled is None:
            failures.append(f"tap input {name} has no {name}_enabled flag: rows cannot be switched; rewrite again")
            continue
        val = enabled.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dtype != torch.bool:
            failures.append(f"{name}_enabled must be a bool tensor over the tapped value's rows")
        wheres = [
            n for n in _wheres_fed_by(enabled)
            if _depends_on(n.args[0], enabled) and _depends_on(n.args[1], nodes[name])
        ]
        if not wheres:
            failures.append(f"tap {name}: no where({name}_enabled, {name}, computed) node; the replacement is never used")
            continue
        computed = wheres[0].args[2]
        bypass = [u.name for u in computed.users if u is not wheres[0] and u.op != "output"]
        if bypass:
            failures.append(
                f"tap {name}: {', '.join(bypass)} read{'s' if len(bypass) == 1 else ''} {computed.name} directly, "
                "bypassing the tap: a replacement would not reach them; rewrite the original program again"
            )
    return failures


def _wheres_fed_by(source) -> list:
    """The ``where`` nodes ``source`` reaches through non-``where`` nodes: a tap's own
    select, found without walking the whole graph once per tap."""
    import torch

    found, seen, stack = [], set(), [source]
    while stack:
        for user in stack.pop().users:
            if user in seen:
                continue
            seen.add(user)
            (found if user.target is torch.ops.aten.where.self else stack).append(user)
    return found


def _depends_on(node, source) -> bool:
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n is source:
            return True
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return False


def _check(args: argparse.Namespace) -> int:
    if args.update and not args.expect:
        raise UsageError("--update rewrites the golden file named by --expect; pass --expect GOLDEN.txt")
    if args.vocab_size is not None and args.vocab_size <= 0:
        raise UsageError(f"--vocab-size {args.vocab_size}: the vocabulary size must be positive")
    if args.expect and not args.update:
        _check_readable(args.expect)
    from neuron_constrain.canonical import canonical_text, diff_graphs, parse_canonical

    progress = _Progress()
    program = load_program(args.input, progress, args.debug)
    with progress.step("checking"):
        failures = check_program(program, args.vocab_size)
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

    from neuron_constrain.xla import _INSTALL

    if importlib.util.find_spec("torch_xla") is None:
        raise UsageError(_INSTALL["torch_xla"])
    if args.output is not None:
        _check_output_dir(args.output)
    progress = _Progress()
    program = load_program(args.input, progress, args.debug)
    from neuron_constrain.xla import lower

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
    from neuron_constrain.program import user_input_names

    inputs = set(user_input_names(program))
    for parameter in lowering.parameters:  # the program's inputs; the rest are weights and scalars
        if parameter.name in inputs:
            print(f"  {parameter}")
    return EXIT_OK


def _demo(args: argparse.Namespace) -> int:
    from neuron_constrain.demo import run_demo

    return run_demo(seed=args.seed)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="neuron-constrain",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    rewrite = sub.add_parser("rewrite", help="run the passes on a saved program and save the result")
    rewrite.add_argument("input", metavar="IN.pt2")
    rewrite.add_argument("-o", "--output", metavar="OUT.pt2", required=True)
    rewrite.add_argument("--logit-mask", choices=("packed", "bool"), default=None,
                         help="mask format: packed int32 xgrammar bitmask (default) or bool")
    rewrite.add_argument("--vocab-size", type=int, default=None,
                         help="the tokenizer's vocabulary when the lm_head is padded past it")
    rewrite.add_argument("--empty-row", default=None, metavar="flag|TOKEN",
                         help="a row that allows nothing: 'flag' (extra output, default) or emit TOKEN")
    rewrite.add_argument("--tp-degree", type=int, default=None, metavar="N",
                         help="the program is one rank's step of a vocab-parallel lm_head sharded N ways: "
                              "the full mask plus a tp_rank input")
    rewrite.add_argument("--tap", action="append", metavar="PATTERN",
                         help="tap the outputs of modules matching PATTERN (e.g. 'model.layers.*.mlp.router', "
                              "'...router:1' for output 1) so reference tensors can replace them at run time")
    rewrite.add_argument("--passes", action="append", metavar="NAME[,NAME]",
                         help=f"passes to run (default: all); available: {', '.join(PASSES)}")
    rewrite.set_defaults(func=_rewrite)

    show = sub.add_parser("show", help="print the canonical text of a saved program")
    show.add_argument("input", metavar="IN.pt2")
    show.set_defaults(func=_show)

    diff = sub.add_parser("diff", help="structural diff of two programs (.pt2 or canonical text)")
    diff.add_argument("a", metavar="A")
    diff.add_argument("b", metavar="B")
    diff.set_defaults(func=_diff)

    check = sub.add_parser("check", help="verify a rewritten program's invariants (and its golden text)")
    check.add_argument("input", metavar="IN.pt2")
    check.add_argument("--expect", metavar="GOLDEN.txt", help="the canonical text must equal this file")
    check.add_argument("--update", action="store_true", help="write the canonical text to --expect instead")
    check.add_argument("--vocab-size", type=int, default=None,
                       help="the tokenizer's vocabulary: check the mask width exactly against it")
    check.set_defaults(func=_check)

    hlo = sub.add_parser("hlo", help="lower a saved program to HLO text with torch-xla (on its example inputs)")
    hlo.add_argument("input", metavar="IN.pt2")
    hlo.add_argument("-o", "--output", metavar="OUT.hlo.txt", help="write the HLO here (default: stdout)")
    hlo.set_defaults(func=_hlo)

    demo = sub.add_parser("demo", help="constrained decoding on a tiny random-weight decoder")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
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
