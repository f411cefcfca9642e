"""What a pass declares about itself: its one name, its options, what it requires of
the program it gets and what it ensures of the program it returns (in the spirit of
torch's ``PassBase.requires`` / ``ensures``).

One name: ``passes/<name>_pass.py`` defines ``<name>_pass``, and ``transform()`` files
its report under ``<name>``. ``requires`` / ``ensures`` name conditions that
:func:`neuron_constrain.checks.check_contract` checks on a program; ``transform()``
runs its declared, ordered list of passes (``transform.PASSES``), handing each the
options it declares, so an option two passes share (``empty_row``) is given once::

    @declares(PassContract(name="mask_logits", switch="mask_format",
                           options=("mask_format", "vocab_size", "empty_row", "tp_degree"),
                           requires=("unmasked",), ensures=("every_site_masked",)))
    def mask_logits_pass(program, *, mask_format="packed", ...): ...
"""
from __future__ import annotations

import dataclasses
from typing import Callable

__all__ = ["PassContract", "declares"]


@dataclasses.dataclass(frozen=True)
class PassContract:
    """``switch``: the option whose ``None`` leaves the pass out of ``transform()``."""

    name: str
    options: tuple[str, ...]
    switch: str | None = None
    requires: tuple[str, ...] = ()
    ensures: tuple[str, ...] = ()


def declares(contract: PassContract) -> Callable:
    """Attach ``contract`` to the pass function it decorates (``fn.contract``), named ``<name>_pass``."""

    def mark(fn: Callable) -> Callable:
        if fn.__name__ != f"{contract.name}_pass":
            raise TypeError(f"the pass {contract.name!r} must be the function {contract.name}_pass, not {fn.__name__}")
        fn.contract = contract
        return fn

    return mark
