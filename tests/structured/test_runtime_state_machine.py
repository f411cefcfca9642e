"""The structured runtime as a state machine: add / remove / step / accept_rows with injected
failures, checked against a reference replay after every rule.

Injected: malformed constraints (fail at add or at compile), compilations slower than their
time limit (and fast ones queued behind them, whose limit must not start in the queue),
fills that raise or never return, tokens the grammar refuses (several rows in one step),
tokens past the vocabulary, and rows the graph flags as allowing no token (a dead end).

Invariants (after every rule):
* every live constrained request's mask row equals a fresh matcher's row after replaying
  the tokens it accepted (nothing fell behind its tokens, nothing advanced twice);
* every failed request has exactly one error, naming it, returned exactly once by
  ``accept_rows``; only requests with an injected fault (or a bad token) fail, and each
  with the error its fault calls for;
* every other request of a step's batch advanced by its token (or finished).
"""
from __future__ import annotations

import threading

import pytest
import torch
import xgrammar as xgr
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from neuron_constrain import structured as S
from neuron_constrain.kernels import unpack_bitmask
from neuron_constrain.structured import engines as E
from neuron_constrain.testing import toy_tokenizer

# what this file checks is host-side, the same on every torch: the main lane runs it (see the torch_agnostic marker)
pytestmark = pytest.mark.torch_agnostic

VOCAB = toy_tokenizer()
EOS = VOCAB.eos_id
SLOW = "slow"  # a regex marked so the injected engine compiles it slower than its time limit
POOL = [
    S.regex(r"[a-c]{1,4}(x|yz)?"),
    S.choice(["yes", "no", "maybe"]),
    S.json_schema({"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
                   "required": ["a"]}),
    S.json_schema({"type": "array", "items": {"type": "boolean"}, "maxItems": 2}),
    None,
]
TIMEOUT, FILL_TIMEOUT = 0.4, 1.0  # seconds; a real fill of POOL's grammars on the toy vocabulary takes 1-3 us
BOUND = 30.0  # seconds: no event wait below lasts longer (a bug fails the test, it never hangs CI)
HANG = threading.Event()  # set at teardown: hung fills return
HUNG_STARTED = threading.Event()  # a hung fill has started on a fill thread
STRAGGLER_WROTE = threading.Event()  # a hung fill woke up and wrote its row
FIRED = {"raise": 0, "hang": 0}  # injected fills that ran: the faults must fire, or the machine proves nothing


class _SlowCompiles:
    """The runtime's engine with compilations of SLOW-marked regexes held past their limit: each
    blocks until ``release(spec)`` — which the machine calls once the runtime has failed the
    request (or it was removed) — so it is past its limit however loaded the machine is, and
    the compilations queued behind it then start. Every other grammar is compiled by ``prepare``
    before its request is added, off the runtime's clock: its timed compile is then a lookup, so
    no request without a fault passes its limit however loaded the machine is (a real compile of
    POOL's schema takes 35 ms, TIMEOUT is 0.4 s: a shared CI core once stretched one past it)."""

    def __init__(self, engine):
        self.engine = engine
        self.releases: dict[str, threading.Event] = {}
        self.prepared: dict = {}
        self.lock = threading.Lock()

    def prepare(self, constraint) -> None:
        if constraint is not None and constraint.key not in self.prepared:
            self.prepared[constraint.key] = self.engine.compile(constraint)

    def _event(self, spec: str) -> threading.Event:
        with self.lock:
            return self.releases.setdefault(spec, threading.Event())

    def release(self, spec: str) -> None:
        self._event(spec).set()

    def release_all(self) -> None:
        with self.lock:
            for event in self.releases.values():
                event.set()

    def compile(self, constraint):
        if constraint.kind == "regex" and SLOW in constraint.spec:
            assert self._event(constraint.spec).wait(BOUND), f"{constraint.spec} was never released"
        prepared = self.prepared.get(constraint.key)
        return prepared if prepared is not None else self.engine.compile(constraint)


def _faulty(matcher, fault: str):
    """``matcher`` (same state) whose fills raise ("raise"), never return off the calling thread
    ("hang"), or take 0.5 s on the calling thread ("slow")."""
    base = type(matcher)

    class Faulty(base):
        __slots__ = () if hasattr(base, "__slots__") else ()

        def fill_next_token_bitmask(self, buffer, row=0):
            FIRED[fault] = FIRED.get(fault, 0) + 1
            on_caller = threading.current_thread() is threading.main_thread()
            if fault == "raise":
                raise RuntimeError("injected fill failure")
            if fault == "hang" and not on_caller:
                HUNG_STARTED.set()
                HANG.wait()
                result = base.fill_next_token_bitmask(self, buffer, row)
                STRAGGLER_WROTE.set()
                return result
            if fault == "slow" and on_caller:  # held until a fill thread has taken a later row
                assert HUNG_STARTED.wait(BOUND), "no fill thread took the hung row"
            return base.fill_next_token_bitmask(self, buffer, row)

    copy = object.__new__(Faulty)
    for name in getattr(base, "__slots__", ()):
        object.__setattr__(copy, name, getattr(matcher, name))
    if hasattr(matcher, "__dict__"):
        copy.__dict__.update(matcher.__dict__)
    return copy


class _Faults:
    """The engine seen by the runtime: matchers of fault-marked requests are made faulty."""

    def __init__(self, engine, marks: dict):
        self._engine, self.marks = engine, marks

    def matcher(self, compiled):
        matcher = self._engine.matcher(compiled)
        fault = self.marks.get(compiled.constraint.key)
        return _faulty(matcher, fault) if fault else matcher

    def __getattr__(self, name):
        return getattr(self._engine, name)


class _Model:
    """The truth per request: its constraint, the tokens it accepted, how it ended."""

    def __init__(self, constraint, fault):
        self.constraint, self.fault = constraint, fault
        self.tokens: list[int] = []
        self.finished = False
        self.failed: type | None = None  # the error class it failed with
        self.reports = 0  # times accept_rows returned its failure


class RuntimeMachine(RuleBasedStateMachine):
    ENGINE, THREADS = "xgrammar", 2

    def __init__(self):
        super().__init__()
        self.runtime = S.StructuredRuntime(
            VOCAB, max_rows=6, engine=self.ENGINE, fill_threads=self.THREADS, parallel_min_rows=2,
            compile_workers=1, compile_timeout=TIMEOUT, fill_timeout=FILL_TIMEOUT,
        )
        self.reference = E.make_engine(self.ENGINE, VOCAB)
        self.marks: dict = {}
        self.slow = self.runtime.compiled.engine = _SlowCompiles(self.runtime.engine)  # what compiles
        self.runtime.requests.engine = _Faults(self.runtime.engine, self.marks)  # what makes each request's matcher
        self.models: dict[int, _Model] = {}
        self.next_id = 0
        self.compiled: dict = {}

    def teardown(self):
        HANG.set()
        self.slow.release_all()
        self.runtime.close()
        self.reference.close()
        HANG.clear()

    # ------------------------------------------------------------------ rules
    @precondition(lambda self: len(self.models) < 8)
    @rule(kind=st.integers(0, len(POOL) - 1),
          fault=st.sampled_from([None, None, None, "syntax", "slow", "raise", "hang"]))
    def add(self, kind, fault):
        request_id, self.next_id = self.next_id, self.next_id + 1
        constraint = POOL[kind]
        if fault == "syntax":
            constraint = S.regex(f"(unclosed{request_id}")
        elif fault == "slow":
            constraint = S.regex(f"{SLOW}{request_id}")
        elif fault in ("raise", "hang"):
            constraint = S.regex(f"{fault}{request_id}[0-9]+")  # its own key: only this request is faulty
            self.marks[constraint.key] = fault
        elif constraint is None:
            fault = None
        if fault not in ("syntax", "slow"):
            self.slow.prepare(constraint)
        self.runtime.add(request_id, constraint)
        self.models[request_id] = _Model(constraint, fault)

    @precondition(lambda self: self.models)
    @rule(data=st.data())
    def remove(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.models)))
        self.runtime.remove(request_id)
        model = self.models.pop(request_id)
        if model.fault == "slow":  # nothing waits for it now: let the compilations queued behind it start
            self.slow.release(model.constraint.spec)

    @precondition(lambda self: self.models)
    @rule(data=st.data())
    def step(self, data):
        # Every draw below has the same shape whatever the threads did (hypothesis replays draws):
        # compilations are waited for (their outcome does not depend on timing: a slow one is held
        # until the runtime has failed it past its limit), the batch is drawn from all requests,
        # then cut to the ready ones.
        ids = sorted(self.models)
        while any(self.runtime.error(r) is None and r not in self.runtime.ready([r]) for r in ids):
            self.runtime.wait(ids, timeout=1.0)
            for request_id in ids:
                model = self.models[request_id]
                if model.fault == "slow" and self.runtime.error(request_id) is not None:
                    self.slow.release(model.constraint.spec)
        size = data.draw(st.integers(1, min(len(ids), self.runtime.max_rows)), label="size")
        order = data.draw(st.permutations(ids), label="order")[:size]
        ready = set(self.runtime.ready(ids))
        batch = [r for r in order if r in ready]
        draws = [(data.draw(st.sampled_from(["good", "good", "stop", "refused", "refused", "past", "empty"]), label="token"),
                  data.draw(st.integers(0, 10**6), label="pick")) for _ in order]
        if not batch:
            return
        mask = self.runtime.step(batch)
        assert mask.shape == (len(batch), self.runtime.width)
        tokens, empty, expect = [], [], {}
        for row, (request_id, (choice, pick)) in enumerate(zip(batch, draws)):
            model = self.models[request_id]
            allowed = unpack_bitmask(mask[row], VOCAB.vocab_size).nonzero().flatten().tolist()
            refused = sorted(set(range(VOCAB.vocab_size)) - set(allowed))
            if model.failed is not None or model.finished or not allowed:
                token, flag = EOS, False  # padding its slot (a failed request's row allows only EOS)
            elif choice == "past":
                token, flag = VOCAB.vocab_size + 3, False
            elif choice == "empty":
                token, flag = 0, True
            elif choice == "refused" and model.constraint is not None and refused:
                token, flag = refused[pick % len(refused)], False
            elif choice == "stop" and EOS in allowed:
                token, flag = EOS, False
            else:
                token, flag = allowed[pick % len(allowed)], False
            tokens.append(token)
            empty.append(flag)
            expect[request_id] = (token, flag, choice)
        result = self.runtime.accept_rows(batch, tokens, empty=empty)
        for request_id in batch:
            model = self.models[request_id]
            token, flag, choice = expect[request_id]
            if request_id in result.failed:
                error = result.failed[request_id]
                model.reports += 1
                assert isinstance(error, S.RequestFailedError) and error.request_id == request_id
                assert repr(request_id) in str(error)
                if model.failed is None:
                    model.failed = self._expected_failure(model, token, flag, choice, error)
                continue
            if model.failed is not None or model.finished:
                continue
            # not failed: it advanced by its token (and the fault, if any, did not fire)
            assert model.fault in (None, "hang"), (request_id, model.fault, "should have failed")
            assert not flag and 0 <= token < VOCAB.vocab_size, (request_id, token, flag)
            if model.constraint is not None:
                assert token in set(unpack_bitmask(mask[batch.index(request_id)], VOCAB.vocab_size)
                                    .nonzero().flatten().tolist())
                model.tokens.append(token)
            if token == EOS:
                model.finished = True
                assert request_id in result.finished

    def _expected_failure(self, model, token, flag, choice, error):
        """The one error class this request could fail with, given its fault and its token."""
        if isinstance(error, S.GrammarFailedError):
            assert model.fault in ("syntax", "slow"), (model.fault, str(error))
            if model.fault == "slow":
                assert "did not compile within" in str(error)
        elif isinstance(error, S.GrammarFillError):
            assert model.fault in ("raise", "hang"), (model.fault, str(error))
        elif isinstance(error, S.NoAllowedTokenError):
            assert flag
        elif isinstance(error, S.DisallowedTokenError):
            assert error.token == token and (choice in ("past", "refused")), (choice, token, str(error))
        else:
            raise AssertionError(f"unexpected error {error!r}")
        return type(error)

    # ------------------------------------------------------------------ invariants
    @invariant()
    def failures_are_single_and_named(self):
        for request_id, model in self.models.items():
            error = self.runtime.error(request_id)
            if model.failed is not None:
                assert isinstance(error, model.failed) and error.request_id == request_id
                assert model.reports == 1, (request_id, model.reports)
            assert model.reports <= 1
            if error is not None and model.failed is None:  # failed, not yet returned by an accept_rows
                assert model.fault is not None, (request_id, str(error))

    @invariant()
    def live_grammars_are_where_their_tokens_put_them(self):
        for request_id, model in self.models.items():
            if model.constraint is None or model.failed or model.finished or model.fault:
                continue  # (faulty matchers are checked by their failures; a step here would fire them)
            if self.runtime.error(request_id) is not None or request_id not in self.runtime.ready([request_id]):
                continue
            compiled = self.compiled.get(model.constraint.key)
            if compiled is None:
                compiled = self.compiled[model.constraint.key] = self.reference.compile(model.constraint)
            fresh = self.reference.matcher(compiled)
            for token in model.tokens:
                assert fresh.accept_token(token), (request_id, model.tokens)
            want = torch.zeros((1, self.reference.width), dtype=torch.int32)
            fresh.fill_next_token_bitmask(want, 0)
            got = self.runtime.step([request_id])
            assert torch.equal(got[0], want[0]), (request_id, model.constraint.describe(), model.tokens)


class LLGuidanceRuntimeMachine(RuntimeMachine):
    ENGINE, THREADS = "llguidance", 1


SETTINGS = settings(max_examples=25, stateful_step_count=12, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@pytest.mark.parametrize("machine", [RuntimeMachine, LLGuidanceRuntimeMachine], ids=["xgrammar-2-threads", "llguidance"])
def test_runtime_state_machine(machine):
    FIRED.update({"raise": 0, "hang": 0})
    machine.TestCase.settings = SETTINGS
    machine.TestCase().runTest()
    assert FIRED["raise"] > 0 and FIRED["hang"] > 0, FIRED


def test_xgrammar_matchers_can_be_made_faulty():
    """The fault injection itself works on both matcher types (else the machine proves nothing)."""
    for name in E.ENGINES:
        engine = E.make_engine(name, VOCAB)
        matcher = _faulty(engine.matcher(engine.compile(S.regex("[0-9]+"))), "raise")
        assert matcher.accept_token(VOCAB.encode("1")[0])
        with pytest.raises(RuntimeError, match="injected"):
            matcher.fill_next_token_bitmask(torch.zeros((1, engine.width), dtype=torch.int32), 0)
        assert isinstance(matcher, xgr.GrammarMatcher) == (name == "xgrammar")


def test_two_refused_rows_and_a_token_past_the_vocabulary_fail_alone_in_one_step():
    """The issue's case: two rows refused and one past the vocabulary in one accept_rows; the others
    advance, each failure names its request and token, and the finished list is not lost."""
    runtime = S.StructuredRuntime(VOCAB, max_rows=5)
    constraint = S.choice(["yes", "no"])
    for request_id in "abcde":
        runtime.add(request_id, None if request_id == "e" else constraint)
    runtime.wait(list("abcde"))
    runtime.step(list("abcde"))
    yes, x = VOCAB.encode("yes")[0], VOCAB.encode("x")[0]
    result = runtime.accept_rows(list("abcde"), [x, yes, VOCAB.vocab_size + 3, x, EOS])
    assert sorted(result.failed) == ["a", "c", "d"] and result.finished == ["e"]
    for request_id, token in (("a", x), ("c", VOCAB.vocab_size + 3), ("d", x)):
        error = result.failed[request_id]
        assert isinstance(error, S.DisallowedTokenError) and error.token == token and f"{request_id!r}" in str(error)
        assert runtime.error(request_id) is error
    assert runtime.accept("b", [EOS])  # b advanced by "yes": only the stop token is left
    assert runtime.accept_rows(list("abcd"), [EOS] * 4).failed == {}  # each failure returned once


def test_a_hung_fill_thread_fails_its_request_alone_and_the_runtime_keeps_serving():
    """The fill thread hangs on request "hung": that request fails with a fill error naming it,
    the others get their rows and tokens, the runtime moves to a fresh buffer (the straggler
    writes into the old one when it wakes), and the next steps need no new runtime."""
    for event in (HANG, HUNG_STARTED, STRAGGLER_WROTE):  # (a state machine run may have set them)
        event.clear()
    runtime = S.StructuredRuntime(VOCAB, max_rows=4, fill_threads=2, parallel_min_rows=2, fill_timeout=0.3,
                                  engine="xgrammar")  # its batch fill on the fill threads
    constraint = S.regex(r"[0-9]{1,3}")
    batch = ["slow", "hung", "c", "d"]
    for request_id in batch:
        runtime.add(request_id, constraint)
    runtime.wait(batch)
    states = runtime.requests.states  # fault injection: the first row is slow on the caller (so the fill
    states["slow"].matcher = _faulty(states["slow"].matcher, "slow")  # thread takes the next rows), the
    states["hung"].matcher = _faulty(states["hung"].matcher, "hang")  # second hangs on the fill thread
    reference = E.make_engine("xgrammar", VOCAB)
    start = torch.zeros((1, reference.width), dtype=torch.int32)
    reference.matcher(reference.compile(constraint)).fill_next_token_bitmask(start, 0)
    old = runtime.buffer
    try:
        mask = runtime.step(batch)
        assert runtime.buffer is not old and mask.data_ptr() == runtime.buffer.data_ptr()
        assert _allowed(mask[1]) == [EOS]  # the failed request's row: stop only
        assert all(torch.equal(mask[row], start[0]) for row in (0, 2, 3))
        one = VOCAB.encode("1")[0]
        result = runtime.accept_rows(batch, [one, EOS, one, one])
        assert list(result.failed) == ["hung"] and isinstance(result.failed["hung"], S.GrammarFillError)
        assert "'hung'" in str(result.failed["hung"]) and "within 0.3 s" in str(result.failed["hung"])
        live = runtime.buffer.clone()
        HANG.set()  # the straggler wakes and writes its row into the abandoned buffer, not the live one
        assert STRAGGLER_WROTE.wait(BOUND)
        assert torch.equal(runtime.buffer, live)
        mask = runtime.step(["slow", "c", "d"])
        after = reference.matcher(reference.compile(constraint))
        after.accept_token(one)
        after.fill_next_token_bitmask(start, 0)
        assert all(torch.equal(mask[row], start[0]) for row in range(3))
        assert runtime.accept_rows(["slow", "c", "d"], [one] * 3).failed == {}
    finally:
        HANG.set()
        runtime.close()
        for event in (HANG, HUNG_STARTED, STRAGGLER_WROTE):
            event.clear()


def _allowed(row) -> list[int]:
    return unpack_bitmask(row, VOCAB.vocab_size).nonzero().flatten().tolist()
