"""The policy's verdict on a request's constraint, reached off the API server's event loop.

    install()                          # once per API server process (validate.py does it on import)
    await admission().check(params)    # VLLMValidationError (a 400) naming the limit or the keyword

vLLM runs a logits processor's ``validate_params`` hook synchronously on the event loop, so
a verdict that compiles there stops every other request while it runs (one 30,000-value
``enum`` held a server for over 90 s). ``install`` wraps ``AsyncLLM.add_request`` — the one
coroutine every OpenAI request passes through before vLLM's own synchronous checks — so
that it first awaits the verdict on the admission's threads: the cheap checks (the server's
:class:`~neuron_constrain.structured.schema.limits.Limits`, whether a schema admits any value, a
verdict cached already, whether a schema's shortest answer fits the request's ``max_tokens``) on the small
lane, then the compilation on the lane its size picks
(``structured/runtime/lanes.py``: a flood of large constraints queues behind its own kind), in
xgrammar worker processes killed past ``compile_seconds`` and ``compile_memory_mb``. The
loop only awaits. By the time ``validate_params`` runs (``validate.check_structured``), the
verdict is cached: it looks it up. A refusal is a ``VLLMValidationError``: vLLM answers that
request alone with a 400 naming the limit and the ``--limit`` flag that raises it.

The verdicts compile on the served model's own vocabulary (``serve_model``: built beside the engine
core's start, a byte vocabulary until then), and each grammar they compile goes to the disk cache: the
engine core loads it instead of compiling the same constraint again (``policy.serve_on``).
"""
from __future__ import annotations

import asyncio
import functools
import logging
import multiprocessing
import threading

from neuron_constrain.structured import ConstraintError
from neuron_constrain.structured.runtime.lanes import Lanes
from neuron_constrain.vllm import check_vllm_version, policy

check_vllm_version()

from vllm.exceptions import VLLMValidationError  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402

log = logging.getLogger("vllm.neuron_constrain")

LANE_THREADS = 2  # threads per lane (small, large); policy.VERDICT_PROCESSES worker processes compile


def refusal(kind: str, error: ConstraintError) -> VLLMValidationError:
    """The 400 for a refused constraint: the policy's message, the parameter, what was refused."""
    item = getattr(error, "unenforced", None)
    limit = getattr(error, "limit", None)
    value = f"{item.keyword} at {item.path}" if item is not None else f"limit {limit}" if limit else None
    return VLLMValidationError(policy.refusal_message(error), parameter=f"structured_outputs.{kind}", value=value)


def verdict(structured_outputs, limits) -> None:
    """The whole verdict on the calling thread (``validate_params``; the offline ``LLM``)."""
    kind = "json"
    try:
        kind, spec = policy.request_constraint(structured_outputs, limits)
        policy.admit(_constraint(kind, spec, limits), limits)
    except ConstraintError as error:
        raise refusal(kind, error) from None


def _constraint(kind: str, spec: str, limits, whitespace: str = "none"):
    from neuron_constrain.structured.schema import limits as limits_

    limits_.check_text(kind, spec, limits)  # before the text is parsed: its size and nesting
    return policy.from_vllm(kind, spec, whitespace=whitespace)


class Admission:
    """The verdicts of one API server process, on two lanes of threads."""

    def __init__(self):
        self.limits = policy.server_limits()
        self.lanes = Lanes(LANE_THREADS, name="neuron-constrain-admission")
        self.whitespace = "none"  # the served model's (serve_model), as the engine core compiles

    def warm(self) -> None:
        """Build the verdict engine now and judge one small schema in the background: the compile
        workers' start and the first compile's imports (seconds) are paid before the first request."""
        policy.verdict_engine(self.limits)
        threading.Thread(target=self._warm_verdict, daemon=True, name="neuron-constrain-admission-warm").start()

    def serve_model(self, vllm_config) -> None:
        """In the background: the verdicts move to the served model's vocabulary (the engine core's tokenizer
        and vocabulary size, its whitespace), so each grammar the admission compiles is the one the engine core
        loads from the disk cache (``policy.serve_on``); built while the engine core starts, and warmed."""
        def build():
            from vllm.tokenizers import cached_tokenizer_from_config

            from neuron_constrain.vllm.grammar_backend import served_engine, whitespace

            model = vllm_config.model_config
            if model.skip_tokenizer_init:
                return
            try:
                engine = served_engine(cached_tokenizer_from_config(model_config=model), model.get_vocab_size(),
                                       self.limits, policy.VERDICT_PROCESSES)
                self.whitespace = whitespace(vllm_config)
                policy.serve_on(engine)
            except Exception as error:  # noqa: BLE001 - the byte vocabulary keeps judging; the core compiles again
                log.warning("neuron_constrain: the admission stays on a byte vocabulary: %s", error)
                return
            self._warm_verdict()
        threading.Thread(target=build, daemon=True, name="neuron-constrain-admission-model").start()

    def _warm_verdict(self) -> None:
        try:
            policy.admit(_constraint("json", policy.WARM_SCHEMA, self.limits, self.whitespace), self.limits)
        except Exception as error:  # noqa: BLE001 - a warm-up only: the first request reports its own failure
            log.warning("neuron_constrain: warming the admission failed: %s", error)

    async def check(self, params: SamplingParams) -> None:
        so = params.structured_outputs
        if so is None or so.all_constraints_none():
            return
        loop = asyncio.get_running_loop()
        checked = await asyncio.wrap_future(self.lanes.submit(0, self._cheap, so, params.max_tokens), loop=loop)
        if checked is not None:
            kind, constraint, size = checked
            await asyncio.wrap_future(self.lanes.submit(size, self._compiled, kind, constraint), loop=loop)

    def _cheap(self, so, max_tokens: int | None):
        """The checks that cost a pass over the constraint (the limits, a cached verdict, whether its shortest
        answer fits ``max_tokens``); None when its verdict is known (admitted), else what the compilation needs."""
        kind = "json"
        try:
            kind, spec = policy.request_constraint(so, self.limits)
            constraint = _constraint(kind, spec, self.limits, self.whitespace)
            known = policy.cached_verdict(constraint, self.limits) is not None
            _fits(constraint, max_tokens)
        except ConstraintError as error:
            raise refusal(kind, error) from None
        return None if known else (kind, constraint, len(spec))

    def _compiled(self, kind: str, constraint) -> None:
        try:
            policy.admit(constraint, self.limits)
        except ConstraintError as error:
            raise refusal(kind, error) from None


def _fits(constraint, max_tokens: int | None) -> None:
    """A 400 naming ``max_tokens`` where a schema's shortest answer needs more tokens than the request may write
    (the answer could only be cut short); checked after the limits, before any compilation."""
    fewest = policy.fewest_tokens(constraint) if max_tokens is not None else None
    if fewest is not None and fewest[1] > max_tokens:
        raise VLLMValidationError(policy.too_few_tokens_message(*fewest, max_tokens), parameter="max_tokens",
                                  value=max_tokens)


_ADMISSION: Admission | None = None
_INSTALL = threading.Lock()


def admission() -> Admission:
    global _ADMISSION
    with _INSTALL:
        if _ADMISSION is None:
            _ADMISSION = Admission()
        return _ADMISSION


def admitted(so, limits) -> bool:
    """Whether ``so`` (a request's ``StructuredOutputsParams``) is a JSON schema or a regex the library's verdict
    admitted already: then the library enforces it, and vLLM's own xgrammar check (which refuses `uniqueItems`,
    `contains`, a pattern beside a length, a regex's lookaround, ... that the library enforces) is not the
    verdict. (A choice is left to vLLM's check: it rewrites the choice into a grammar.)"""
    if not so.json and not (so.regex and "\x00" not in so.regex):
        return False
    try:
        kind, spec = policy.request_constraint(so, limits)
        constraint = _constraint(kind, spec, limits, admission().whitespace)
        return kind in ("json", "regex") and policy.cached_verdict(constraint, limits) is not None
    except ConstraintError:
        return False  # refused: the verdict's own 400 comes first (add_request); vLLM's check is not needed


def _defer_vllm_check() -> None:
    """vLLM's front end validates a JSON schema with xgrammar's feature list and a regex with xgrammar's parser
    (``validate_xgrammar_grammar``: the plugin's servers name the xgrammar backend) before the plugin's
    ``validate_params``; for a schema or regex the library admitted, the library's verdict is the one that counts.
    Wrapped once, at module level: vLLM imports it inside the functions that call it."""
    from vllm.v1.structured_output import backend_xgrammar

    original = backend_xgrammar.validate_xgrammar_grammar
    if getattr(original, "neuron_constrain_admission", False):
        return

    @functools.wraps(original)
    def validate_xgrammar_grammar(sampling_params):
        so = sampling_params.structured_outputs
        if so is not None and admitted(so, admission().limits):
            return None
        return original(sampling_params)

    validate_xgrammar_grammar.neuron_constrain_admission = True
    backend_xgrammar.validate_xgrammar_grammar = validate_xgrammar_grammar


def install() -> None:
    """Wrap ``AsyncLLM.add_request`` so that a request's constraint is judged, off the event loop,
    before vLLM reads it, and vLLM's own xgrammar check defers to that verdict (idempotent)."""
    from vllm.v1.engine.async_llm import AsyncLLM

    _defer_vllm_check()
    with _INSTALL:
        original = AsyncLLM.add_request
        if getattr(original, "neuron_constrain_admission", False):
            return

        @functools.wraps(original)
        async def add_request(self, request_id, prompt, params, *args, **kwargs):
            if isinstance(params, SamplingParams):
                await admission().check(params)
            return await original(self, request_id, prompt, params, *args, **kwargs)

        add_request.neuron_constrain_admission = True
        AsyncLLM.add_request = add_request
        original_init = AsyncLLM.__init__

        @functools.wraps(original_init)
        def __init__(self, vllm_config, *args, **kwargs):
            admission().serve_model(vllm_config)  # built beside the engine core's start
            original_init(self, vllm_config, *args, **kwargs)

        AsyncLLM.__init__ = __init__
    if multiprocessing.parent_process() is None:  # the API server (vLLM's engine core and workers are its children)
        admission().warm()
