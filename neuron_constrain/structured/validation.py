"""``validate_output``: the check of a finished answer that does not trust the engine that
constrained it (``jsonschema``, ``re``, the tool-call parser; an EBNF grammar by a fresh
xgrammar matcher, the dialect's own).

Python's ``re`` backtracks: on some patterns (nested repetitions) a text that does not match takes it
seconds, then hours. So every regex, and every JSON schema holding a pattern, is judged in a referee
process (``referee.py``, started once, a plain subprocess) within :data:`REFEREE_SECONDS`; past them
the process is killed (the next check starts another) and the answer is not counted as valid.
"""
from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import threading

from neuron_constrain.structured import referee
from neuron_constrain.structured.constraints import Constraint
from neuron_constrain.structured.engines.xgrammar.grammars import ebnf_accepts

REFEREE_SECONDS = 2.0  # the longest one check of a pattern may take in the referee process


def validate_output(constraint: Constraint, text: str) -> str | None:
    """Whether ``text`` satisfies ``constraint``, checked without the engine that constrained it.

    JSON by ``jsonschema`` (the schema's declared ``$schema`` draft, default 2020-12), regex by
    ``re``, choices and tool calls parsed (arguments validated); EBNF, xgrammar's dialect, by a
    fresh xgrammar matcher. A pattern is matched in the referee process, within
    :data:`REFEREE_SECONDS` (past them: not valid, and the reason says so).

    Args:
        constraint: what the output had to match.
        text: the output.

    Returns:
        ``None`` if it matches, else why not, in one line."""
    if constraint.validate is not None:
        return constraint.validate(text)
    if constraint.kind in ("json_schema", "json"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as error:
            return f"not JSON: {error}"
        if constraint.kind == "json":
            return None if isinstance(value, (dict, list)) else f"JSON {type(value).__name__}, not an object or array"
        request = {"kind": "json_schema", "spec": constraint.spec, "value": value}
        has_pattern = '"pattern' in json.dumps(constraint.spec)  # `pattern`, `patternProperties` (or more: safe)
        return _REFEREE.judge(request) if has_pattern else referee.check(request)
    if constraint.kind == "regex":
        return _REFEREE.judge({"kind": "regex", "spec": constraint.spec, "text": text})
    if constraint.kind == "choice":
        return None if text in constraint.spec else f"not one of {list(constraint.spec)}"
    return None if ebnf_accepts(constraint.spec, text) else "does not match the grammar"


class _RefereeProcess:
    """``referee.py`` run as a script: one request at a time, killed past its deadline (then started
    again by the next check); a process that forked gets its own."""

    def __init__(self):
        self.process: subprocess.Popen | None = None
        self.owner = 0  # the pid that started it
        self.lock = threading.Lock()
        self.started = 0  # processes started (a killed one is replaced)

    def judge(self, request: dict, seconds: float | None = None) -> str | None:
        seconds = REFEREE_SECONDS if seconds is None else seconds
        with self.lock:
            if self.process is None or self.process.poll() is not None or self.owner != os.getpid():
                self._start()
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            ready, _, _ = select.select([self.process.stdout], [], [], seconds)
            if not ready:
                self.stop()
                return (f"could not be checked: Python's re took longer than {seconds:g} s on this pattern (it "
                        "backtracks on nested repetitions); not counted as valid")
            line = self.process.stdout.readline()
        if not line:
            raise RuntimeError("the referee process ended without an answer (see its stderr)")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"the referee could not check the answer: {answer['error']}")
        return answer["verdict"]

    def _start(self) -> None:
        # -I: no PYTHON* variables, no user site, not the script's folder on sys.path (structured/ holds
        # modules named like packages the referee imports)
        self.process = subprocess.Popen([sys.executable, "-I", referee.__file__], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, encoding="utf-8")
        self.owner = os.getpid()
        self.started += 1

    def stop(self) -> None:
        """Kill the process (if this process started it)."""
        process, self.process = self.process, None
        if process is not None and self.owner == os.getpid() and process.poll() is None:
            process.kill()
            process.wait()


_REFEREE = _RefereeProcess()
atexit.register(_REFEREE.stop)
