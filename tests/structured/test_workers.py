"""xgrammar's compile workers start wherever the library runs: inside a daemonic process too (every
``multiprocessing.Pool`` worker is one, and multiprocessing refuses it children), where they are plain
subprocesses with the same limits."""
from __future__ import annotations

import json
import multiprocessing

import jsonschema
import pytest

pytestmark = pytest.mark.torch_agnostic

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["n"]}


def generate_in_a_pool_worker(_) -> dict:
    """In the Pool's (daemonic) worker: generate with grammars compiled in xgrammar's worker processes, and a
    compile past its deadline, killed."""
    from neuron_constrain import structured as S
    from neuron_constrain.decoding import export_decoder
    from neuron_constrain.structured import engines as E
    from neuron_constrain.structured.schema import limits as L
    from neuron_constrain.testing import tiny_decoder, toy_tokenizer
    from neuron_constrain.testing.hostile import hostile_constraints

    tok = toy_tokenizer()
    decoder = export_decoder(tiny_decoder("llama", vocab_size=tok.vocab_size), max_batch=1, max_len=64,
                             vocab_size=tok.vocab_size)
    with S.StructuredRuntime(tok, max_rows=1, engine="xgrammar") as runtime:
        out = S.generate(decoder, ["Count:"], [S.json_schema(SCHEMA)], 24, tokenizer=tok, runtime=runtime).outputs[0]
        pids = runtime.engine.workers.pids()
    limits = L.Limits(enum_values=10 ** 6, spec_bytes=10 ** 7, compile_seconds=1)
    engine = E.make_engine("xgrammar", tok, limits=limits, compile_processes=1)
    engine.wait_ready()
    try:
        engine.compile(S.json_schema(json.loads(hostile_constraints()["huge_enum"][1])))
        slow = "compiled"
    except L.LimitError as error:
        slow = error.limit
    return {"daemon": multiprocessing.current_process().daemon, "text": out.text, "reason": out.finish_reason,
            "error": out.error, "workers": len(pids), "slow": slow, "killed": engine.workers.killed}


def test_generate_inside_a_pool_worker_compiles_in_killable_workers():
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        seen = pool.map(generate_in_a_pool_worker, [0])[0]
    assert seen["daemon"] and seen["error"] is None, seen
    assert seen["workers"] >= 1, "no compile worker process was started"
    assert seen["slow"] == "compile_seconds" and seen["killed"] >= 1, seen  # the deadline still kills
    if seen["reason"] == "stop":
        jsonschema.validate(json.loads(seen["text"]), SCHEMA)
    else:
        assert seen["reason"] == "length" and seen["text"].startswith('{"n":'), seen
