"""Graphs with more than one head (a main lm_head and a draft head, each sampled):
every head gets its own mask, ``check`` verifies every site on its own."""
from __future__ import annotations

import pytest
import torch

import neuron_constrain as nc
from neuron_constrain.core.checks import check_program
from neuron_constrain.kernels import pack_bool_mask
from neuron_constrain.core.program import ProgramEditor
from neuron_constrain.testing import DraftHeadStep, random_ids, tiny_decoder

VOCAB = 1000


@pytest.fixture(scope="module")
def model():
    return tiny_decoder("llama", vocab_size=VOCAB)


def random_allowed(rows: int, width: int, seed: int, density: float = 0.3) -> torch.Tensor:
    allowed = torch.rand(rows, width, generator=torch.Generator().manual_seed(seed)) < density
    allowed[:, seed % width] = True  # never an empty row
    return allowed


def eager_logits(step: DraftHeadStep, ids: torch.Tensor):
    with torch.no_grad():
        out = step.model(input_ids=ids, use_cache=False, output_hidden_states=True)
        return out.logits[:, -1], step.draft(out.hidden_states[-1][:, -1])


def best_allowed(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    return logits.masked_fill(~allowed, float("-inf")).argmax(-1)


def test_both_heads_get_their_own_mask_and_pick_their_best_allowed_token(model):
    step = DraftHeadStep(model)
    ids = random_ids(3, 5, VOCAB)
    t = nc.transform(step, (ids,), dynamic_shapes=({0: torch.export.Dim("batch")},))
    report = t.report["mask_logits"]
    assert [i.name for i in report.inputs_added] == ["logit_mask", "logit_mask_1"]
    assert [s["head"] for s in report.sites] == [0, 1]
    assert report.outputs_added == ["logit_mask_empty", "logit_mask_1_empty"]
    main_logits, draft_logits = eager_logits(step, ids)
    shared_mask_would_differ = []
    for seed in range(3):
        main_allowed, draft_allowed = random_allowed(3, VOCAB, seed), random_allowed(3, VOCAB, seed + 10)
        token, draft = t(ids, logit_mask=pack_bool_mask(main_allowed), logit_mask_1=pack_bool_mask(draft_allowed))
        assert torch.equal(token, best_allowed(main_logits, main_allowed))
        assert torch.equal(draft, best_allowed(draft_logits, draft_allowed))
        shared_mask_would_differ.append(not torch.equal(best_allowed(draft_logits, main_allowed), draft))
    # The draft head really reads its own mask: the main head's mask would have picked other tokens.
    assert any(shared_mask_would_differ)
    assert check_program(t.program) == []


def test_a_draft_head_of_another_width_is_masked_at_its_own_width(model):
    step = DraftHeadStep(model, draft_vocab=300)
    ids = random_ids(2, 4, VOCAB)
    with pytest.raises(nc.TransformError, match=r"head 1 .*300 wide.* narrower than vocab_size=1000.*vocab_size=\[1000, 300\]"):
        nc.transform(step, (ids,), vocab_size=VOCAB)
    t = nc.transform(step, (ids,), vocab_size=[VOCAB, 300])
    widths = {i.name: tuple(i.shape) for i in t.report["mask_logits"].inputs_added}
    assert widths == {"logit_mask": (2, 32), "logit_mask_1": (2, 10)}
    main_logits, draft_logits = eager_logits(step, ids)
    main_allowed, draft_allowed = random_allowed(2, VOCAB, 3), random_allowed(2, 300, 4)
    token, draft = t(ids, logit_mask=pack_bool_mask(main_allowed), logit_mask_1=pack_bool_mask(draft_allowed))
    assert torch.equal(token, best_allowed(main_logits, main_allowed))
    assert torch.equal(draft, best_allowed(draft_logits, draft_allowed))
    with pytest.raises(nc.TransformError, match=r"vocab_size gives 3 sizes but the graph has 2 head"):
        nc.transform(step, (ids,), vocab_size=[VOCAB, 300, 5])
    assert check_program(t.program, VOCAB) == []


def test_processors_refuse_two_heads_naming_both(model):
    ids = random_ids(2, 4, VOCAB)
    with pytest.raises(nc.TransformError, match=r"2 logits heads.*head 0 .*head 1 "):
        nc.transform(DraftHeadStep(model), (ids,), logit_mask=None, processors=["min_tokens"])


def test_check_fails_when_one_head_is_unmasked(model):
    ids = random_ids(2, 4, VOCAB)
    t = nc.transform(DraftHeadStep(model), (ids,))
    # Undo the draft head's mask: its argmax reads the raw projection again.
    editor = ProgramEditor(t.program)
    (site,) = [n for n in editor.graph.nodes if n.name == t.report["mask_logits"].sites[1]["node"]]
    masked = site.args[0]  # where(allowed, logits, -inf)
    assert masked.target == torch.ops.aten.where.self
    raw = masked.args[1]
    editor.replace_uses(masked, raw, users=[site])
    broken = editor.build()
    (failure,) = check_program(broken)
    assert f"sampling site {site.name} (argmax)" in failure and "does not depend on logit_mask or logit_mask_1" in failure


class LeakyMaskStep(torch.nn.Module):
    """A hand-threaded mask that never masks: the site depends on ``logit_mask`` but sees every token."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, logit_mask):
        logits = self.model(input_ids=input_ids, use_cache=False).logits[:, -1]
        return (logits + 0.0 * logit_mask.float().sum()).argmax(-1)


def test_check_runs_the_program_and_finds_a_mask_that_does_not_mask(model):
    ids = random_ids(2, 4, VOCAB)
    program = torch.export.export(
        LeakyMaskStep(model), (ids,), kwargs={"logit_mask": torch.full((2, 32), -1, dtype=torch.int32)}
    )
    (failure,) = check_program(program)
    assert "more than one candidate token in 2 of 2 row(s)" in failure and "logit_mask allows exactly one" in failure
    assert check_program(program, numeric=False) == []  # structurally it looks masked
