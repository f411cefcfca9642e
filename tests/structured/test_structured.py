"""The structured-outputs runtime: mixed batches against per-request xgrammar masks,
regex / choice / EBNF / tool calling end to end, the enable switch, and the errors."""
from __future__ import annotations

import re
import threading
import time

import pytest
import torch
import xgrammar as xgr
from conftest import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from neuron_constrain import structured as S
from neuron_constrain.structured import engines as E
from neuron_constrain.kernels import unpack_bitmask
from neuron_constrain.structured.engines.xgrammar.grammars import compile_grammar, xgrammar_info
from neuron_constrain.testing import GreedyStep, tiny_decoder, toy_tokenizer, weather_tool

# what this file checks is host-side, the same on every torch: the main lane runs it (see the torch_agnostic marker)
pytestmark = pytest.mark.torch_agnostic

MODEL_VOCAB = 768
BATCH = torch.export.Dim("batch")

WEATHER = weather_tool(10)
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 12}}, "required": ["query"]},
    },
}
TOOLS = [WEATHER, SEARCH]


@pytest.fixture(scope="module")
def vocab():
    return toy_tokenizer()


@pytest.fixture(scope="module")
def greedy(vocab):
    model = tiny_decoder("llama", vocab_size=MODEL_VOCAB, seed=1)
    ids = torch.zeros(2, 8, dtype=torch.long)
    step = GreedyStep(model)
    enabled = S.transform_decoder(step, (ids,), vocab_size=vocab.vocab_size, dynamic_shapes=({0: BATCH},))
    disabled = S.transform_decoder(
        step, (ids,), vocab_size=vocab.vocab_size, enable_structured_outputs=False, dynamic_shapes=({0: BATCH},)
    )
    return enabled, disabled


# ----------------------------------------------------------------------------- end to end


def test_regex_choice_ebnf_outputs_match(greedy, vocab):
    enabled, _ = greedy
    patterns = [r"[a-z]{2,5}@[a-z]{2,4}\.com", r"(19|20)[0-9]{2}-[01][0-9]", r"-?[0-9]{1,3}(\.[0-9])?", r"(yes|no), [A-Z][a-z]{0,6}\."]
    choices = [["yes", "no", "maybe"], ["red", "green", "blue", 'say "hi"'], ["café", "naïve", "a\\b"]]
    grammar = 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "x"'
    constraints = [S.regex(p) for p in patterns] + [S.choice(c) for c in choices] + [S.ebnf(grammar)]
    result = S.generate(enabled, ["pick:", "x"] * 4, constraints, 30, tokenizer=vocab)
    for constraint, out in zip(constraints, result.outputs):
        assert out.finish_reason == "stop", (constraint.describe(), out.text)
        assert S.validate_output(constraint, out.text) is None, (constraint.describe(), out.text)
    assert re.fullmatch(r"\(([0-9]|x)(,([0-9]|x))*\)", result.outputs[-1].text)


def test_tool_choice_required_and_named(greedy, vocab):
    enabled, _ = greedy
    required = S.tool_constraint(TOOLS, "required")
    named = S.tool_constraint(TOOLS, {"type": "function", "function": {"name": "search"}})
    # one engine: auto races the tools' bounded strings (exact on both engines), and the engine serving each token
    # decides which tokenizations a random model may pick (llguidance forces canonical ones), so how long it writes
    result = S.generate(enabled, ["call a tool", "search"], [required, named], 60, tokenizer=vocab, engine="llguidance")
    for choice_, out in zip(["required", {"type": "function", "function": {"name": "search"}}], result.outputs):
        assert out.finish_reason == "stop", out.text
        content, calls = S.parse_tool_calls(out.text, TOOLS, choice_)
        assert content == "" and calls
        for call in calls:
            import jsonschema

            params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.name]
            jsonschema.validate(call.arguments, params)
    assert S.parse_tool_calls(result.outputs[1].text, TOOLS, {"type": "function", "function": {"name": "search"}})[1][0].name == "search"


def test_tool_choice_auto_and_none_parse_free_text():
    assert S.tool_constraint(TOOLS, "auto") is None and S.tool_constraint(TOOLS, "none") is None
    text = 'Let me check. {"name": "get_weather", "arguments": {"location": "Paris", "unit": "celsius"}} and {"x": 1} done'
    content, calls = S.parse_tool_calls(text, TOOLS, "auto")
    assert [c.name for c in calls] == ["get_weather"] and calls[0].arguments["location"] == "Paris"
    assert content == 'Let me check.  and {"x": 1} done'
    content, calls = S.parse_tool_calls('[{"name": "search", "parameters": {"query": "q"}}, {"name": "search", "arguments": "{\\"query\\": \\"r\\"}"}]', TOOLS)
    assert [c.arguments["query"] for c in calls] == ["q", "r"] and content == ""
    assert S.parse_tool_calls(text, TOOLS, "none") == (text, [])
    assert S.parse_tool_calls('{"name": "unknown", "arguments": {}} {broken', TOOLS)[1] == []


def test_padded_columns_never_chosen_unconstrained(greedy, vocab):
    enabled, _ = greedy
    result = S.generate(enabled, ["a", "b", "c", "d"], [None] * 4, 20, tokenizer=vocab)
    assert all(t < vocab.vocab_size for out in result.outputs for t in out.tokens)
    assert len(result.step_host_seconds) == max(len(o.tokens) for o in result.outputs)


# ----------------------------------------------------------------------------- enable switch


def test_disabled_graph_has_no_mask_and_refuses_constraints(greedy, vocab):
    enabled, disabled = greedy
    assert [i.name for i in enabled.report.inputs_added] == ["logit_mask"]
    assert disabled.report.inputs_added == [] and "logit_mask" not in disabled.report.passes
    with pytest.raises(S.StructuredOutputsDisabledError, match="enable_structured_outputs=True"):
        S.generate(disabled, ["a", "b"], [None, S.json_schema({"type": "boolean"})], 5, tokenizer=vocab)
    runtime = S.StructuredRuntime.for_model(disabled, vocab.info, max_rows=2)
    assert not runtime.enabled
    runtime.add("plain")
    assert runtime.step(["plain"]) is None
    with pytest.raises(S.StructuredOutputsDisabledError, match="request 'r'"):
        runtime.add("r", S.regex("[0-9]+"))
    # Unconstrained traffic runs: the same tokens as the enabled graph fed all-allowed rows.
    ids = torch.randint(0, vocab.vocab_size, (3, 8), generator=torch.Generator().manual_seed(0))
    plain = disabled(ids)
    masked = enabled(ids)
    ok = plain < vocab.vocab_size
    assert torch.equal(plain[ok], masked[ok])


# ----------------------------------------------------------------------------- errors


def test_disallowed_token_names_request_and_token_and_changes_nothing(vocab):
    runtime = S.StructuredRuntime(vocab.info, max_rows=4)
    runtime.add("req-7", S.choice(["yes", "no"]))
    before = runtime.step(["req-7"]).clone()
    bad = vocab.encode("x")[0]
    with pytest.raises(S.DisallowedTokenError, match=r"request 'req-7' .* got token %d \(b'x'\)" % bad) as info:
        runtime.accept("req-7", [vocab.encode("y")[0], bad])
    assert info.value.request_id == "req-7" and info.value.token == bad
    assert torch.equal(runtime.step(["req-7"]), before)  # the good "y" was rolled back too
    with pytest.raises(S.DisallowedTokenError, match="vocab_size=%d" % vocab.vocab_size):
        runtime.accept("req-7", [vocab.vocab_size + 3])  # a padded lm_head column
    assert runtime.accept("req-7", vocab.encode("no") + [vocab.eos_id])
    assert runtime.accept("req-7", [vocab.eos_id])  # a finished request padding its slot
    with pytest.raises(S.DisallowedTokenError, match="already finished"):
        runtime.accept("req-7", [bad])


def test_layout_errors(vocab):
    runtime = S.StructuredRuntime(vocab.info, max_rows=3)
    runtime.add("a", S.regex("[0-9]+"))
    runtime.add("b")
    with pytest.raises(S.BatchLayoutError, match="request 'zz' is not in the runtime"):
        runtime.step(["a", "zz"])
    with pytest.raises(S.BatchLayoutError, match="names a request twice"):
        runtime.step(["a", "a"])
    with pytest.raises(S.BatchLayoutError, match=r"needs 4 mask rows .* max_rows>=4"):
        runtime.step(["a", "b"], drafts={"a": [1, 2]})
    before = runtime.step(["a"]).clone()
    with pytest.raises(S.BatchLayoutError, match="draft token 99999"):
        runtime.step(["a"], drafts={"a": [vocab.encode("1")[0], 99999]})
    assert torch.equal(runtime.step(["a"]), before)  # the accepted draft "1" was rolled back: the grammar is where it was
    assert not runtime.accept("a", vocab.encode("12"))  # and it still takes a whole number from the start
    with pytest.raises(S.BatchLayoutError, match="already in the runtime"):
        runtime.add("a")
    runtime.remove("a")
    with pytest.raises(S.BatchLayoutError, match="never added, or removed already"):
        runtime.remove("a")
    with pytest.raises(S.BatchLayoutError, match="one token per request"):
        runtime.accept_rows(["b"], [1, 2])


def test_width_mismatch_and_bad_constraints(greedy, vocab):
    enabled, _ = greedy
    with pytest.raises(ValueError, match=r"transform with vocab_size=1000"):
        S.StructuredRuntime.for_model(enabled, toy_tokenizer(1000).info, max_rows=2)
    runtime = S.StructuredRuntime(vocab.info, max_rows=1)
    runtime.add("r", S.regex("(unclosed"))  # fails the request (once its compilation ran), never the caller
    assert runtime.wait(["r"]) == [] and isinstance(runtime.error("r"), S.GrammarFailedError)
    assert "an unclosed `(` at offset 0" in str(runtime.error("r")) and "request 'r'" in str(runtime.error("r"))
    with pytest.raises(S.ConstraintError, match="non-empty strings"):
        S.choice([])
    with pytest.raises(S.ConstraintError, match="add it to tools"):
        S.tool_constraint(TOOLS, {"type": "function", "function": {"name": "nope"}})
    with pytest.raises(S.ConstraintError, match="not an OpenAI function tool"):
        S.tool_constraint([{"name": "x"}], "required")
    with pytest.raises(S.ConstraintError, match="no tools"):
        S.tool_constraint([], "required")


def test_length_bounded_strings_reject_control_characters(vocab):
    """xgrammar 0.2.8 lets raw control characters into minLength/maxLength strings; we do not."""
    compiler = xgr.GrammarCompiler(xgrammar_info(vocab.info), max_threads=1)
    for compact in (True, False):
        constraint = S.json_schema({"type": ["string", "null"], "maxLength": 4}, compact=compact)
        assert not xgr.GrammarMatcher(compile_grammar(compiler, constraint)).accept_string('"a\x06')
        assert xgr.GrammarMatcher(compile_grammar(compiler, constraint)).accept_string('"a\u00e9"')
    raw = compiler.compile_json_schema({"type": ["string", "null"], "maxLength": 4}, any_whitespace=False)
    assert xgr.GrammarMatcher(raw).accept_string('"a\x06')  # the upstream behaviour this guards against


# ----------------------------------------------------------------------------- mixed batches


POOL = [
    S.json_schema({"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}}, "required": ["a"]}),
    S.json_schema({"anyOf": [{"type": "string", "maxLength": 3}, {"type": "null"}]}, compact=False),
    S.regex(r"[a-c]{1,4}(x|yz)?"),
    S.choice(["yes", "no", "maybe"]),
    S.any_json(),
    None,
    None,
]


class _Reference:
    """The per-request truth: a fresh xgrammar matcher per row over the accepted history."""

    def __init__(self, vocab, compiled):
        self.vocab, self.compiled = vocab, compiled
        self.history: list[int] = []
        self.finished = False

    def _matcher(self, tokens):
        matcher = xgr.GrammarMatcher(self.compiled)
        for token in tokens:
            if not matcher.accept_token(token):
                return None
        return matcher

    def row(self, drafts_before: list[int]) -> torch.Tensor:
        """Allowed tokens [V] after history + the longest prefix of drafts the grammar takes."""
        accepted = []
        for token in drafts_before:
            if self._matcher(self.history + accepted + [token]) is None:
                break
            accepted.append(token)
        matcher = self._matcher(self.history + accepted)
        if self.finished or matcher.is_terminated():
            allowed = torch.zeros(self.vocab.vocab_size, dtype=torch.bool)
            allowed[self.vocab.eos_id] = True
            return allowed
        bitmask = xgr.allocate_token_bitmask(1, self.vocab.vocab_size)
        matcher.fill_next_token_bitmask(bitmask)
        return unpack_bitmask(bitmask[0], self.vocab.vocab_size)


@pytest.fixture(scope="module")
def compiled(vocab):
    compiler = xgr.GrammarCompiler(xgrammar_info(vocab.info), max_threads=1)
    return [None if c is None else compile_grammar(compiler, c) for c in POOL]


@settings(max_examples=examples(30))
@given(data=st.data())
def test_mixed_batch_rows_equal_per_request_masks(vocab, compiled, data):
    V = vocab.vocab_size
    runtime = S.StructuredRuntime(vocab.info, max_rows=12)
    references: dict[int, _Reference | None] = {}
    kinds: dict[int, int] = {}
    next_id = 0
    for _ in range(data.draw(st.integers(2, 7), label="steps")):
        # join
        for kind in data.draw(st.lists(st.integers(0, len(POOL) - 1), min_size=0 if references else 1, max_size=3), label="join"):
            runtime.add(next_id, POOL[kind])
            references[next_id] = None if POOL[kind] is None else _Reference(vocab, compiled[kind])
            kinds[next_id] = kind
            next_id += 1
        # leave (finished or not)
        for request in data.draw(st.lists(st.sampled_from(sorted(references)), unique=True, max_size=2), label="leave"):
            if len(references) > 1:
                runtime.remove(request)
                del references[request]
        batch = data.draw(st.permutations(sorted(references)), label="order")[: data.draw(st.integers(1, 5))]
        drafts: dict[int, list[int]] = {}
        for request in batch:
            reference = references[request]
            count = data.draw(st.integers(0, 2), label="drafts")
            tokens = []
            for _ in range(count):
                if reference is not None and data.draw(st.booleans(), label="valid draft"):
                    allowed = reference.row(tokens).nonzero().flatten().tolist()
                    tokens.append(data.draw(st.sampled_from(allowed)))
                else:
                    tokens.append(data.draw(st.integers(0, V - 1)))
            if tokens:
                drafts[request] = tokens
        if sum(1 + len(drafts.get(r, ())) for r in batch) > runtime.max_rows:
            continue
        mask = runtime.step(batch, drafts)
        row = 0
        for request in batch:
            draft = drafts.get(request, [])
            for i in range(1 + len(draft)):
                if references[request] is None:
                    assert bool((mask[row] == -1).all()), f"unconstrained request {request} row {i} is not -1"
                else:
                    want = references[request].row(draft[:i])
                    got = unpack_bitmask(mask[row], V)
                    assert torch.equal(got, want), f"request {request} ({POOL[kinds[request]].describe()}) row {i} drafts {draft}"
                row += 1
        assert row == mask.shape[0]
        # accept a sampled token per request (sometimes the stop token when it is allowed)
        for request in batch:
            reference = references[request]
            if reference is None:
                token = data.draw(st.sampled_from([vocab.eos_id, 65, 700]), label="free token")
                runtime.accept(request, [token])
                if token == vocab.eos_id:
                    runtime.remove(request)
                    del references[request]
                continue
            allowed = reference.row([]).nonzero().flatten().tolist()
            token = vocab.eos_id if vocab.eos_id in allowed and data.draw(st.booleans()) else data.draw(st.sampled_from(allowed))
            finished = runtime.accept(request, [token])
            if not reference.finished:
                reference.history.append(token)
            reference.finished = reference.finished or token == vocab.eos_id
            assert finished == reference.finished



@settings(max_examples=examples(40), deadline=None)
@given(data=st.data())
def test_reused_layouts_follow_finishes_joins_and_other_batches(vocab, compiled, data):
    """step() reuses a batch's layout while nothing changed (the decode loop's usual case);
    a finish, a join in a freed row (even under a reused id), a reorder, or a step of
    another batch in between must all show in the next mask, row by row."""
    V, eos = vocab.vocab_size, vocab.eos_id
    runtime = S.StructuredRuntime(vocab.info, max_rows=6)
    references: dict[int, _Reference | None] = {}
    free_finished: set[int] = set()  # unconstrained requests that took the stop token
    next_id = 0

    def join(request_id=None) -> int:
        nonlocal next_id
        if request_id is None:
            request_id, next_id = next_id, next_id + 1
        kind = data.draw(st.integers(0, len(POOL) - 1), label="kind")
        runtime.add(request_id, POOL[kind])
        references[request_id] = None if POOL[kind] is None else _Reference(vocab, compiled[kind])
        free_finished.discard(request_id)
        return request_id

    def check(batch, mask):
        assert mask.shape[0] == len(batch)
        for row, request in enumerate(batch):
            if references[request] is None:
                assert bool((mask[row] == -1).all()), f"unconstrained request {request} (row {row}) is not -1"
            else:
                got = unpack_bitmask(mask[row], V)
                assert torch.equal(got, references[request].row([])), f"request {request} row {row}"

    slots = [join() for _ in range(data.draw(st.integers(1, 5), label="batch"))]
    for _ in range(data.draw(st.integers(2, 10), label="steps")):
        event = data.draw(st.sampled_from(["same", "same", "same", "replace", "reorder", "other batch"]), label="event")
        if event == "replace":  # a request leaves; a new one joins in its row (sometimes under the same id)
            position = data.draw(st.integers(0, len(slots) - 1), label="position")
            runtime.remove(slots[position])
            del references[slots[position]]
            with pytest.raises(S.BatchLayoutError, match="not in the runtime"):
                runtime.step(slots)  # the old layout names a request that left
            slots[position] = join(slots[position] if data.draw(st.booleans(), label="reuse id") else None)
        elif event == "reorder":
            slots = data.draw(st.permutations(slots), label="order")
        elif event == "other batch":  # e.g. another micro-batch stepped in between
            other = data.draw(st.lists(st.sampled_from(slots), unique=True, min_size=1), label="other")
            check(other, runtime.step(other))
        batch = list(slots)
        check(batch, runtime.step(batch))
        tokens, finishing = [], set()
        for request in batch:
            reference = references[request]
            if reference is None:
                token = eos if request in free_finished else data.draw(st.sampled_from([eos, 65, 700]), label="free")
                if token == eos and request not in free_finished:
                    finishing.add(request)
                    free_finished.add(request)
            else:
                allowed = reference.row([]).nonzero().flatten().tolist()
                token = eos if eos in allowed and data.draw(st.booleans(), label="stop") else data.draw(st.sampled_from(allowed))
                if not reference.finished:
                    reference.history.append(token)
                    if token == eos:
                        finishing.add(request)
                reference.finished = reference.finished or token == eos
            tokens.append(token)
        if data.draw(st.booleans(), label="one by one"):
            assert {r for r, t in zip(batch, tokens) if runtime.accept(r, [t]) and r in finishing} == finishing
        else:
            assert set(runtime.accept_rows(batch, tokens).finished) == finishing


def test_parallel_and_direct_fills_write_the_same_rows(vocab):
    """Batch 1 (the matcher directly), a few rows on this thread, and the threaded batch fill agree."""
    texts = ['{"a": 1', '{"a": 12, "b": [tr', '"ab', 'ye', '[1, ', "cc", '{"a": ', "m"]
    constraints = [POOL[0], POOL[0], POOL[1], POOL[3], POOL[4], POOL[2], POOL[0], POOL[3]]
    masks = []
    for threads, min_rows in [(1, 2), (2, 2), (2, 16)]:
        runtime = S.StructuredRuntime(vocab.info, max_rows=8, fill_threads=threads, parallel_min_rows=min_rows)
        for index, (constraint, text) in enumerate(zip(constraints, texts)):
            runtime.add(index, constraint)
            runtime.accept(index, vocab.encode(text))
        masks.append(runtime.step(list(range(8))[::-1]).clone())
        singles = [runtime.step([i]).clone() for i in range(8)]
        assert torch.equal(torch.cat(singles[::-1]), masks[-1])
        runtime.close()
    assert torch.equal(masks[0], masks[1]) and torch.equal(masks[0], masks[2])
    assert len({tuple(row.tolist()) for row in masks[0]}) >= 6  # distinct states, so a row mix-up would show


class _SlowRow:
    """A stand-in matcher: fills its row with its id after ``seconds``, records the thread, may fail."""

    def __init__(self, value: int, seconds: float = 0.0, fail: bool = False, hang: threading.Event | None = None):
        self.value, self.seconds, self.fail, self.hang, self.thread = value, seconds, fail, hang, None

    def fill_next_token_bitmask(self, buffer, row):
        self.thread = threading.current_thread()
        if self.hang is not None and self.thread is not threading.main_thread():
            self.hang.wait(10)
        time.sleep(self.seconds)  # releases the GIL, as xgrammar's fill does
        if self.fail:
            raise ValueError(f"row {row} failed")
        buffer[row] = self.value


def test_fill_threads_fill_every_row_and_report_each_failure_with_its_row():
    fillers = E.RowFillers(2)
    try:
        buffer = torch.zeros(20, 4, dtype=torch.int32)
        rows = [_SlowRow(i + 1, seconds=0.005) for i in range(20)]
        assert fillers.fill(rows, buffer, list(range(20))[::-1]) == []
        assert buffer[:, 0].tolist() == list(range(20, 0, -1))  # each matcher wrote its own row
        # (whether the second thread took any row is up to the scheduler on a loaded 2-core box)
        buffer.zero_()
        failing = [_SlowRow(i + 1, seconds=0.005, fail=(i % 2 == 1)) for i in range(8)]
        failures = fillers.fill(failing, buffer, list(range(8)))
        assert [index for index, _ in failures] == [1, 3, 5, 7]  # each failure names its own row
        assert all(isinstance(error, ValueError) and f"row {i} failed" in str(error) for i, error in failures)
        assert buffer[:8, 0].tolist() == [1, 0, 3, 0, 5, 0, 7, 0]  # the others were still filled
        buffer.zero_()
        assert fillers.fill(rows[:8], buffer, list(range(8))) == []  # the threads survive an error
        assert buffer[:8, 0].tolist() == list(range(1, 9))
    finally:
        fillers.close()


class _MeetingRow(_SlowRow):
    """The first row each thread takes waits (10 s at most) for the other thread to take one."""

    def __init__(self, value, meeting, first, lock):
        super().__init__(value)
        self.meeting, self.first, self.lock = meeting, first, lock

    def fill_next_token_bitmask(self, buffer, row):
        me = threading.current_thread()
        with self.lock:
            new = me not in self.first
            self.first.add(me)
        if new:
            self.meeting.wait()  # BrokenBarrierError after 10 s: one thread took every row
        super().fill_next_token_bitmask(buffer, row)


def test_both_fill_threads_take_rows():
    """Shown by a meeting, not by timing: each thread's first row waits for the other thread's."""
    fillers = E.RowFillers(2, timeout=30)
    try:
        meeting, first, lock = threading.Barrier(2, timeout=10), set(), threading.Lock()
        rows = [_MeetingRow(i + 1, meeting, first, lock) for i in range(20)]
        buffer = torch.zeros(20, 4, dtype=torch.int32)
        assert fillers.fill(rows, buffer, list(range(20))) == []
        assert len({r.thread for r in rows}) == 2 and buffer[:, 0].tolist() == list(range(1, 21))
    finally:
        fillers.close()


def test_a_fill_thread_that_never_returns_fails_its_row_alone_and_is_replaced():
    release = threading.Event()
    fillers = E.RowFillers(2, timeout=0.3)
    try:
        # the caller takes 0.05 s a row, so the worker wakes and takes (and hangs on) one of the 10
        rows = [_SlowRow(i + 1, seconds=0.05, hang=release) for i in range(10)]
        start = time.perf_counter()
        failures = fillers.fill(rows, torch.zeros(10, 4, dtype=torch.int32), list(range(10)))
        assert time.perf_counter() - start < 5
        hung = [r for r in rows if r.thread is not threading.main_thread()]
        assert len(failures) == len(hung) == 1 and fillers.stragglers == 1
        for index, error in failures:
            assert isinstance(error, E.FillTimeout) and "within 0.3 s" in str(error)
            assert rows[index].thread is not threading.main_thread()  # the row the hung thread held
        buffer = torch.zeros(10, 4, dtype=torch.int32)
        healthy = [_SlowRow(i + 1, seconds=0.001) for i in range(10)]
        assert fillers.fill(healthy, buffer, list(range(10))) == []  # a fresh thread took its place
        assert buffer[:, 0].tolist() == list(range(1, 11))
    finally:
        release.set()
        fillers.close()
