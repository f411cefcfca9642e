"""Hostile constraints sent at once while ordinary requests flow (``test_hostile.py``, ``bench_hostile.py``).

    alone = ordinary_alone(server, requests=12)           # worst latency of ordinary traffic, nothing else
    result = storm(server, hostile_constraints())         # the hostile requests at once, ordinary traffic during
    result.hostile[name] -> Outcome(status, seconds, text, message, finish_reason)
    judge(kind, spec, outcome)                            # None, or why it is neither a named 4xx nor a valid answer
    group_processes(pgid), group_memory_mb(pgid)          # the server's processes (one process group) and memory

Ordinary requests are completions constrained by a small schema, a new one each time
(``ordinary_schema(i)``: every one needs its own verdict and grammar), two at a time, as the
issue's facts measured them.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import time

import openai

from neuron_constrain.testing.hostile import ordinary_schema

PROMPT = "Answer:"
HOSTILE_MAX_TOKENS = 48
ORDINARY_MAX_TOKENS = 32
ORDINARY_CONCURRENCY = 2


@dataclasses.dataclass
class Outcome:
    status: int  # 200, or the HTTP error's status
    seconds: float
    text: str = ""
    message: str = ""  # the error's text
    finish_reason: str | None = None


@dataclasses.dataclass
class Storm:
    hostile: dict  # name -> Outcome
    ordinary: list  # Outcome of each ordinary request sent while the hostile ones were out
    seconds: float  # from the first hostile request to the last answer
    peak_memory_mb: float  # the server's process group (group_memory_mb), sampled during the storm


def body(kind: str, spec: str) -> dict:
    """The request's ``structured_outputs``: a JSON schema or a choice list as a parsed value, as clients send."""
    value = json.loads(spec) if kind in ("json", "choice") else spec
    return {"structured_outputs": {kind: value}}


async def send(client, name: str, kind: str, spec: str, max_tokens: int) -> Outcome:
    start = time.perf_counter()
    try:
        r = await client.completions.create(model=name, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                            extra_body=body(kind, spec))
    except openai.APIStatusError as error:
        return Outcome(error.status_code, time.perf_counter() - start, message=str(error))
    except openai.APIError as error:  # a timeout or a dropped connection
        return Outcome(0, time.perf_counter() - start, message=f"{type(error).__name__}: {error}")
    choice = r.choices[0]
    return Outcome(200, time.perf_counter() - start, choice.text, finish_reason=choice.finish_reason)


async def _ordinary(server, client, counter, stop: asyncio.Event, out: list, limit: int | None) -> None:
    while not stop.is_set() and (limit is None or len(out) < limit):
        i = next(counter)
        out.append(await send(client, server.name, "json", json.dumps(ordinary_schema(i)), ORDINARY_MAX_TOKENS))


def ordinary_alone(server, requests: int, start: int = 0) -> list[Outcome]:
    """``requests`` ordinary requests, two at a time, nothing else running."""
    async def run():
        client, out = server.async_client(), []
        counter = iter(range(start, start + 10 * requests))
        try:
            await asyncio.gather(*(_ordinary(server, client, counter, asyncio.Event(), out, requests)
                                   for _ in range(ORDINARY_CONCURRENCY)))
        finally:
            await client.close()
        return out
    return asyncio.run(run())


def storm(server, constraints: dict, *, start: int = 10_000, sample=None) -> Storm:
    """Every hostile ``(kind, spec)`` sent at once while ordinary requests flow two at a time; the
    flow stops when the last hostile request is answered. ``sample()`` (the memory) is called
    every 0.25 s during it; the largest value is kept."""
    async def run():
        client, ordinary, stop, peak = server.async_client(), [], asyncio.Event(), [0.0]
        counter = iter(range(start, start + 1_000_000))

        async def watch():
            while not stop.is_set():
                if sample is not None:
                    peak[0] = max(peak[0], sample())
                await asyncio.sleep(0.25)

        flows = [asyncio.create_task(_ordinary(server, client, counter, stop, ordinary, None))
                 for _ in range(ORDINARY_CONCURRENCY)] + [asyncio.create_task(watch())]
        await asyncio.sleep(0.5)  # ordinary traffic is flowing when the storm comes
        began = time.perf_counter()
        names = list(constraints)
        answers = await asyncio.gather(*(send(client, server.name, *constraints[name], HOSTILE_MAX_TOKENS)
                                         for name in names))
        seconds = time.perf_counter() - began
        stop.set()
        await asyncio.gather(*flows)
        await client.close()
        return Storm(dict(zip(names, answers)), ordinary, seconds, peak[0])
    return asyncio.run(run())


def judge(kind: str, spec: str, outcome: Outcome) -> str | None:
    """None if ``outcome`` is a 4xx whose message says what was refused, or an answer its constraint
    accepts; else what is wrong."""
    from neuron_constrain.vllm import policy

    if 400 <= outcome.status < 500:
        words = ("limit", "admits no value", "cannot be compiled", "not enforced", "nested too deeply", "max_tokens",
                 "Failed to", "Invalid", "not supported", "neither engine")
        return None if any(w in outcome.message for w in words) else f"a {outcome.status} that names nothing: " \
                                                                     f"{outcome.message[:300]}"
    if outcome.status != 200:
        return f"HTTP {outcome.status}: {outcome.message[:300]}"
    why = policy.violation(policy.from_vllm(kind, spec), outcome.text)
    return None if why is None else f"an answer its constraint refuses ({outcome.finish_reason}): {why[:200]}"


# --------------------------------------------------------------------------- the server's processes
def group_processes(pgid: int) -> list[int]:
    """The live processes of process group ``pgid`` (a server started with start_new_session)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(entry))
    return pids


def group_memory_mb(pgid: int) -> float:
    """Memory of the process group, MiB: each process's proportional set size (a page shared by k
    processes, as forked compile workers share their fork server's, counts 1/k in each)."""
    total = 0
    for pid in group_processes(pgid):
        try:
            with open(f"/proc/{pid}/smaps_rollup") as rollup:
                for line in rollup:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1])
        except OSError:
            continue
    return total / 1024
