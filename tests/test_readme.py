"""Every ``python`` code block of the README runs, on tiny random-weight models.

A block's free names (``bitmask``, ``model``, ``prompts`` ...) are what a reader
already has; ``GIVEN`` below supplies them per section, built here on tiny
decoders. A block whose section has no entry in ``GIVEN`` runs as it is, so a new
block either runs on its own or gets its givens here: the docs cannot drift.
"""
from __future__ import annotations

import functools
import pathlib
import re

import pytest
from conftest import require_torch_xla

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
FENCE = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
HEADING = re.compile(r"^#+ (.+)$", re.M)
VOCAB = 1000


def blocks() -> list[tuple[str, str]]:
    """(section heading, code) for every python block, in README order."""
    text = README.read_text()
    found = []
    for match in FENCE.finditer(text):
        headings = HEADING.findall(text, 0, match.start())
        found.append((headings[-1] if headings else "", match.group(1)))
    return found


@functools.lru_cache(maxsize=None)
def tiny(arch: str = "llama", seed: int = 0):
    from neuron_constrain.testing import tiny_decoder

    return tiny_decoder(arch, vocab_size=1024, seed=seed)


def _bitmask(rows: int):
    import torch

    from neuron_constrain.kernels import pack_bool_mask

    allowed = torch.rand(rows, VOCAB, generator=torch.Generator().manual_seed(0)) < 0.3
    allowed[:, 7] = True
    return pack_bool_mask(allowed)


def given_use():
    return {"bitmask": _bitmask(4)}


def given_tensor_parallel():
    import torch

    from neuron_constrain.testing import VocabShardedGreedyStep

    return {"rank_step": VocabShardedGreedyStep(tiny(), 1, 4), "ids": torch.randint(0, VOCAB, (3, 6)),
            "V": VOCAB, "rank": 1, "bitmask": _bitmask(3)}


def given_taps():
    import torch

    from neuron_constrain.testing import LogitsStep

    prompts = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]
    ids = torch.tensor(prompts)
    return {"model": tiny("gpt_oss"), "reference": tiny("gpt_oss", seed=1), "LogitsStep": LogitsStep, "ids": ids,
            "dims": ({0: torch.export.Dim("batch"), 1: torch.export.Dim("seq", max=64)},), "prompts": prompts,
            "tokens": prompts[0]}


def given_localize():
    import copy

    import torch

    from neuron_constrain.testing import LogitsStep

    reference = tiny("llama")
    device_model = copy.deepcopy(reference)
    with torch.no_grad():
        device_model.model.layers[1].mlp.down_proj.weight.mul_(1.01)
    return {"device_model": device_model, "reference": reference, "LogitsStep": LogitsStep,
            "prompts": [[1, 2, 3, 4], [5, 6, 7, 8]]}


def given_compile():
    import torch

    from neuron_constrain.testing import GreedyStep

    return {"model": tiny(), "GreedyStep": GreedyStep, "step": GreedyStep(tiny()),
            "ids": torch.randint(0, VOCAB, (4, 8)), "bitmask": _bitmask(4)}


def given_xla():
    import torch

    import neuron_constrain as nc
    from neuron_constrain.testing import GreedyStep
    from neuron_constrain.decoding.xla import xla_device

    ids = torch.randint(0, VOCAB, (3, 6))
    return {"t": nc.transform(GreedyStep(tiny()), (ids,), vocab_size=VOCAB), "ids": ids, "dev": xla_device(),
            "mask": _bitmask(3)}


def given_processors():
    import torch

    from neuron_constrain.testing import GreedyStep

    return {"step": GreedyStep(tiny()), "ids": torch.randint(0, VOCAB, (2, 6)), "eos": 2, "bitmask": _bitmask(2),
            "prompt_ids_0": [1, 5, 9], "prompt_ids_1": [4, 4, 8], "think_id": 998, "end_think_id": 999}


@functools.lru_cache(maxsize=None)
def _real_tokenizers():
    """The "Real tokenizers" block, run once (as a reader runs it once before the sections that
    build on it): its ``S``, ``model`` (a rewritten program, no state between runs) and ``tok``."""
    code = next(code for section, code in blocks() if section == "Real tokenizers")
    namespace = _base()
    exec(compile(code, "README.md [Real tokenizers]", "exec"), namespace)
    return namespace["S"], namespace["model"], namespace["tok"]


def given_engines():
    """The "Real tokenizers" block's model and tokenizer, and a batch to constrain."""
    S, model, tok = _real_tokenizers()
    return {"S": S, "model": model, "tok": tok, "prompts": ["Answer:", "Pick:"],
            "constraints": [S.json_schema({"type": "boolean"}), S.choice(["yes", "no"])]}


def given_reasoning():
    """The "Real tokenizers" model (its markers several tokens each) and prompts that open a thought."""
    given = given_engines()
    return {"S": given["S"], "decoder": given["model"], "tok": given["tok"], "prompts": ["Q: <think>", "Pick: <think>"],
            "constraints": given["constraints"]}


def given_failures():
    """The "Real tokenizers" model and tokenizer, a runtime with a constrained and a free request."""
    import torch

    given = given_engines()
    S, model, tok = given["S"], given["model"], given["tok"]
    runtime = S.StructuredRuntime.for_model(model, tok, max_rows=2)
    runtime.add("a", S.json_schema({"type": "boolean"}))
    runtime.add("b", None)
    runtime.wait(["a", "b"], timeout=60)
    return {"S": S, "model": model, "runtime": runtime, "batch": ["a", "b"],
            "ids": torch.zeros(2, 8, dtype=torch.long)}


def _base() -> dict:
    import torch

    import neuron_constrain as nc

    return {"__name__": "readme", "torch": torch, "nc": nc}  # the Use block's imports


def given_pipeline():
    """A rewritten 1-token static-cache decode step, its inputs and a runtime with two requests."""
    import torch

    import neuron_constrain as nc
    from neuron_constrain import structured as S
    from neuron_constrain.testing import CachedGreedyStep, toy_tokenizer

    vocab = toy_tokenizer()
    step = CachedGreedyStep(tiny(), batch_size=2, max_cache_len=16)
    t = nc.transform(step, step.example_inputs(vocab.vocab_size), vocab_size=vocab.vocab_size)
    runtime = S.StructuredRuntime(vocab, max_rows=2)
    runtime.add("a", S.choice(["yes", "no"]))
    runtime.add("b", None)
    runtime.wait(["a", "b"], timeout=60)
    batch = ["a", "b"]
    return {"t": t, "ids": torch.tensor([[vocab.eos_id]] * 2), "pos": torch.tensor([0]), "runtime": runtime,
            "batch": batch, "mask": runtime.step(batch)}


GIVEN = {
    "Grammar off the critical path (split at the mask, pipelined step)": given_pipeline,
    "Choosing a grammar engine": given_engines,
    "Failures stay with their request": given_failures,
    "Use": given_use,
    "Tensor parallel (vocab-parallel lm_head)": given_tensor_parallel,
    "Replacement taps (accuracy debugging)": given_taps,
    "Finding the first diverging module": given_localize,
    "torch.compile backend": given_compile,
    "XLA and Neuron": given_xla,
    "Logits processors": given_processors,
    "Reasoning models: a thought, then the answer's grammar": given_reasoning,
}
NEEDS = {"XLA and Neuron": "torch_xla"}  # blocks that need a package only one lane has


@pytest.mark.parametrize("section,code", blocks(), ids=[f"{i}-{s}" for i, (s, _) in enumerate(blocks())])
def test_readme_block_runs(section, code, tmp_path, monkeypatch):
    if NEEDS.get(section) == "torch_xla":
        require_torch_xla()  # the main lane fails without it; the others skip
    monkeypatch.chdir(tmp_path)  # blocks that save files write here
    namespace = _base()
    if section in GIVEN:
        namespace.update(GIVEN[section]())
    code = code.replace("dynamic_shapes=...", "dynamic_shapes=None")  # an ellipsis the reader fills in
    exec(compile(code, f"README.md [{section}]", "exec"), namespace)


def test_every_section_with_givens_still_has_a_block():
    sections = {s for s, _ in blocks()}
    assert set(GIVEN) <= sections, f"GIVEN names sections the README no longer has: {set(GIVEN) - sections}"
