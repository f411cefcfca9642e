"""The layout's rules, checked on the real import graph of the source (see ARCHITECTURE.md).

The graph has an edge for every import of this library's modules, at module level, inside
functions and under ``if TYPE_CHECKING:`` alike (a function-level import that hides a cycle
is still a cycle; a type named across rooms is a dependency across rooms). Importing ``a.b.c`` from
outside package ``a.b`` runs ``a/b/__init__.py`` first, so such an import is an edge to
that package too. The rules:

- no cycle, at any level;
- every import is allowed by ARCHITECTURE.md's table (which room may import which);
- every module is in a room of that table;
- no pass imports another pass's private (``_``) names; nothing imports ``cli`` but ``__main__``;
- no source module is over 500 lines.
"""
from __future__ import annotations

import ast
import pathlib
import re

import pytest

# what this file checks is host-side, the same on every torch: the main lane runs it (see the torch_agnostic marker)
pytestmark = pytest.mark.torch_agnostic

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE_DIRS = {"neuron_constrain": ROOT / "neuron_constrain", "neuron_constrain.passes": ROOT / "passes",
                "neuron_constrain.kernels": ROOT / "kernels"}
MAX_LINES = 500


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            out[".".join((package, *parts)).removesuffix(".__init__")] = path
    return out


MODULES = modules()


def imports(module: str) -> list[tuple[str, list[str], int, bool]]:
    """``(imported module, names, line, in a function)`` for every import of ``module``, resolved
    to the deepest module of this library it names (``from a import b``: ``a.b`` if that is a module)."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    functions = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                 for n in ast.walk(f)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                out.append((alias.name, [], node.lineno, id(node) in functions))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [alias.name for alias in node.names]
            submodules = [f"{base}.{n}" for n in names if f"{base}.{n}" in MODULES]
            for target in submodules or [base]:
                out.append((target, names, node.lineno, id(node) in functions))
    return [entry for entry in out if entry[0] in MODULES]


def edges(module: str) -> set[str]:
    """What importing ``module`` runs: each imported module, and the packages above it that do not contain ``module``."""
    out = set()
    for target, _, _, _ in imports(module):
        out.add(target)
        parts = target.split(".")
        for cut in range(1, len(parts)):
            ancestor = ".".join(parts[:cut])
            if ancestor in MODULES and not (module == ancestor or module.startswith(ancestor + ".")):
                out.add(ancestor)
    out.discard(module)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                on_stack.discard(other)
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _path(graph, start, goal) -> list[str]:
    """A shortest import chain from ``start`` back to ``goal`` (to print a cycle readably)."""
    frontier, seen = [[start]], {start}
    while frontier:
        chain = frontier.pop(0)
        for other in sorted(graph[chain[-1]]):
            if other == goal:
                return chain + [goal]
            if other not in seen:
                seen.add(other)
                frontier.append(chain + [other])
    return [start]


def rooms() -> tuple[dict[str, str], dict[str, set[str]]]:
    """ARCHITECTURE.md's table: module prefix -> room, and room -> the rooms it may import."""
    prefixes, allowed = {}, {}
    for line in (ROOT / "ARCHITECTURE.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or not cells[0].startswith("**"):
            continue
        room = cells[0].strip("*")
        for prefix in re.findall(r"`([\w.]+)`", cells[1]):
            prefixes[prefix] = room
        allowed[room] = {r.strip("* ") for r in re.findall(r"\*\*[\w -]+\*\*", cells[2])} | {room}
    return prefixes, allowed


def room_of(module: str, prefixes: dict[str, str]) -> str | None:
    """The room of the longest prefix naming ``module`` (the package itself names only itself)."""
    best = max((p for p in prefixes if module == p or ("." in p and module.startswith(p + "."))), key=len, default=None)
    return prefixes.get(best)


GRAPH = {module: edges(module) for module in MODULES}


def test_the_graph_is_the_real_one():
    assert {"neuron_constrain.passes.mask_logits_pass", "neuron_constrain.kernels.bitmask",
            "neuron_constrain.structured.runtime", "neuron_constrain.transform"} <= set(MODULES)
    assert "neuron_constrain.structured.layout" in GRAPH["neuron_constrain.structured.runtime"]
    assert "neuron_constrain.kernels" in GRAPH["neuron_constrain.structured.mask_buffer"]  # a package edge
    # a function-level import is an edge too (the cycle workaround this test exists to catch)
    assert any(in_function for module in MODULES for *_, in_function in imports(module))


def test_no_import_cycle_at_any_level():
    found = cycles(GRAPH)
    chains = [" -> ".join(_path(GRAPH, c[0], c[0])) for c in found]
    assert not found, "import cycles (module- or function-level):\n" + "\n".join(chains)


def test_the_cycle_check_has_teeth():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert _path(graph, "a", "a") == ["a", "b", "c", "a"]


def test_every_module_is_in_a_room():
    prefixes, _ = rooms()
    assert prefixes, "ARCHITECTURE.md's table of rooms was not found"
    homeless = [m for m in MODULES if room_of(m, prefixes) is None]
    assert not homeless, f"modules in no room of ARCHITECTURE.md's table (add them): {homeless}"


def test_every_import_is_one_the_table_allows():
    prefixes, allowed = rooms()
    bad = []
    for module in MODULES:
        room = room_of(module, prefixes)
        for target, _, line, _ in imports(module):
            other = room_of(target, prefixes)
            if room is not None and other is not None and other not in allowed[room]:
                bad.append(f"{MODULES[module].relative_to(ROOT)}:{line} ({room}) imports {target} ({other})")
    assert not bad, "imports ARCHITECTURE.md's table forbids:\n" + "\n".join(bad)


def test_no_pass_imports_another_pass_s_private_names():
    bad = []
    for module in MODULES:
        if not module.startswith("neuron_constrain.passes."):
            continue
        for target, names, line, _ in imports(module):
            if target.startswith("neuron_constrain.passes.") and target != module:
                bad += [f"{MODULES[module].relative_to(ROOT)}:{line} imports {target}.{n}" for n in names if n.startswith("_")]
    assert not bad, "\n".join(bad)


def test_nothing_imports_the_cli():
    for module in MODULES:
        if module in ("neuron_constrain.cli", "neuron_constrain.__main__"):
            continue
        for target, _, line, _ in imports(module):
            assert target != "neuron_constrain.cli", f"{MODULES[module].relative_to(ROOT)}:{line} imports the CLI"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_is_over_500_lines(module):
    lines = len(MODULES[module].read_text().splitlines())
    assert lines <= MAX_LINES, f"{MODULES[module].relative_to(ROOT)} has {lines} lines (> {MAX_LINES}): give it one job"


def test_the_cli_holds_no_invariant_logic():
    source = (ROOT / "neuron_constrain" / "cli.py").read_text()
    tree = ast.parse(source)
    defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    assert not defined & {"check_program", "check_taps", "depends_on", "find_sites"}
    assert "graph.nodes" not in source and ".users" not in source, "graph walks belong in the library"
