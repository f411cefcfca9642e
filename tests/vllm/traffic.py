"""Requests the vLLM tests send concurrently (batches of several rows, as in serving)."""
from __future__ import annotations

import asyncio


async def _gather(server, requests, *, field):
    client = server.async_client()

    async def one(kind, kwargs):
        kwargs = dict(kwargs)
        kwargs["extra_body"] = {**kwargs.get("extra_body", {}), "return_token_ids": True}
        if kind == "completion":
            r = await client.completions.create(model=server.name, **kwargs)
        else:
            r = await client.chat.completions.create(model=server.name, **kwargs)
        return field(r.choices[0])

    try:
        return await asyncio.wait_for(asyncio.gather(*(one(k, kw) for k, kw in requests)), timeout=900)
    finally:
        await client.close()


def token_ids(server, requests) -> list[list[int]]:
    """The output token ids of each ``(kind, kwargs)`` request ("completion" or "chat"), sent together."""
    return asyncio.run(_gather(server, requests, field=lambda choice: choice.model_extra["token_ids"]))


def choices(server, requests) -> list:
    """The first choice of each ``(kind, kwargs)`` request, sent together."""
    return asyncio.run(_gather(server, requests, field=lambda choice: choice))


def logprob_rows(choice) -> list[tuple[str, float, list[str], list[float]]]:
    """(token, logprob, top tokens, their logprobs) per generated token of a chat or completion choice."""
    logprobs = choice.logprobs
    if hasattr(logprobs, "content"):  # chat
        return [(t.token, t.logprob, [x.token for x in t.top_logprobs], [x.logprob for x in t.top_logprobs])
                for t in logprobs.content]
    return [(token, value, list(top), list(top.values()))
            for token, value, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs)]


MASKED = -9999.0  # vLLM reports a -inf logprob (a token the grammar forbids) as -9999.0


def assert_logprobs_match(expected, got, *, atol: float = 1e-4) -> int:
    """Same tokens, logprobs within ``atol``, the same top ids in the same order; returns the rows compared.

    Top entries the grammar masked (-inf, reported as -9999.0) are ties with no order: both
    sides must have as many, and the allowed ones before them must match in order."""
    rows_e, rows_g = logprob_rows(expected), logprob_rows(got)
    assert [r[0] for r in rows_e] == [r[0] for r in rows_g]
    for (token, a, top_a, values_a), (_, b, top_b, values_b) in zip(rows_e, rows_g):
        assert abs(a - b) <= atol, (token, a, b)
        allowed_a = [t for t, v in zip(top_a, values_a) if v > MASKED]
        allowed_b = [t for t, v in zip(top_b, values_b) if v > MASKED]
        assert allowed_a == allowed_b and len(top_a) == len(top_b), (token, top_a, top_b)
        assert all(abs(x - y) <= atol for x, y in zip(values_a, values_b) if x > MASKED), (token, values_a, values_b)
    return len(rows_e)
