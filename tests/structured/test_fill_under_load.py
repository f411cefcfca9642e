"""The per-token fill budget counts the work itself (``runtime/fill_budget.py``): on a host whose
cores are all busy with other processes, an ordinary request of a real schema on a real
tokenizer answers, none of its fills counted past the budget."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

import neuron_constrain.structured as S

pytestmark = pytest.mark.torch_agnostic(lane="latest")

# A nested object of strings (the shape of the request a busy host once failed at its 25th token).
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "address", "tags"], "properties": {
    "name": {"type": "string", "maxLength": 40},
    "address": {"type": "object", "additionalProperties": False, "required": ["street", "city", "country"],
                "properties": {"street": {"type": "string", "maxLength": 60}, "city": {"type": "string"},
                               "country": {"type": "string", "minLength": 2, "maxLength": 2}}},
    "tags": {"type": "array", "maxItems": 4, "items": {"type": "string", "maxLength": 12}}}}
ANSWER = {"name": "Ada Lovelace", "address": {"street": "12 St James's Square", "city": "London", "country": "GB"},
          "tags": ["mathematics", "engines"]}


def _allows(row, token: int) -> bool:
    return bool((int(row[token >> 5]) >> (token & 31)) & 1)


def test_an_ordinary_request_answers_within_its_budget_while_every_core_is_busy(tekken):
    text = json.dumps(ANSWER)
    tokens = tekken.encode(text)
    assert tekken.decode(tokens) == text
    runtime = S.StructuredRuntime(tekken, max_rows=1, compile_isolation="thread")  # the default fill_ms=50
    loaders = []  # three busy processes a core: this thread gets a third of one
    try:
        runtime.add("person", S.json_schema(SCHEMA))
        runtime.wait(["person"], timeout=120)
        busy = [sys.executable, "-c", "while True: pass"]
        loaders = [subprocess.Popen(busy) for _ in range(3 * (os.cpu_count() or 2))]
        slow_by_the_clock = 0
        for token in tokens:
            start = time.perf_counter()
            mask = runtime.step(["person"])
            slow_by_the_clock += time.perf_counter() - start > runtime.limits.fill_ms / 1e3
            assert _allows(mask[0], token), tekken.decode([token])
            assert not runtime.accept_rows(["person"], [token]).failed
        print(f"{len(tokens)} tokens, {slow_by_the_clock} steps past the budget by the clock")
        mask = runtime.step(["person"])
        assert any(_allows(mask[0], stop) for stop in runtime.stop_token_ids)
        assert runtime.error("person") is None and runtime.budget_ended == 0, (runtime.error("person"),
                                                                                slow_by_the_clock)
        assert all(loader.poll() is None for loader in loaders)  # the cores stayed busy throughout
    finally:
        for loader in loaders:
            loader.kill()
            loader.wait()
        runtime.close()
