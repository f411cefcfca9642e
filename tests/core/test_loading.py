"""``neuron_constrain.load``: untrusted ``.pt2`` files never run code, saved programs load as torch loads them.

Crafted archives carry live payloads — a pickle whose ``__reduce__`` calls
``os.system("touch MARKER")``, a sympy expression and a guard that do the same —
and ``torch.export.load`` is shown to run them; every CLI command that reads a
``.pt2`` then refuses them with exit 2 and one line naming the entry, and the
marker never appears. A hypothesis fuzz mutates a valid archive (raw byte flips and
truncation, and entry contents re-zipped with valid checksums) through ``load`` and
the CLI commands.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import neuron_constrain as nc
from neuron_constrain.cli import build_parser, main
from neuron_constrain.loading import LoadError, load
from neuron_constrain.loading.archive import check_zip
from neuron_constrain.loading.program_json import _walk
from neuron_constrain.testing import GreedyStep, VocabShardedGreedyStep, random_ids, tiny_decoder
from conftest import examples

VOCAB, PADDED = 250, 256
COMMANDS = ("show", "check", "diff", "rewrite", "hlo")


class Evil:
    """Unpickling this runs ``touch marker`` (the issue's reproduction)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def pickled(value) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def rewrite_archive(src: Path, dst: Path, replace=None, add=None, compress=None) -> Path:
    """A copy of the archive ``src`` with entries (names relative to its root folder) replaced or added.

    ``compress`` maps entries to a size: that entry becomes ``size`` zero bytes, deflated (streamed).
    """
    replace, add, compress = replace or {}, add or {}, compress or {}
    with zipfile.ZipFile(src) as a, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as b:
        root = a.namelist()[0].split("/")[0] + "/"
        for info in a.infolist():
            inner = info.filename[len(root):]
            if inner in compress:
                continue
            data = a.read(info)
            if inner in replace:
                data = replace[inner](data) if callable(replace[inner]) else replace[inner]
            b.writestr(info.filename, data)
        for name, data in add.items():
            b.writestr(name if name.startswith(("..", "/")) else root + name, data)
        for name, size in compress.items():
            info = zipfile.ZipInfo(root + name)
            info.compress_type = zipfile.ZIP_DEFLATED
            with b.open(info, "w", force_zip64=True) as f:
                chunk = bytes(2**22)
                for _ in range(size // len(chunk)):
                    f.write(chunk)
    return dst


def json_edit(edit):
    def apply(data: bytes) -> bytes:
        value = json.loads(data)
        edit(value)
        return json.dumps(value).encode()
    return apply


def use_pickle(config):
    next(iter(config["config"].values()))["use_pickle"] = True


# ----------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("loading")


@pytest.fixture(scope="module")
def good(workdir) -> Path:
    """A tiny Llama greedy step with a dynamic batch, saved by torch.export.save."""
    step = GreedyStep(tiny_decoder("llama", vocab_size=PADDED, hidden_size=32, layers=1))
    with torch.no_grad():
        program = torch.export.export(step, (random_ids(2, 5, VOCAB),), dynamic_shapes=({0: torch.export.Dim("batch")},))
    path = workdir / "good.pt2"
    torch.export.save(program, path)
    return path


def _entries(path: Path) -> list[str]:
    with zipfile.ZipFile(path) as archive:
        return archive.namelist()


@pytest.fixture(scope="module")
def crafted(good, workdir) -> dict[str, tuple[Path, Path, str]]:
    """name -> (archive, marker its payload would create, the entry the error must name)."""
    root = _entries(good)[0].split("/")[0]
    cases = {}

    def case(name, entry, edits):
        marker = workdir / f"marker-{name}"
        cases[name] = (rewrite_archive(good, workdir / f"{name}.pt2", **edits(marker)), marker, entry)

    def evil_expression(marker):
        def edit(program):
            for node in _walk(program):
                if "expr_str" in node:
                    node["expr_str"] = f"__import__('os').system('touch {marker}') or {node['expr_str']}"
        return json_edit(edit)

    def evil_guard(marker):
        return json_edit(lambda program: program.update(guards_code=[f"__import__('os').system('touch {marker}') == 0"]))

    def custom_object(config):
        next(iter(config["config"].values())).update(path_name="custom_obj_0", use_pickle=True, tensor_meta=None)

    weights, constants = "data/weights/model_weights_config.json", "data/constants/model_constants_config.json"
    case("pickled_weight", f"{root}/data/weights/weight_0", lambda m: dict(
        replace={weights: json_edit(use_pickle), "data/weights/weight_0": pickled(Evil(m))}))
    case("pickled_constant", f"{root}/data/constants/tensor_0", lambda m: dict(
        replace={constants: json_edit(use_pickle), "data/constants/tensor_0": pickled(Evil(m))}))
    case("legacy_weights", f"{root}/data/weights/model.pt", lambda m: dict(add={"data/weights/model.pt": pickled(Evil(m))}))
    case("pickled_sample_inputs", f"{root}/data/sample_inputs/model.pt", lambda m: dict(
        replace={"data/sample_inputs/model.pt": pickled(Evil(m))}))
    case("sympy_expression", f"{root}/models/model.json", lambda m: dict(replace={"models/model.json": evil_expression(m)}))
    case("guard_code", f"{root}/models/model.json", lambda m: dict(replace={"models/model.json": evil_guard(m)}))
    case("custom_object", f"{root}/data/constants/custom_obj_0", lambda m: dict(
        replace={constants: json_edit(custom_object)}, add={"data/constants/custom_obj_0": b"\x80\x02."}))
    case("dotdot", "../x", lambda m: dict(add={"../x": b"x"}))
    case("absolute", "/etc/x", lambda m: dict(add={"/etc/x": b"x"}))
    case("aot_inductor", f"{root}/data/aotinductor/model/model.so", lambda m: dict(
        add={"data/aotinductor/model/model.so": b"\x7fELF"}))
    case("executable", f"{root}/extra/run", lambda m: dict(add={"extra/run": b"\x7fELF\x02\x01\x01"}))
    # 200 MB of zeros where the config declares embed_tokens float32[256, 32] (32 KiB): ~200 KB deflated.
    case("zip_bomb", f"{root}/data/weights/weight_0", lambda m: dict(compress={"data/weights/weight_0": 200 * 2**20}))
    case("short_payload", f"{root}/data/weights/weight_0", lambda m: dict(replace={"data/weights/weight_0": bytes(100)}))

    truncated = workdir / "truncated.pt2"
    data = good.read_bytes()
    truncated.write_bytes(data[: len(data) * 2 // 3])
    cases["truncated"] = (truncated, workdir / "marker-truncated", "truncated")
    return cases


# ----------------------------------------------------------------------------- the payloads are live

RUNS_CODE = ("pickled_weight", "pickled_constant", "legacy_weights", "pickled_sample_inputs", "sympy_expression",
             "guard_code")


@pytest.mark.parametrize("name", RUNS_CODE)
def test_torch_export_load_runs_the_crafted_payload(crafted, name):
    """The crafted archives are real attacks: torch.export.load (then calling the program) runs them."""
    path, marker, _ = crafted[name]
    marker.unlink(missing_ok=True)
    try:
        torch.export.load(path).module()(random_ids(2, 5, VOCAB))
    except Exception:
        pass  # most crafted archives do not load afterwards: the payload ran already
    try:
        assert marker.exists(), f"the {name} payload did not run under torch.export.load"
    finally:
        marker.unlink(missing_ok=True)


# ----------------------------------------------------------------------------- every command refuses

def _argv(command: str, path: Path, good: Path, out: Path) -> list[str]:
    return {
        "show": ["show", str(path)],
        "check": ["check", str(path)],
        "diff": ["diff", str(good), str(path)],
        "rewrite": ["rewrite", str(path), "-o", str(out / "out.pt2")],
        "hlo": ["hlo", str(path), "-o", str(out / "out.hlo.txt")],
    }[command]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("name", ["pickled_weight", "pickled_constant", "legacy_weights", "pickled_sample_inputs",
                                  "sympy_expression", "guard_code", "custom_object", "dotdot", "absolute",
                                  "aot_inductor", "executable", "zip_bomb", "short_payload", "truncated"])
def test_every_command_refuses_a_crafted_archive(crafted, good, tmp_path, capsys, name, command):
    path, marker, entry = crafted[name]
    marker.unlink(missing_ok=True)
    code = main(_argv(command, path, good, tmp_path))
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2, out + err
    assert len(lines) == 1 and "Traceback" not in err and "unexpected" not in err, err
    assert lines[0].startswith(f"neuron-constrain {command}: error: {path}"), lines[0]
    assert entry in lines[0], lines[0]
    if name in RUNS_CODE or name in ("custom_object", "aot_inductor", "executable"):
        assert "--allow-pickle" in lines[0], lines[0]
    assert out == "" and not marker.exists()
    assert not (tmp_path / "out.pt2").exists() and not (tmp_path / "out.hlo.txt").exists()


def test_messages_say_what_and_why(crafted):
    def message(name):
        with pytest.raises(LoadError) as info:
            load(crafted[name][0])
        assert info.value.entry == crafted[name][2] or name == "truncated"
        return str(info.value)

    assert "use_pickle true" in message("pickled_weight") and "'model.model.embed_tokens.weight'" in message("pickled_weight")
    assert "legacy pickled weights file" in message("legacy_weights")
    assert "GLOBAL posix.system" in message("pickled_sample_inputs")
    assert "sympify" in message("sympy_expression") and "exec" in message("guard_code")
    assert "custom-object constant" in message("custom_object")
    assert "'..' component" in message("dotdot") and "absolute path" in message("absolute")
    assert "AOTInductor" in message("aot_inductor") and "executable" in message("executable")
    assert "inflates 1029x" in message("zip_bomb") and "zip bomb" in message("zip_bomb")
    # Past the ratio limit, the payload still disagrees with the tensor its config declares.
    with pytest.raises(LoadError) as bomb:
        load(crafted["zip_bomb"][0], max_ratio=10**6)
    assert f"inflates to {200 * 2**20} bytes" in str(bomb.value) and "float32[256, 32], 32768 bytes" in str(bomb.value)
    assert "needs 32768" in message("short_payload")
    assert "not a .pt2 archive" in message("truncated") and "truncated" in message("truncated")


def test_the_console_script_refuses_the_issue_reproduction(crafted):
    """`neuron-constrain show evil.pt2` as a subprocess: one line, exit 2, no marker."""
    path, marker, entry = crafted["pickled_weight"]
    marker.unlink(missing_ok=True)
    result = subprocess.run([str(Path(sys.executable).parent / "neuron-constrain"), "show", str(path)],
                            capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert result.returncode == 2 and result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1 and entry in result.stderr, result.stderr
    assert not marker.exists()


def test_overlapping_and_duplicate_entries_are_refused(good, tmp_path):
    duplicate = tmp_path / "duplicate.pt2"
    rewrite_archive(good, duplicate)
    with zipfile.ZipFile(duplicate, "a") as archive, pytest.warns(UserWarning, match="Duplicate name"):
        archive.writestr(archive.namelist()[0], b"other")
    with pytest.raises(LoadError, match="appears twice"):
        load(duplicate)
    # Two directory records pointing at the same local bytes (the overlapping-entries zip bomb).
    data = bytearray(good.read_bytes())
    end = data.rindex(b"PK\x05\x06")
    start = int.from_bytes(data[end + 16:end + 20], "little")
    first = data.index(b"PK\x01\x02", start)
    second = data.index(b"PK\x01\x02", first + 4)
    data[second + 42:second + 46] = data[first + 42:first + 46]  # entry 2's local header offset := entry 1's
    overlapping = tmp_path / "overlapping.pt2"
    overlapping.write_bytes(bytes(data))
    with pytest.raises(LoadError, match="overlaps|local header"):
        load(overlapping)


def test_ratio_and_size_limits(good, tmp_path):
    deflated = tmp_path / "deflated.pt2"
    rewrite_archive(good, deflated, add={"extra/notes": b""}, compress={"extra/zeros": 8 * 2**20})
    with pytest.raises(LoadError, match=r"entry '.*extra/zeros' inflates \d+x .* past max_ratio=100"):
        load(deflated)
    assert check_zip(deflated, max_ratio=10**6)  # the limit is the caller's to raise
    with pytest.raises(LoadError, match="max_bytes"):
        load(good, max_bytes=10_000)


def test_the_program_json_checks_accept_what_torch_writes_and_nothing_that_runs():
    import sympy
    from torch.utils._sympy.functions import FloorDiv, ModularIndexing

    from neuron_constrain.loading.program_json import _allowed_python_targets, _bad_guard, _bad_sympy, _bad_target

    s0, s1 = sympy.Symbol("s0", positive=True, integer=True), sympy.Symbol("u1", integer=True)
    for expr in (s0, 4 * s0 * (s0 + 1), FloorDiv(s0, 2), ModularIndexing(s0, 1, 8), sympy.Max(s0, 3), s0 ** 2,
                 sympy.Eq(s0, 3), sympy.And(s0 > 1, s1 < 4), sympy.Rational(1, 2) * s0, sympy.Float(1.5) * s0,
                 -sympy.oo, sympy.true, sympy.Piecewise((s0, s1 > 0), (1, True))):
        assert _bad_sympy(sympy.srepr(expr)) is None, sympy.srepr(expr)
    for attack in ("__import__('os').system('x')", "Symbol('s0').__class__", "exec('x')", "Symbol(open('f'))",
                   "Integer(1) + Integer(2)", "Symbol('a b')", "Symbol('s0', __x=1)", "lambda: 0", "Symbol" + "(" * 300):
        assert _bad_sympy(attack), attack
    for guard in ("L['y'].size()[0] <= L['x'].size()[0]", "L['x'].size()[0] > 4", "Max(L['x'].size()[0], 2) == 8",
                  "L['x'].stride()[0] == L['x'].size()[1] and math.floor(L['x'].size()[0] / 2) < 64"):
        assert _bad_guard(guard) is None, guard
    for attack in ("__import__('os')", "L['x'].__class__", "(lambda: 0)()", "open('f')", "[x for x in L]",
                   "L['x'].size(print)[0]", "eval('1')", "L['x'].size()[0] ** 99999999"):
        assert _bad_guard(attack), attack
    allowed = _allowed_python_targets()
    for target in ("torch.ops.aten.add.Tensor", "torch.ops.aten.__and__.Tensor", "torch.ops.higher_order.cond",
                   "_operator.getitem", "torch.sym_max", "math.ceil", "not.a.module.string"):
        assert _bad_target(target, allowed) is None, target
    for attack in ("torch.ops.load_library", "torch.ops.import_module", "torch.load", "torch.os.system",
                   "_operator.call", "_operator.methodcaller", "math.__loader__", "#ext:op", "torch.ops.aten"):
        assert _bad_target(attack, allowed), attack


# ----------------------------------------------------------------------------- opting in

def test_allow_pickle_loads_a_trusted_pickled_weight(good, tmp_path, capsys):
    """A file with a genuinely pickled weight (a Parameter saved by torch.save): refused, then loaded on opt-in."""
    reference = torch.export.load(good)
    name = next(iter(reference.state_dict))
    trusted = rewrite_archive(good, tmp_path / "trusted.pt2", replace={
        "data/weights/model_weights_config.json": json_edit(use_pickle),
        "data/weights/weight_0": pickled(torch.nn.Parameter(reference.state_dict[name].detach().clone())),
    })
    with pytest.raises(LoadError, match="allow_pickle=True"):
        load(trusted)
    program = load(trusted, allow_pickle=True)
    ids = random_ids(3, 5, VOCAB, seed=1)
    assert torch.equal(program.module()(ids), reference.module()(ids))
    assert main(["show", str(trusted)]) == 2
    capsys.readouterr()
    assert main(["show", "--allow-pickle", str(trusted)]) == 0
    assert main(["diff", "--allow-pickle", str(good), str(trusted)]) == 0
    assert "same graph" in capsys.readouterr().out
    # Trusted once: the rewrite saves plain payloads, which the safe loader then reads.
    out = tmp_path / "rewritten.pt2"
    assert main(["rewrite", "--allow-pickle", str(trusted), "-o", str(out), "--vocab-size", str(VOCAB)]) == 0
    assert "logit_mask" in load(out).graph_signature.user_inputs
    for command in COMMANDS:  # every command that reads a .pt2 takes the flag
        assert build_parser().parse_args(_argv(command, trusted, good, tmp_path) + ["--allow-pickle"]).allow_pickle


# ----------------------------------------------------------------------------- normal programs load unchanged

def assert_same_program(ours, theirs) -> None:
    assert str(ours.graph_module.code) == str(theirs.graph_module.code)
    assert ours.graph_signature == theirs.graph_signature
    assert ours.module_call_graph == theirs.module_call_graph
    assert str(ours.range_constraints) == str(theirs.range_constraints)
    assert ours.verifiers == theirs.verifiers and ours._guards_code == theirs._guards_code
    assert list(ours.state_dict) == list(theirs.state_dict) and list(ours.constants) == list(theirs.constants)
    for table in ("state_dict", "constants"):
        for key, value in getattr(theirs, table).items():
            mine = getattr(ours, table)[key]
            assert type(mine) is type(value) and mine.dtype == value.dtype and mine.stride() == value.stride(), key
            assert torch.equal(mine, value) and mine.requires_grad == value.requires_grad, key
    # aliasing survives: tensors sharing storage under torch share it here too
    def shared(program):
        return [(a, b) for a, x in program.state_dict.items() for b, y in program.state_dict.items()
                if a < b and x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()]
    assert shared(ours) == shared(theirs)
    (args, kwargs), (targs, tkwargs) = ours.example_inputs, theirs.example_inputs
    assert len(args) == len(targs) and all(torch.equal(a, b) for a, b in zip(args, targs)) and kwargs.keys() == tkwargs.keys()


@pytest.mark.parametrize("arch", ["llama", "mixtral", "gpt_oss"])
def test_transformed_decoders_load_exactly_as_torch_loads_them(arch, tmp_path):
    step = GreedyStep(tiny_decoder(arch, vocab_size=PADDED, hidden_size=32, layers=1, tie_word_embeddings=arch == "llama"))
    ids = random_ids(3, 6, VOCAB, seed=2)
    transformed = nc.transform(step, (ids,), dynamic_shapes=({0: torch.export.Dim("batch")},), vocab_size=VOCAB)
    path = tmp_path / f"{arch}.pt2"
    torch.export.save(transformed.program, path)
    ours, theirs = nc.load(path), torch.export.load(path)
    assert_same_program(ours, theirs)
    mask = torch.randint(-(2**31), 2**31, (4, 8), dtype=torch.int32)
    ids = random_ids(4, 6, VOCAB, seed=3)
    got = ours.module()(ids, logit_mask=mask)
    want = theirs.module()(ids, logit_mask=mask)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert torch.equal(got[0], transformed(ids, logit_mask=mask))
    if arch == "llama":  # tied lm_head / embeddings: one payload, two views
        assert len({v.untyped_storage().data_ptr() for v in ours.state_dict.values()}) < len(ours.state_dict)


def test_programs_with_guards_views_constants_taps_processors_and_ranks_load(tmp_path):
    class Shapes(torch.nn.Module):
        def __init__(self):
            super().__init__()
            base = torch.arange(24, dtype=torch.float32)
            self.register_buffer("window", base[:12].view(3, 4))  # a view: the payload is the 24-float storage
            self.register_buffer("table", torch.arange(6, dtype=torch.bfloat16).view(2, 3).t())  # strided
            self.scale = torch.tensor(2.0)                       # a lifted tensor constant

        def forward(self, x):
            if x.shape[0] > 2:                                   # a guard in guards_code
                x = x * self.scale
            return x @ self.window.t()[:4, :3] + self.table.float().sum()

    x = torch.randn(5, 4)
    program = torch.export.export(Shapes(), (x,), dynamic_shapes=({0: torch.export.Dim.AUTO},))
    assert program._guards_code, "the program should carry a guard"
    path = tmp_path / "shapes.pt2"
    torch.export.save(program, path)
    ours, theirs = load(path), torch.export.load(path)
    assert_same_program(ours, theirs)
    assert torch.equal(ours.module()(x), theirs.module()(x))

    # every pass at once: taps (preserve_module_call_signature), logit mask, logits processors
    everything = nc.transform(GreedyStep(tiny_decoder("gpt_oss", vocab_size=PADDED, hidden_size=32, layers=1)),
                              (random_ids(2, 5, VOCAB),), vocab_size=VOCAB, taps=["model.layers.*.mlp.router"],
                              processors=["min_tokens", "logit_bias", "penalties", "min_p"])
    assert set(everything.report.passes) == {"tap_modules", "mask_logits", "process_logits"}
    # one rank of a vocab-parallel lm_head (a tp_rank input)
    rank = nc.transform(VocabShardedGreedyStep(tiny_decoder("llama", vocab_size=PADDED, hidden_size=32, layers=1), 1, 2),
                        (random_ids(2, 5, VOCAB),), vocab_size=VOCAB, tp_degree=2)
    for name, transformed in (("everything", everything), ("rank", rank)):
        saved = tmp_path / f"{name}.pt2"
        transformed.save(saved)
        assert_same_program(load(saved), torch.export.load(saved))


def test_not_a_program(tmp_path):
    state = tmp_path / "state.pt2"
    torch.save({"w": torch.zeros(2)}, state)
    with pytest.raises(LoadError, match="not a loadable exported program"):
        load(state)
    with pytest.raises(LoadError, match="no such file"):
        load(tmp_path / "missing.pt2")


# ----------------------------------------------------------------------------- fuzz

class Original(tuple):
    """(path, bytes, {entry: bytes}) of the program the fuzz mutates; a short repr for hypothesis' reports."""

    def __repr__(self):
        return f"Original({self[0]})"


@pytest.fixture(scope="module")
def small(workdir) -> Original:
    """A small program (dynamic batch, a buffer, a constant, a guard) whose bytes the fuzz mutates."""
    class Small(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8, 16)
            self.register_buffer("bias", torch.randn(16))

        def forward(self, x):
            return (self.proj(x) + self.bias).argmax(-1)

    program = torch.export.export(Small(), (torch.randn(3, 8),), dynamic_shapes=({0: torch.export.Dim("batch")},))
    path = workdir / "small.pt2"
    torch.export.save(program, path)
    with zipfile.ZipFile(path) as archive:
        contents = {info.filename: archive.read(info) for info in archive.infolist()}
    return Original((path, path.read_bytes(), contents))


FUZZ_CASES = 100  # under the ci profile; examples() scales it for the long one


def _check_mutant(path: Path, good: Path, out: Path, command: str, counts: dict[str, int]) -> None:
    """``load`` returns a program or raises LoadError (anything else fails); the command exits 0/1, or 2 with one line."""
    try:
        load(path)
        counts["loaded"] += 1
    except LoadError as e:
        assert "\n" not in str(e)
        counts["refused"] += 1
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(_argv(command, path, good, out))
    lines = err.getvalue().strip().splitlines()
    assert "Traceback" not in err.getvalue()
    assert code in (0, 1) or (code == 2 and len(lines) == 1), err.getvalue()
    counts[command] += 1


def _fuzz(mutate, small, tmp_path, capsys) -> dict[str, int]:
    """Run ``mutate(data, original) -> bytes`` FUZZ_CASES times through load and a CLI command; the counts."""
    counts = dict.fromkeys(("loaded", "refused") + COMMANDS, 0)

    @settings(max_examples=examples(FUZZ_CASES), deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def run(data):
        target = tmp_path / "mutant.pt2"
        target.write_bytes(mutate(data, small))
        _check_mutant(target, small[0], tmp_path, data.draw(st.sampled_from(COMMANDS), label="command"), counts)

    run()
    with capsys.disabled():  # the case counts, in the test log
        print(f"\n{mutate.__name__}: {counts['loaded'] + counts['refused']} cases, {counts}")
    assert counts["loaded"] + counts["refused"] == examples(FUZZ_CASES) and counts["refused"] > 0
    return counts


def test_fuzz_raw_byte_flips_and_truncation(small, tmp_path, capsys):
    def raw_flips(data, original):
        mutant = bytearray(original[1])
        for _ in range(data.draw(st.integers(1, 8), label="flips")):
            at = data.draw(st.integers(0, len(mutant) - 1), label="at")
            mutant[at] ^= data.draw(st.integers(1, 255), label="xor")
        if data.draw(st.booleans(), label="truncate"):
            mutant = mutant[: data.draw(st.integers(0, len(mutant)), label="length")]
        return bytes(mutant)

    _fuzz(raw_flips, small, tmp_path, capsys)


def test_fuzz_entry_contents_with_valid_checksums(small, tmp_path, capsys):
    """Flips inside one entry, re-zipped with a valid CRC: the checks past the zip layer are what refuse."""
    def entry_flips(data, original):
        contents = original[2]
        name = data.draw(st.sampled_from(sorted(contents)), label="entry")
        body = bytearray(contents[name])
        for _ in range(data.draw(st.integers(1, 4), label="flips")):
            if body:
                body[data.draw(st.integers(0, len(body) - 1), label="at")] ^= data.draw(st.integers(1, 255), label="xor")
        if data.draw(st.booleans(), label="truncate"):
            body = body[: data.draw(st.integers(0, len(body)), label="length")]
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w") as archive:
            for entry, value in contents.items():
                archive.writestr(entry, bytes(body) if entry == name else value)
        return buffer.getvalue()

    counts = _fuzz(entry_flips, small, tmp_path, capsys)
    assert counts["loaded"] > 0  # harmless mutations (a weight's value) still load
