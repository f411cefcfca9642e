"""Real grammar states for the benchmarks: the Tekken tokenizer (``mistral-common``),
real JSON schemas from MaskBench's development sample, and requests part-way into
valid instances of them, so a batch's rows sit at different grammar states (inside
strings, between keys, in numbers), as a serving batch's do.

    tokenizer = tekken()
    schemas = load_schemas(tokenizer, SCHEMAS, limit=4)
    ids, cursors = start_requests(runtime, schemas, batch)      # for decode loops
    mask = grammar_masks(batch, vocab_size=128256)              # one step's packed masks
    worst = random_masks(batch, vocab_size=128256)              # the contrast: half allowed at random
"""
from __future__ import annotations

import json
import pathlib
import time

import torch

from neuron_constrain import structured as S
from neuron_constrain.kernels import pack_bool_mask, unpack_bitmask
from neuron_constrain.structured.runtime.structured_runtime import BatchLayoutError, StructuredRuntime
from neuron_constrain.structured.tokenizers import from_mistral, mistral_data_file

DATA = pathlib.Path("/work/shared/data/maskbench-dev")
SCHEMAS = (  # several sources and shapes: tool calls, configs, API objects
    "Github_easy---o9967.json", "Glaiveai2K---send_email_f5af728d.json", "BFCL_simple_86.json",
    "JsonSchemaStore---zcodeformat-schema-0.0.1.json", "Kubernetes_1.json", "Snowplow_1.json", "JME_89.json",
    "BFCL_parallel_90.json",
)
TEKKEN_SPECIAL = 1000  # Tekken's ids 0..999 are control tokens; text tokens follow


def tekken():
    return from_mistral(mistral_data_file("tekken_240911.json"))


def load_schemas(tokenizer, names, limit: int) -> list[tuple[str, S.Constraint, list[int]]]:
    """(name, constraint, tokens of a valid instance) for the first ``limit`` usable files."""
    found = []
    runtime = StructuredRuntime(tokenizer, max_rows=1, fill_threads=1)
    files = [DATA / n for n in names if (DATA / n).exists()] + sorted(DATA.glob("*.json"))
    for path in dict.fromkeys(files):
        if len(found) == limit:
            break
        doc = json.loads(path.read_text())
        valid = [t["data"] for t in doc.get("tests", []) if t.get("valid")]
        if not valid:
            continue
        text = json.dumps(valid[0], separators=(",", ":"), ensure_ascii=False)
        try:
            constraint = S.json_schema(doc["schema"], strict=False, whitespace="none", unenforced="allow")
        except Exception:  # noqa: BLE001 - a schema this engine refuses: take the next
            continue
        tokens = tokenizer.encode(text)
        if not accepts_whole(runtime, constraint, tokens):
            continue  # this instance breaks a keyword xgrammar enforces differently: take the next file
        found.append((path.name, constraint, tokens))
    runtime.close()
    return found


def accepts_whole(runtime, constraint, tokens) -> bool:
    """The instance's tokens, then the stop token, are all accepted by ``constraint``."""
    try:
        runtime.add("probe", constraint, timeout=120)
        runtime.wait(["probe"], timeout=120)
        runtime.accept("probe", tokens + [runtime.tokenizer.eos_id])
        return runtime.finished("probe")
    except Exception:  # noqa: BLE001 - refused token, failed compile: not usable
        return False
    finally:
        runtime.remove("probe")


def start_requests(runtime, schemas, batch: int) -> list:
    """Fresh requests at their start states (compiled grammars come from the runtime's cache)."""
    ids = [("r", i) for i in range(batch)]
    for request in ids:
        try:
            runtime.remove(request)
        except BatchLayoutError:  # not added yet
            pass
    for i, request in enumerate(ids):
        runtime.add(request, schemas[i % len(schemas)][1], timeout=300)
    deadline = time.perf_counter() + 600
    while len(runtime.ready(ids)) < batch:
        if time.perf_counter() > deadline:
            raise TimeoutError("grammars did not compile within 600 s")
        runtime.wait(ids, timeout=10)
    cursors = []
    for i, request in enumerate(ids):
        tokens = schemas[i % len(schemas)][2]
        cursors.append((7 * i) % max(1, len(tokens) - 1))
        runtime.accept(request, tokens[: cursors[-1]])
    return ids, cursors


def grammar_masks(batch: int, vocab_size: int, limit: int = 4, always_allowed: int = 0) -> torch.Tensor:
    """Packed masks ``[batch, ceil(vocab_size / 32)]`` of one real decode step.

    Rows are ``start_requests``' grammar states on Tekken, filled by xgrammar; a model
    whose vocabulary is not Tekken's gets Tekken's text tokens (ids from 1000 on) as its
    columns ``0 .. vocab_size - 1``, so the mask keeps a real vocabulary's structure
    (long allowed runs inside strings, a few tokens between keys). ``always_allowed``
    is set in every row (a stop token: no row is empty).
    """
    tokenizer = tekken()
    schemas = load_schemas(tokenizer, SCHEMAS, limit)
    runtime = StructuredRuntime(tokenizer, max_rows=batch, fill_threads=1)
    try:
        ids, _ = start_requests(runtime, schemas, batch)
        full = unpack_bitmask(runtime.step(ids).clone(), tokenizer.vocab_size)
    finally:
        runtime.close()
    start = 0 if vocab_size == tokenizer.vocab_size else TEKKEN_SPECIAL
    if start + vocab_size > full.shape[-1]:
        raise ValueError(f"vocab_size={vocab_size}: Tekken has {full.shape[-1] - start} text tokens to lend")
    allowed = full[:, start:start + vocab_size].clone()
    allowed[:, always_allowed] = True
    return pack_bool_mask(allowed)


def random_masks(batch: int, vocab_size: int, always_allowed: int = 0, seed: int = 0) -> torch.Tensor:
    """Packed masks allowing each token with probability 1/2, independently: no grammar
    state looks like this; it is the worst case for eager CPU's per-element ``where``."""
    generator = torch.Generator().manual_seed(seed)
    allowed = torch.rand(batch, vocab_size, generator=generator) < 0.5
    allowed[:, always_allowed] = True
    return pack_bool_mask(allowed)
