"""What a pass declares about itself and what it returns: its one name, its options, what
it requires of the program it gets and ensures of the one it returns, which passes it runs
after (in the spirit of torch's ``PassBase.requires`` / ``ensures``), and :class:`PassResult`.

One name: ``passes/<name>_pass.py`` defines ``<name>_pass``, and its report is filed under
``<name>``. ``requires`` / ``ensures`` name conditions of ``checks.CONDITIONS``; the pass
manager (``neuron_constrain.core.pass_manager``) checks them around the pass, orders a list of
passes by ``after`` / ``before``, and hands each the options it declares, so an option two
passes share (``empty_row``) is given once::

    @declares(PassContract(name="mask_logits", switch="mask_format",
                           options=("mask_format", "vocab_size", "empty_row", "tp_degree"),
                           requires=("unmasked",), ensures=("every_site_masked",), after=("tap_modules",)))
    def mask_logits_pass(program, *, mask_format="packed", ...) -> PassResult: ...
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from torch.export import ExportedProgram

from neuron_constrain.core.report import PassReport

__all__ = ["PassContract", "PassResult", "declares"]


@dataclasses.dataclass(frozen=True)
class PassContract:
    """What a pass declares about itself.

    Attributes:
        name: its one name: the file ``passes/<name>_pass.py``, the function ``<name>_pass``, its report's key.
        options: the keyword options it takes (the pass manager hands it those).
        switch: the option whose ``None`` leaves the pass out of a run.
        requires: conditions of ``checks.CONDITIONS`` the program it gets must meet.
        ensures: conditions the program it returns meets.
        after: passes this one runs after when both are in a list.
        before: passes this one runs before when both are in a list.
    """

    name: str
    options: tuple[str, ...] = ()
    switch: str | None = None
    requires: tuple[str, ...] = ()
    ensures: tuple[str, ...] = ()
    after: tuple[str, ...] = ()
    before: tuple[str, ...] = ()


@dataclasses.dataclass
class PassResult:
    """What every pass returns: the program it made, its report, and any programs it made
    beside it, by name (the split: the body is ``program``, ``programs["head"]`` the head)."""

    program: ExportedProgram
    report: PassReport
    programs: dict[str, ExportedProgram] = dataclasses.field(default_factory=dict)


def declares(contract: PassContract) -> Callable:
    """A decorator attaching a contract to the pass function it decorates (``fn.contract``).

    Args:
        contract: the pass's declaration.

    Returns:
        The decorator; it returns the function itself, and raises ``TypeError`` when the function is not
        named ``<contract.name>_pass``.
    """

    def mark(fn: Callable) -> Callable:
        if fn.__name__ != f"{contract.name}_pass":
            raise TypeError(f"the pass {contract.name!r} must be the function {contract.name}_pass, not {fn.__name__}")
        fn.contract = contract
        return fn

    return mark
