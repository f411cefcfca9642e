"""A pipelined decode step: the body runs while the host fills the grammar mask.

    split = split_step(transformed)          # body (layers, KV-cache writes, lm_head) | head (mask, processors, sampler)
    step = PipelinedStep(split, body_threads=1)
    tokens = step((ids, pos), fill=lambda: {"logit_mask": runtime.step(batch)})
    serial = split(ids, pos, logit_mask=mask)   # the same tokens, body and head one after the other

For step t, :class:`PipelinedStep`:

    caller thread     feed body inputs | launch body ──┐ fill(t) (xgrammar) | wait body | head -> tokens
    body (CPU eager)                                   └─ worker thread: body(ids, pos) -> logits
    body (torch-xla)  fill(t) on the worker thread | trace body, torch_xla.sync(): runs on the device | wait fill | head

On torch-xla the fill runs on the worker thread while the caller traces the body
(lazy-tensor tracing is host work as long as a fill) and dispatches it with
``torch_xla.sync()``, which returns while the device (PJRT) runs it; the head's
inputs (the mask) are transferred after the fill and the head is a second compiled
graph reading the body's outputs as device data. On CPU eager the body runs on one
worker thread that owns its torch thread budget: ``body_threads`` is set with
``torch.set_num_threads`` *inside* the worker. Measured on torch 2.9 (OpenMP +
MKL build): the budget is per thread (OpenMP's ``omp_set_num_threads`` and MKL's
``mkl_set_num_threads_local``), but ``set_num_threads`` also stores a process-wide
default that a thread adopts on its first parallel op; so the caller's thread is
initialised first and that default is put back after the worker took its budget
(``tests/decoding/test_pipeline.py`` checks both threads' counts).

Token-identical to the serial step: the same two programs run on the same inputs;
only when they run changes. Errors surface, never hang: a body error is raised from
the step; a fill error is raised once the body has finished (so the KV cache is in a
known state); every wait is bounded by ``timeout`` (:class:`PipelineTimeout`), after
which the step refuses further calls (its worker may still be busy).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time
from typing import Callable, Mapping, Sequence

import torch
from torch.utils import _pytree as pytree

from neuron_constrain.core.errors import Error, TransformError
from neuron_constrain.passes.split_at_mask_pass import SplitReport, split_at_mask_pass
from neuron_constrain.core.report import TransformReport
from neuron_constrain.core.transform import Transformed

__all__ = ["HEAD_PASSES", "PipelineTimeout", "PipelinedStep", "Split", "split_step"]

HEAD_PASSES = ("mask_logits", "process_logits")  # passes whose inputs the head takes


class PipelineTimeout(Error, TimeoutError):
    """The body (or its worker) did not finish within the step's ``timeout``."""


def _partial_report(report: TransformReport, keep_input, keep_outputs: bool) -> TransformReport:
    passes = {
        name: dataclasses.replace(
            r, inputs_added=[i for i in r.inputs_added if keep_input(i.name)],
            outputs_added=list(r.outputs_added) if keep_outputs else [],
        )
        for name, r in report.passes.items()
    }
    return TransformReport(passes=passes, export_seconds=report.export_seconds, transform_seconds=report.transform_seconds)


@dataclasses.dataclass
class Split:
    """A rewritten step cut in two; calling it runs body then head (the serial step).

    ``body(*args, **kwargs)`` takes the step's inputs minus the head's and returns the
    cut values (a tuple); ``head(*cut, **head_kwargs)`` returns the step's outputs
    (``EmptyMaskRowError`` and neutral fills as with :class:`Transformed`).
    """

    body: Transformed
    head: Transformed
    report: SplitReport
    head_names: list[str]  # the added inputs the head takes (logit_mask, processor inputs)
    passthrough: list[tuple[int, str]]  # (leaf among the step's own inputs, name): body inputs the head reads
    kwarg_order: list[str]

    def body_call(self, args: Sequence, kwargs: Mapping) -> tuple[tuple, dict]:
        """The body's inputs from the step's.

        Args:
            args: the step's positional inputs.
            kwargs: its keyword inputs, the head's among them.

        Returns:
            ``(args, kwargs)`` without the head's inputs.
        """
        return tuple(args), {k: v for k, v in kwargs.items() if k not in self.head_names}

    def head_kwargs(self, args: Sequence, kwargs: Mapping) -> dict:
        """The head's keyword inputs from the step's.

        Args:
            args: the step's positional inputs.
            kwargs: its keyword inputs.

        Returns:
            The step's inputs the head reads (passthrough) and the head's own added inputs, by name.
        """
        ordered = {k: kwargs[k] for k in self.kwarg_order if k in kwargs}
        leaves = pytree.tree_leaves((tuple(args), ordered))
        out = {name: leaves[i] for i, name in self.passthrough}
        out.update({k: v for k, v in kwargs.items() if k in self.head_names})
        return out

    def __call__(self, *args, **kwargs):
        body_args, body_kwargs = self.body_call(args, kwargs)
        return self.head(*self.body(*body_args, **body_kwargs), **self.head_kwargs(args, kwargs))

    def to(self, device: torch.device | None = None) -> "Split":
        """Both halves on the XLA device (``neuron_constrain.decoding.xla.to_xla``).

        The moved weights and state are materialised at once (synced): torch-xla keeps
        small scalars (a cache's length counters) as pending constants, which made the
        first step's body a different graph from every later one's (two compilations).

        Args:
            device: the XLA device (default: torch-xla's).

        Returns:
            A new split over the moved halves; this one is unchanged.
        """
        import torch_xla

        from neuron_constrain.decoding.xla import to_xla

        moved = dataclasses.replace(self, body=to_xla(self.body, device), head=to_xla(self.head, device))
        state = [t for half in (moved.body, moved.head) for t in (*half.program.state_dict.values(),
                 *half.program.constants.values()) if isinstance(t, torch.Tensor)]
        torch_xla._XLAC._xla_sync_multi(state, [], True, False)  # these tensors only
        return moved


def split_step(transformed: Transformed, head_inputs: Sequence[str] | None = None, *, cut: str = "logits") -> Split:
    """Cut a rewritten step at its mask (:func:`split_at_mask_pass`). The halves share the program's
    weights and state (nothing is copied): the body writes the KV cache the unsplit program would.

    Args:
        transformed: the rewritten step.
        head_inputs: the added inputs the head takes; default those the mask-logits and process-logits
            passes added (tap inputs stay in the body: taps replace values inside the layers).
        cut: ``"logits"`` (the body ends with the lm_head) or ``"hidden"`` (the lm_head moves into the
            head; the last hidden rows cross the cut).

    Returns:
        The two halves, callable as the serial step.

    Raises:
        TransformError: the program has no mask or processor input (and no ``head_inputs`` were given), or
            the split pass refuses the cut (an unknown cut, an input it does not take, a cache write the
            head's inputs would reach...).
    """
    if head_inputs is None:
        head_inputs = [i.name for p in HEAD_PASSES if p in transformed.report.passes
                       for i in transformed.report.passes[p].inputs_added]
    if not head_inputs:
        raise TransformError("split_step: the program has no logit-mask or processor inputs; transform it with "
                             "logit_mask='packed' (or processors=...) first, or pass head_inputs=")
    result = split_at_mask_pass(transformed.program, head_inputs, cut=cut)
    body, head, report = result.program, result.programs["head"], result.report
    names = set(head_inputs)
    body_t = Transformed(body, _partial_report(transformed.report, lambda n: n not in names, keep_outputs=False))
    head_t = Transformed(head, _partial_report(transformed.report, lambda n: n in names, keep_outputs=True))
    own = [s.arg.name for s in transformed._user_specs]
    passthrough = [(own.index(n), n) for n in report.head_inputs if n not in names]
    return Split(body_t, head_t, report, list(head_inputs), passthrough, list(transformed._kwarg_order))


def _on_xla(leaves) -> bool:
    return any(isinstance(x, torch.Tensor) and x.device.type == "xla" for x in leaves)


class PipelinedStep:
    """Run a :class:`Split` step with the mask fill overlapped with the body.

    ``step(args, kwargs, fill=fill)`` runs one step: ``fill()`` runs on the caller's thread while
    the body runs, and returns the head's inputs (``{"logit_mask": mask}``, processor inputs) or
    ``None`` (all neutral); the call returns the head's outputs. It raises the body's error, else
    the fill's (once the body is done), and :class:`PipelineTimeout` past ``timeout`` (the step
    refuses every later call). Timings of the last call are kept in ``last_body_seconds``
    (worker), ``last_fill_seconds``, ``last_wait_seconds`` (the caller waiting for the body
    after its fill) and ``last_head_seconds``.

    Args:
        split: the step cut in two (:func:`split_step`).
        body_threads: the CPU worker's torch thread budget (None: the process's).
        timeout: seconds any wait may take.
    """

    def __init__(self, split: Split, *, body_threads: int | None = None, timeout: float = 120.0):
        self.split = split
        self.timeout = timeout
        self.body_threads = body_threads
        self._broken: str | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self.worker_threads: int | None = None  # torch.get_num_threads() inside the worker
        self.last_body_seconds = self.last_fill_seconds = self.last_wait_seconds = self.last_head_seconds = 0.0

    # -------------------------------------------------------------- the CPU worker
    def _worker(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._executor is None:
            caller = torch.get_num_threads()  # initialises the caller's own budget first
            ready = threading.Event()

            def init():
                if self.body_threads is not None:
                    torch.set_num_threads(self.body_threads)
                self.worker_threads = torch.get_num_threads()
                ready.set()

            self._executor = concurrent.futures.ThreadPoolExecutor(1, "neuron-constrain-body", initializer=init)
            self._executor.submit(lambda: None).result(timeout=self.timeout)
            if not ready.is_set():
                raise PipelineTimeout(f"the body worker did not start within {self.timeout} s")
            torch.set_num_threads(caller)  # the process-wide default back (the worker keeps its own)
        return self._executor

    def close(self) -> None:
        """Stop the worker thread (a body still running is not waited for)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -------------------------------------------------------------- one step
    def __call__(self, args: Sequence, kwargs: Mapping | None = None, *, fill: Callable[[], Mapping | None] | None = None):
        if self._broken:
            raise PipelineTimeout(self._broken)
        kwargs = dict(kwargs or {})
        split = self.split
        body_args, body_kwargs = split.body_call(args, kwargs)
        head_kwargs = split.head_kwargs(args, kwargs)
        clock = time.perf_counter
        # Added body inputs (taps) are fed here: the replacement context is per thread.
        fed = split.body._with_added_inputs(body_args, body_kwargs)
        module = split.body.graph_module
        if _on_xla(pytree.tree_leaves((body_args, fed))):
            return self._xla_step(module, body_args, fed, head_kwargs, fill)

        def run_body():
            start = clock()
            with torch.no_grad():  # grad mode is per thread: decode never records autograd
                out = module(*body_args, **fed)
            return out, clock() - start

        future = self._worker().submit(run_body)
        fill_error, filled = None, None
        tick = clock()
        try:
            filled = fill() if fill is not None else None
        except BaseException as e:  # noqa: BLE001 - re-raised below once the body is done
            fill_error = e
        self.last_fill_seconds = clock() - tick
        tick = clock()
        try:
            result, body_error = self._wait(future, "the body", cause=fill_error)
        finally:
            self.last_wait_seconds = clock() - tick
        _raise_errors(body_error, fill_error)
        cut, self.last_body_seconds = result
        return self._head(cut, head_kwargs, filled)

    def _head(self, cut, head_kwargs: dict, filled: Mapping | None):
        tick = time.perf_counter()
        if filled:
            head_kwargs.update(filled)
        with torch.no_grad():
            out = self.split.head(*cut, **head_kwargs)
        self.last_head_seconds = time.perf_counter() - tick
        return out

    def _xla_step(self, module, body_args, fed, head_kwargs, fill):
        import torch_xla

        clock = time.perf_counter

        def timed_fill():
            tick = clock()
            return fill(), clock() - tick

        # The fill runs on the worker while this thread traces and dispatches the body: tracing a
        # lazy-tensor graph is host work of the fill's size (1.9 ms for bench_overlap's quick model),
        # and the device then runs the body while the fill may still go on.
        future = self._worker().submit(timed_fill) if fill is not None else None
        tick = clock()
        try:
            with torch.no_grad():
                cut = module(*body_args, **fed)
            torch_xla.sync()  # dispatch: returns while the device runs the body
        except BaseException as body_error:
            _raise_errors(body_error, self._wait(future, "the mask fill")[1] if future is not None else None)
        self.last_body_seconds = clock() - tick  # tracing + dispatch (the device time overlaps the fill)
        tick = clock()
        filled, self.last_fill_seconds = None, 0.0
        if future is not None:
            result, fill_error = self._wait(future, "the mask fill")
            _raise_errors(None, fill_error)
            filled, self.last_fill_seconds = result
        self.last_wait_seconds = clock() - tick
        device = next(t.device for t in pytree.tree_leaves(cut) if isinstance(t, torch.Tensor))
        filled = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in (filled or {}).items()}
        return self._head(cut, head_kwargs, filled)

    def _wait(self, future: concurrent.futures.Future, what: str, cause: BaseException | None = None):
        """``(result, None)`` or ``(None, error)`` of ``future`` within ``timeout``; past it the step is unusable."""
        try:
            return future.result(timeout=self.timeout), None
        except concurrent.futures.TimeoutError:
            self._broken = f"{what} did not finish within {self.timeout} s; this pipelined step is unusable"
            raise PipelineTimeout(self._broken) from cause
        except BaseException as error:  # noqa: BLE001 - the caller decides which error wins
            return None, error


def _raise_errors(body_error: BaseException | None, fill_error: BaseException | None) -> None:
    """Raise the body's error (noting the fill's if it failed too), else the fill's; neither: return."""
    if body_error is not None:
        if fill_error is not None:
            body_error.add_note(f"the mask fill failed too: {fill_error!r}")
        raise body_error
    if fill_error is not None:
        raise fill_error

