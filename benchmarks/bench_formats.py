"""The format table: per 2020-12 format and engine, what is accepted and what is refused.

    python benchmarks/bench_formats.py [--engines auto,xgrammar,llguidance] [--walks 40] [--json benchmarks/results/formats.json]

Per format (``{"type": "string", "format": name}``) and engine: whether it compiles (else the refusal);
the specifications' own examples (``benchmarks/data/formats.json``), valid and invalid, teacher-forced
(``json.dumps`` text on the byte-level toy vocabulary, then a stop token); strings drawn by the engine
itself (``--walks`` random walks through its masks), each judged by the referee (``jsonschema``'s format
checker, format assertion on) where it has a checker here and by the format's grammar
(``schema/formats.py``) everywhere; and drawn invalid strings: each valid example edited by one
character (inserted, deleted, replaced), kept where the referee refuses it (formats it checks) or,
for the formats it cannot judge here, where the grammar refuses it. The target: 0 invalid accepted
on every engine (printed loudly). A measurement: the exit status is 0.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import random
import re
import sys
import time
import zlib

import jsonschema

from neuron_constrain.structured import engines as E
from neuron_constrain.structured.constraints import ConstraintError, json_schema
from neuron_constrain.structured.schema import formats
from neuron_constrain.testing import force, toy_tokenizer
from neuron_constrain.testing.schemas import walks
from timing import write_results

DATA = pathlib.Path(__file__).resolve().parent / "data" / "formats.json"
CHECKER = jsonschema.Draft202012Validator.FORMAT_CHECKER
EDITS = "0aZ.:-/@%~#?[]{}_ \u00e9"  # characters an edit inserts or puts in place of another


def in_grammar(name: str, text: str) -> bool:
    """Whether the library's grammar of ``name`` takes ``text``."""
    found = formats.FORMATS[name]
    return re.fullmatch(found.pattern, text) is not None and (found.max_length is None or len(text) <= found.max_length)


def valid(name: str, text: str) -> bool:
    """The judge of a drawn string: the referee where it checks ``name``, else the format's grammar."""
    return CHECKER.conforms(text, name) if formats.checked(name) else in_grammar(name, text)


def edited(name: str, examples: list[str], rng: random.Random, count: int = 40) -> list[str]:
    """Up to ``count`` strings one edit away from the valid ``examples`` that the judge calls invalid."""
    out: set[str] = set()
    for _ in range(count * 4):
        text = rng.choice(examples)
        at, char = rng.randrange(len(text) + 1), rng.choice(EDITS)
        text = rng.choice((text[:at] + char + text[at:], text[:at] + text[at + 1:], text[:at] + char + text[at + 1:]))
        if not valid(name, text) and not in_grammar(name, text):
            out.add(text)
        if len(out) == count:
            break
    return sorted(out)


def measure(engine, name: str, cases: dict, count: int, vocabulary) -> dict:
    """One format on one engine: the counts of the table's row."""
    def accepted(text):
        return force(engine, compiled, vocabulary.encode(json.dumps(text, ensure_ascii=False)))
    try:
        compiled = engine.compile(json_schema({"type": "string", "format": name}))
    except ConstraintError as refused:
        return {"refused": " ".join(str(refused).split())[:160]}
    drawn_invalid = edited(name, cases["valid"], random.Random(zlib.crc32(name.encode())))
    texts = [json.loads(vocabulary.decode(t)) for t in walks(engine, compiled, count, seed=zlib.crc32(name.encode()),
                                                            max_tokens=64)]
    return {
        "valid_examples": [sum(map(accepted, cases["valid"])), len(cases["valid"])],
        "invalid_examples": [sum(map(accepted, cases["invalid"])), len(cases["invalid"])],
        "drawn_invalid": [sum(map(accepted, drawn_invalid)), len(drawn_invalid)],
        "walks_valid": [sum(valid(name, t) and in_grammar(name, t) for t in texts), len(texts)],
        "invalid_accepted": [t for t in cases["invalid"] + drawn_invalid if accepted(t)]
                            + [t for t in texts if not (valid(name, t) and in_grammar(name, t))],
    }


def table(rows: dict, names: list[str]) -> str:
    """The printed table: per format, per engine, the counts (``-`` where refused)."""
    def cell(row):
        if "refused" in row:
            return "refused"
        v, i, d, w = (row[k] for k in ("valid_examples", "invalid_examples", "drawn_invalid", "walks_valid"))
        return f"{v[0]}/{v[1]} {i[0]}/{i[1]} {d[0]}/{d[1]} {w[0]}/{w[1]}"
    lines = [f"{'format':<22} {'judged by':<9} " + " ".join(f"{n:<24}" for n in names),
             f"{'':<22} {'':<9} " + " ".join(f"{'valid inval drawn walks':<24}" for _ in names)]
    for fmt, per in rows.items():
        judge = "checker" if formats.checked(fmt) else "grammar"
        lines.append(f"{fmt:<22} {judge:<9} " + " ".join(f"{cell(per[n]):<24}" for n in names))
    return "\n".join(lines)


def main(argv=None) -> int:
    """Run the table and write it; the exit status is 0 (a measurement)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default=",".join(E.ENGINE_CHOICES), help="comma-separated engine choices")
    parser.add_argument("--walks", type=int, default=40, help="random walks through each grammar's masks")
    parser.add_argument("--json", default="benchmarks/results/formats.json")
    args = parser.parse_args(argv)
    vocabulary = toy_tokenizer()
    names = [n for n in args.engines.split(",") if n]
    engines = {n: E.make_engine(n, vocabulary) for n in names}
    data = json.loads(DATA.read_text(encoding="utf-8"))["formats"]
    started = time.perf_counter()
    rows = {fmt: {n: measure(engines[n], fmt, cases, args.walks, vocabulary) for n in names}
            for fmt, cases in data.items()}
    seconds = time.perf_counter() - started
    print(table(rows, names))
    print("cells: valid examples accepted, invalid examples accepted, drawn invalid accepted, walks judged valid")
    holes = {n: sum(len(per[n].get("invalid_accepted", ())) for per in rows.values()) for n in names}
    for n in names:
        flag = "" if holes[n] == 0 else "   <-- SOUNDNESS HOLES"
        print(f"{n}: invalid accepted {holes[n]}{flag}")
    print(f"the referee checks: {', '.join(f for f in data if formats.checked(f))}; {seconds:.0f} s")
    write_results({"engines": names, "walks": args.walks, "rows": rows,
                   "checked": [f for f in data if formats.checked(f)], "invalid_accepted": holes,
                   "seconds": seconds}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
