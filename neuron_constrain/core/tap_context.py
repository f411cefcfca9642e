"""The active replacement context and capture recorders, per thread: what
``Transformed`` feeds its tap inputs from and hands its capture outputs to (the host
runtime in ``replacement/`` builds the contexts and reads the captures).

A context maps tap names (module paths as ``named_modules()`` spells them, plus
``:N`` when a selector was used) to a tensor, or to ``(values, enabled)`` where
``values`` is ``[rows, features]`` over the flattened leading dims of the tapped
value and ``enabled`` is ``bool[rows]``. ``Transformed`` reads the calling thread's
context on every call, so two server threads never see each other's references.
"""
from __future__ import annotations

import contextlib
import math
import threading
from typing import Mapping

import torch

from neuron_constrain.core.errors import InputError

Entry = tuple[torch.Tensor, "torch.Tensor | None"]


class _ThreadState(threading.local):
    def __init__(self):
        self.active: dict[str, Entry] | None = None
        self.recorders: list[list[dict[str, torch.Tensor]]] = []


_state = _ThreadState()


def _entries(ctx: Mapping | None) -> dict[str, Entry] | None:
    if ctx is None:
        return None
    if not isinstance(ctx, Mapping):
        raise InputError(f"a replacement context is a mapping of tap name -> tensor, got {type(ctx).__name__}")
    entries = {}
    for name, item in ctx.items():
        values, enabled = item if isinstance(item, tuple) else (item, None)
        if not isinstance(values, torch.Tensor) or not (enabled is None or isinstance(enabled, torch.Tensor)):
            raise InputError(f"replacement for {name!r} must be a tensor or (tensor, bool tensor), got {item!r:.80}")
        entries[name] = (values, enabled)
    return entries


def set_active_context(ctx: Mapping | None) -> None:
    """Make ``ctx`` the replacements of every later call in this thread.

    Args:
        ctx: tap name -> a tensor (every row replaced) or ``(values, enabled)`` (per-row flags),
            e.g. :meth:`TensorReplacer.build_context`'s result; ``None`` turns all taps off.
    """
    _state.active = _entries(ctx)


def get_replacement_tensor(name: str) -> torch.Tensor | None:
    """The active replacement values for tap ``name``.

    Args:
        name: the tap's name.

    Returns:
        The values of the active context, or ``None`` when the tap is off.
    """
    entry = (_state.active or {}).get(name)
    return None if entry is None else entry[0]


def active_replacement(name: str) -> Entry | None:
    return (_state.active or {}).get(name)


@contextlib.contextmanager
def active_context(ctx: Mapping | None):
    """``set_active_context(ctx)`` for the ``with`` block, restoring the previous one after.

    Args:
        ctx: as :func:`set_active_context` takes it.
    """
    previous = _state.active
    set_active_context(ctx)
    try:
        yield
    finally:
        _state.active = previous


@contextlib.contextmanager
def recording_captures():
    """Collect, per call of a ``Transformed`` model, the values its capture taps computed.

    Yields:
        A list that gets, for each call inside the block, ``{capture output name: tensor}``.
    """
    calls: list[dict[str, torch.Tensor]] = []
    _state.recorders.append(calls)
    try:
        yield calls
    finally:
        _state.recorders.remove(calls)


def record_captures(values: dict[str, torch.Tensor]) -> None:
    for calls in _state.recorders:
        calls.append(values)


def tap_input(name: str, shape: tuple, dtype: torch.dtype, device, role: str) -> torch.Tensor | None:
    """The active context's tensor for one tap input, in the graph's layout (None: not set)."""
    entry = active_replacement(name)
    if entry is None:
        return None
    values, enabled = entry
    if role == "enabled":
        rows = shape
        if enabled is None:
            return torch.ones(rows, dtype=torch.bool).to(device)
        if enabled.numel() != math.prod(rows):
            raise InputError(f"the enable flags for tap {name!r} have {enabled.numel()} rows; the graph has {math.prod(rows)} {tuple(rows)}")
        return enabled.reshape(rows).to(device=device, dtype=torch.bool)
    if values.numel() != math.prod(shape):
        raise InputError(
            f"the replacement for tap {name!r} has shape {tuple(values.shape)} ({values.numel()} values) but the "
            f"tapped value is {tuple(shape)}: give [rows, features] for exactly these inputs' rows"
        )
    return values.reshape(shape).to(device=device, dtype=dtype)
