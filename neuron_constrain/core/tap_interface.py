"""What a tapped program looks like from outside, and what a tap is: the names of the
inputs and outputs the tap-modules pass adds, :class:`Tap` and the module-path globs.

    tap_<name>, tap_<name>_enabled    a tap's replacement and its row flags
    tap_rank                          this rank's index, with sequence_parallel > 1
    capture_<tap>                     the computed value, with Tap(capture=True)

The tap-modules pass writes these; ``transform()`` (which modules to keep the call
signature of), the checks and the replacement runtime find the inputs and outputs by
them, and read module patterns with :func:`match_modules`.
"""
from __future__ import annotations

import dataclasses
import difflib
import re
from typing import Callable, Iterable

import torch

from neuron_constrain.core.errors import TransformError

INPUT_PREFIX = "tap_"  # tap_<name> (replacement), tap_<name>_enabled (row flags)
ENABLED_SUFFIX = "_enabled"
RANK_INPUT = INPUT_PREFIX + "rank"
CAPTURE_PREFIX = "capture_"


@dataclasses.dataclass(frozen=True)
class Tap:
    """One tap: the modules whose output a reference tensor may replace, and how.

    Args:
        pattern: a dotted module path as ``named_modules()`` spells it (``*`` = one component; it
            may match the end of a longer path); ``path:N`` taps output N of a module returning a
            tuple.
        post: a function traced into the graph that turns the replacement into the tapped value's
            form (router logits -> top-k affinities); needs ``features``.
        features: the replacement's last dimension, when ``post`` changes it.
        dtype: the replacement input's dtype.
        capture: also return the computed value (read it with
            :func:`neuron_constrain.replacement.recording_captures`).

    Raises:
        TransformError: ``post`` without ``features``, or a selector after ``:`` that is not an
            output index.
    """

    pattern: str
    post: Callable[[torch.Tensor], torch.Tensor] | None = None
    features: int | None = None
    dtype: torch.dtype = torch.float32
    capture: bool = False

    def __post_init__(self):
        if self.post is not None and not self.features:
            raise TransformError(f"tap {self.pattern!r} has a post function: give features= (the replacement's last dim)")

    @property
    def module_pattern(self) -> str:
        """The pattern without its ``:N`` output selector."""
        return self.pattern.split(":", 1)[0]

    @property
    def selector(self) -> int | None:
        """The output index after ``:`` (None without one).

        Raises:
            TransformError: the text after ``:`` is not an output index.
        """
        if ":" not in self.pattern:
            return None
        text = self.pattern.split(":", 1)[1]
        if not text.isdigit():
            raise TransformError(f"tap {self.pattern!r}: the selector after ':' must be an output index, e.g. ':1'")
        return int(text)


def as_taps(taps: Iterable[str | Tap]) -> list[Tap]:
    result = [t if isinstance(t, Tap) else Tap(t) for t in taps]
    bad = [t for t in result if not isinstance(t.pattern, str) or not t.module_pattern]
    if bad:
        raise TransformError(f"taps must be module path patterns (str or Tap), got {bad}")
    return result


def _component_regex(part: str) -> str:
    return "[^.]+" if part == "*" else "[^.]*".join(re.escape(p) for p in part.split("*"))


def _pattern_regex(pattern: str) -> re.Pattern:
    parts = [r"(?:[^.]+\.)*" if p == "**" else _component_regex(p) + r"\." for p in pattern.split(".")]
    body = "".join(parts)
    body = body[:-2] if body.endswith(r"\.") else body
    return re.compile(r"(?:^|.*\.)" + body + "$")


def match_modules(pattern: str, paths: Iterable[str]) -> list[str]:
    """The module paths ``pattern`` matches (in the given order), or a TransformError."""
    paths = [p for p in dict.fromkeys(paths) if p]  # '' is the root module: never a tap
    regex = _pattern_regex(pattern)
    found = [p for p in paths if regex.match(p)]
    if not found:
        probe = pattern.replace("**.", "").replace("*", "0")
        near = difflib.get_close_matches(probe, paths, n=5, cutoff=0.4)
        raise TransformError(
            f"tap pattern {pattern!r} matches no module; nearest module paths: {near or sorted(paths)[:5]}. "
            "Patterns are dotted module paths as named_modules() spells them, '*' = one component"
        )
    return found


def tap_input_name(tap_name: str) -> str:
    """The replacement input of tap ``tap_name`` (its flags: this name + ``ENABLED_SUFFIX``)."""
    return INPUT_PREFIX + re.sub(r"\W", "_", tap_name)


def is_tap_input(name: str) -> bool:
    """Whether ``name`` is an input the tap-modules pass adds (a tap's values or flags, or ``tap_rank``)."""
    return name.startswith(INPUT_PREFIX)
