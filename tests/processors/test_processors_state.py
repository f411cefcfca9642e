"""Host state for logits processors: persistent slots, batch updates, dirty tracking.

The state is checked against a plain dict-of-requests reference that rebuilds every
graph input from scratch, from the semantics, after each random batch update.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from neuron_constrain.processors import (
    BatchUpdate,
    ProcessorError,
    ProcessorState,
    RequestParams,
)
from neuron_constrain.core.processor_interface import Thinking
from references import reference_thought

# what this file checks is host-side, the same on every torch: the main lane runs it (see the torch_agnostic marker)
pytestmark = pytest.mark.torch_agnostic

SLOTS, VOCAB, STOPS, BIAS, SEEN, EOS = 6, 37, 3, 4, 16, 2
THINK, END = [35], [36, 34]  # a thought opens at 35 and closes at 36 34 (an end marker of two tokens)


def new_state(**options) -> ProcessorState:
    options = {"vocab_size": VOCAB, "max_stop_tokens": STOPS, "max_bias_tokens": BIAS,
               "max_penalty_tokens": SEEN, "eos_token_id": EOS, "thinking": Thinking(THINK, END), **options}
    return ProcessorState(SLOTS, **options)


@dataclasses.dataclass
class Request:
    params: RequestParams
    prompt: list
    outputs: list


def reference_inputs(slots: dict[int, Request], batch: int) -> dict:
    """Every input from scratch: what each processor means for each row. The seen
    tokens of penalties are a per-row ``{token: output count}`` (their column order
    is the state's business)."""
    cols = {name: [] for name in (
        "min_tokens_remaining", "min_tokens_stop_ids", "logit_bias_ids", "logit_bias_values",
        "penalty_repetition", "penalty_frequency", "penalty_presence", "penalty_seen", "thinking_budget_left",
        "thinking_end_id", "temperature", "min_p",
    )}
    for row in range(batch):
        request = slots.get(row)
        p = request.params if request else RequestParams()
        outputs = request.outputs if request else []
        stops = list(dict.fromkeys([*p.stop_token_ids, EOS]))
        remaining = max(0, p.min_tokens - len(outputs))
        cols["min_tokens_remaining"].append(remaining)
        cols["min_tokens_stop_ids"].append(stops + [-1] * (STOPS - len(stops)) if remaining else [-1] * STOPS)
        bias = dict(p.logit_bias or {})
        cols["logit_bias_ids"].append(list(bias) + [-1] * (BIAS - len(bias)))
        cols["logit_bias_values"].append(list(bias.values()) + [0.0] * (BIAS - len(bias)))
        active = (p.repetition_penalty, p.frequency_penalty, p.presence_penalty) != (1.0, 0.0, 0.0)
        cols["penalty_repetition"].append(p.repetition_penalty)
        cols["penalty_frequency"].append(p.frequency_penalty)
        cols["penalty_presence"].append(p.presence_penalty)
        seen = {}
        if active:
            seen = {token: 0 for token in request.prompt}
            for token in outputs:
                seen[token] = seen.get(token, 0) + 1
        cols["penalty_seen"].append(seen)
        left, end_id = (0, -1) if p.thinking_token_budget is None else \
            reference_thought(request.prompt, outputs, p.thinking_token_budget, THINK, END)
        cols["thinking_budget_left"].append(left)
        cols["thinking_end_id"].append(end_id)
        cols["temperature"].append(p.temperature)
        cols["min_p"].append(p.min_p)
    dtypes = {"min_tokens_remaining": torch.int32, "min_tokens_stop_ids": torch.int64, "logit_bias_ids": torch.int64,
              "thinking_budget_left": torch.int32, "thinking_end_id": torch.int64}
    shapes = {"min_tokens_stop_ids": (STOPS,), "logit_bias_ids": (BIAS,), "logit_bias_values": (BIAS,)}
    return {
        k: v if k == "penalty_seen" else torch.tensor(v, dtype=dtypes.get(k, torch.float32)).reshape(batch, *shapes.get(k, ()))
        for k, v in cols.items()
    }


def seen_tokens(ids: torch.Tensor, counts: torch.Tensor) -> list[dict]:
    """penalty_token_ids / _counts -> per-row {token: count}; each id at most once."""
    rows = []
    for row_ids, row_counts in zip(ids.tolist(), counts.tolist()):
        pairs = [(i, c) for i, c in zip(row_ids, row_counts) if i >= 0]
        assert len({i for i, _ in pairs}) == len(pairs), row_ids
        assert all(c == 0 for i, c in zip(row_ids, row_counts) if i < 0)
        rows.append(dict(pairs))
    return rows


def params_strategy():
    tokens = st.integers(0, VOCAB - 1)
    return st.builds(
        RequestParams,
        min_tokens=st.sampled_from([0, 0, 1, 3]),
        stop_token_ids=st.lists(tokens, max_size=STOPS - 1, unique=True),
        logit_bias=st.one_of(st.none(), st.dictionaries(tokens, st.floats(-5, 5, width=32), max_size=BIAS)),
        min_p=st.sampled_from([0.0, 0.0, 0.2]),
        temperature=st.sampled_from([1.0, 1.0, 0.5]),
        repetition_penalty=st.sampled_from([1.0, 1.0, 1.5]),
        frequency_penalty=st.sampled_from([0.0, 0.0, 0.25]),
        presence_penalty=st.sampled_from([0.0, 0.0, -0.5]),
        thinking_token_budget=st.sampled_from([None, None, 0, 1, 3]),
    )


def apply_reference(slots: dict[int, Request], update: BatchUpdate) -> None:
    for slot in update.removed:
        slots.pop(slot, None)
    for slot, params, prompt, *rest in update.added:
        slots[slot] = Request(params, list(prompt), list(rest[0]) if rest else [])
    for a, b, kind in update.moved:
        ra, rb = slots.pop(a, None), slots.pop(b, None)
        if ra is not None:
            slots[b] = ra
        if kind == "swap" and rb is not None:
            slots[a] = rb


def assert_inputs_equal(state: ProcessorState, slots: dict, batch: int) -> None:
    got, want = dict(state.inputs()), reference_inputs(slots, batch)
    assert got["penalty_token_ids"].shape == got["penalty_token_counts"].shape == (batch, SEEN)
    assert got["penalty_token_ids"].dtype == torch.int64 and got["penalty_token_counts"].dtype == torch.int32
    assert seen_tokens(got.pop("penalty_token_ids"), got.pop("penalty_token_counts")) == want.pop("penalty_seen")
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert torch.equal(got[name], want[name]), (name, got[name], want[name])


@given(data=st.data())
def test_property_random_updates_match_the_reference(data):
    state, slots = new_state(), {}
    # the markers' tokens often: thoughts open, close and get forced
    tokens = st.one_of(st.integers(0, VOCAB - 1), st.sampled_from(THINK + END))
    for _ in range(data.draw(st.integers(1, 6), label="steps")):
        occupied = sorted(slots)
        removed = data.draw(st.lists(st.sampled_from(occupied), unique=True) if occupied else st.just([]), label="removed")
        free = [s for s in range(SLOTS) if s not in slots or s in removed]
        added_slots = data.draw(st.lists(st.sampled_from(free), unique=True, max_size=3) if free else st.just([]))
        added = []
        for slot in added_slots:
            entry = (slot, data.draw(params_strategy()), data.draw(st.lists(tokens, max_size=5)))
            if data.draw(st.booleans()):
                entry += (data.draw(st.lists(tokens, max_size=3)),)  # a resumed request's outputs so far
            added.append(entry)
        moved = data.draw(st.lists(st.tuples(st.integers(0, SLOTS - 1), st.integers(0, SLOTS - 1),
                                             st.sampled_from(["move", "swap"])).filter(lambda m: m[0] != m[1]), max_size=3))
        update = BatchUpdate(data.draw(st.integers(0, SLOTS), label="batch"), removed, added, moved)
        state.update(update)
        apply_reference(slots, update)
        assert_inputs_equal(state, slots, update.batch_size)
        sampled = data.draw(st.lists(tokens, min_size=update.batch_size, max_size=update.batch_size))
        state.append_tokens(torch.tensor(sampled, dtype=torch.long))
        for row, token in enumerate(sampled):
            if row in slots:
                slots[row].outputs.append(token)
        assert_inputs_equal(state, slots, update.batch_size)


def test_inputs_rebuilt_only_when_something_changed():
    state = new_state()
    state.update(BatchUpdate(2, added=[(0, RequestParams(min_tokens=2), [1]), (1, RequestParams(), [3])]))
    first = state.inputs()
    assert state.inputs() is first
    state.update(None)
    state.update(BatchUpdate(2))  # nothing added, removed or moved
    assert state.inputs() is first
    state.update(BatchUpdate(2, moved=[(3, 4, "swap")]))  # swap of two empty slots
    assert state.inputs() is first
    state.append_tokens([5, 6])  # min_tokens counts down
    second = state.inputs()
    assert second is not first and second["min_tokens_remaining"].tolist() == [1, 0]
    state.append_tokens([5, 6])  # reaches 0: the row turns neutral
    third = state.inputs()
    assert third["min_tokens_remaining"].tolist() == [0, 0]
    state.append_tokens([5, 6])  # nobody uses any processor now: no change at all
    assert state.inputs() is third


def test_unused_processors_cost_nothing_and_still_feed_the_graph():
    state = new_state()
    state.update(BatchUpdate(3, added=[(s, RequestParams(), [1, 2]) for s in range(3)]))
    inputs = state.inputs()
    assert set(inputs) >= {"penalty_token_counts", "min_p", "logit_bias_ids", "min_tokens_remaining"}
    counts_storage = state.storage["penalty_token_counts"].clone()
    for _ in range(3):
        state.append_tokens([4, 5, 6])
        assert state.inputs() is inputs  # no rebuild, no per-slot work
    assert torch.equal(state.storage["penalty_token_counts"], counts_storage)
    # the neutral tensors are shared between states' batches of the same size
    state.update(BatchUpdate(2, removed=[2]))
    state.update(BatchUpdate(3, added=[(2, RequestParams(), [])]))
    assert state.inputs()["penalty_token_counts"] is inputs["penalty_token_counts"]


def test_moves_one_way_and_swap():
    state, slots = new_state(), {}
    update = BatchUpdate(3, added=[(0, RequestParams(min_tokens=3), [1]), (1, RequestParams(repetition_penalty=2.0), [7]),
                                  (2, RequestParams(logit_bias={4: 1.0}), [])])
    for step in (update, BatchUpdate(3, moved=[(0, 2, "swap")]), BatchUpdate(3, moved=[(1, 0, "move")]),
                 BatchUpdate(2, removed=[2], moved=[(0, 1, "swap")])):
        state.update(step)
        apply_reference(slots, step)
        assert_inputs_equal(state, slots, step.batch_size)


def test_speculative_rows_keep_only_min_tokens():
    with pytest.raises(ProcessorError, match=r"speculative decoding .* keeps only min_tokens.*\['logit_bias', 'penalties', 'min_p'\]"):
        new_state(num_speculative_tokens=2)
    state = new_state(processors=["min_tokens"], num_speculative_tokens=2)
    state.update(BatchUpdate(2, added=[(0, RequestParams(min_tokens=2, stop_token_ids=[9]), []), (1, RequestParams(), [])]))
    inputs = state.inputs()
    assert set(inputs) == {"min_tokens_remaining", "min_tokens_stop_ids"}
    # request 0 owns rows 0..2 (target + 2 drafts): 2, 1, 0 tokens still required there
    assert inputs["min_tokens_remaining"].tolist() == [2, 1, 0, 0, 0, 0]
    assert inputs["min_tokens_stop_ids"][:3].tolist() == [[9, EOS, -1]] * 3
    state.append_tokens([[11], [12, 13]])  # accepted tokens per request
    assert state.inputs()["min_tokens_remaining"].tolist() == [1, 0, 0, 0, 0, 0]


def test_bad_parameters_name_the_problem_and_fix():
    state = new_state()
    with pytest.raises(ProcessorError, match=r"4 stop ids \(EOS included\) but the graph holds max_stop_tokens=3"):
        state.update(BatchUpdate(1, added=[(0, RequestParams(min_tokens=1, stop_token_ids=[5, 6, 7]), [])]))
    with pytest.raises(ProcessorError, match=r"biases 5 tokens but the graph holds max_bias_tokens=4"):
        state.update(BatchUpdate(1, added=[(0, RequestParams(logit_bias={i: 1.0 for i in range(5)}), [])]))
    with pytest.raises(ProcessorError, match=r"logit_bias has ids \[37\] outside the vocabulary \[0, 37\)"):
        state.update(BatchUpdate(1, added=[(0, RequestParams(logit_bias={37: 1.0}), [])]))
    with pytest.raises(ProcessorError, match="NaN or \\+inf"):
        state.update(BatchUpdate(1, added=[(0, RequestParams(logit_bias={3: float("inf")}), [])]))
    with pytest.raises(ProcessorError, match=r"seen 17 distinct tokens but the graph holds max_penalty_tokens=16"):
        state.update(BatchUpdate(1, added=[(0, RequestParams(presence_penalty=1.0), list(range(17)))]))
    with pytest.raises(ProcessorError, match="repetition must be > 0"):
        state.update(BatchUpdate(1, added=[(0, RequestParams(repetition_penalty=0.0), [])]))
    with pytest.raises(ProcessorError, match=r"min_p must be in \[0, 1\] and temperature > 0"):
        state.update(BatchUpdate(1, added=[(0, RequestParams(min_p=1.5), [])]))
    with pytest.raises(ProcessorError, match=r"batch slot 6 is outside \[0, 6\); raise max_num_reqs"):
        state.update(BatchUpdate(1, added=[(6, RequestParams(), [])]))
    with pytest.raises(ProcessorError, match="move kind 'jump'"):
        state.update(BatchUpdate(1, moved=[(0, 1, "jump")]))
    state.update(BatchUpdate(2))
    with pytest.raises(ProcessorError, match="append_tokens got 1 rows but the batch has 2"):
        state.append_tokens([1])
    # a rejected request leaves the slot as it was
    assert state.requests[0] is None


def test_input_names_restrict_and_check():
    state = new_state(input_names=["min_tokens_remaining", "min_tokens_stop_ids", "min_p"])
    state.update(BatchUpdate(1, added=[(0, RequestParams(min_p=0.3, temperature=0.5), [])]))
    assert set(state.inputs()) == {"min_tokens_remaining", "min_tokens_stop_ids", "min_p"}
    assert state.inputs()["min_p"].tolist() == pytest.approx([0.3])
    with pytest.raises(ProcessorError, match=r"takes processor inputs \['scale_factor'\] that processors="):
        new_state(input_names=["scale_factor"])


def test_seen_tokens_past_max_penalty_tokens_raise_naming_the_option():
    state = new_state()
    state.update(BatchUpdate(1, added=[(0, RequestParams(frequency_penalty=0.5), list(range(SEEN - 1)))]))
    state.append_tokens([30])  # the 16th distinct token still fits
    state.append_tokens([30])  # a repeat takes no new column
    assert seen_tokens(state.inputs()["penalty_token_ids"], state.inputs()["penalty_token_counts"])[0][30] == 2
    with pytest.raises(ProcessorError, match=r"slot 0 has seen more than max_penalty_tokens=16 distinct tokens"):
        state.append_tokens([31])
