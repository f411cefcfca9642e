"""``examples/vllm_client.py`` against the plugin's server (the session's shared ``plugin_server``, tiny
model), run as a reader runs it: a subprocess from a temporary folder, the base URL as ``--base-url``
or as ``OPENAI_BASE_URL``. The script checks its own answers (schema, choice, regex, tool call) and
exits 1 when one is not valid."""
from __future__ import annotations

import os
import subprocess
import sys

from conftest import ROOT, REQUEST_TIMEOUT

SCRIPT = ROOT / "examples" / "vllm_client.py"


def run_client(tmp_path, args=(), env=None):
    result = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=tmp_path, capture_output=True, text=True,
                            timeout=4 * REQUEST_TIMEOUT, env={**os.environ, **(env or {})})
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result.stdout


def test_vllm_client_example_runs_against_the_plugin(plugin_server, tmp_path):
    out = run_client(tmp_path, ["--base-url", plugin_server.url + "/v1"])
    assert "every answer is valid" in out and "tool call -> get_weather(" in out, out
    # the base URL from the environment, as the openai client reads it
    out = run_client(tmp_path, env={"OPENAI_BASE_URL": plugin_server.url + "/v1"})
    assert f"server {plugin_server.url}/v1, model tiny" in out, out


def test_vllm_client_example_fails_without_a_server(tmp_path):
    """The script's exit status means something: no server, no 0."""
    from conftest import free_port

    result = subprocess.run([sys.executable, str(SCRIPT), "--base-url", f"http://127.0.0.1:{free_port()}/v1"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=REQUEST_TIMEOUT)
    assert result.returncode == 1 and "APIConnectionError" in result.stderr, result.stderr
