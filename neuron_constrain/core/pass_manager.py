"""Run a list of passes under their contracts: ``PassManager(passes).run(program, **options)``.

    manager = PassManager([process_logits_pass, mask_logits_pass])   # any order: the contracts order them
    result = manager.run(program, mask_format="packed", processors=["min_p"])
    result.program, result.report["mask_logits"], result.programs   # the last program, every report, extras

Each pass is a function declared with :func:`~neuron_constrain.core.contract.declares` that
returns a :class:`~neuron_constrain.core.contract.PassResult`. The manager

- orders the list by what each contract declares (``after`` / ``before``: names of passes
  that may or may not be in the list), keeping the given order where nothing is declared,
  and refuses a cycle;
- hands each pass the options its contract names (the pass's own default for one not
  given), leaves out a pass whose ``switch`` option is given as ``None``, and refuses an
  option no pass of the list takes;
- with ``check`` (the default), checks each pass's ``requires`` on the program it gets and
  its ``ensures`` on the program it returns (``checks.check_contract``);
- raises :class:`~neuron_constrain.core.errors.PassError` naming the pass and the ones that ran
  before it when a check fails or the pass raises (the original error chained).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

from torch.export import ExportedProgram

from neuron_constrain.core.checks import CONDITIONS, check_contract
from neuron_constrain.core.contract import PassContract, PassResult
from neuron_constrain.core.errors import Error, PassError, TransformError
from neuron_constrain.core.report import TransformReport

__all__ = ["PassManager", "RunResult", "order_passes"]


@dataclasses.dataclass
class RunResult:
    """What :meth:`PassManager.run` returns: the last pass's program, every pass's report
    (``report.passes``, in the order they ran), and the programs passes made beside theirs."""

    program: ExportedProgram
    report: TransformReport
    programs: dict[str, ExportedProgram] = dataclasses.field(default_factory=dict)


def _contract(run: Callable) -> PassContract:
    contract = getattr(run, "contract", None)
    if not isinstance(contract, PassContract):
        raise TransformError(f"{getattr(run, '__name__', run)!r} declares no contract: decorate the pass with "
                             "@declares(PassContract(name=...)) (neuron_constrain.core.contract)")
    unknown = [c for c in (*contract.requires, *contract.ensures) if c not in CONDITIONS]
    if unknown:
        raise TransformError(f"the pass {contract.name!r} names condition(s) {unknown}, which checks.CONDITIONS does "
                             f"not define; known: {sorted(CONDITIONS)}")
    return contract


def order_passes(passes: Sequence[Callable]) -> list[Callable]:
    """Passes in an order every contract's ``after`` / ``before`` allows; among passes free to run, the one
    listed first runs first.

    Args:
        passes: pass functions, each declared with ``@declares``.

    Returns:
        The same passes, ordered.

    Raises:
        TransformError: a pass without a contract, or naming a condition ``checks.CONDITIONS`` lacks; a pass
            listed twice; contracts that order the passes in a cycle.
    """
    by_name: dict[str, Callable] = {}
    for run in passes:
        name = _contract(run).name
        if name in by_name:
            raise TransformError(f"the pass {name!r} is listed twice; each pass runs once")
        by_name[name] = run
    waits_for: dict[str, set[str]] = {name: set() for name in by_name}
    for name, run in by_name.items():
        contract = run.contract
        waits_for[name] |= {other for other in contract.after if other in by_name}
        for other in contract.before:
            if other in by_name:
                waits_for[other].add(name)
    ordered: list[Callable] = []
    while waits_for:
        ready = next((name for name in waits_for if not waits_for[name]), None)
        if ready is None:
            loop = ", ".join(f"{name} after {sorted(others)}" for name, others in waits_for.items())
            raise TransformError(f"the passes' contracts order them in a cycle ({loop}); no order runs them all")
        ordered.append(by_name[ready])
        del waits_for[ready]
        for others in waits_for.values():
            others.discard(ready)
    return ordered


class PassManager:
    """Runs passes in their declared order (:func:`order_passes`).

    Args:
        passes: pass functions, each declared with ``@declares``.
        check: check each pass's ``requires`` before it and ``ensures`` after it.

    Raises:
        TransformError: as :func:`order_passes` raises it.
    """

    def __init__(self, passes: Sequence[Callable], *, check: bool = True):
        self.passes = order_passes(passes)
        self.check = check

    def run(self, program: ExportedProgram, **options) -> RunResult:
        """Run the passes, each on the program the one before it returned.

        Args:
            program: the program the first pass gets.
            **options: the passes' options, each handed to the passes whose contract names it; a pass whose
                ``switch`` option is given as None is left out.

        Returns:
            The last program, every pass's report in the order they ran, and the programs passes made beside
            theirs.

        Raises:
            TransformError: an option none of the passes takes.
            PassError: a pass raised (its error chained), returned something else than a ``PassResult``, or
                broke a condition its contract names; the message names the pass and the passes before it.
        """
        declared = {option for run in self.passes for option in run.contract.options}
        unknown = sorted(set(options) - declared)
        if unknown:
            names = ", ".join(run.contract.name for run in self.passes)
            raise TransformError(f"option(s) {unknown} are taken by none of the passes ({names}); "
                                 f"they take {sorted(declared)}")
        report, programs, ran = TransformReport(), {}, []
        start = time.perf_counter()
        for run in self.passes:
            contract = run.contract
            if contract.switch in options and options[contract.switch] is None:
                continue
            if self.check:
                self._check(program, contract, "requires", ran)
            try:
                result = run(program, **{o: options[o] for o in contract.options if o in options})
            except Exception as e:
                cause = str(e) if isinstance(e, Error) else f"{type(e).__name__}: {e}"
                raise PassError(f"while running {contract.name} ({_history(ran)}): {cause}", contract.name, ran) from e
            if not isinstance(result, PassResult):
                raise PassError(f"{contract.name} ({_history(ran)}) returned a {type(result).__name__}; a pass returns "
                                "PassResult(program, report) (neuron_constrain.core.contract)", contract.name, ran)
            if self.check:
                self._check(result.program, contract, "ensures", ran)
            program = result.program
            report.passes[contract.name] = result.report
            programs.update(result.programs)
            ran.append(contract.name)
        report.transform_seconds = time.perf_counter() - start
        return RunResult(program, report, programs)

    @staticmethod
    def _check(program: ExportedProgram, contract: PassContract, stage: str, ran: list[str]) -> None:
        doing = f"checking what {contract.name} {stage} ({_history(ran)})"
        try:
            failures = check_contract(program, contract, stage)
        except Error as e:  # a condition that cannot judge this program says why
            raise PassError(f"{doing}: {e}", contract.name, ran) from e
        if failures:
            raise PassError(f"{doing}: " + "; ".join(failures), contract.name, ran)


def _history(ran: list[str]) -> str:
    return f"after {', '.join(ran)}" if ran else "no pass before it"
