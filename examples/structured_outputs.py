"""Structured outputs: one batch, one constraint per request, every answer valid.

    python examples/structured_outputs.py

Runs in seconds on the CPU with no download: a tiny random-weight Llama and a toy byte-level
vocabulary from ``neuron_constrain.testing`` stand in for a real model and its tokenizer
(``neuron_constrain.models.load_model("smollm2")`` and ``S.from_huggingface`` are the real ones).
A random model writes nonsense, but inside its constraint: the mask is applied in the graph,
before the argmax, so every finished answer matches. The schemas bound their strings and
numbers so that an answer ends well inside the token limit.

What it shows: ``export_decoder`` (KV-cached prefill and step programs with a ``logit_mask``
input), ``S.generate`` with a JSON schema (``examples/person.json``, the file the README's
``neuron-constrain generate --schema`` takes), a choice, a regex and a schema that needs the
schema algebra and the host's item tracker (``uniqueItems``, ``not``); each answer checked
with ``S.validate_output`` and ``jsonschema``, which do not trust the engine; and a schema no
value satisfies, which fails its own request alone while the others are answered.
"""
from __future__ import annotations

import json
import pathlib

import jsonschema

from neuron_constrain import structured as S
from neuron_constrain.decoding import export_decoder
from neuron_constrain.testing import tiny_decoder, toy_tokenizer

HERE = pathlib.Path(__file__).resolve().parent
PERSON = json.loads((HERE / "person.json").read_text())  # name, age and city; strings of at most 40 characters
NUMBERS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99, "not": {"const": 13}},
           "minItems": 1, "maxItems": 4, "uniqueItems": True}
IMPOSSIBLE = {"type": "integer", "minimum": 5, "maximum": 1}


def main() -> None:
    tok = toy_tokenizer()
    decoder = export_decoder(tiny_decoder("llama", vocab_size=tok.vocab_size), max_batch=4, max_len=640,
                             vocab_size=tok.vocab_size)
    requests = [
        ("Extract the person: Maria Lopez, 42, lives in Madrid.", S.json_schema(PERSON)),
        ("Is the sky blue?", S.choice(["yes", "no"])),
        ("Email:", S.regex(r"[a-z]{3,8}@[a-z]{3}\.com")),
        ("Up to four distinct numbers below 100, never 13:", S.json_schema(NUMBERS)),
        ("An integer of at least 5 and at most 1:", S.json_schema(IMPOSSIBLE)),
    ]
    # 512 new tokens: more than the longest answer these constraints admit, so each one ends by itself
    result = S.generate(decoder, [prompt for prompt, _ in requests], [c for _, c in requests], 512, tokenizer=tok)

    for (prompt, constraint), answer in zip(requests, result.outputs):
        served = "+".join(answer.engines) or "-"
        print(f"{prompt!r}\n  -> {answer.finish_reason}, engine {served}: {answer.text or answer.error}")

    *answered, impossible = result.outputs
    for (_, constraint), answer in zip(requests, answered):
        assert answer.finish_reason == "stop", (answer.finish_reason, answer.text, answer.error)
        assert S.validate_output(constraint, answer.text) is None, S.validate_output(constraint, answer.text)
    jsonschema.validate(json.loads(answered[0].text), PERSON)
    assert answered[1].text in ("yes", "no")
    numbers = json.loads(answered[3].text)
    assert len(set(numbers)) == len(numbers) and 13 not in numbers
    # the impossible schema failed alone: refused before any token, naming why
    assert impossible.finish_reason == "error" and "admits no value" in impossible.error, impossible.error
    print("every answer matches its constraint; the impossible schema failed alone")


if __name__ == "__main__":
    main()
