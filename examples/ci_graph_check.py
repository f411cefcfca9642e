"""Guarding graphs in CI: a golden graph file, and the checks that fail a pull request.

    python examples/ci_graph_check.py [--workdir DIR]

Runs in seconds on the CPU with no download, in a temporary folder unless ``--workdir`` names
one (the files are kept there). A tiny random-weight Llama from ``neuron_constrain.testing``
stands in for your model; your CI exports your own decode step the same way. Each step runs
the ``neuron-constrain`` command named on its ``$`` line, in this process (``cli.main`` is the
console script's entry point; in a workflow, run the command itself: docs/guides/ci.md has a
GitHub Actions job).

What it shows:

1. Once: export the decode step, ``rewrite`` it (the ``logit_mask`` input), and commit its
   canonical text as the golden file (``check --expect ... --update``).
2. Every pull request: export and rewrite again, then ``check --expect``: exit 0 while the graph
   is the same.
3. A pull request that changes the graph (here: a logit soft-cap before the argmax) fails with
   exit 1 and the structural diff, by module; ``diff`` prints it too.
4. A pull request that loses the mask (the program the accelerator would compile is not the
   rewritten one) fails with exit 1, naming the unmasked sampling site.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import pathlib
import tempfile

import torch

from neuron_constrain.cli import main as neuron_constrain
from neuron_constrain.testing import tiny_decoder

VOCAB = 1000  # the tokenizer's vocabulary; the model's lm_head is padded to 1024


class Step(torch.nn.Module):
    """The decode step the accelerator compiles: ``input_ids -> the next token`` (greedy)."""

    def __init__(self, model: torch.nn.Module, softcap: float | None = None):
        super().__init__()
        self.model, self.softcap = model, softcap

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=input_ids, use_cache=False).logits[:, -1]
        if self.softcap is not None:  # the pull request's change
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.argmax(-1)


def export_step(path: str, softcap: float | None = None) -> None:
    """What your CI runs first: export the step and save it (``torch.export.save``)."""
    ids = torch.zeros(2, 8, dtype=torch.long)
    with torch.no_grad():
        program = torch.export.export(Step(tiny_decoder("llama", vocab_size=1024), softcap), (ids,),
                                      dynamic_shapes=({0: torch.export.Dim("batch")},))
    torch.export.save(program, path)


def run(*argv: str, lines: int = 12) -> tuple[int, str]:
    """``neuron-constrain ARGV``: its exit status and output (the first ``lines`` lines printed)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        status = neuron_constrain(list(argv))
    text = out.getvalue()
    shown = text.splitlines()
    print(f"$ neuron-constrain {' '.join(argv)}")
    print("\n".join(shown[:lines] + ([f"... ({len(shown) - lines} more lines)"] if len(shown) > lines else [])))
    print(f"(exit {status})\n")
    return status, text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", help="where the programs and the golden file go (default: a temporary folder)")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        workdir = args.workdir or stack.enter_context(tempfile.TemporaryDirectory())
        os.makedirs(os.path.join(workdir, "graphs"), exist_ok=True)
        stack.callback(os.chdir, os.getcwd())  # back where it started, before the folder is removed
        os.chdir(workdir)
        rewrite = ("rewrite", "step.pt2", "-o", "step.masked.pt2", "--vocab-size", str(VOCAB))
        check = ("check", "step.masked.pt2", "--vocab-size", str(VOCAB), "--expect", "graphs/step.txt")

        print("# 1. once: the golden file, committed beside your code")
        export_step("step.pt2")
        assert run(*rewrite)[0] == 0
        assert run(*check, "--update")[0] == 0
        assert pathlib.Path("graphs/step.txt").read_text().startswith("# neuron-constrain canonical graph v1")

        print("# 2. a pull request that leaves the graph as it was")
        export_step("step.pt2")
        assert run(*rewrite)[0] == 0
        status, text = run(*check)
        assert status == 0 and "matches graphs/step.txt" in text

        print("# 3. a pull request that changes the graph: a logit soft-cap")
        export_step("step.pt2", softcap=30.0)
        assert run(*rewrite)[0] == 0
        status, text = run(*check)
        assert status == 1 and "the graph differs from graphs/step.txt" in text
        assert "aten.tanh.default" in text  # the diff names the added op
        assert run("diff", "graphs/step.txt", "step.masked.pt2")[0] == 1

        print("# 4. a pull request that ships the program without its mask")
        status, text = run("check", "step.pt2", "--vocab-size", str(VOCAB))
        assert status == 1 and "is not masked" in text
    print("the unchanged graph passed; the changed graph and the unmasked one failed")


if __name__ == "__main__":
    main()
