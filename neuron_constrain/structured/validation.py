"""``validate_output``: the check of a finished answer that does not trust the engine that
constrained it (``jsonschema``, ``re``, the tool-call parser; an EBNF grammar by a fresh
xgrammar matcher, the dialect's own)."""
from __future__ import annotations

import json
import re

from neuron_constrain.structured.constraints import Constraint
from neuron_constrain.structured.engines.xgrammar.grammars import ebnf_accepts


def validate_output(constraint: Constraint, text: str) -> str | None:
    """Whether ``text`` satisfies ``constraint``, checked without the engine that constrained it.

    JSON by ``jsonschema`` (the schema's declared ``$schema`` draft, default 2020-12), regex by
    ``re``, choices and tool calls parsed (arguments validated); EBNF, xgrammar's dialect, by a
    fresh xgrammar matcher.

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
        import jsonschema

        # The draft the schema declares ($schema): draft-04's boolean exclusiveMinimum, draft-07's
        # tuple `items` and draft-04's `dependencies` mean other things in 2020-12.
        validator = jsonschema.validators.validator_for(constraint.spec, default=jsonschema.Draft202012Validator)
        errors = sorted(validator(constraint.spec).iter_errors(value), key=str)
        return None if not errors else f"schema violation: {errors[0].message}"
    if constraint.kind == "regex":
        return None if re.fullmatch(constraint.spec, text) else f"does not match /{constraint.spec}/"
    if constraint.kind == "choice":
        return None if text in constraint.spec else f"not one of {list(constraint.spec)}"
    return None if ebnf_accepts(constraint.spec, text) else "does not match the grammar"
