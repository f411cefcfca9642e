"""The ``neuron-constrain`` CLI, the way users and CI run it.

Commands run in-process through ``cli_runner.run_cli`` (``cli.main`` with stdin empty
and stdout/stderr captured, not TTYs: what a subprocess sees, without a fresh
interpreter importing torch per call). A few run the installed entry points as real
subprocesses (``run_installed``): ``python -m neuron_constrain show`` (exit 0), the
``neuron-constrain`` console script's ``rewrite --tap`` (exit 0) and a failing
``check`` (exit 1).

Golden canonical texts live in ``tests/cli/golden/``; the same files hold on torch 2.9
and 2.13. After an intended graph change, regenerate one with
``neuron-constrain check OUT.pt2 --expect tests/cli/golden/NAME.txt --update``.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from neuron_constrain.core.mask_interface import MASK_INPUT
from neuron_constrain.testing import GreedyStep, random_ids, tiny_decoder
from cli_runner import run_cli as cli
from cli_runner import run_installed

GOLDEN = Path(__file__).parent / "golden"
VOCAB, PADDED = 1000, 1024
ARCHS = ("llama", "mixtral", "gpt_oss")


def one_error_line(result: subprocess.CompletedProcess, *words: str) -> str:
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cli")


@pytest.fixture(scope="module")
def plain(workdir) -> dict[str, Path]:
    """Greedy-step programs of the tiny decoders, exported once (fixed seed), saved as .pt2."""
    paths = {}
    for arch in ARCHS:
        step = GreedyStep(tiny_decoder(arch, vocab_size=PADDED, seed=0))
        with torch.no_grad():
            program = torch.export.export(
                step, (random_ids(3, 6, VOCAB),), dynamic_shapes=({0: torch.export.Dim("batch")},)
            )
        paths[arch] = workdir / f"{arch}.pt2"
        torch.export.save(program, paths[arch])
    return paths


@pytest.fixture(scope="module")
def rewritten(plain, workdir) -> dict[str, Path]:
    paths = {}
    for arch, path in plain.items():
        paths[arch] = workdir / f"{arch}-masked.pt2"
        result = cli("rewrite", path, "-o", paths[arch], "--vocab-size", VOCAB)
        assert result.returncode == 0, result.stderr
        assert "mask_logits: 1 site(s)" in result.stdout and "input  logit_mask: int32[s" in result.stdout, result.stdout
    return paths


# ----------------------------------------------------------------------------- rewrite, check, golden

@pytest.mark.parametrize("arch", ARCHS)
def test_rewrite_then_check_matches_golden(rewritten, arch):
    result = cli("check", rewritten[arch], "--expect", GOLDEN / f"{arch}_greedy_logit_mask.txt", "--vocab-size", VOCAB)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("ok:") and "matches" in result.stdout


def test_rewritten_program_loads_and_masks_without_the_library(rewritten):
    program = torch.export.load(rewritten["llama"])
    ids = random_ids(2, 6, VOCAB)
    allowed = 7
    mask = torch.zeros(2, 32, dtype=torch.int32)
    mask[:, allowed // 32] = 1 << (allowed % 32)
    token, empty = program.module()(ids, logit_mask=mask)
    assert token.tolist() == [allowed, allowed] and not empty.any()


def test_show_is_the_golden_text_and_diff_reads_both_forms(rewritten, workdir):
    shown = run_installed("show", rewritten["mixtral"], module=True)  # python -m neuron_constrain
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout == (GOLDEN / "mixtral_greedy_logit_mask.txt").read_text()
    text = workdir / "mixtral-masked.txt"
    text.write_text(shown.stdout)
    same = cli("diff", text, rewritten["mixtral"])
    assert same.returncode == 0 and "same graph" in same.stdout, same.stdout + same.stderr


def test_diff_lists_exactly_the_inserted_inputs_and_nodes(plain, rewritten):
    from neuron_constrain import transform

    report = transform(torch.export.load(plain["llama"]), vocab_size=VOCAB).report["mask_logits"]
    result = cli("diff", plain["llama"], rewritten["llama"])
    assert result.returncode == 1, result.stderr
    out = result.stdout
    summary = out.split("\n\n")[0].splitlines()
    assert "inputs: 1 added, 0 removed, 0 changed" in summary
    assert "outputs: 1 added, 0 removed, 0 changed" in summary
    # The mask input and the empty-row flag output (an `all` over the mask), nothing else.
    assert [l.strip() for l in summary if l.startswith("  + ")] == [
        "+ logit_mask: i32[s0, 32] = user_input keyword",
        "+ all_0: b8[s0] = user_output",
    ]
    # The nodes the pass inserted, and only the site reading them changed.
    assert f"nodes: {report.nodes_inserted} added, 0 removed, 1 changed" in summary
    added = [l for l in summary if l.startswith("    + ")]
    assert len(added) == report.nodes_inserted
    changed = [l for l in summary if l.startswith("    ~ ")]
    assert len(changed) == 1 and "aten.argmax.default" in changed[0]
    assert any("f32[s0, 1024] = aten.where.self(" in l for l in added)  # where(allowed, logits, -inf)
    # ... followed by a unified diff of the canonical texts.
    assert f"--- {plain['llama']}" in out and "\n+  logit_mask: i32[s0, 32] = user_input keyword" in out
    assert "\n@@ " in out


def test_check_update_writes_golden_and_flags_a_changed_graph(rewritten, workdir):
    golden = workdir / "gpt_oss-golden.txt"
    wrote = cli("check", rewritten["gpt_oss"], "--expect", golden, "--update")
    assert wrote.returncode == 0 and golden.exists(), wrote.stdout + wrote.stderr
    # The llama rewrite is not the gpt_oss graph: check fails with a structural diff.
    other = run_installed("check", rewritten["llama"], "--expect", golden)  # the console script: exit 1
    assert other.returncode == 1, other.stdout + other.stderr
    assert "FAIL the graph differs from" in other.stdout and "--update" in other.stdout
    assert "nodes:" in other.stdout and "@ model.model.layers.0.mlp" in other.stdout


# ----------------------------------------------------------------------------- unmasked sites fail

def test_check_fails_on_a_program_that_was_never_rewritten(plain):
    result = cli("check", plain["llama"])
    assert result.returncode == 1, result.stdout + result.stderr
    assert "sampling site argmax (argmax)" in result.stdout and "no 'logit_mask' input" in result.stdout


def test_check_fails_when_a_site_reads_unmasked_logits(rewritten, workdir):
    program = torch.export.load(rewritten["llama"])
    argmax = next(n for n in program.graph.nodes if n.target == torch.ops.aten.argmax.default)
    masked = argmax.args[0]
    assert masked.target == torch.ops.aten.where.self
    argmax.replace_input_with(masked, masked.args[1])  # the site bypasses the mask again
    program.graph_module.recompile()
    path = workdir / "llama-bypassed.pt2"
    torch.export.save(program, path)
    result = cli("check", path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"does not depend on {MASK_INPUT}" in result.stdout


def test_check_flags_a_mask_narrower_than_the_vocabulary(rewritten):
    result = cli("check", rewritten["llama"], "--vocab-size", 1024 + 32)
    # vocab wider than the logits: no logits of that width exist at all.
    one_error_line(result, "no logits")
    narrow = cli("check", rewritten["llama"], "--vocab-size", 900)
    assert narrow.returncode == 1 and "needs ceil(V/32) = 29 columns" in narrow.stdout, narrow.stdout


# ----------------------------------------------------------------------------- bad input: one line, exit 2

def test_missing_file(workdir):
    one_error_line(cli("show", workdir / "nope.pt2"), "nope.pt2", "no such file")


def test_empty_file(workdir):
    path = workdir / "empty.pt2"
    path.write_bytes(b"")
    one_error_line(cli("check", path), "is empty", "torch.export.save")


def test_random_bytes(workdir):
    path = workdir / "random.pt2"
    path.write_bytes(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0)).to(torch.uint8).numpy().tobytes())
    one_error_line(cli("rewrite", path, "-o", workdir / "out.pt2"), "not a .pt2 archive")


def test_truncated_pt2(plain, workdir):
    path = workdir / "truncated.pt2"
    data = plain["llama"].read_bytes()
    path.write_bytes(data[: len(data) // 2])
    one_error_line(cli("show", path), "not a .pt2 archive", "truncated")


def test_corrupt_pt2(plain, workdir):
    path = workdir / "corrupt.pt2"
    data = bytearray(plain["llama"].read_bytes())
    middle = len(data) // 2
    data[middle:middle + 256] = bytes(256)
    path.write_bytes(bytes(data))
    one_error_line(cli("diff", plain["llama"], path), "corrupt", "checksum")


def test_zip_that_is_not_an_exported_program(workdir):
    path = workdir / "state_dict.pt2"
    torch.save({"w": torch.zeros(2)}, path)
    one_error_line(cli("show", path), "not a loadable exported program")


def test_program_without_logits(workdir):
    class Narrow(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(16, 4)

        def forward(self, x):
            return self.proj(x).argmax(-1)

    path = workdir / "narrow.pt2"
    torch.export.save(torch.export.export(Narrow(), (torch.randn(2, 16),)), path)
    one_error_line(cli("rewrite", path, "-o", workdir / "narrow-out.pt2"), "found no logits")
    one_error_line(cli("check", path), "no logits")


def test_unknown_pass(plain, workdir):
    one_error_line(cli("rewrite", plain["llama"], "-o", workdir / "x.pt2", "--passes", "logit_mask,fuse_everything"),
                   "unknown pass 'fuse_everything'", "mask_logits")


def test_rewrite_with_taps_then_check(plain, workdir):
    out = workdir / "llama.tapped.pt2"
    # the console script: exit 0, the summary on stdout
    result = run_installed("rewrite", plain["llama"], "-o", out, "--tap", "model.layers.*.mlp", "--vocab-size", VOCAB)
    assert result.returncode == 0, result.stderr
    assert "tap_modules: 2 site(s)" in result.stdout and "mask_logits: 1 site(s)" in result.stdout
    assert cli("check", out, "--vocab-size", VOCAB).returncode == 0
    program = torch.export.load(out)
    inputs = [s.arg.name for s in program.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
    assert inputs[1:] == [
        "tap_model_model_layers_0_mlp", "tap_model_model_layers_0_mlp_enabled",
        "tap_model_model_layers_1_mlp", "tap_model_model_layers_1_mlp_enabled", MASK_INPUT,
    ]
    # a reader that bypasses a tap is caught
    where = next(n for n in program.graph.nodes if n.target is torch.ops.aten.where.self and n.name.startswith("tap_"))
    reader = next(iter(where.users))
    reader.replace_input_with(where, where.args[2])
    torch.export.save(program, workdir / "bypassed.pt2")
    failed = cli("check", workdir / "bypassed.pt2")
    assert failed.returncode == 1 and "bypassing the tap" in failed.stdout, failed.stdout


def test_tap_errors(plain, workdir):
    one_error_line(cli("rewrite", plain["gpt_oss"], "-o", workdir / "x.pt2", "--tap", "model.layers.*.mlp.router"),
                   "preserve_module_call_signature")  # a saved program does not say which of 3 values is the logits
    one_error_line(cli("rewrite", plain["llama"], "-o", workdir / "x.pt2", "--tap", "model.layers.*.moe"),
                   "matches no module", "model.model.layers.0.mlp")
    one_error_line(cli("rewrite", plain["llama"], "-o", workdir / "x.pt2", "--passes", "taps"), "needs at least one --tap")


def test_conflicting_flags(plain, workdir):
    one_error_line(cli("check", plain["llama"], "--update"), "--update", "--expect")
    one_error_line(cli("rewrite", plain["llama"], "-o", plain["llama"]), "is the input file")
    one_error_line(cli("rewrite", plain["llama"], "-o", workdir / "x.pt2", "--logit-mask", "sparse"), "invalid choice")


def test_pass_option_that_does_not_fit_the_graph(plain, rewritten, workdir):
    one_error_line(cli("rewrite", plain["llama"], "-o", workdir / "x.pt2", "--vocab-size", 5000), "vocab_size=5000")
    one_error_line(cli("rewrite", rewritten["llama"], "-o", workdir / "x.pt2"), "applied already")


def test_debug_shows_the_traceback(workdir):
    path = workdir / "empty-debug.pt2"
    path.write_bytes(b"")
    result = cli("--debug", "show", path)
    assert result.returncode != 0 and "Traceback" in result.stderr


# ----------------------------------------------------------------------------- generate (one request)

def test_generate_prints_the_answer_and_its_json(tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], '
                      '"additionalProperties": false}')
    result = cli("generate", "--model", "tiny", "--prompt", "Is it ok?", "--schema", schema, "--max-tokens", "16")
    assert result.returncode == 0, result.stderr
    text, parsed = result.stdout.splitlines()[:2]
    assert text in ('{"ok": true}', '{"ok": false}'), result.stdout  # compact whitespace, the default
    assert parsed == "json: " + text
    choice = cli("generate", "--model", "tiny", "--prompt", "Pick", "--choice", "red,green", "--max-tokens", "8")
    assert choice.returncode == 0 and choice.stdout.splitlines()[0] in ("red", "green"), choice.stdout + choice.stderr


def test_generate_required_tool_call_is_one_call_unless_parallel(tmp_path):
    """One call by default: the grammar ends after it, so even random weights finish with exactly one
    valid call. --parallel-tool-calls lets them go on (to more calls, or to the token limit: exit 1)."""
    import json

    from neuron_constrain.testing import weather_tool

    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([weather_tool(6)]))
    base = ("generate", "--model", "tiny", "--prompt", "Weather?", "--tools", tools, "--tool-choice", "required",
            "--max-tokens", "200")
    one = cli(*base)
    assert one.returncode == 0, one.stdout + one.stderr
    calls = json.loads(one.stdout.split("tool calls: ", 1)[1].splitlines()[0])
    assert [c["name"] for c in calls] == ["get_weather"] and set(calls[0]["arguments"]) <= {"location", "unit"}
    many = cli(*base, "--parallel-tool-calls")
    assert many.returncode in (0, 1), many.stdout + many.stderr
    if many.returncode == 1:
        assert "max_tokens=200" in many.stderr, many.stderr


@pytest.mark.parametrize("args, words", [
    (("--schema", "/nonexistent/schema.json"), ("--schema", "no such file")),
    (("--regex", "(unclosed"), ("regex",)),
    (("--tool-choice", "required"), ("--tools",)),
    (("--choice", "a,b", "--whitespace", "none"), ("whitespace", "schema")),
    (("--choice", "a,b", "--max-tokens", "0"), ("--max-tokens",)),
    (("--choice", "a,b", "--regex", "x"), ("choice", "regex")),
])
def test_generate_bad_input_is_one_line_and_exit_2(args, words):
    result = cli("generate", "--model", "tiny", "--prompt", "hi", *args)
    assert result.returncode == 2, result.stdout + result.stderr
    one_error_line(result, *words)
