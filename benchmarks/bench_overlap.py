"""Grammar off the critical path: per-step wall time of a structured decode loop,
unconstrained / serial (fill, then step: the seeds' design) / pipelined (fill
overlapped with the body, then the head), side by side.

    .venv/bin/python benchmarks/bench_overlap.py [--quick] [--backends eager,xla] [--out PATH]

The loop: a 1-token decode step over a static KV cache (``decode_steps.py``; a Llama
with Tekken's 131072-token vocabulary, greedy in-graph, logit-mask pass), the Tekken
tokenizer from ``mistral-common`` and real JSON schemas from MaskBench's development
sample (``/work/shared/data/maskbench-dev``). Request ``i`` of a batch takes schema
``i % n`` and starts ``(7 i) % len`` tokens into a valid instance of it, so the rows
are at different grammar states (inside strings, between keys, in numbers). Each step
fills the masks with xgrammar (``StructuredRuntime``, one fill thread), runs the
step and accepts each row's next token of its valid instance (teacher forcing: the
grammar walks real JSON as a trained model's output would; a random-weight model's
own tokens, ``--free-run``, wander into states xgrammar fills hundreds of times
slower, measured: 0.3-3 s per step). The three ways each own a copy of the program (its KV
cache) and a runtime, and run interleaved step by step (a burst of load on the shared
machine hits all three alike); every round restarts them from position 0 and the
same grammar states, so serial and pipelined decode the same tokens (checked).

    critical-path overhead = median over steps of step(constrained) / step(unconstrained) - 1
    bound for pipelined    = max(0, fill - body) / step(unconstrained) + 0.02

``fill``: the runtime's step (xgrammar fill + layout) in the serial loop; ``body``:
the split's body run alone (eager: on one thread; XLA: dispatch + device time). CPU
eager runs every torch op on one thread (``torch.set_num_threads(1)``; the pipelined
body on its worker with ``body_threads=1``) so the fill has the other core; torch-xla
runs on PJRT CPU with XLA's CPU thread pool limited the same way (``XLA_FLAGS``) and
asynchronous dispatch, and the split cuts before the lm_head (``cut="hidden"``: a
body returning ``[B, V]`` logits ran 2x slower than the whole unsplit step there).
``--quick``: a smaller model, fewer steps, XLA at batch 1 and 8.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")

import torch  # noqa: E402

import neuron_constrain as nc  # noqa: E402
from neuron_constrain.decoding.pipeline import PipelinedStep, split_step  # noqa: E402
from neuron_constrain.structured.runtime.structured_runtime import StructuredRuntime  # noqa: E402
from neuron_constrain.core.transform import Transformed  # noqa: E402
from decode_steps import decoder, export_decode_step  # noqa: E402
from grammar_states import SCHEMAS, load_schemas, start_requests, tekken  # noqa: E402
from timing import paired, write_results  # noqa: E402

FORCED = True  # set by --free-run
CUT = None
FULL = dict(vocab_size=131072, hidden_size=256, layers=4, intermediate_size=512)
QUICK = dict(vocab_size=131072, hidden_size=128, layers=2, intermediate_size=256)


class Lane:
    """One way of decoding (its own program copy, KV cache and runtime), stepped one
    decode step at a time so the three ways run interleaved, step by step."""

    def __init__(self, step_fn, runtime, schemas, batch):
        self.step_fn, self.runtime, self.schemas, self.batch = step_fn, runtime, schemas, batch

    def start(self) -> None:
        self.requests, self.cursors = start_requests(self.runtime, self.schemas, self.batch) if self.runtime else (None, None)
        self.ids = torch.zeros(self.batch, 1, dtype=torch.long)
        self.tokens, self.fills = [], []

    def step(self, position: int) -> float:
        start = time.perf_counter()
        tokens = self.step_fn(self.ids, torch.tensor([position]), self.requests)
        if self.requests is not None:
            if FORCED:  # the rows write their valid instances (the tokens a trained model would pick)
                tokens = tokens.clone()
                eos = self.runtime.tokenizer.eos_id
                for row, cursor in enumerate(self.cursors):
                    instance = self.schemas[row % len(self.schemas)][2]
                    tokens[row] = instance[cursor] if cursor < len(instance) else eos
                    self.cursors[row] = cursor + 1
            self.runtime.accept_rows(self.requests, tokens)
            self.fills.append(self.runtime.last_step_seconds)
        seconds = time.perf_counter() - start
        self.tokens.append(tokens.tolist())
        self.ids = tokens[:, None]
        return seconds


def measure(model, tokenizer, schemas, batch: int, backend: str, rounds: int, steps: int) -> dict:
    program, _ = export_decode_step(model, batch)
    base = nc.transform(program, vocab_size=tokenizer.vocab_size)
    runtimes = [StructuredRuntime(tokenizer, max_rows=batch, fill_threads=1) for _ in range(2)]
    width = runtimes[0].width
    neutral = torch.full((batch, width), -1, dtype=torch.int32)
    copies = [Transformed(copy.deepcopy(base.program), base.report) for _ in range(3)]  # a KV cache each
    cut = CUT or ("hidden" if backend == "xla" else "logits")
    unsplit_u, unsplit_s, split = copies[0], copies[1], split_step(copies[2], cut=cut)
    if backend == "xla":
        import torch_xla

        from neuron_constrain.decoding.xla import to_xla

        device = torch_xla.device()
        unsplit_u, unsplit_s, split = to_xla(unsplit_u), to_xla(unsplit_s), split.to(device)
        torch_xla.sync(wait=True)
        to_dev = lambda t: t.to(device)  # noqa: E731

        def body_alone(ids, pos):
            out = split.body(to_dev(ids), to_dev(pos))
            torch_xla.sync(wait=True)
            return out
    else:
        to_dev = lambda t: t  # noqa: E731

        def body_alone(ids, pos):
            return split.body(ids, pos)

    neutral_dev = to_dev(neutral)
    pipe = PipelinedStep(split, body_threads=1 if backend == "eager" else None, timeout=600)
    serial_runtime, pipelined_runtime = runtimes

    def unconstrained(ids, pos, requests):
        return unsplit_u(to_dev(ids), to_dev(pos), logit_mask=neutral_dev).cpu()

    def serial(ids, pos, requests):
        mask = serial_runtime.step(requests)
        return unsplit_s(to_dev(ids), to_dev(pos), logit_mask=to_dev(mask)).cpu()

    def pipelined(ids, pos, requests):
        return pipe((to_dev(ids), to_dev(pos)), fill=lambda: {"logit_mask": pipelined_runtime.step(requests)}).cpu()

    lanes = {
        "unconstrained": Lane(unconstrained, None, schemas, batch),
        "serial": Lane(serial, serial_runtime, schemas, batch),
        "pipelined": Lane(pipelined, pipelined_runtime, schemas, batch),
    }
    times = {m: [] for m in lanes}
    fills, bodies, identical = [], [], True
    with torch.no_grad():
        for round_ in range(rounds + 1):  # round 0 warms up (compilations, grammar compilation)
            for lane in lanes.values():
                lane.start()
            for position in range(steps if round_ else 2):
                names = list(lanes)[position % 3:] + list(lanes)[: position % 3]  # rotated: no fixed first
                for m in names:  # interleaved: a burst of load hits all three alike
                    seconds = lanes[m].step(position)
                    if round_ and position:  # position 0 pays the fresh requests' first fill
                        times[m].append(seconds)
            if round_:
                fills += lanes["serial"].fills[1:]
                identical &= lanes["serial"].tokens == lanes["pipelined"].tokens
                for position in range(1, steps):
                    start = time.perf_counter()
                    body_alone(torch.zeros(batch, 1, dtype=torch.long), torch.tensor([position]))
                    bodies.append(time.perf_counter() - start)
    pipe.close()
    for runtime in runtimes:
        runtime.close()
    med = {m: statistics.median(t) for m, t in times.items()}
    # per step, the three ran back to back: the median of paired ratios resists load bursts
    over = {m: paired(times, m, "unconstrained") - 1 for m in ("serial", "pipelined")}
    fill, body = statistics.median(fills), statistics.median(bodies)
    bound = max(0.0, fill - body) / med["unconstrained"] + 0.02
    return {
        "backend": backend, "batch": batch, "cut": cut,
        "unconstrained_ms": 1e3 * med["unconstrained"], "serial_ms": 1e3 * med["serial"],
        "pipelined_ms": 1e3 * med["pipelined"], "fill_ms": 1e3 * fill, "body_ms": 1e3 * body,
        "serial_overhead": over["serial"], "pipelined_overhead": over["pipelined"],
        "serial_overhead_of_medians": med["serial"] / med["unconstrained"] - 1,
        "pipelined_overhead_of_medians": med["pipelined"] / med["unconstrained"] - 1,
        "pipelined_bound": bound,
        "meets_bound": over["pipelined"] <= bound,
        "meets_half_serial": batch < 8 or over["pipelined"] <= max(over["serial"], 0) / 2,
        "token_identical": identical, "steps_timed": len(times["serial"]),
        "head_ops": split.report.head_ops, "head_bytes_in": split.report.head_bytes_in,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a smaller model, fewer steps, XLA at batch 1 and 8")
    parser.add_argument("--backends", default="eager,xla")
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--free-run", action="store_true",
                        help="accept the random model's own tokens instead of forcing the valid instances")
    parser.add_argument("--cut", choices=("logits", "hidden"), default=None,
                        help="where the split cuts (default: hidden on XLA, logits on eager)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds of 10 steps (default 3; --quick 2)")
    parser.add_argument("--out", default="benchmarks/results/bench_overlap.json")
    args = parser.parse_args()
    global FORCED, CUT
    FORCED, CUT = not args.free_run, args.cut
    config, rounds, steps = (QUICK, 2, 6) if args.quick else (FULL, 3, 10)
    rounds = args.rounds or rounds
    torch.set_num_threads(1)  # the body's budget in every mode; the fill gets the other core
    tokenizer = tekken()
    schemas = load_schemas(tokenizer, SCHEMAS, limit=6)
    print(f"Tekken ({tokenizer.vocab_size} tokens), {len(schemas)} schemas: {', '.join(s[0] for s in schemas)}")
    model = decoder("llama", **{**config, "vocab_size": tokenizer.vocab_size})
    rows = []
    for backend in args.backends.split(","):
        batches = [int(b) for b in args.batches.split(",")]
        if backend == "xla" and args.quick:
            batches = [b for b in batches if b <= 8]
        for batch in batches:
            row = measure(model, tokenizer, schemas, batch, backend, rounds, steps)
            rows.append(row)
            print(f"  {backend} batch {batch}: done ({row['steps_timed']} steps timed)", flush=True)
    print(f"decode step: llama {config}, static cache 128; ms per step (one token per row), medians; "
          f"{'rows forced along valid instances' if FORCED else 'free-running random model'}")
    print(f"{'backend':7} {'batch':>5} {'uncon':>8} {'serial':>8} {'pipel':>8} {'fill':>7} {'body':>7} "
          f"{'ser.ovh':>8} {'pip.ovh':>8} {'bound':>7} {'ok':>3} {'half':>4} {'same':>4}")
    for r in rows:
        print(f"{r['backend']:7} {r['batch']:5d} {r['unconstrained_ms']:8.2f} {r['serial_ms']:8.2f} "
              f"{r['pipelined_ms']:8.2f} {r['fill_ms']:7.2f} {r['body_ms']:7.2f} {r['serial_overhead']:8.3f} "
              f"{r['pipelined_overhead']:8.3f} {r['pipelined_bound']:7.3f} {'y' if r['meets_bound'] else 'n':>3} "
              f"{'y' if r['meets_half_serial'] else 'n':>4} {'y' if r['token_identical'] else 'n':>4}")
    write_results({"config": config, "forced": FORCED, "schemas": [s[0] for s in schemas], "rows": rows}, args.out)
    return 0 if all(r["token_identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
