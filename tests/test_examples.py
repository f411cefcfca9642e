"""The scripts in ``examples/`` run as a reader runs them: each a subprocess started from an empty temporary
folder, exit 0 (each asserts what it shows: answers valid against their constraints, the culprit named,
the changed graph failing its check). ``vllm_client.py`` needs a server: the vLLM lane runs it
(``tests/vllm/test_client_example.py``).

The scripts run on the main lane only (``one_lane``): the wheel smoke test (``make test-wheel``,
``tests/wheel_smoke.py``) runs them again on the latest lane's torch, from the installed wheel.
"""
from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
NEEDS_A_SERVER = {"vllm_client.py": "tests/vllm/test_client_example.py"}  # run by the vLLM lane
TIMEOUT = 300  # seconds; each takes about 10-20 s on a loaded 2-core machine


def scripts() -> list[str]:
    return sorted(path.name for path in EXAMPLES.glob("*.py"))


@pytest.mark.one_lane
@pytest.mark.parametrize("name", [name for name in scripts() if name not in NEEDS_A_SERVER])
def test_example_runs(name, tmp_path):
    # the package this test imports (the checkout's), not another installed copy
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    result = subprocess.run([sys.executable, str(EXAMPLES / name)], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=TIMEOUT)
    assert result.returncode == 0, f"{name} exited {result.returncode}\n{result.stdout}\n{result.stderr[-4000:]}"
    assert result.stdout.strip(), f"{name} printed nothing: an example shows what it did"
    assert not list(tmp_path.iterdir()), f"{name} left files in the folder it ran from: {list(tmp_path.iterdir())}"


@pytest.mark.torch_agnostic
@pytest.mark.parametrize("name", scripts())
def test_example_says_how_to_run_it(name):
    """Each script opens with a docstring whose first command runs it, and guards its entry point."""
    tree = ast.parse((EXAMPLES / name).read_text())
    doc = ast.get_docstring(tree)
    assert doc, f"examples/{name} has no module docstring"
    commands = [line.strip() for line in doc.splitlines() if line.strip().startswith("python ")]
    assert commands and commands[0].startswith(f"python examples/{name}"), (name, commands)
    assert "if __name__ == \"__main__\":" in (EXAMPLES / name).read_text(), name


@pytest.mark.torch_agnostic
def test_every_example_is_run_somewhere():
    assert {"structured_outputs.py", "tool_calling.py", "taps_and_localize.py", "ci_graph_check.py",
            "vllm_client.py"} <= set(scripts())
    for name, test in NEEDS_A_SERVER.items():
        assert name in (ROOT / test).read_text(), (name, test)
    wheel_smoke = (ROOT / "tests" / "wheel_smoke.py").read_text()
    assert all(name in wheel_smoke for name in NEEDS_A_SERVER)  # left out there by name, the rest run
