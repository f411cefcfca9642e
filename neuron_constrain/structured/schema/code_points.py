"""Sets of code points as sorted, merged ``(low, high)`` ranges, and the shorthand classes of the two
regex dialects (``patterns.py``).

    normalize([(0x61, 0x7A), (0x41, 0x5A)])   # ((0x41, 0x5A), (0x61, 0x7A)); surrogates always removed
    complement(ranges), subtract(ranges, removed)
    shorthand("d")                             # ((0x30, 0x39),): what ECMA-262 and Python's re both call a digit
"""
from __future__ import annotations

import functools
import re

MAX_CODE = 0x10FFFF
ANY = ((0, 0xD7FF), (0xE000, MAX_CODE))  # every character (surrogates are never text)
LINE_TERMINATORS = ((0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029))


def normalize(ranges) -> tuple:
    """Sorted, merged, without surrogates."""
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        for a, b in ((lo, min(hi, 0xD7FF)), (max(lo, 0xE000), hi)):
            if a > b:
                continue
            if out and a <= out[-1][1] + 1:
                out[-1][1] = max(out[-1][1], b)
            else:
                out.append([a, b])
    return tuple((a, b) for a, b in out)


def complement(ranges) -> tuple:
    out, at = [], 0
    for lo, hi in normalize(ranges):
        if lo > at:
            out.append((at, lo - 1))
        at = hi + 1
    if at <= MAX_CODE:
        out.append((at, MAX_CODE))
    return normalize(out)


def covers(ranges, low: int, high: int) -> bool:
    """Whether the code points ``low..high`` all lie in ``ranges`` (sorted, disjoint, merged)."""
    return any(lo <= low and high <= hi for lo, hi in ranges)


def subtract(ranges, removed) -> tuple:
    keep = complement(removed)
    out = []
    for lo, hi in normalize(ranges):
        out += [(max(lo, a), min(hi, b)) for a, b in keep if max(lo, a) <= min(hi, b)]
    return normalize(out)


@functools.lru_cache(maxsize=None)
def _python_set(letter: str) -> tuple:
    """The code points Python's ``re`` matches with ``\\d``, ``\\w`` or ``\\s`` on a ``str``."""
    text = "".join(map(chr, range(0xD800))) + "".join(map(chr, range(0xE000, MAX_CODE + 1)))
    found = [(m.start(), m.end() - 1) for m in re.finditer(f"\\{letter}+", text)]
    return normalize((lo if lo < 0xD800 else lo + 0x800, hi if hi < 0xD800 else hi + 0x800) for lo, hi in found)


_ECMA_SETS = {
    "d": ((0x30, 0x39),),
    "w": ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)),
    "s": ((0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A), (0x2028, 0x2029),
          (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF)),
}


def shorthand(letter: str, wide: bool = False) -> tuple:
    """``\\d`` etc. as the set both dialects agree a string must hold (see the module docstring), or
    with ``wide`` as the set either dialect lets through (their union: what a complement must exclude)."""
    lower = letter.lower()
    both = subtract(_ECMA_SETS[lower], complement(_python_set(lower)))
    either = normalize(_ECMA_SETS[lower] + _python_set(lower))
    if letter == lower:
        return either if wide else both
    return complement(both) if wide else complement(either)
