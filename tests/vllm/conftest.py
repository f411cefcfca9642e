"""vLLM lane: OpenAI servers started and stopped by the tests on 127.0.0.1.

Collected only by ``make test-vllm`` (the other lanes pass ``--ignore=tests/vllm``).
A stock and a plugin server on the tiny model with default flags are shared by the session
(``stock_server``, ``plugin_server``); a module that needs other flags starts its own
(``start_server``, stopped after the module). Every wait is bounded.
"""
from __future__ import annotations

import os
import pathlib
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
START_TIMEOUT = 600  # seconds; an engine start is ~30-60 s idle, up to ~300 s (TP 2) on the loaded 2-core machine
REQUEST_TIMEOUT = 120
METRICS_SETTLE = 0.25  # seconds; the worker writes its counters file at most ~50 ms after a step


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One vLLM OpenAI server on 127.0.0.1 (the plugin unless ``plugin=False``), on the tiny model
    unless ``model="smollm2"`` (or ``"tiny-think"``: the tiny reasoning checkpoint, ``<think>`` /
    ``</think>`` added; ``"tiny-llama3"`` / ``"tiny-mistral"``: a tool-call family's, ``tiny_checkpoint.build(family=)``); ``extra``: more vLLM flags (the launcher's thread binding applies).
    ``wait=False``: return once started; ``wait()`` then (several servers start side by side)."""

    def __init__(self, name: str, *, plugin: bool = True, env: dict | None = None, tmp: pathlib.Path,
                 extra: list[str] | None = None, max_num_seqs: int = 8, model: str = "tiny", wait: bool = True):
        from neuron_constrain.vllm.serve import command, environment, resolve
        from neuron_constrain.testing.tiny_checkpoint import build

        self.port = free_port()
        if model in ("tiny", "tiny-think"):
            folder = "tiny-think" if model == "tiny-think" else "tiny-llama"
            spec = dict(model=build(ROOT / "build" / folder, reasoning=model == "tiny-think"), name="tiny")
        elif model in ("tiny-llama3", "tiny-mistral"):  # a tool-call family's tiny checkpoint
            family = model.split("-", 1)[1]
            spec = dict(model=build(ROOT / "build" / model, family=family), name="tiny")
            if family == "mistral":
                extra = ["--tokenizer-mode", "mistral", *(extra or [])]
        else:
            spec = resolve(model)
        self.model = spec["model"]
        self.name = spec["name"]
        self.log_path = tmp / f"{name}.log"
        self.metrics_path = tmp / f"{name}.metrics.json"
        # unbuffered: vLLM logs to stdout, which a file would hold back in 8 KB blocks
        extra_env = {"NEURON_CONSTRAIN_VLLM_METRICS": str(self.metrics_path), "PYTHONUNBUFFERED": "1",
                     "NEURON_CONSTRAIN_GRAMMAR_CACHE": str(tmp / f"{name}.grammars"), **(env or {})}
        self.cmd = command(port=self.port, plugin=plugin, max_num_seqs=max_num_seqs, extra=extra, **spec)
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, env=environment(vllm_args=extra or (), **extra_env),
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"
        if wait:
            self.wait()

    def wait(self):
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = self.log()
                self.stop()
                raise RuntimeError(f"the vLLM server exited ({self.proc.returncode}) at start:\n{log[-6000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        log = self.log()
        self.stop()
        raise RuntimeError(f"the vLLM server did not answer /health in {START_TIMEOUT}s:\n{log[-6000:]}")

    def client(self):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", timeout=REQUEST_TIMEOUT, max_retries=0)

    def async_client(self):
        import openai

        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="unused", timeout=REQUEST_TIMEOUT, max_retries=0)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def metrics(self, rank: int = 0) -> dict:
        """The plugin's counters (of one tensor-parallel rank): its writer thread rewrites the file
        ~50 ms after a step, so wait until the file is older than METRICS_SETTLE (or a bound)."""
        import json

        path = self.metrics_path if rank == 0 else self.metrics_path.with_name(f"{self.metrics_path.name}.rank{rank}")
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and time.time() - path.stat().st_mtime < METRICS_SETTLE:
            time.sleep(0.05)
        time.sleep(METRICS_SETTLE)
        return json.loads(path.read_text())

    def engine_metrics(self) -> dict:
        """The plugin scheduler's counters (engine-core process): grammars per engine, finished
        answers validated / invalid (``<metrics file>.engine``, written like the worker's)."""
        import json

        path = self.metrics_path.with_name(self.metrics_path.name + ".engine")
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and (not path.exists() or time.time() - path.stat().st_mtime < METRICS_SETTLE):
            time.sleep(0.05)
        time.sleep(METRICS_SETTLE)
        return json.loads(path.read_text())

    def prometheus(self, name: str) -> float:
        """The sum of a counter in vLLM's ``/metrics`` (e.g. ``vllm:spec_decode_num_accepted_tokens_total``)."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + "{") or line.startswith(name + " "))

    def log_since(self, offset: int) -> str:
        """The server log written after ``offset`` (``len(server.log())`` taken earlier)."""
        return self.log()[offset:]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self._log.close()


@pytest.fixture(scope="session")
def server_dir():
    """Logs and counters files of this session's servers. Not pytest's tmp_path: pytest keeps only
    its three latest base folders, so another pytest run on the machine would delete a running
    server's files mid-session."""
    folder = pathlib.Path(tempfile.mkdtemp(prefix="neuron-constrain-vllm-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def plugin_server(server_dir):
    """The plugin on the tiny model with default flags, shared by the modules that compare against it."""
    server = Server("plugin-shared", tmp=server_dir)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def stock_server(server_dir):
    """Stock vLLM (plugin off) on the tiny model with the same flags, shared like ``plugin_server``."""
    server = Server("stock-shared", plugin=False, tmp=server_dir)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def start_server(server_dir):
    """``start_server(name, plugin=True, env=None)`` -> a running :class:`Server`, stopped after the module
    (``wait=False``: started, not yet waited for; call its ``wait()``)."""
    servers = []
    tmp = server_dir

    def start(name: str, **kwargs) -> Server:
        server = Server(name, tmp=tmp, **kwargs)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()
