"""Every code block of the README and the docs (``docs/**/*.md``) runs, or says why it does not.

A ``python`` block runs on tiny random-weight models. Its free names (``bitmask``, ``model``,
``prompts`` ...) are what a reader already has; ``GIVEN`` below supplies them per section
(the heading above the block), built here on tiny decoders. A block whose section has no entry
in ``GIVEN`` runs as it is, so a new block either runs on its own or gets its givens here: the
docs cannot drift. A block that cannot run here (a shell command that starts a server, a
workflow file, an error message) is preceded by ``<!-- not run: REASON -->``; every block of
another language must be. A page's ``--8<-- "PATH"`` line (the docs' include) counts as the
included file's text, so ARCHITECTURE.md is checked where the site shows it.
"""
from __future__ import annotations

import dataclasses
import functools
import pathlib
import re

import pytest
from conftest import require_torch_xla

ROOT = pathlib.Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
HEADING = re.compile(r"^#+ (.+)$", re.M)
NOT_RUN = re.compile(r"<!-- not run: (.+?) -->\n\Z")
INCLUDE = re.compile(r'^--8<-- "(.+?)"$', re.M)
VOCAB = 1000


def pages() -> list[pathlib.Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def page_text(path: pathlib.Path) -> str:
    """The page as the site shows it: includes expanded (lines outside fences only)."""
    return INCLUDE.sub(lambda m: (ROOT / m.group(1)).read_text(), path.read_text())


@dataclasses.dataclass(frozen=True)
class Block:
    page: str  # relative to the repository
    section: str  # the heading above it
    language: str
    code: str
    not_run: str | None  # the reason, when marked


def all_blocks() -> list[Block]:
    """Every fenced block of every page, in page order."""
    found = []
    for path in pages():
        text = page_text(path)
        for match in FENCE.finditer(text):
            headings = HEADING.findall(text, 0, match.start())
            reason = NOT_RUN.search(text, 0, match.start())
            found.append(Block(str(path.relative_to(ROOT)), headings[-1] if headings else "", match.group(1),
                               match.group(2), reason.group(1) if reason else None))
    return found


def blocks() -> list[tuple[str, str]]:
    """(section heading, code) for every python block that runs, in page order."""
    return [(b.section, b.code) for b in all_blocks() if b.language == "python" and b.not_run is None]


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


@functools.lru_cache(maxsize=None)
def _first_answer():
    """The "A first constrained answer" block, run once: its ``S``, ``decoder`` and ``tok``."""
    code = next(code for section, code in blocks() if section == "A first constrained answer")
    namespace = _base()
    exec(compile(code, "docs [A first constrained answer]", "exec"), namespace)
    return {name: namespace[name] for name in ("S", "decoder", "tok")}


def given_tool_calling():
    return dict(_first_answer())


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
    exec(compile(code, "docs [Real tokenizers]", "exec"), namespace)
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
    "Grammar off the critical path": given_pipeline,
    "Choosing a grammar engine": given_engines,
    "Failures stay with their request": given_failures,
    "Rewrite a decoder step": given_use,
    "Tool calling": given_tool_calling,
    "Tensor parallel (vocab-parallel lm_head)": given_tensor_parallel,
    "Replacement taps and localize": given_taps,
    "Finding the first diverging module": given_localize,
    "torch.compile backend": given_compile,
    "XLA and Neuron": given_xla,
    "Logits processors": given_processors,
    "Reasoning models": given_reasoning,
}
NEEDS = {"XLA and Neuron": "torch_xla", "Check the HLO the compiler gets": "torch_xla"}  # blocks that need a package only one lane has


@pytest.mark.parametrize("section,code", blocks(), ids=[f"{i}-{s}" for i, (s, _) in enumerate(blocks())])
def test_readme_block_runs(section, code, tmp_path, monkeypatch):
    if NEEDS.get(section) == "torch_xla":
        require_torch_xla()  # the main lane fails without it; the others skip
    monkeypatch.chdir(tmp_path)  # blocks that save files write here
    namespace = _base()
    if section in GIVEN:
        namespace.update(GIVEN[section]())
    code = code.replace("dynamic_shapes=...", "dynamic_shapes=None")  # an ellipsis the reader fills in
    exec(compile(code, f"docs [{section}]", "exec"), namespace)


def test_every_section_with_givens_still_has_a_block():
    sections = {s for s, _ in blocks()}
    assert set(GIVEN) <= sections, f"GIVEN names sections the docs no longer have: {set(GIVEN) - sections}"


def test_every_block_runs_or_says_why_not():
    unmarked = [f"{b.page} [{b.section}] ```{b.language}" for b in all_blocks()
                if b.language != "python" and b.not_run is None]
    assert not unmarked, f"blocks that neither run nor say why (add <!-- not run: REASON --> before them): {unmarked}"
    assert any(b.language == "python" and b.not_run is None for b in all_blocks())


LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
REPO_PATH = re.compile(r"(?<![\w./-])((?:examples|benchmarks|docs)/[\w./-]+\.\w+)")


def test_the_readme_links_and_files_exist():
    """What the README points a newcomer at exists: its relative links, and every repository file a
    command in it names (``--schema examples/person.json``)."""
    text = (ROOT / "README.md").read_text()
    links = [link for link in LINK.findall(text) if "://" not in link]
    assert links and all((ROOT / link).exists() for link in links), [l for l in links if not (ROOT / l).exists()]
    named = REPO_PATH.findall(text)
    assert "examples/person.json" in named and all((ROOT / path).exists() for path in named), named


@pytest.mark.parametrize("name", ["person.json", "tools.json"])
def test_the_example_files_are_what_the_cli_takes(name):
    """The quick start's files read as the CLI reads them: a schema a request compiles, a tool list."""
    import json

    from neuron_constrain import structured as S

    value = json.loads((ROOT / "examples" / name).read_text())
    constraint = S.json_schema(value) if name == "person.json" else S.tool_constraint(value, "required")
    assert constraint is not None


ISSUE = re.compile(r"\bissues? #?\d+\b", re.I)
HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b")


def test_the_user_docs_name_no_issue_or_commit():
    """The README and the site speak to a user: no issue numbers, no commit hashes."""
    found = [(str(path.relative_to(ROOT)), hit) for path in pages() for pattern in (ISSUE, HASH)
             for hit in pattern.findall(page_text(path))]
    assert not found, found
