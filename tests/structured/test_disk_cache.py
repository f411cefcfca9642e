"""Compiled grammars on disk (``engines/xgrammar/disk_cache.py``): a hit after a restart, a corrupt
entry compiled again (never loaded), the size bound kept, the directory chosen by the environment."""
from __future__ import annotations

import os
import time

import pytest

import neuron_constrain.structured as S
from neuron_constrain.structured.engines import make_engine
from neuron_constrain.structured.engines.xgrammar import disk_cache as D
from neuron_constrain.testing.vocabulary import force, toy_tokenizer

pytestmark = pytest.mark.torch_agnostic(lane="latest")

SCHEMA = S.json_schema({"type": "object", "required": ["id", "name"], "additionalProperties": False,
                        "properties": {"id": {"type": "integer", "minimum": 1}, "name": {"type": "string",
                                                                                         "maxLength": 20}}})


def _engine(tekken, directory):
    engine = make_engine("xgrammar", tekken)
    engine.disk_cache = D.DiskCache(directory, min_seconds=0)  # every compile stored
    return engine


def _sound(engine, compiled, tekken) -> bool:
    """The grammar takes a valid answer and refuses an invalid one."""
    return (force(engine, compiled, tekken.encode('{"id": 7, "name": "x"}'))
            and not force(engine, compiled, tekken.encode('{"id": 0, "name": "x"}')))


def test_a_restarted_engine_loads_what_an_earlier_one_compiled(tekken, tmp_path):
    first = _engine(tekken, tmp_path)
    assert _sound(first, first.compile(SCHEMA), tekken)
    assert (first.compiles, first.disk_cache.stored, first.disk_cache.hits) == (1, 1, 0)
    second = _engine(tekken, tmp_path)  # a fresh process's engine: nothing in memory
    compiled = second.compile(SCHEMA)
    assert (second.compiles, second.disk_cache.hits) == (0, 1) and _sound(second, compiled, tekken)
    other = second.compile(S.regex("[0-9]{3}"))  # another constraint: another entry
    assert second.compiles == 1 and len(list(tmp_path.iterdir())) == 2 and force(second, other, tekken.encode("123"))


@pytest.fixture(scope="module")
def engine(tekken):
    """One engine for the tests below: it keeps no grammar in memory, each compile compiles or loads."""
    return make_engine("xgrammar", tekken)


@pytest.mark.parametrize("damage", ["flip a byte", "truncate", "valid checksum, not a grammar"])
def test_a_corrupt_entry_is_compiled_again_not_loaded(engine, tekken, tmp_path, damage):
    engine.disk_cache = D.DiskCache(tmp_path, min_seconds=0)
    engine.compile(SCHEMA)
    (entry,) = tmp_path.iterdir()
    text = entry.read_text()
    if damage == "flip a byte":
        middle = len(text) // 2
        text = text[:middle] + ("0" if text[middle] != "0" else "1") + text[middle + 1:]
    elif damage == "truncate":
        text = text[: len(text) * 2 // 3]
    else:
        payload = '{"not": "a grammar"}'
        text = D.hashlib.sha256(payload.encode()).hexdigest() + "\n" + payload
    entry.write_text(text)
    compiles = engine.compiles
    compiled = engine.compile(SCHEMA)
    assert (engine.compiles - compiles, engine.disk_cache.corrupt, engine.disk_cache.hits) == (1, 1, 0)
    assert _sound(engine, compiled, tekken)
    engine.compile(SCHEMA)  # the entry written again, whole: it loads
    assert (engine.compiles - compiles, engine.disk_cache.hits) == (1, 1)


def test_the_size_bound_keeps_the_most_recently_used(tmp_path):
    cache = D.DiskCache(tmp_path, max_bytes=3 * 1100)
    keys = [D.DiskCache.key(("regex", str(i)), "tokenizer") for i in range(6)]
    for i, key in enumerate(keys):
        cache.store(key, "x" * 1000)
        stamp = time.time() - 100 + i
        os.utime(tmp_path / key, (stamp, stamp))
        if i == 2:
            assert cache.load(keys[0]) is not None  # touched: the most recently used now
    total = sum(path.stat().st_size for path in tmp_path.iterdir())
    assert total <= cache.max_bytes
    assert {key for key in keys if (tmp_path / key).exists()} == {keys[0], keys[4], keys[5]}
    assert D.DiskCache.key(("regex", "0"), "tokenizer") != D.DiskCache.key(("regex", "0"), "another tokenizer")


def test_the_environment_picks_the_directory_or_turns_it_off(monkeypatch, tmp_path):
    monkeypatch.setenv(D.ENV, str(tmp_path / "grammars"))
    assert D.DiskCache.from_environment().directory == tmp_path / "grammars"
    for off in ("off", "0", ""):
        monkeypatch.setenv(D.ENV, off)
        assert D.DiskCache.from_environment() is None
    monkeypatch.setenv(D.ENV, "on")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert D.DiskCache.from_environment().directory == tmp_path / "neuron-constrain" / "grammars"
    monkeypatch.delenv(D.ENV)
    assert D.DiskCache.from_environment() is None and make_engine("xgrammar", toy_tokenizer()).disk_cache is None
    with pytest.raises(ValueError, match="positive size"):
        D.DiskCache(tmp_path, max_bytes=0)
