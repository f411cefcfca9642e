"""What several rooms' tests share: references written from the semantics, not from the code
they check (the logits processors' rows, sampling, the thinking-budget rule), and a fresh copy
of a rewritten program."""
from __future__ import annotations

import collections
import copy
import math

from neuron_constrain.core.transform import Transformed
from neuron_constrain.processors import RequestParams

NEG_INF = -math.inf
THINK, END = [60], [61, 62]  # thought markers of the processors' tests (the end marker two tokens)


def argmax(x):
    return max(range(len(x)), key=x.__getitem__)


def reference_thought(prompt: list, outputs: list, budget: int, start: list, end: list) -> tuple[int, int]:
    """(thinking_budget_left, thinking_end_id) from the rule: inside a thought after a start
    marker with no end marker after it; every token after the start counts; once ``budget``
    are written, the end marker's tokens are forced one by one."""
    def ends_with(seq, marker):
        return seq[-len(marker):] == marker

    opened = [i for i in range(len(prompt)) if prompt[i:i + len(start)] == start]
    closed = [i for i in range(len(prompt)) if prompt[i:i + len(end)] == end]
    inside = bool(opened) and (not closed or opened[-1] > closed[-1])
    count, forced, seq = (len(prompt) - opened[-1] - len(start) if inside else 0), 0, list(prompt)
    for token in outputs:
        seq.append(token)
        if not inside:
            inside, count, forced = ends_with(seq, start), 0, 0
        elif ends_with(seq, end):
            inside = False
        else:
            if count >= budget and forced < len(end) and token == end[forced]:
                forced += 1
            count += 1
    return (budget - count, end[min(forced, len(end) - 1)]) if inside else (0, -1)


def reference_row(logits, allowed, params: RequestParams, prompt, outputs, *, eos, vocab):
    """The processed logits of one row before sampling (greedy picks their argmax):
    grammar mask, min_tokens, logit_bias, penalties, thinking budget. Plain Python floats."""
    x = [float(v) if i < vocab and allowed[i] else NEG_INF for i, v in enumerate(logits)]
    if len(outputs) < params.min_tokens:
        for token in {*params.stop_token_ids, eos}:
            x[token] = NEG_INF
    for token, bias in (params.logit_bias or {}).items():
        x[token] += bias
    counts = collections.Counter(outputs)
    for token in range(len(x)):
        if token in prompt or counts[token]:
            p = params.repetition_penalty
            x[token] = x[token] / p if x[token] > 0 else x[token] * p
        x[token] -= params.frequency_penalty * counts[token] + params.presence_penalty * (counts[token] > 0)
    if params.thinking_token_budget is not None:  # a spent budget: the end marker's next token gains 1e9
        left, end_id = reference_thought(list(prompt), list(outputs), params.thinking_token_budget, THINK, END)
        if end_id >= 0 and left <= 0:
            x[end_id] += 1e9
    return x


def reference_sample(x, params: RequestParams, noise, *, temperature):
    """Sampling path: temperature, min_p (probability threshold), then the exponential race."""
    x = [v / temperature for v in x]
    top = max(x)
    probs = [math.exp(v - top) for v in x]
    total = sum(probs)
    probs = [p / total for p in probs]
    p_max = max(probs)
    kept = [p if p >= params.min_p * p_max else 0.0 for p in probs]
    total = sum(kept)
    return max(range(len(x)), key=lambda i: (kept[i] / total) / float(noise[i]))


def fresh(transformed: Transformed) -> Transformed:
    """The same rewritten step with its own copy of the weights and KV cache."""
    return Transformed(copy.deepcopy(transformed.program), transformed.report)
