"""The ``torch.compile`` (dynamo) backend that runs neuron-constrain's passes on dynamo's graph.

    compiled = nc.compile(step, inner="inductor", vocab_size=1000)   # or inner="openxla"
    tok = compiled(ids, logit_mask=mask)      # mask omitted: all-allowed, same compiled graph

    be = nc.backend(inner="openxla", vocab_size=1000)                 # the same, by hand
    compiled = torch.compile(step, backend=be, dynamic=False)
    with be.feed(logit_mask=mask):
        tok = compiled(ids)

Also registered with dynamo (on ``import neuron_constrain``) as
``backend="neuron_constrain"``: :data:`default_backend`, inductor inside with the
default pass options; feed it with ``nc.default_backend.feed(logit_mask=...)``.

How it works. For every graph dynamo hands it, the backend re-exports the graph
with ``torch.export`` (non-strict, on dynamo's example inputs: parameters arrive
as graph inputs), runs :func:`neuron_constrain.transform` on that program — the
same passes, nothing duplicated — and gives the rewritten, lifted aten graph to
the inner backend with the example inputs plus one neutral tensor per added
input (``logit_mask``, tap inputs). The callable it returns appends the added
inputs on every call: the tensors the caller fed, or their neutral fill, so the
compiled graph always receives tensors and a mask never causes a recompile
(dynamo does not guard on values it never sees). Flag outputs
(``logit_mask_empty``) are stripped and raise ``EmptyMaskRowError`` as in
``Transformed``.

Why the mask does not go through dynamo: it is not an argument of the user's
forward, so the caller hands it to the backend out of band — ``feed`` (a
per-thread stash read by the compiled callables), wrapped by ``nc.compile`` into a
callable that takes ``logit_mask=`` like ``Transformed``. A fed input no compiled
graph consumed (the logits landed in no graph: a graph break around the lm_head,
or the pass disabled) raises after the call instead of being ignored.

Tap inputs (``taps=[...]``) are filled from the active replacement context, as
for ``Transformed``. Dynamo's graphs record no module call signatures, so a tap
on a value the module's parent discards (GPT-OSS router logits) fails here with
the fix: ``transform(model, taps=...)``, then ``torch.compile`` the result.

Graphs without logits (the other side of a graph break) go to the inner backend
unchanged. Shapes must be static per graph (``dynamic=False``, the default of
``nc.compile``): each batch size is its own compiled graph, as on Neuron.
"""
from __future__ import annotations

import contextlib
import copy
import inspect
import threading
from typing import Callable

import torch
import torch._dynamo
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils import _pytree as pytree

from neuron_constrain.core.errors import InputError, TransformError
from neuron_constrain.core.mask_interface import MASK_INPUT
from neuron_constrain.passes.mask_logits_pass import mask_pass_adds
from neuron_constrain.passes.process_logits_pass import processors_pass_adds
from neuron_constrain.core.sites import find_logits_root
from neuron_constrain.core.tap_interface import is_tap_input
from neuron_constrain.core.transform import Transformed, strip_added_outputs, transform

__all__ = ["BACKEND_NAME", "Backend", "TorchCompiled", "backend", "compile", "default_backend"]

BACKEND_NAME = "neuron_constrain"


class _Feed(threading.local):
    values: dict | None = None
    consumed: set | None = None


class Backend:
    """``backend=`` for ``torch.compile``: our passes on each graph, then ``inner``.

    Feed the added inputs of a call with ``with backend.feed(logit_mask=...):``; ``reports``
    holds one :class:`TransformReport` per graph rewritten.

    Args:
        inner: a dynamo backend name (``"inductor"``, ``"openxla"``, ``"eager"``, ...) or a
            callable ``(gm, example_inputs) -> callable``.
        **pass_options: keywords of :func:`neuron_constrain.transform` (``logit_mask``,
            ``vocab_size``, ``empty_row``, ``taps``, ...).

    Raises:
        ValueError: ``inner`` names this backend itself (the passes would run twice).
    """

    def __init__(self, inner: str | Callable = "inductor", **pass_options):
        self.inner = inner
        self.pass_options = {"logit_mask": "packed", **pass_options}
        self.reports = []  # one TransformReport per graph rewritten, in compile order
        self.graphs_compiled = 0
        self._feed = _Feed()

    # ------------------------------------------------------------------ feeding
    @contextlib.contextmanager
    def feed(self, **inputs):
        """Feed added inputs to the compiled calls made inside the ``with`` block (this thread's).

        Args:
            **inputs: added inputs by name (``logit_mask=``, tap inputs); a None is not fed.

        Raises:
            RuntimeError: a ``feed`` is already active in this thread.
            InputError: at the block's end, an input no compiled graph took (the message says why that happens).
        """
        if self._feed.values is not None:
            raise RuntimeError("feed() is already active in this thread; feed each call once")
        self._feed.values = {k: v for k, v in inputs.items() if v is not None}
        self._feed.consumed = set()
        try:
            yield
            unused = sorted(set(self._feed.values) - self._feed.consumed)
            if unused:
                known = sorted({i.name for r in self.reports for i in r.inputs_added})
                raise InputError(
                    f"{', '.join(unused)} was fed but no compiled graph takes it (graphs take: {known or 'nothing'}): "
                    "the logits were in no graph dynamo compiled with this backend (a graph break around the "
                    "lm_head or sampler? try fullgraph=True), or the pass that adds it is disabled"
                )
        finally:
            self._feed.values = self._feed.consumed = None

    # ------------------------------------------------------------------ compiling
    def _inner(self) -> Callable:
        if callable(self.inner):
            return self.inner
        if self.inner == BACKEND_NAME:
            raise ValueError(f"inner={BACKEND_NAME!r} would run the passes twice; name the compiler inside it")
        return torch._dynamo.lookup_backend(self.inner)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        inner = self._inner()
        self.graphs_compiled += 1
        symbolic = [
            i for i, x in enumerate(example_inputs)
            if isinstance(x, torch.SymInt)
            or (isinstance(x, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in x.shape))
        ]
        if symbolic:
            raise TransformError(
                f"dynamo handed the {BACKEND_NAME} backend a graph with symbolic sizes (inputs {symbolic}); "
                "compile with dynamic=False (nc.compile does): each shape gets its own static graph, as on Neuron"
            )
        with torch.no_grad():
            program = torch.export.export(_without_grad_toggles(gm), tuple(example_inputs), strict=False)
        if self.pass_options.get("logit_mask") is not None and find_logits_root(
            program.graph, self.pass_options.get("vocab_size")
        ) is None:
            return inner(gm, example_inputs)  # no logits here (a graph break); the caller is told if a mask goes unused
        result = transform(program, **self.pass_options)
        self.reports.append(result.report)
        return self._compile_rewritten(result, example_inputs, inner)

    def _compile_rewritten(self, result: Transformed, example_inputs: list, inner: Callable) -> Callable:
        program = result.program
        signature = program.graph_signature
        others = [s for s in signature.output_specs if s.kind != OutputKind.USER_OUTPUT]
        if others:
            raise TransformError(
                f"the graph mutates {[s.target or s.arg.name for s in others]} ({others[0].kind.name}); "
                f"the {BACKEND_NAME} backend compiles graphs without state updates (a decode step without an "
                "in-place KV cache)"
            )
        device = next((x.device for x in example_inputs if isinstance(x, torch.Tensor)), torch.device("cpu"))
        by_name = {i.name: i for i in result.report.inputs_added}
        # The lifted graph's inputs in signature order: constants (and any weights the
        # graph holds) as tensors, dynamo's arguments by position, the added inputs by
        # their AddedInput (fed on each call).
        slots: list = []
        example: list = []
        position = 0
        for spec in signature.input_specs:
            if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
                store = program.constants if spec.kind == InputKind.CONSTANT_TENSOR else program.state_dict
                slots.append(store[spec.target].to(device))
                example.append(slots[-1])
            elif spec.kind != InputKind.USER_INPUT:
                raise TransformError(f"the rewritten graph has a {spec.kind.name} input; the backend cannot feed it")
            elif spec.arg.name in by_name:
                info = by_name[spec.arg.name]
                slots.append(info)
                # Made on the host and copied: on XLA that is device data (a parameter), not a constant.
                example.append(torch.full(info.shape_for({}), 0 if info.fill is None else info.fill, dtype=info.dtype).to(device))
            else:
                slots.append(position)
                example.append(example_inputs[position])
                position += 1
        if position != len(example_inputs):
            raise TransformError(f"the rewritten graph takes {position} of dynamo's {len(example_inputs)} inputs")
        fake_mode = detect_fake_mode(example_inputs) if any(isinstance(x, FakeTensor) for x in example_inputs) else None
        if fake_mode is not None:  # newer dynamo may hand over fake inputs: ours must be fake too
            example = [x if isinstance(x, FakeTensor) or not isinstance(x, torch.Tensor) else fake_mode.from_tensor(x)
                       for x in example]
        compiled = inner(program.graph_module, example)
        out_spec, report, state = program.call_spec.out_spec, result.report, self._feed

        def run(*args):
            values = state.values or {}
            flat = []
            for slot in slots:
                if isinstance(slot, int):
                    flat.append(args[slot])
                elif isinstance(slot, torch.Tensor):
                    flat.append(slot)
                else:  # Transformed's own feeding: dtype/shape/device checks, neutral fill, tap contexts
                    flat.append(Transformed._feed(slot, values.get(slot.name), {}, device))
                    if state.consumed is not None:
                        state.consumed.add(slot.name)
            return strip_added_outputs(pytree.tree_unflatten(list(compiled(*flat)), out_spec), report)

        return run


def _without_grad_toggles(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of dynamo's graph without its ``_set_grad_enabled`` calls (a model's own
    ``@torch.no_grad()`` blocks, e.g. HF's rotary embedding). A decode step is
    inference: the values are the same, and re-exporting would otherwise wrap the rest
    of the graph in a ``wrap_with_set_grad_enabled`` region the passes cannot see into."""
    toggles = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch._C._set_grad_enabled]
    if not toggles:
        return gm
    graph = copy.deepcopy(gm.graph)
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target is torch._C._set_grad_enabled]:
        graph.erase_node(node)
    return torch.fx.GraphModule(gm, graph)


def backend(inner: str | Callable = "inductor", **pass_options) -> Backend:
    """A ``torch.compile`` backend running the passes before ``inner``.

    Args:
        inner: the compiler after the passes: a dynamo backend name (``"inductor"``,
            ``"openxla"``, ``"eager"``) or a callable ``(gm, example_inputs) -> callable``.
        **pass_options: keywords of :func:`neuron_constrain.transform` (``vocab_size``, ``taps``...).

    Returns:
        The backend; pass it as ``torch.compile(model, backend=...)`` and feed the added inputs
        with ``backend.feed(logit_mask=...)``.
    """
    return Backend(inner, **pass_options)


class TorchCompiled:
    """What :func:`compile` returns: ``torch.compile(model, backend=Backend(...))`` that takes
    the added inputs as keywords.

    ``compiled(*args, logit_mask=mask, **kwargs)``: keywords the model's forward
    does not take, and any input a pass added, are fed to the compiled graph (an
    omitted one gets its neutral value); the rest go to the model.

    Args:
        model: the module or function compiled.
        backend: the :class:`Backend` running the passes.
        **compile_options: keywords of ``torch.compile`` (``fullgraph``, ``mode``...).

    Raises:
        InputError: on a call, a keyword neither the model nor any pass takes.
    """

    def __init__(self, model: Callable, backend: Backend, **compile_options):
        self.model = model
        self.backend = backend
        self.compiled = torch.compile(model, backend=backend, **compile_options)
        forward = model.forward if isinstance(model, torch.nn.Module) else model
        params = inspect.signature(forward).parameters
        self._takes_any_kwarg = any(p.kind == p.VAR_KEYWORD for p in params.values())
        self._model_kwargs = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}

    def _added_names(self) -> set:
        names = {i.name for r in self.backend.reports for i in r.inputs_added}
        if self.backend.pass_options.get("logit_mask") is not None:
            names.add(MASK_INPUT)
        return names

    def _may_add(self, name: str) -> bool:
        """Whether the configured passes add (or may add, once compiled) an input called ``name``."""
        options = self.backend.pass_options
        processors = options.get("processors") or ()
        return (
            name in self._added_names()
            or (options.get("logit_mask") is not None and mask_pass_adds(name))
            or (bool(options.get("taps")) and is_tap_input(name))
            or (bool(processors) and processors_pass_adds(name, processors))
        )

    def __call__(self, *args, **kwargs):
        added = self._added_names()
        fed = {
            k: kwargs.pop(k) for k in list(kwargs)
            if k in added or (not self._takes_any_kwarg and k not in self._model_kwargs)
        }
        unknown = sorted(k for k in fed if not self._may_add(k))
        if unknown:
            raise InputError(
                f"unexpected keyword(s) {unknown}: not arguments of the model's forward "
                f"({', '.join(sorted(self._model_kwargs)) or 'no keywords'}) and not inputs the configured passes add "
                f"({', '.join(sorted(added)) or 'none yet'}); check the spelling"
            )
        try:
            with self.backend.feed(**fed):
                return self.compiled(*args, **kwargs)
        except torch._dynamo.exc.BackendCompilerFailed as e:  # our own errors, without dynamo's wrapping
            if isinstance(e.inner_exception, (TransformError, InputError)):
                raise e.inner_exception from None
            raise


def compile(model: Callable, *, inner: str | Callable = "inductor", dynamic: bool = False, **options) -> TorchCompiled:
    """``torch.compile`` with the passes; the result takes ``logit_mask=`` (and tap inputs).

    Args:
        model: the module or function to compile.
        inner: the compiler after the passes (see :func:`backend`).
        dynamic: ``torch.compile``'s ``dynamic``; static shapes by default, one graph per batch
            size, as on Neuron.
        **options: keywords of :func:`neuron_constrain.transform`, and ``fullgraph`` / ``mode`` /
            ``options`` / ``disable`` for ``torch.compile``.

    Returns:
        A callable taking the model's inputs plus the added ones as keywords (an omitted one is
        fed its neutral value: one compiled graph for masked and unmasked calls).

    Raises:
        TransformError: on the first call, a graph the passes cannot rewrite (no sampling site, a
            bad option).
        InputError: on a call, an added input that does not fit, or a mask no graph takes.
    """
    compile_keys = ("fullgraph", "mode", "options", "disable")
    compile_options = {k: options.pop(k) for k in compile_keys if k in options}
    return TorchCompiled(model, Backend(inner, **options), dynamic=dynamic, **compile_options)


default_backend = Backend("inductor")
torch._dynamo.register_backend(default_backend, name=BACKEND_NAME)
