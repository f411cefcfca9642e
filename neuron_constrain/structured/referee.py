"""The referee's checks (Python's ``re``, ``jsonschema``), importable alone and served by a process
that can be killed: ``validate_output`` runs them there, so that a pattern on which ``re`` backtracks
catastrophically (``(([a-z]{1,20}){1,20}){1,20}`` on 17 letters and a ``!``: 9 s, one more letter
ten times that) costs its deadline, not the caller's thread.

    check({"kind": "regex", "spec": "a+", "text": "aa"})       # None, or why not (one line)
    python referee.py                                          # one JSON request a line in, one answer out

This module imports only the standard library and ``jsonschema`` (no torch, no engine): run as a
script it starts in a fraction of a second, anywhere a process can start (a daemonic
``multiprocessing`` worker included: it is a plain subprocess).
"""
from __future__ import annotations

import json
import re
import sys


def check(request: dict) -> str | None:
    """The referee's verdict on one request.

    Args:
        request: ``{"kind": "regex", "spec": pattern, "text": text}`` (a full match by Python's ``re``)
            or ``{"kind": "json_schema", "spec": schema, "value": value}`` (``jsonschema``, the draft the
            schema declares, default 2020-12).

    Returns:
        ``None`` if it matches, else why not, in one line."""
    if request["kind"] == "regex":
        try:
            found = re.fullmatch(request["spec"], request["text"])
        except re.error as error:
            return f"the pattern does not compile in Python's re: {error}"
        return None if found else f"does not match /{request['spec']}/"
    import jsonschema

    # The draft the schema declares ($schema): draft-04's boolean exclusiveMinimum, draft-07's
    # tuple `items` and draft-04's `dependencies` mean other things in 2020-12.
    schema = request["spec"]
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    errors = sorted(validator(schema).iter_errors(request["value"]), key=str)
    return None if not errors else f"schema violation: {errors[0].message}"


def serve(lines=sys.stdin, out=sys.stdout) -> None:
    """Answer one JSON request a line (:func:`check`'s) with one JSON line: ``{"verdict": ...}``, or
    ``{"error": ...}`` where the check itself raised."""
    for line in lines:
        try:
            answer = {"verdict": check(json.loads(line))}
        except Exception as error:  # noqa: BLE001 - the caller's to report
            answer = {"error": f"{type(error).__name__}: {error}"}
        out.write(json.dumps(answer) + "\n")
        out.flush()


if __name__ == "__main__":
    serve()
