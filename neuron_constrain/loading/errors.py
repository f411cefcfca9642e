"""The one error ``load`` raises, and the fixes its messages name."""
from __future__ import annotations

from neuron_constrain.core.errors import Error

OPT_IN = "if you trust this file, pass allow_pickle=True (CLI: --allow-pickle)"
RESAVE = "save the program again with torch.export.save(program, path)"


class LoadError(Error, ValueError):
    """A file ``load`` will not read: names the file, the entry, the reason and the fix.

    Args:
        path: the file (kept as ``path``).
        reason: why, and the fix (kept as ``reason``).
        entry: the archive entry at fault, if one is (kept as ``entry``).
    """

    def __init__(self, path: str, reason: str, entry: str | None = None):
        self.path, self.reason, self.entry = path, reason, entry
        where = f"{path}: entry {entry!r}" if entry else str(path)
        super().__init__(f"{where} {reason}")


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (its type when it has none)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
