"""Compiled decode programs (``export_decoder(..., compile=...)``): token for token the eager
programs' output, for every constraint kind on both engines, with jump-forward's verify
steps, sampling noise, and more requests than cache rows (rows leave and join); AOTInductor
packages that compile once (a second decoder loads them, and nothing compiles while a
``generate`` runs) and run in a plain interpreter without this library; on torch-xla, one
compilation per program and shape bucket over a whole ``generate``.

The main lane runs this file (``one_lane``: its packages take minutes to compile on two
shared cores, and the main lane has torch-xla); the latest lane's torch exports the same
programs (tests/decoding/test_generate_cached.py)."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import require_torch_xla
from test_generate_cached import PADDED, REQUESTS  # every constraint kind, and free text: 7 requests

from neuron_constrain import structured as S
from neuron_constrain.decoding import compile_decoder, export_decoder
from neuron_constrain.testing import tiny_decoder, toy_tokenizer

VOCAB = toy_tokenizer()
MAX_NEW = 20
pytestmark = pytest.mark.one_lane


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    return tmp_path_factory.mktemp("packages")


@pytest.fixture(scope="module")
def decoders(packages):
    """(eager, AOTInductor) decoders of a tiny GPT-OSS (sliding-window layers, attention
    sinks), sampled (noise and temperature inputs), with a 4-token verify step."""
    model = tiny_decoder("gpt_oss", vocab_size=PADDED)
    eager = export_decoder(model, max_batch=3, max_len=96, vocab_size=VOCAB.vocab_size, pad_id=VOCAB.eos_id,
                           new_tokens=(1, 4), sampled=True)
    return eager, compile_decoder(eager, "inductor", cache_dir=packages)


def _tokens(decoder, **options):
    """Each request's tokens; on one engine (xgrammar unless ``engine`` says): ``auto``'s race may move a request
    at another token in each run (its bounded string is exact on both engines, so it is raced)."""
    options.setdefault("engine", "xgrammar")
    prompts, constraints = zip(*REQUESTS)
    result = S.generate(decoder, list(prompts), list(constraints), MAX_NEW, tokenizer=VOCAB, **options)
    return [(o.tokens, o.finish_reason, o.error) for o in result.outputs], result


@pytest.mark.parametrize("engine", ["xgrammar", "llguidance"])
@pytest.mark.parametrize("jump_forward", [None, "exact"])
def test_compiled_generate_is_token_identical_to_eager(decoders, engine, jump_forward):
    eager, compiled = decoders
    expected, _ = _tokens(eager, engine=engine, jump_forward=jump_forward)
    got, result = _tokens(compiled, engine=engine, jump_forward=jump_forward)
    assert got == expected
    assert all(error is None for _, _, error in got)
    for (_, constraint), out in zip(REQUESTS, result.outputs):
        if constraint is not None and out.finish_reason == "stop":
            assert S.validate_output(constraint, out.text) is None, out.text
    assert result.outputs[2].finish_reason == "stop" and result.outputs[2].text in ("yes", "no", "maybe")


def test_compiled_sampling_is_token_identical_to_eager(decoders):
    eager, compiled = decoders
    expected, _ = _tokens(eager, temperature=0.9, seed=3)
    got, _ = _tokens(compiled, temperature=0.9, seed=3)
    assert got == expected
    assert got != _tokens(compiled, temperature=0.9, seed=4)[0], "the noise must reach the compiled program"


def test_compiled_decoder_shares_the_eager_cache_and_keeps_its_shapes(decoders):
    eager, compiled = decoders
    assert compiled.eager is eager and compiled.compiled == "inductor"
    assert all(a is b for a, b in zip(compiled.cache, eager.cache))
    assert sorted(compiled.steps) == [1, 4] and set(compiled.packages) == {"prefill", "step1", "step4"}
    with pytest.raises(ValueError, match="already compiled"):
        compile_decoder(compiled, "inductor")
    with pytest.raises(ValueError, match="choose one of inductor, xla"):
        compile_decoder(eager, "tensorrt")
    mask = torch.zeros(2, 3, dtype=torch.int32)  # the compiled program keeps the host-side checks
    with pytest.raises(Exception, match="logit_mask has shape"):
        compiled.run_step([[1], [2]], [3, 3], logit_mask=mask, **_greedy(compiled, 2))


def test_packages_compile_once(decoders, packages, monkeypatch):
    """A second decoder of the same graph loads its packages; a whole generate compiles nothing."""
    import torch._inductor

    eager, first = decoders

    def refuse(*args, **kwargs):
        raise AssertionError("AOTInductor compiled again")

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", refuse)
    again = compile_decoder(eager, "inductor", cache_dir=packages)
    assert again.packages_built == 0 and again.packages == first.packages
    before = dict(torch._dynamo.utils.counters["inductor"])
    got, _ = _tokens(again, jump_forward="exact")
    assert got == _tokens(eager, jump_forward="exact")[0]
    assert dict(torch._dynamo.utils.counters["inductor"]) == before


def _unfrozen_linears(decoder) -> list[str]:
    """The projection weights a decoder's packages still take by name (frozen ones are
    Inductor's ``_frozen_param`` constants, prepacked for oneDNN)."""
    from torch._inductor import aoti_load_package

    left = []
    for path in decoder.packages.values():
        names = aoti_load_package(str(path)).get_constant_fqns()
        assert any(name.startswith("_frozen_param") for name in names), path
        left += [name for name in names if name.endswith("proj.weight")]
    return left


def test_weights_are_frozen_into_the_packages(decoders):
    """Every projection's weight is frozen into the packages, for the dynamic batch too
    (Inductor freezes only with autograd off, and says nothing when it does not)."""
    assert _unfrozen_linears(decoders[1]) == []


def _inductor_libraries() -> set:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return set(pathlib.Path(cache_dir()).rglob("*.wrapper.so"))


def test_frozen_weights_at_batch_one(packages):
    """A decoder of one row (a static batch): frozen weights, the same tokens as eager, each
    constraint kind one request at a time; Inductor's cache keeps no copy of the packages'
    libraries (they hold the weights: 1.8 GB a test run, never read again)."""
    model = tiny_decoder("llama", vocab_size=PADDED)
    eager = export_decoder(model, max_batch=1, max_len=64, vocab_size=VOCAB.vocab_size, pad_id=VOCAB.eos_id)
    before = _inductor_libraries()
    compiled = compile_decoder(eager, "inductor", cache_dir=packages)
    assert compiled.packages_built == 2 and _inductor_libraries() <= before
    assert sorted(p.name for p in packages.iterdir() if not p.name.endswith(".pt2")) == []  # no scratch left
    assert _unfrozen_linears(compiled) == []
    prompts, constraints = zip(*REQUESTS[:4])
    # one engine: auto's race may move a request at another token in each run (both answers valid, not identical)
    expected = S.generate(eager, list(prompts), list(constraints), 16, tokenizer=VOCAB, engine="xgrammar")
    got = S.generate(compiled, list(prompts), list(constraints), 16, tokenizer=VOCAB, engine="xgrammar")
    assert [o.tokens for o in got.outputs] == [o.tokens for o in expected.outputs]
    assert got.outputs[2].finish_reason == "stop" and got.outputs[2].text in ("yes", "no", "maybe")


PLAIN = textwrap.dedent("""
    import json, sys
    import torch
    from torch._inductor import aoti_load_package
    step = aoti_load_package(sys.argv[1])
    step.load_constants(torch.load(sys.argv[2]), check_full_update=False)  # the cache; the weights are inside
    inputs = torch.load(sys.argv[3])
    tokens, empty = step(*inputs["args"], **inputs["kwargs"])
    assert not any(name.startswith("neuron_constrain") for name in sys.modules), "the library was imported"
    print(json.dumps({"tokens": tokens.tolist(), "empty": empty.tolist()}))
""")


def test_package_runs_in_plain_torch(decoders, tmp_path):
    """The step package, its constants and one step's inputs: a fresh interpreter that imports
    only torch gives the tokens the library's own call gives."""
    eager, compiled = decoders
    prompts = [VOCAB.encode("hello"), VOCAB.encode("two words")]
    first, _ = eager.run_prefill(prompts, rows=[0, 1], **_greedy(eager, 2))
    compiled.save_cache(tmp_path / "cache.pt")  # what the prefill wrote
    positions = torch.tensor([len(p) for p in prompts])[:, None]
    mask = torch.full((2, -(-VOCAB.vocab_size // 32)), -1, dtype=torch.int32)
    mask[1, :] = 0
    mask[1, 0] = 1 << 5  # row 1 may only emit token 5
    args = (first[:, None], positions, torch.arange(64)[None, :] <= positions, *_greedy(eager, 2).values())
    kwargs = {"logit_mask": mask}
    torch.save({"args": args, "kwargs": kwargs}, tmp_path / "inputs.pt")
    out = subprocess.run([sys.executable, "-c", PLAIN, str(compiled.packages["step1"]), str(tmp_path / "cache.pt"),
                          str(tmp_path / "inputs.pt")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    plain = json.loads(out.stdout.strip().splitlines()[-1])
    mine, empty = eager.steps[1].run(*args, **kwargs)
    assert plain["tokens"] == mine.tolist() and plain["tokens"][1] == 5
    assert plain["empty"] == empty["logit_mask"].tolist() == [False, False]


def _greedy(decoder, batch):
    return {"noise": torch.ones(batch, decoder.logits_width), "temperature": torch.ones(batch)}


def test_xla_compiles_once_per_bucket():
    """On the XLA device (the lowering torch-neuronx compiles): a generate with rows joining and
    leaving, windows and prompt lengths in several buckets compiles one graph per program
    and shape it ran (plus the one that moves cache rows), never one shape twice."""
    require_torch_xla()
    import torch_xla.debug.metrics as metrics

    model = tiny_decoder("llama", vocab_size=PADDED)
    eager = export_decoder(model, max_batch=3, max_len=96, vocab_size=VOCAB.vocab_size, pad_id=VOCAB.eos_id)
    xla = compile_decoder(eager, "xla")
    assert xla.device.type == "xla" and all(t.device.type == "xla" for t in xla.cache)
    shapes = set()
    for name, program in [("prefill", xla.prefill), *((f"step{n}", p) for n, p in xla.steps.items())]:
        run = program.run

        def recording(*args, _name=name, _run=run, **kwargs):
            shapes.add((_name, *(tuple(a.shape) for a in args)))
            return _run(*args, **kwargs)

        program.run = recording
    compiles = lambda: (metrics.metric_data("CompileTime") or (0,))[0]  # noqa: E731
    before = compiles()
    expected, _ = _tokens(eager)
    for _ in range(2):  # requests join as their grammars compile: the second run may batch them otherwise
        assert _tokens(xla)[0] == expected
        # each (program, shapes) bucket compiled at most once, plus the graph that moves cache rows
        assert 0 < compiles() - before <= len(shapes) + 1, (compiles() - before, sorted(shapes))
    seen = len(shapes)
    assert _tokens(xla, engine="llguidance")[0] == _tokens(eager, engine="llguidance")[0]
    assert compiles() - before <= len(shapes) + 1 and len(shapes) >= seen


def test_a_package_is_keyed_by_its_weights(decoders):
    """Frozen weights live in the package: other weights (a fine-tune of the same graph) are another package."""
    from neuron_constrain.decoding.compiled import weights_digest

    eager, _ = decoders
    program = eager.steps[1].program
    before = weights_digest(program, eager.cache)
    weight = program.state_dict["model.lm_head.weight"]
    with torch.no_grad():
        slot, value = eager.cache[0][0, 0, 0, 0].item(), weight[0, 0].item()
        eager.cache[0][0, 0, 0, 0] = slot + 1.0  # the cache's values are not part of it
        assert weights_digest(program, eager.cache) == before
        weight[0, 0] = value + 1e-3
        try:
            assert weights_digest(program, eager.cache) != before
        finally:
            weight[0, 0], eager.cache[0][0, 0, 0, 0] = value, slot


def test_out_of_range_inputs_are_refused_on_the_host(decoders):
    """A compiled program has no index checks of its own (decoding.compiled): a token id past
    the embedding, or a cache row past the cache, is refused before any program runs."""
    eager, compiled = decoders
    rows = compiled.embedding_rows
    assert rows == eager.prefill.program.state_dict["model.model.embed_tokens.weight"].shape[0]
    for decoder in (eager, compiled):
        with pytest.raises(ValueError, match=rf"token id {rows}: the model's embedding has ids 0..{rows - 1}"):
            decoder.run_prefill([[1, rows]], rows=[0], **_greedy(decoder, 1))
        with pytest.raises(ValueError, match=r"token id -1"):
            decoder.run_step([[-1]], positions=[3], **_greedy(decoder, 1))
        with pytest.raises(ValueError, match=r"rows \[3\]: each prompt takes its own cache row, 0..2"):
            decoder.run_prefill([[1, 2]], rows=[3], **_greedy(decoder, 1))


def test_auto_compiles_nothing_and_loads_what_is_built(decoders, packages, tmp_path):
    """``compile="auto"``: the packages where all of them are built (loaded, none compiled),
    the eager programs where any is missing (no first compile of minutes)."""
    eager, compiled = decoders
    options = dict(max_batch=3, max_len=96, vocab_size=VOCAB.vocab_size, pad_id=VOCAB.eos_id, new_tokens=(1, 4),
                   sampled=True)
    model = tiny_decoder("gpt_oss", vocab_size=PADDED)
    loaded = export_decoder(model, compile="auto", package_dir=packages, **options)
    assert loaded.compiled == "inductor" and loaded.packages_built == 0 and loaded.packages == compiled.packages
    assert _tokens(loaded)[0] == _tokens(eager)[0]
    assert export_decoder(model, compile="auto", package_dir=tmp_path, **options).compiled is None
    assert list(tmp_path.iterdir()) == []


def test_large_vocabulary_mask_compiled(packages):
    """A 262,144-token vocabulary (Gemma 3's): the packed mask is 8,192 words a row; the
    compiled prefill and step pick what eager picks, the best allowed token of each row."""
    from neuron_constrain.kernels import pack_bool_mask

    width = 262_144
    model = tiny_decoder("qwen3", vocab_size=width)
    eager = export_decoder(model, max_batch=2, max_len=32, vocab_size=width)
    compiled = compile_decoder(eager, "inductor", cache_dir=packages)
    generator = torch.Generator().manual_seed(0)
    allowed = torch.zeros(2, width, dtype=torch.bool)
    allowed[0, torch.randint(0, width, (7,), generator=generator)] = True
    allowed[1, width - 3:] = True  # the last word of the row
    mask = pack_bool_mask(allowed)
    assert mask.shape == (2, width // 32)
    prompts = [[5, 9, 200_000], [261_000, 3]]
    picks = []
    for decoder in (eager, compiled):
        first, _ = decoder.run_prefill(prompts, rows=[0, 1], logit_mask=mask)
        second, _ = decoder.run_step(first[:, None], positions=[3, 2], logit_mask=mask)
        picks.append((first.tolist(), second.tolist()))
    assert picks[0] == picks[1]
    with torch.no_grad():  # the best allowed token of the prefill's last position, from the model itself
        for row, prompt in enumerate(prompts):
            logits = model(torch.tensor([prompt])).logits[0, -1]
            best = int(logits.masked_fill(~allowed[row], float("-inf")).argmax())
            assert picks[1][0][row] == best
