"""What :func:`~neuron_constrain.replacement.localization.localize` found, per tapped module,
and its renderings: a text table (:meth:`LocalizationReport.summary`), strict JSON
(:meth:`~LocalizationReport.to_json`) and a PNG of the errors by module
(:meth:`~LocalizationReport.plot`, optional matplotlib).

    report.culprit        # the first module whose local error exceeds atol, or None
    report.ranking(3)     # the three largest local errors, worst first
"""
from __future__ import annotations

import dataclasses
import json
import math
import sys


@dataclasses.dataclass
class LogitsError:
    """The final logits vs the reference at every decode step (teacher-forced)."""

    max_abs_error: float
    topk_agreement: float              # the worst step's share of the reference's top-k
    first_divergence: tuple[int, int] | None  # (prompt, step) of the earliest argmax mismatch

    def restored(self, atol: float) -> bool:
        return self.first_divergence is None and self.max_abs_error <= atol


@dataclasses.dataclass
class LocalizationRow:
    """One tapped module of :func:`localize`, in graph order.

    Attributes:
        module: its path, as ``named_modules()`` spells it on the model.
        local_error: max abs difference of its output from the reference's, every upstream tap on.
        propagated: the logits' error with taps on up to this module, off after it.
        alone: the logits' error with only this module's tap on.
    """

    module: str            # tap name: the module path as named_modules() spells it on the model
    local_error: float     # max |computed - reference| with every upstream tap on
    propagated: LogitsError  # logits with taps on up to this module, off after it
    alone: LogitsError     # logits with only this module's tap on

    def to_dict(self) -> dict:
        """The row as JSON-ready data.

        Returns:
            Its module, local error, propagated error, top-k agreement and first divergence, and the
            error and first divergence with its tap alone on.
        """
        return {
            "module": self.module,
            "local_error": self.local_error,
            "propagated_error": self.propagated.max_abs_error,
            "topk_agreement": self.propagated.topk_agreement,
            "first_divergence": self.propagated.first_divergence,
            "alone_error": self.alone.max_abs_error,
            "alone_first_divergence": self.alone.first_divergence,
        }


@dataclasses.dataclass
class LocalizationReport:
    """What :func:`localize` found: ``culprit``, ``summary()``, ``to_json()``, ``plot(path)``.

    Attributes:
        rows: one per tapped module, in graph order.
        baseline: the logits' error with no tap on (the model as it is).
        atol: the tolerance.
        top_k: the k of the top-k agreement.
        forward_passes: calls of the tapped program.
        reference_passes: eager calls of the reference (0 when given captures).
        prompts: prompts compared.
        steps: decode steps compared per prompt.
        positions: token slots per forward pass (batch x sequence).
    """

    rows: list[LocalizationRow]
    baseline: LogitsError  # no tap on: the model as it is
    atol: float
    top_k: int
    forward_passes: int    # calls of the tapped program
    reference_passes: int  # eager calls of the reference (0 when given captures)
    prompts: int
    steps: int             # decode steps compared per prompt
    positions: int         # token slots per forward pass (batch x sequence)

    @property
    def culprit(self) -> str | None:
        """The first module (in graph order) whose local error exceeds ``atol``."""
        return next((r.module for r in self.rows if r.local_error > self.atol), None)

    @property
    def culprit_row(self) -> LocalizationRow | None:
        """The culprit's row, or None."""
        return next((r for r in self.rows if r.module == self.culprit), None)

    def ranking(self, n: int = 3) -> list[LocalizationRow]:
        """The modules with the largest local errors.

        Args:
            n: how many.

        Returns:
            Their rows, worst first (a NaN error counts as the worst).
        """
        return sorted(self.rows, key=lambda r: -_sortable(r.local_error))[:n]

    def summary(self) -> str:
        """The report as a table (what ``neuron-constrain localize`` prints).

        Returns:
            A row per module (local, propagated and alone errors, top-k agreement, first divergence), the
            baseline, the culprit and the worst local errors, and the cost in forward passes.
        """
        width = max([len("module")] + [len(r.module) for r in self.rows])
        head = (f"{'module':<{width}}  {'local err':>9}  {'propagated':>10}  {'top-' + str(self.top_k):>6}  "
                f"{'diverges':>8}  {'alone':>9}  restores")
        lines = [head, "-" * len(head)]
        for r in self.rows:
            mark = "  <- culprit" if r.module == self.culprit else ""
            lines.append(
                f"{r.module:<{width}}  {_num(r.local_error):>9}{'!' if r.local_error > self.atol else ' '} "
                f"{_num(r.propagated.max_abs_error):>10}  {r.propagated.topk_agreement:>6.2f}  "
                f"{_step(r.propagated.first_divergence):>8}  {_num(r.alone.max_abs_error):>9}  "
                f"{'yes' if r.alone.restored(self.atol) else 'no':<8}{mark}"
            )
        lines.append(
            f"no taps on: max |logit error| {_num(self.baseline.max_abs_error)}, min top-{self.top_k} agreement "
            f"{self.baseline.topk_agreement:.2f}, first divergence {_step(self.baseline.first_divergence)}"
        )
        culprit = self.culprit_row
        if culprit is None:
            lines.append(f"no module's local error exceeds atol {self.atol:g}: nothing diverges")
        else:
            alone = culprit.alone
            lines.append(
                f"culprit: {culprit.module} (local error {_num(culprit.local_error)} > atol {self.atol:g}); "
                f"replacing it alone {'restores' if alone.restored(self.atol) else 'does not restore'} the logits "
                f"(max |logit error| {_num(alone.max_abs_error)})"
            )
            worst = ", ".join(f"{r.module} {_num(r.local_error)}" for r in self.ranking() if r.local_error > self.atol)
            lines.append(f"worst local errors: {worst}")
        lines.append("columns: local err = max |Δ| of the module's output, every earlier tap on; propagated = max "
                     "|Δlogits|, taps on up to it;")
        lines.append("         top-k = the worst step's agreement; diverges = first prompt:step whose argmax differs; "
                     "alone = max |Δlogits|, only its tap on")
        lines.append(
            f"cost: {self.forward_passes} forward passes for {len(self.rows)} tapped modules (2n + 1), "
            f"{self.positions} token slots each ({self.prompts} prompts x {self.steps} decode steps compared); "
            f"{self.reference_passes} reference passes"
        )
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """The report as data.

        Returns:
            The culprit, the options and costs, the baseline, the modules over ``atol`` worst first, and
            every row (:meth:`LocalizationRow.to_dict`).
        """
        return {
            "culprit": self.culprit,
            "atol": self.atol,
            "top_k": self.top_k,
            "forward_passes": self.forward_passes,
            "reference_passes": self.reference_passes,
            "prompts": self.prompts,
            "steps": self.steps,
            "positions": self.positions,
            "baseline": dataclasses.asdict(self.baseline),
            "ranking": [r.module for r in self.ranking(len(self.rows)) if r.local_error > self.atol],
            "rows": [r.to_dict() for r in self.rows],
        }

    def to_json(self, indent: int | None = 2) -> str:
        """The report as strict JSON.

        Args:
            indent: ``json.dumps``' indent.

        Returns:
            :meth:`to_dict` as JSON, non-finite errors as the strings ``"inf"`` / ``"nan"``.
        """
        return json.dumps(_finite(self.to_dict()), indent=indent)

    def plot(self, path) -> str | None:
        """Write a PNG of the errors by module (log scale). The figure is drawn on its own Agg canvas:
        pyplot's state and the process's backend are left alone.

        Args:
            path: the file to write.

        Returns:
            The path written, or None, with a one-line note on stderr, when matplotlib is not installed.
        """
        try:
            import matplotlib  # noqa: F401  first, so an absent or blocked matplotlib raises here
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
        except ImportError:
            print("plot skipped: matplotlib is not installed (pip install 'neuron-constrain[plot]')", file=sys.stderr)
            return None
        floor = 1e-12  # exact zeros on a log scale
        x = list(range(len(self.rows)))
        fig = Figure(figsize=(max(6.0, 0.5 * len(self.rows) + 2), 4.0))
        FigureCanvasAgg(fig)
        ax = fig.subplots()
        ax.semilogy(x, [max(_sortable(r.local_error), floor) for r in self.rows], "o-", label="local error")
        ax.semilogy(x, [max(_sortable(r.propagated.max_abs_error), floor) for r in self.rows], "s--",
                    label="propagated |Δlogits| (taps on up to it)")
        ax.axhline(self.atol, color="gray", linestyle=":", label=f"atol {self.atol:g}")
        culprit = next((i for i, r in enumerate(self.rows) if r.module == self.culprit), None)
        if culprit is not None:
            ax.axvline(culprit, color="red", alpha=0.3, linewidth=6, label=f"culprit {self.culprit}")
        ax.set_xticks(x, [_short(r.module) for r in self.rows], rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("max |error|")
        ax.set_title("first diverging module" + (f": {self.culprit}" if self.culprit else ": none"))
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, format="png", dpi=100)
        return str(path)


def _sortable(x: float) -> float:
    return math.inf if math.isnan(x) else x


def _num(x: float) -> str:
    return f"{x:.2e}" if math.isfinite(x) else str(x)


def _step(first: tuple[int, int] | None) -> str:
    return "-" if first is None else f"p{first[0]}:s{first[1]}"


def _short(module: str) -> str:
    return "L" + module.rsplit("layers.", 1)[-1] if "layers." in module else module


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
