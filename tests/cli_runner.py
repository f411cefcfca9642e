"""Running the ``neuron-constrain`` CLI from tests.

``run_cli`` calls ``neuron_constrain.cli.main`` in this process and returns what a
subprocess would (a ``CompletedProcess``: exit status, stdout, stderr), without
paying a fresh interpreter's torch/transformers import per call. It reproduces what
the console script and the interpreter add around ``main``: ``sys.exit(main())``
(``SystemExit`` from argparse becomes the status), an uncaught exception printed as a
traceback with status 1, stdin empty and not a terminal, stdout/stderr not terminals
(so the CLI's progress lines stay off, as in CI).

``run_installed`` runs the real installed entry point (the ``neuron-constrain``
console script, or ``python -m neuron_constrain``) as a subprocess: use it only
where the entry point itself is what a test checks.
"""
from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import traceback
from pathlib import Path

SCRIPT = Path(sys.executable).parent / "neuron-constrain"


def _exit_status(code, stderr) -> int:
    """What the interpreter makes of ``SystemExit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=stderr)
    return 1


def run_cli(*args) -> subprocess.CompletedProcess:
    """``neuron-constrain ARGS`` in this process, stdin empty and stdout/stderr captured (not TTYs)."""
    from neuron_constrain.cli import main

    argv = [str(a) for a in args]
    out, err = io.StringIO(), io.StringIO()
    cwd, saved_argv, saved_stdin = os.getcwd(), sys.argv, sys.stdin
    sys.argv = [str(SCRIPT), *argv]
    sys.stdin = io.StringIO("")  # subprocess.DEVNULL: empty, not a terminal
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                status = main(argv)
            except SystemExit as e:
                status = _exit_status(e.code, err)
            except Exception:  # uncaught (e.g. under --debug): the interpreter prints it and exits 1
                traceback.print_exc(file=err)
                status = 1
    finally:
        sys.argv, sys.stdin = saved_argv, saved_stdin
    assert os.getcwd() == cwd, f"neuron-constrain {' '.join(argv)} changed the working directory"
    return subprocess.CompletedProcess(["neuron-constrain", *argv], status, out.getvalue(), err.getvalue())


def run_installed(*args, module: bool = False, timeout: float = 300) -> subprocess.CompletedProcess:
    """The installed CLI as a subprocess: the console script, or ``python -m neuron_constrain``
    (stdin /dev/null, stdout/stderr captured, ``PJRT_DEVICE=CPU``)."""
    command = [sys.executable, "-m", "neuron_constrain"] if module else [str(SCRIPT)]
    return subprocess.run(
        command + [str(a) for a in args], capture_output=True, text=True, stdin=subprocess.DEVNULL,
        env={**os.environ, "PJRT_DEVICE": "CPU"}, timeout=timeout,
    )
