"""The layout's import rule, checked on the source (see ARCHITECTURE.md):

- ``passes/`` and ``kernels/`` never import a host runtime;
- ``kernels/`` imports nothing of this library but ``kernels``;
- nothing imports ``cli`` (but ``__main__``);
- no function-level import works around an import cycle.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE_DIRS = {"neuron_constrain": ROOT / "neuron_constrain", "neuron_constrain.passes": ROOT / "passes",
                "neuron_constrain.kernels": ROOT / "kernels"}
HOST_RUNTIMES = (
    "neuron_constrain.structured", "neuron_constrain.processors.state", "neuron_constrain.replacement",
    "neuron_constrain.cli", "neuron_constrain.backend", "neuron_constrain.xla", "neuron_constrain.vllm",
    "neuron_constrain.pipeline", "neuron_constrain.loading", "neuron_constrain.demo", "neuron_constrain.transform",
)


def modules():
    for package, folder in PACKAGE_DIRS.items():
        for path in sorted(folder.rglob("*.py")):
            if package == "neuron_constrain" and path.is_relative_to(ROOT / "neuron_constrain" / "vllm"):
                continue  # the vLLM lane's own package, checked where vLLM is installed
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *parts)).removesuffix(".__init__")
            yield name, path


def imports(path: pathlib.Path, module: str):
    """(imported module, line, at function level) for every import in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    functions = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                 for n in ast.walk(f)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno, id(node) in functions
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                yield f"{base}.{alias.name}" if base == "neuron_constrain" else base, node.lineno, id(node) in functions


ALL = list(modules())


def test_the_tree_is_what_the_rule_checks():
    names = {name for name, _ in ALL}
    assert {"neuron_constrain.passes.mask_logits_pass", "neuron_constrain.kernels.bitmask",
            "neuron_constrain.processors.registry", "neuron_constrain.checks"} <= names


@pytest.mark.parametrize("name,path", [(n, p) for n, p in ALL if ".passes" in n or ".kernels" in n],
                         ids=lambda v: v if isinstance(v, str) else "")
def test_passes_and_kernels_import_no_host_runtime(name, path):
    for imported, line, _ in imports(path, name):
        bad = [r for r in HOST_RUNTIMES if imported == r or imported.startswith(r + ".")]
        assert not bad, f"{path.relative_to(ROOT)}:{line} imports {imported}, a host runtime"
        if ".kernels" in name and imported.startswith("neuron_constrain"):
            assert imported.startswith("neuron_constrain.kernels"), f"{path}:{line}: kernels import only kernels"


def test_nothing_imports_the_cli():
    for name, path in ALL:
        if name in ("neuron_constrain.cli", "neuron_constrain.__main__"):
            continue
        for imported, line, _ in imports(path, name):
            assert not imported.startswith("neuron_constrain.cli"), f"{path.relative_to(ROOT)}:{line} imports the CLI"


def test_no_import_is_marked_as_a_cycle_workaround():
    for name, path in ALL:
        for number, text in enumerate(path.read_text().splitlines(), 1):
            if "import" in text and "#" in text:
                assert "cycle" not in text.split("#", 1)[1].lower(), f"{path.relative_to(ROOT)}:{number}: {text.strip()}"


def test_the_cli_holds_no_invariant_logic():
    source = (ROOT / "neuron_constrain" / "cli.py").read_text()
    tree = ast.parse(source)
    defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    assert not defined & {"check_program", "check_taps", "depends_on", "find_sites"}
    assert "graph.nodes" not in source and ".users" not in source, "graph walks belong in the library"
