"""Reference captures on disk: ``save_captures`` / ``load_captures`` (safetensors + JSON, no pickle),
``TensorReplacer.from_files`` (the seeds' online mode), and the seeds' ``torch.save`` format read
weights-only — a malicious pickle in it is refused and never runs.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from neuron_constrain.loading import LoadError
from neuron_constrain.replacement import TensorReplacer, capture, load_captures, save_captures
from neuron_constrain.replacement.files import FORMAT, METADATA_KEY
from neuron_constrain.testing import LogitsStep, tiny_decoder

PROMPTS = [[1, 2, 3], [4, 5], [1, 2, 3, 9, 8]]
GATE = "model.model.layers.0.mlp.gate"


class Evil:
    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def captures():
    """Router logits of a tiny Mixtral (float32, full recompute: step k has len(prompt) + k rows), plus a
    bfloat16 tap in the seeds' layout ([1, S, E] prefill, [1, 1, E] one-token decode steps)."""
    model = tiny_decoder("mixtral", vocab_size=128, hidden_size=32, layers=1)
    result = capture(LogitsStep(model), PROMPTS, ["model.layers.*.mlp.gate"], max_new_tokens=3)
    for i, steps in enumerate(result):
        gate = steps[GATE]
        steps["bf16.router"] = [gate[0].unsqueeze(0).to(torch.bfloat16)] + \
                               [s[-1:].unsqueeze(0).to(torch.bfloat16) + i for s in gate[1:]]
    result[1]["only.in.prompt1"] = [torch.arange(8, dtype=torch.int64).view(2, 4)]
    return result


def assert_same_captures(got, want) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert sorted(g) == sorted(w)
        for name in w:
            assert len(g[name]) == len(w[name]), name
            for a, b in zip(g[name], w[name]):
                assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name


def assert_same_context(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        (va, ea), (vb, eb) = a[name], b[name]
        assert va.dtype == vb.dtype and torch.equal(va, vb) and torch.equal(ea, eb), name


def contexts(replacer: TensorReplacer) -> list[dict]:
    """Prefill with padding, batched decode, speculative decode and warmup contexts of one replacer."""
    replacer.register_request("a", PROMPTS[0] + [77, 78])  # extends prompt 0 (teacher-forcing retry)
    replacer.register_request("b", PROMPTS[1])
    replacer.register_request("c", PROMPTS[2] + [5])        # prompt 2, not its prefix prompt 0
    assert [replacer.prompt_index(r) for r in "abc"] == [0, 1, 2]
    return [
        replacer.build_context(["a"], [0, 1, 2, 2, 2], is_prefill=True),
        replacer.build_context(["a", "b", "c"], [3, 2, 6, 0]),
        replacer.build_context(["c", "b"], [5, 6, 7, 2, 3, 4], tokens_per_req=3),
        replacer.warmup_context(4),
    ]


# ----------------------------------------------------------------------------- round trip

def test_round_trip_keeps_values_dtypes_steps_and_prompt_ids(captures, tmp_path):
    path = tmp_path / "captures.safetensors"
    save_captures(path, captures, PROMPTS)
    got, prompts = load_captures(path)
    assert prompts == PROMPTS
    assert_same_captures(got, captures)
    assert got[0]["bf16.router"][0].dtype == torch.bfloat16 and len(got[0][GATE]) == 4
    # The documented layout: tensors "{prompt}/{step}/{tap}", a JSON structure in the header.
    with safe_open(str(path), framework="pt") as f:
        header = json.loads(f.metadata()[METADATA_KEY])
        assert f"2/3/{GATE}" in f.keys() and "1/0/only.in.prompt1" in f.keys()
    assert header["format"] == FORMAT and header["version"] == 1
    assert header["prompts"][1]["token_ids"] == PROMPTS[1]
    assert header["prompts"][0]["taps"]["bf16.router"] == {"dtype": "bfloat16", "shapes": [[1, 3, 4]] + [[1, 1, 4]] * 3}
    assert header["prompts"][2]["taps"][GATE]["shapes"] == [[5, 4], [6, 4], [7, 4], [8, 4]]


def test_from_files_builds_the_same_contexts_as_in_memory(captures, tmp_path):
    path = tmp_path / "captures.safetensors"
    save_captures(path, captures, PROMPTS)
    in_memory, from_file = contexts(TensorReplacer(captures, PROMPTS)), contexts(TensorReplacer.from_files(path))
    for a, b in zip(in_memory, from_file):
        assert_same_context(a, b)
    prefill = from_file[0]
    assert prefill[GATE][1].tolist() == [True, True, True, False, False]  # the repeated position is padding
    assert torch.equal(prefill[GATE][0][:3], captures[0][GATE][0])
    assert prefill["bf16.router"][0].dtype == torch.bfloat16


def test_seeds_torch_save_format_is_read_weights_only(captures, tmp_path):
    tensors, ids = tmp_path / "tensors.pt", tmp_path / "prompt_token_ids.pt"
    torch.save(captures, tensors)
    for saved in (PROMPTS, [torch.tensor(p) for p in PROMPTS]):
        torch.save(saved, ids)
        got, prompts = load_captures(tensors, ids)
        assert prompts == PROMPTS
        assert_same_captures(got, captures)
    for a, b in zip(contexts(TensorReplacer(captures, PROMPTS)), contexts(TensorReplacer.from_files(tensors, ids))):
        assert_same_context(a, b)


# ----------------------------------------------------------------------------- refusals

def test_a_malicious_pickle_in_the_seeds_format_is_refused(captures, tmp_path):
    marker = tmp_path / "marker"
    evil, ids = tmp_path / "tensors.pt", tmp_path / "prompt_token_ids.pt"
    torch.save([{GATE: [Evil(marker)]}], evil)
    torch.save(PROMPTS[:1], ids)
    torch.load(evil, weights_only=False)  # the payload is live: a full unpickle runs it
    assert marker.exists()
    marker.unlink()
    with pytest.raises(LoadError, match=r"tensors.pt.*weights-only load refuses \(.*GLOBAL posix.system"):
        load_captures(evil, ids)
    with pytest.raises(LoadError, match="posix.system"):
        TensorReplacer.from_files(evil, ids)
    # ... and in the prompt ids file
    torch.save(captures, tmp_path / "good.pt")
    torch.save([Evil(marker)], ids)
    with pytest.raises(LoadError, match=r"prompt_token_ids.pt.*posix.system"):
        load_captures(tmp_path / "good.pt", ids)
    assert not marker.exists()


def _tampered(tmp_path: Path, captures, edit) -> Path:
    """A captures file rewritten by hand: ``edit(tensors, header)`` changes either before it is saved."""
    path = tmp_path / "good.safetensors"
    save_captures(path, captures, PROMPTS)
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        header = json.loads(f.metadata()[METADATA_KEY])
    edit(tensors, header)
    out = tmp_path / "tampered.safetensors"
    save_file(tensors, str(out), metadata={METADATA_KEY: json.dumps(header)} if header else None)
    return out


def test_files_whose_parts_disagree_are_refused(captures, tmp_path):
    def shape(t, h):
        h["prompts"][0]["taps"][GATE]["shapes"][1] = [9, 4]

    def dtype(t, h):
        h["prompts"][0]["taps"][GATE]["dtype"] = "float16"

    def extra(t, h):
        t["9/0/smuggled"] = torch.zeros(2)

    def missing(t, h):
        del t[f"0/3/{GATE}"]

    def ids(t, h):
        h["prompts"][0]["token_ids"] = [1, "2"]

    def version(t, h):
        h["version"] = 2

    def no_metadata(t, h):
        h.clear()

    cases = {
        shape: f"entry '0/1/{GATE}' is float32[4, 4] but the metadata says float32[9, 4]",
        dtype: "says float16",
        extra: "entry '9/0/smuggled' is a tensor the metadata does not describe",
        missing: f"entry '0/3/{GATE}' is missing",
        ids: "prompts[0].token_ids that is not a list of non-negative token ids",
        version: "captures format version 2",
        no_metadata: "without the 'neuron_constrain.captures' metadata",
    }
    for edit, message in cases.items():
        with pytest.raises(LoadError, match=message.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
            load_captures(_tampered(tmp_path, captures, edit))


def test_unreadable_files_are_refused_with_one_line(captures, tmp_path):
    good = tmp_path / "good.safetensors"
    save_captures(good, captures, PROMPTS)
    data = good.read_bytes()
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(data[: len(data) - 100])
    garbage = tmp_path / "garbage.bin"
    garbage.write_bytes(bytes(range(256)) * 4)
    tensors = tmp_path / "tensors.pt"
    torch.save(captures, tensors)
    for call, message in [
        (lambda: load_captures(truncated), "not a readable safetensors file"),
        (lambda: load_captures(garbage, tmp_path / "ids.pt"), "not a torch.save file"),
        (lambda: load_captures(garbage), "not a captures file written by save_captures"),
        (lambda: load_captures(tmp_path / "missing"), "no such file"),
        (lambda: load_captures(good, tensors), "drop prompt_token_ids_path"),
        (lambda: load_captures(tensors), "pass prompt_token_ids_path"),
    ]:
        with pytest.raises(LoadError, match=message) as info:
            call()
        assert "\n" not in str(info.value)


def test_save_checks_its_inputs(captures, tmp_path):
    with pytest.raises(ValueError, match="3 captures but 2 prompts"):
        save_captures(tmp_path / "x", captures, PROMPTS[:2])
    with pytest.raises(ValueError, match=r"prompt_token_ids\[1\] must be a list of non-negative token ids"):
        save_captures(tmp_path / "x", captures, [PROMPTS[0], [1.5], PROMPTS[2]])
    mixed = [{"t": [torch.zeros(2), torch.zeros(2, dtype=torch.float16)]}]
    with pytest.raises(ValueError, match=r"captures\[0\]\['t'\] must be a list of tensors of one dtype"):
        save_captures(tmp_path / "x", mixed, [[1, 2]])
    assert not (tmp_path / "x").exists()
