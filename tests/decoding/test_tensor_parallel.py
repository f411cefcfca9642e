"""Vocab-parallel logit masks: the sharded kernel, one program for every rank, and
greedy decoding across 2 and 4 ``torch.distributed`` (gloo) processes."""
from __future__ import annotations

import functools
import hashlib
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

import neuron_constrain as nc
from neuron_constrain.core.errors import EmptyMaskRowError, InputError, TransformError
from neuron_constrain.kernels import allowed_shard_columns, pack_bool_mask
from neuron_constrain.testing import (
    GreedyStep,
    VocabShardedGreedyStep,
    greedy_across_ranks,
    pick_across_ranks,
    random_ids,
    tiny_decoder,
)
from conftest import require_torch_xla

aten = torch.ops.aten
BATCH, SEQ = 4, 5
SMALL = dict(hidden_size=32, layers=1)  # every rank builds and exports its own model
BATCH_DIM = torch.export.Dim("batch")


def rank_tensor(rank: int) -> torch.Tensor:
    return torch.tensor([rank], dtype=torch.int32)


def shard_of(vocab: int, tp: int) -> int:
    return -(-vocab // tp)


def test_masks(vocab: int, shard: int, tp: int) -> list[torch.Tensor]:
    """Bool masks ``[BATCH, vocab]``, the same in every process: random rows, a row whose
    tokens all lie in the (padded) last shard, a row straddling the rank 0 / rank 1
    boundary (a multiple of 32 or not, by the case), a dense row; then all-allowed."""
    masks = []
    for seed in range(2):
        generator = torch.Generator().manual_seed(seed)
        allowed = torch.rand(BATCH, vocab, generator=generator) < 0.02
        allowed[0, torch.randint(0, vocab, (1,), generator=generator)] = True
        allowed[1] = False
        allowed[1, (tp - 1) * shard + torch.randint(0, vocab - (tp - 1) * shard, (3,), generator=generator)] = True
        allowed[2] = False
        allowed[2, shard - 5 - seed : shard + 5] = True
        allowed[3] = torch.rand(vocab, generator=generator) < 0.6
        masks.append(allowed)
    masks.append(torch.ones(BATCH, vocab, dtype=torch.bool))
    return masks


test_masks.__test__ = False  # a helper, not a test


def worst_token_only(decoder, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """Allow only each row's lowest-logit token: any padding column (a zero row of the
    padded last shard, or a padded lm_head row) would beat it unless masked off."""
    with torch.no_grad():
        worst = decoder(input_ids=ids, use_cache=False).logits[:, -1, :vocab].argmin(-1)
    allowed = torch.zeros(ids.shape[0], vocab, dtype=torch.bool)
    allowed[torch.arange(ids.shape[0]), worst] = True
    return allowed


def feed(mask: torch.Tensor, fmt: str) -> torch.Tensor:
    return pack_bool_mask(mask) if fmt == "packed" else mask


# ----------------------------------------------------------------------------- kernel


@given(
    vocab=st.integers(1, 300),
    tp=st.integers(1, 5),
    pad=st.sampled_from([0, 1, 7, 33]),
    rows=st.integers(1, 3),
    density=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
)
def test_property_shards_concatenate_to_the_full_mask(vocab, tp, pad, rows, density, seed):
    # A padded lm_head (vocab + pad rows) sharded over tp ranks, the last shard padded.
    shard = shard_of(vocab + pad, tp)
    generator = torch.Generator().manual_seed(seed)
    allowed = torch.rand(rows, vocab, generator=generator) < density
    packed = pack_bool_mask(allowed)
    packed[:, -1] |= torch.tensor(-1 << (vocab % 32) if vocab % 32 else 0, dtype=torch.int32)  # junk past V
    for mask in (packed, allowed):
        # Traced once with the rank as a tensor input, as the pass inserts it.
        kernel = make_fx(lambda m, r: allowed_shard_columns(m, shard, vocab, r))(mask, rank_tensor(0))
        columns = torch.cat([kernel(mask, rank_tensor(r)) for r in range(tp)], dim=-1)
        assert columns.shape == (rows, shard * tp)
        assert torch.equal(columns[:, :vocab], allowed)
        assert not bool(columns[:, vocab:].any())  # padding columns are never allowed


def test_kernel_rejects_a_mask_of_the_wrong_width():
    with pytest.raises(ValueError, match=r"needs ceil\(1000/32\) = 32"):
        allowed_shard_columns(torch.zeros(1, 31, dtype=torch.int32), 250, 1000, rank_tensor(0))
    with pytest.raises(ValueError, match="bool logit mask has 999 columns but vocab_size=1000"):
        allowed_shard_columns(torch.zeros(1, 999, dtype=torch.bool), 250, 1000, rank_tensor(0))


# ----------------------------------------------------------------------------- one process, all ranks


@functools.lru_cache(maxsize=None)
def model(vocab: int):
    return tiny_decoder("llama", vocab_size=vocab, **SMALL)


@functools.lru_cache(maxsize=None)
def sharded_program(vocab: int, tp: int, rank: int = 0):
    with torch.no_grad():
        return torch.export.export(
            VocabShardedGreedyStep(model(vocab), rank, tp), (random_ids(BATCH, SEQ, vocab),),
            dynamic_shapes=({0: BATCH_DIM},),
        )


@functools.lru_cache(maxsize=None)
def plain_program(vocab: int):
    """The unsharded greedy step, exported once (as ``nc.transform`` exports a module) for every reference."""
    with torch.no_grad():
        return torch.export.export(GreedyStep(model(vocab)), (random_ids(BATCH, SEQ, vocab),),
                                   dynamic_shapes=({0: BATCH_DIM},))


@functools.lru_cache(maxsize=None)
def reference(vocab: int, tokenizer_vocab: int, fmt: str):
    return nc.transform(plain_program(vocab), logit_mask=fmt, vocab_size=tokenizer_vocab)


def run_all_ranks(t, vocab: int, tp: int, ids: torch.Tensor, **kwargs) -> torch.Tensor:
    """Run ONE transformed program as every rank in turn (load the rank's lm_head shard,
    feed its ``tp_rank``), then pick the greedy token across ranks."""
    values, tokens = [], []
    for rank in range(tp):
        step = VocabShardedGreedyStep(model(vocab), rank, tp)
        t.graph_module.lm_head_shard = step.lm_head_shard  # a new tensor: the program's own stays rank 0's
        value, index = t(ids, tp_rank=rank_tensor(rank), **kwargs)
        values.append(value)
        tokens.append(index + rank * step.shard_width)
    return pick_across_ranks(torch.stack(values), torch.stack(tokens))


SINGLE_CASES = [  # (lm_head rows, tokenizer vocab, tp, mask format)
    (1001, 1001, 3, "packed"),  # shards of 334 (mid-word boundaries), last shard padded by 1
    (1024, 1000, 4, "packed"),  # padded lm_head: columns 1000..1023 of the last shard are padding
    (1001, 1001, 2, "bool"),
]


@pytest.mark.parametrize("vocab,tokenizer_vocab,tp,fmt", SINGLE_CASES)
def test_one_program_serves_every_rank(vocab, tokenizer_vocab, tp, fmt):
    t = nc.transform(sharded_program(vocab, tp), logit_mask=fmt, vocab_size=tokenizer_vocab, tp_degree=tp)
    (site,) = t.report["mask_logits"].sites
    assert site["kind"] == "max"
    assert [i.name for i in t.report.inputs_added] == ["logit_mask", "tp_rank"]
    assert [n.name for n in t.program.graph.nodes if n.op == "placeholder"][-2:] == ["logit_mask", "tp_rank"]
    shard = shard_of(vocab, tp)
    for batch in (BATCH, 2):  # the batch stays dynamic
        ids = random_ids(batch, SEQ, tokenizer_vocab, seed=batch)
        masks = test_masks(tokenizer_vocab, shard, tp) + [worst_token_only(model(vocab), ids, tokenizer_vocab)]
        for allowed in masks:
            allowed = allowed[:batch]
            mask = feed(allowed, fmt)
            expected = reference(vocab, tokenizer_vocab, fmt)(ids, logit_mask=mask)
            tokens = run_all_ranks(t, vocab, tp, ids, logit_mask=mask)
            assert torch.equal(tokens, expected), (tokens, expected)
            assert bool(allowed[torch.arange(batch), tokens].all())


def test_no_rank_is_baked_into_the_program():
    # Each rank traces its own step (different weights); the rewritten programs are the same code.
    codes = {nc.transform(sharded_program(1001, 3, r), vocab_size=1001, tp_degree=3).program.graph_module.code
             for r in range(3)}
    assert len(codes) == 1
    t = nc.transform(sharded_program(1001, 3), vocab_size=1001, tp_degree=3)
    rank_input = next(n for n in t.program.graph.nodes if n.name == "tp_rank")
    inserted = [n for n in t.program.graph.nodes if n.name.startswith("logit_mask_") and n.op == "call_function"]
    assert len(inserted) == t.report["mask_logits"].nodes_inserted
    # op-count contract: the shard's columns come from tp_rank; gather words and bits, one where(.., -inf)
    ops = [n.target for n in inserted]
    masks = [n for n in inserted if n.target == aten.where.self and n.args[2].target == aten.scalar_tensor.default
             and n.args[2].args[0] == float("-inf")]
    assert ops.count(aten.index_select.default) == 2 and len(masks) == 1
    assert aten.slice.Tensor not in ops  # no static slice of the mask: a rank constant would hide there
    assert any(u in inserted for u in rank_input.users)
    assert [u.target for u in masks[0].users] == [aten.max.dim]


def test_empty_rows_are_flagged_on_every_rank_and_fallback_is_global():
    vocab, tp = 1001, 3
    ids = random_ids(BATCH, SEQ, vocab)
    allowed = test_masks(vocab, shard_of(vocab, tp), tp)[0]
    allowed[2] = False
    flagged = nc.transform(sharded_program(vocab, tp), vocab_size=vocab, tp_degree=tp)
    for rank in range(tp):  # the flag reads the full mask: every rank raises, naming the row
        with pytest.raises(EmptyMaskRowError, match=r"row\(s\) \[2\]"):
            flagged(ids, logit_mask=pack_bool_mask(allowed), tp_rank=rank_tensor(rank))
    eos = 700  # held by rank 2 (columns 668..1001)
    fallback = nc.transform(sharded_program(vocab, tp), vocab_size=vocab, tp_degree=tp, empty_row=eos)
    tokens = run_all_ranks(fallback, vocab, tp, ids, logit_mask=pack_bool_mask(allowed))
    assert int(tokens[2]) == eos
    assert bool(allowed[[0, 1, 3], tokens[[0, 1, 3]]].all())


def test_tp_rank_must_be_fed_and_in_range():
    t = nc.transform(sharded_program(1001, 3), vocab_size=1001, tp_degree=3)
    ids = random_ids(BATCH, SEQ, 1001)
    with pytest.raises(InputError, match=r"tp_rank is required \(tp_rank: int32\[1\]"):
        t(ids)
    with pytest.raises(InputError, match=r"tp_rank=\[3\] is outside \[0, 3\)"):
        t(ids, tp_rank=rank_tensor(3))
    with pytest.raises(InputError, match=r"tp_rank=\[-1\] is outside"):
        t(ids, tp_rank=rank_tensor(-1))
    with pytest.raises(InputError, match="dtype torch.int64 but the graph takes torch.int32"):
        t(ids, tp_rank=torch.tensor([0]))
    with pytest.raises(InputError, match=r"shape \(\) but these inputs need \(1,\)"):
        t(ids, tp_rank=torch.tensor(0, dtype=torch.int32))


def test_bad_tp_options_name_the_fix():
    program = sharded_program(1001, 3)  # shards of 334 columns
    for bad in (0, -2, 1.5, True):
        with pytest.raises(TransformError, match=r"tp_degree=.*an int >= 1"):
            nc.transform(program, vocab_size=1001, tp_degree=bad)
    with pytest.raises(TransformError, match=r"vocab_size=1001 does not fit in tp_degree=2 shards of 334 columns"):
        nc.transform(program, vocab_size=1001, tp_degree=2)
    with pytest.raises(TransformError, match=r"the last of tp_degree=4 ranks would hold no token"):
        nc.transform(program, vocab_size=1001, tp_degree=4)
    with torch.no_grad():  # the full (unsharded) lm_head, mistaken for a shard
        full = torch.export.export(GreedyStep(model(1001)), (random_ids(BATCH, SEQ, 1001),))
    with pytest.raises(TransformError, match="would hold no token"):
        nc.transform(full, vocab_size=1001, tp_degree=4)
    # vocab_size defaults to the gathered width: every column a token
    t = nc.transform(program, logit_mask="bool", tp_degree=3)
    assert t.report["mask_logits"].inputs_added[0].shape[-1] == 1002


def test_save_load_round_trip_takes_tp_rank(tmp_path):
    t = nc.transform(sharded_program(1001, 3, 1), vocab_size=1001, tp_degree=3)
    ids = random_ids(BATCH, SEQ, 1001)
    mask = pack_bool_mask(test_masks(1001, 334, 3)[0])
    t.save(tmp_path / "rank.pt2")
    (_, index), empty = torch.export.load(tmp_path / "rank.pt2").module()(ids, logit_mask=mask, tp_rank=rank_tensor(1))
    assert torch.equal(index, t(ids, logit_mask=mask, tp_rank=rank_tensor(1))[1]) and not bool(empty.any())


def test_one_xla_compilation_serves_every_rank():
    torch_xla = require_torch_xla()
    import torch_xla.debug.metrics as metrics

    from neuron_constrain.decoding.xla import to_xla

    def compilations() -> int:
        data = metrics.metric_data("CompileTime")
        return data[0] if data else 0

    vocab, tp = 1001, 3
    t = nc.transform(sharded_program(vocab, tp), vocab_size=vocab, tp_degree=tp)
    device = torch_xla.device()
    on_xla = to_xla(t.program, device).module()  # a copy: the cached program stays on the host
    ids = random_ids(BATCH, SEQ, vocab)
    seen = []
    for rank in range(tp):
        for allowed in test_masks(vocab, shard_of(vocab, tp), tp)[:2]:
            mask = pack_bool_mask(allowed)
            with torch.no_grad():
                (value, index), empty = on_xla(ids.to(device), logit_mask=mask.to(device),
                                               tp_rank=rank_tensor(rank).to(device))
                torch_xla.sync()
                expected_value, expected_index = t(ids, logit_mask=mask, tp_rank=rank_tensor(rank))
            seen.append(compilations())
            assert torch.equal(index.cpu(), expected_index) and not bool(empty.cpu().any())
            # A row with nothing allowed on this rank: XLA's max gives -FLT_MAX where eager gives -inf.
            local = expected_value.isfinite()
            assert torch.allclose(value.cpu()[local], expected_value[local])
            assert bool((value.cpu()[~local] <= torch.finfo(torch.float32).min).all())
    assert seen[0] >= 1 and len(set(seen)) == 1, seen  # the rank and the mask are data: no recompilation


# ----------------------------------------------------------------------------- processes


# lm_head rows -> (tokenizer vocab, mask format): for tp 2 and 4, 1024 is divisible by
# 32 * tp; 1000 (a padded lm_head) and 1001 (shards of 501 / 251, the last padded) are not.
MP_CASES = {1024: [(1024, "packed"), (1000, "packed")], 1001: [(1001, "packed"), (1001, "bool")]}


# One spawn serves both world sizes (each process imports torch and transformers and builds
# its decoders once): all 4 processes run a world of 4, then ranks 0 and 1 a fresh world of 2.
MP_WORLDS = (4, 2)


def _run_world(rank: int, world: int, rendezvous: str, out: str, cache: dict) -> None:
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        assert dist.get_world_size() == world
        results = {"codes": set(), "tokens": {}, "reference": {}}
        for vocab, cases in MP_CASES.items():
            if vocab not in cache:  # the decoder, and rank 0's unsharded program: the same for every world
                decoder = tiny_decoder("llama", vocab_size=vocab, **SMALL)
                with torch.no_grad():
                    plain = torch.export.export(GreedyStep(decoder), (random_ids(BATCH, SEQ, 1000),)) if rank == 0 else None
                cache[vocab] = decoder, plain
            decoder, plain = cache[vocab]
            step = VocabShardedGreedyStep(decoder, rank, world)
            ids = random_ids(BATCH, SEQ, 1000)
            with torch.no_grad():
                program = torch.export.export(step, (ids,))
            for tokenizer_vocab, fmt in cases:
                t = nc.transform(program, logit_mask=fmt, vocab_size=tokenizer_vocab, tp_degree=world)
                results["codes"].add(hashlib.sha256(t.program.graph_module.code.encode()).hexdigest())
                single = nc.transform(plain, logit_mask=fmt, vocab_size=tokenizer_vocab) if rank == 0 else None
                masks = test_masks(tokenizer_vocab, step.shard_width, world)
                masks = [feed(m, fmt) for m in masks + [worst_token_only(decoder, ids, tokenizer_vocab)]] + [None]
                for index, mask in enumerate(masks):  # None: the mask omitted (all-allowed)
                    kwargs = {} if mask is None else {"logit_mask": mask}
                    value, local = t(ids, tp_rank=rank_tensor(rank), **kwargs)
                    key = (vocab, tokenizer_vocab, fmt, index)
                    results["tokens"][key] = greedy_across_ranks(value, local, rank, step.shard_width)
                    if single is not None:
                        results["reference"][key] = single(ids, **kwargs)
        torch.save(results, f"{out}/world{world}-rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _worker(rank: int, worlds: tuple[int, ...], out: str) -> None:
    torch.set_num_threads(1)
    cache = {}
    for world in worlds:
        if rank < world:  # each world its own process group, over its own rendezvous file
            _run_world(rank, world, f"{out}/rendezvous-{world}", out, cache)


@pytest.fixture(scope="module")
def across_processes(tmp_path_factory):
    """``{world: [each rank's results]}`` for every world in ``MP_WORLDS``, from one spawn."""
    out = tmp_path_factory.mktemp("gloo")
    processes = mp.start_processes(_worker, args=(MP_WORLDS, str(out)), nprocs=max(MP_WORLDS), join=False,
                                   start_method="spawn")
    deadline = time.monotonic() + 300 * len(MP_WORLDS)
    while not processes.join(timeout=5):  # raises, with the worker's traceback, if one fails
        if time.monotonic() > deadline:
            for process in processes.processes:
                process.kill()
            pytest.fail(f"gloo workers for worlds {MP_WORLDS} did not finish in {300 * len(MP_WORLDS)} s")
    return {world: [torch.load(out / f"world{world}-rank{r}.pt", weights_only=False) for r in range(world)]
            for world in MP_WORLDS}


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_sharded_greedy_across_processes_matches_one_process(world, across_processes):
    results = across_processes[world]
    assert len(results) == world
    reference = results[0]["reference"]
    assert len(reference) == 4 * 5  # 4 (lm_head, vocab, format) cases x (2 random, all, worst only, omitted)
    for rank, result in enumerate(results):
        assert result["tokens"].keys() == reference.keys()
        for key, expected in reference.items():
            assert torch.equal(result["tokens"][key], expected), (rank, key, result["tokens"][key], expected)
    owners = set()
    for (vocab, tokenizer_vocab, fmt, index), tokens in reference.items():
        masks = test_masks(tokenizer_vocab, shard_of(vocab, world), world)
        if index < len(masks):
            assert bool(masks[index][torch.arange(BATCH), tokens].all())
        owners |= set((tokens // shard_of(vocab, world)).tolist())
    assert owners == set(range(world)), owners  # the picks really come from every rank
    # every rank rewrote its own trace into the same program: the rank is an input only
    assert len({code for result in results for code in result["codes"]}) == 4
    assert all(len(result["codes"]) == 4 for result in results)


def test_cli_rewrites_and_checks_a_vocab_parallel_program(tmp_path, capsys):
    from neuron_constrain.core.checks import check_program
    from neuron_constrain.cli import main

    torch.export.save(sharded_program(1001, 3), tmp_path / "rank.pt2")
    out = tmp_path / "rank-masked.pt2"
    rewrite = ["rewrite", str(tmp_path / "rank.pt2"), "--vocab-size", "1001"]
    assert main(rewrite + ["-o", str(out), "--tp-degree", "3"]) == 0
    assert "input  tp_rank: int32[1]" in capsys.readouterr().out
    assert main(["check", str(out), "--vocab-size", "1001"]) == 0
    ids = random_ids(BATCH, SEQ, 1001)
    all_allowed = pack_bool_mask(torch.ones(BATCH, 1001, dtype=torch.bool))
    (_, index), _ = torch.export.load(out).module()(ids, logit_mask=all_allowed, tp_rank=rank_tensor(2))
    assert bool((index < 1001 - 2 * 334).all())  # rank 2's last column is padding
    assert main(rewrite + ["-o", str(tmp_path / "x.pt2"), "--tp-degree", "2"]) == 2
    assert "does not fit in tp_degree=2 shards of 334 columns" in capsys.readouterr().err
    for fmt in ("packed", "bool"):
        t = nc.transform(sharded_program(1001, 3), logit_mask=fmt, vocab_size=1001, tp_degree=3)
        assert check_program(t.program) == [] and check_program(t.program, 1001) == []
        (failure,) = check_program(t.program, 1200)  # the full mask is checked against the full vocab
        assert "needs" in failure and ("38" if fmt == "packed" else "1200") in failure
