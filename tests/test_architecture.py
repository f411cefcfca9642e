"""The layout's rules, checked on the real import graph of the source (see ARCHITECTURE.md).

The graph has an edge for every import of this library's modules, at module level, inside
functions and under ``if TYPE_CHECKING:`` alike (a function-level import that hides a cycle
is still a cycle; a type named across rooms is a dependency across rooms). Importing ``a.b.c`` from
outside package ``a.b`` runs ``a/b/__init__.py`` first, so such an import is an edge to
that package too. The rules:

- no cycle, at any level;
- every import is allowed by ARCHITECTURE.md's table (which room may import which);
- every module is in a room of that table; every host-runtime module but the front door and the
  demo is in a sub-room's folder;
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
            "neuron_constrain.structured.runtime.structured_runtime", "neuron_constrain.core.transform"} <= set(MODULES)
    assert "neuron_constrain.structured.runtime.layout" in GRAPH["neuron_constrain.structured.runtime.structured_runtime"]
    assert "neuron_constrain.kernels" in GRAPH["neuron_constrain.structured.runtime.mask_buffer"]  # a package edge
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


# ----------------------------------------------------------------------------- issue 34: one writer per fact

def subrooms() -> tuple[dict[str, str], dict[str, set[str]]]:
    """ARCHITECTURE.md's table of the host runtimes' sub-rooms (rows whose first cell is
    ``*name*``): module prefix -> sub-room, and sub-room -> the sub-rooms it may import."""
    prefixes, allowed = {}, {}
    for line in (ROOT / "ARCHITECTURE.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or not re.fullmatch(r"\*[\w -]+\*", cells[0]):
            continue
        room = cells[0].strip("*")
        for prefix in re.findall(r"`([\w.]+)`", cells[1]):
            prefixes[prefix] = room
        allowed[room] = {r.strip("* ") for r in re.findall(r"\*[\w -]+\*", cells[2])} | {room}
    return prefixes, allowed


def test_every_edge_is_one_the_table_allows_package_inits_included():
    """Importing ``a.b.c`` runs ``a/b/__init__.py``: a pass that imports a graph-core module
    inside a host-runtime package runs that package's host code too."""
    prefixes, allowed = rooms()
    bad = []
    for module, targets in GRAPH.items():
        room = room_of(module, prefixes)
        for target in targets:
            other = room_of(target, prefixes)
            if room is not None and other is not None and other not in allowed[room]:
                bad.append(f"{module} ({room}) runs {target} ({other})")
    assert not bad, "import edges ARCHITECTURE.md's table forbids (package __init__ included):\n" + "\n".join(sorted(bad))


def test_host_runtime_sub_rooms_import_in_order():
    host, _ = rooms()
    prefixes, allowed = subrooms()
    assert prefixes, "ARCHITECTURE.md has no table of the host runtimes' sub-rooms (rows `| *name* | modules | may import |`)"
    host_modules = [m for m in MODULES if room_of(m, host) == "host runtimes" and m != "neuron_constrain"]
    homeless = [m for m in host_modules if room_of(m, prefixes) is None]
    assert not homeless, f"host-runtime modules in no sub-room: {homeless}"
    bad = []
    for module in host_modules:
        room = room_of(module, prefixes)
        for target in GRAPH[module]:
            other = room_of(target, prefixes) if target in host_modules else None
            if other is not None and other not in allowed[room]:
                bad.append(f"{module} ({room}) runs {target} ({other})")
    assert not bad, "imports against the sub-rooms' order:\n" + "\n".join(sorted(bad))


TOP_LEVEL_HOST_MODULES = {"neuron_constrain", "neuron_constrain.demo"}  # the front door and the demo


def test_host_runtime_sub_rooms_are_folders():
    """Every host-runtime module but the front door and the demo lives in a sub-room's folder
    (``decoding/``, ``structured/``...), not loose at the package's top level, and each
    sub-room of ARCHITECTURE.md's table names a folder (the demo excepted)."""
    host, _ = rooms()
    prefixes, _ = subrooms()
    top = PACKAGE_DIRS["neuron_constrain"]
    loose = [f"{MODULES[m].relative_to(ROOT)}" for m in MODULES if room_of(m, host) == "host runtimes"
             and MODULES[m].parent == top and m not in TOP_LEVEL_HOST_MODULES]
    assert not loose, f"host-runtime modules loose at the top level (move each into its sub-room's folder): {loose}"
    not_folders = [p for p in prefixes if p not in TOP_LEVEL_HOST_MODULES
                   and not (top / p.removeprefix("neuron_constrain.").replace(".", "/") / "__init__.py").exists()]
    assert not not_folders, f"sub-rooms in ARCHITECTURE.md's table that are not folders: {not_folders}"


PASS_FILES = sorted(p for p in (ROOT / "passes").glob("*_pass.py"))


@pytest.mark.parametrize("path", PASS_FILES, ids=lambda p: p.stem)
def test_a_pass_has_one_name_and_declares_its_contract(path):
    """``passes/<name>_pass.py`` defines ``<name>_pass``, decorated with ``declares(CONTRACT)``,
    and ``CONTRACT = PassContract(name="<name>", ...)``: one name for file, function and report."""
    name = path.stem.removesuffix("_pass")
    tree = ast.parse(path.read_text())
    functions = {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)}
    assert f"{name}_pass" in functions, f"{path.name} defines no {name}_pass (its pass function has another name)"
    decorators = [ast.unparse(d) for d in functions[f"{name}_pass"].decorator_list]
    assert "declares(CONTRACT)" in decorators, f"{name}_pass does not declare its contract (@declares(CONTRACT))"
    contract = next((n.value for n in tree.body if isinstance(n, ast.Assign)
                     and any(getattr(t, "id", None) == "CONTRACT" for t in n.targets)), None)
    assert isinstance(contract, ast.Call) and ast.unparse(contract.func) == "PassContract"
    keywords = {k.arg: k.value for k in contract.keywords}
    declared = keywords["name"]
    if isinstance(declared, ast.Name):  # a constant of the graph core (PASS_NAME)
        source = "\n".join(p.read_text() for p in (ROOT / "neuron_constrain" / "core").glob("*.py"))
        declared = ast.Constant(re.search(rf'^{declared.id} = "(\w+)"', source, re.M).group(1))
    assert declared.value == name, f"{path.name}'s contract names it {declared.value!r}"
    assert {"options", "requires", "ensures"} & set(keywords), f"{path.name}'s contract declares nothing"


def calls_in(prefix: str, names) -> list[str]:
    """``file:line calls f`` for every call, in the modules under ``prefix``, of a function or
    method whose last name is one of ``names``."""
    found = []
    for module, path in MODULES.items():
        if not module.startswith(prefix):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] in names:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} calls {ast.unparse(node.func)}")
    return found


def test_only_the_program_editor_builds_programs():
    """A pass edits through ``ProgramEditor``: it neither calls ``ExportedProgram(...)`` nor builds signatures."""
    built = ("ExportedProgram", "ExportGraphSignature", "ModuleCallSignature", "ModuleCallEntry", "InputSpec", "OutputSpec")
    bad = calls_in("neuron_constrain.passes.", built)
    assert not bad, "\n".join(bad)


def test_what_passes_share_is_not_defined_in_a_pass():
    """``Tap`` / ``match_modules`` / ``as_taps`` (used by ``transform`` and the replacement runtime) live in the graph core."""
    prefixes, _ = rooms()
    for name in ("Tap", "match_modules", "as_taps"):
        homes = [m for m, p in MODULES.items() if re.search(rf"^(class|def) {name}\b", p.read_text(), re.M)]
        assert homes and all(room_of(m, prefixes) == "graph core" for m in homes), f"{name} is defined in {homes}"


def _string_literals(path) -> list[tuple[int, str]]:
    return [(n.lineno, n.value) for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def test_one_writer_of_processor_rows():
    """Processor input names are spelled where they are defined (the graph core's table) and
    written by ``processors/rows.py`` only: the vLLM plugin spells none of them."""
    table = next(n.value for path in MODULES.values() for n in ast.parse(path.read_text()).body
                 if isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "BUILTIN_INPUTS" for t in n.targets))
    names = {k.value for k in table.keys} - {"temperature", "min_p"}  # also the sampler's / vLLM's parameter names
    bad = [f"{path.relative_to(ROOT)}:{line} spells {value!r}" for module, path in MODULES.items()
           if module.startswith("neuron_constrain.vllm") for line, value in _string_literals(path) if value in names]
    assert not bad, "processor input names spelled outside the one writer:\n" + "\n".join(bad)


def test_default_widths_are_written_once():
    """``max_stop_tokens`` / ``max_bias_tokens`` / ``max_penalty_tokens`` default to one table, not to literals."""
    widths = {"max_stop_tokens", "max_bias_tokens", "max_penalty_tokens"}
    bad = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            args = node.args.args[len(node.args.args) - len(node.args.defaults):] + node.args.kwonlyargs
            defaults = node.args.defaults + node.args.kw_defaults
            for arg, default in zip(args, defaults[-len(args):] if args else []):
                if arg.arg in widths and isinstance(default, ast.Constant):
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}({arg.arg}={default.value})")
    assert not bad, "width defaults written as literals:\n" + "\n".join(bad)


def test_nothing_outside_an_engine_branches_on_its_name():
    """What differs between engines is a ``GrammarEngine`` method (``parse``, ``compile``,
    ``enforces``...), not an ``if engine.name == ...`` elsewhere."""
    bad = []
    for module, path in MODULES.items():
        if module.startswith("neuron_constrain.structured.engines"):
            continue
        for line, text in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\.name\s*[!=]=\s*[\"'](xgrammar|llguidance|auto)[\"']", text):
                bad.append(f"{path.relative_to(ROOT)}:{line}: {text.strip()}")
    assert not bad, "branches on an engine's name outside structured/engines/:\n" + "\n".join(bad)


def _constants(path) -> dict[str, str]:
    return {t.id: n.value.value for n in ast.parse(path.read_text()).body if isinstance(n, ast.Assign)
            and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str) and len(n.value.value) > 8
            for t in n.targets if isinstance(t, ast.Name)}


def test_no_copy_of_another_room_s_constants():
    """A string constant of ``structured/`` is imported where it is needed, not written again
    (the plugin's copy of the string-class repair drifted from the library's once)."""
    library = {value: f"{module}.{name}" for module, path in MODULES.items() if module.startswith("neuron_constrain.structured")
               for name, value in _constants(path).items()}
    bad = [f"{path.relative_to(ROOT)}: {name} copies {library[value]}" for module, path in MODULES.items()
           if not module.startswith("neuron_constrain.structured") for name, value in _constants(path).items()
           if value in library]
    assert not bad, "\n".join(bad)


def test_engines_own_their_grammars():
    """Only ``structured/engines/`` imports a grammar engine's library in ``structured/``."""
    bad = []
    for module, path in MODULES.items():
        if not module.startswith("neuron_constrain.structured") or module.startswith("neuron_constrain.structured.engines"):
            continue
        for line, text in enumerate(path.read_text().splitlines(), 1):
            if re.match(r"\s*(import xgrammar|from xgrammar|import llguidance|from llguidance)", text):
                bad.append(f"{path.relative_to(ROOT)}:{line}: {text.strip()}")
    assert not bad, "grammar-engine code outside structured/engines/:\n" + "\n".join(bad)


def test_the_decode_loop_is_not_in_structured():
    """``structured/`` holds what grammars do to masks; the decode loop (running the decode
    programs, their cache rows, the pipelined step, sampling noise) is ``decoding/``'s."""
    decoder_work = ("run_step", "run_prefill", "keep_rows", "exponential_", "PipelinedStep", "split_step")
    bad = calls_in("neuron_constrain.structured", decoder_work)
    assert not bad, "decoder work in structured/:\n" + "\n".join(bad)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_blank_holes(module):
    """No run of three or more blank lines (what a move left behind)."""
    text = MODULES[module].read_text()
    assert "\n\n\n\n" not in text, f"{MODULES[module].relative_to(ROOT)} has a run of blank lines at line " \
        f"{text[: text.index(chr(10) * 4)].count(chr(10)) + 2}"


STRUCTURED_ROOMS = ("schema", "engines", "runtime")  # structured/'s rooms, in the one direction they import


def test_the_schema_layer_imports_one_way():
    """``structured/schema`` imports neither ``engines`` nor ``runtime``; ``engines`` does not import ``runtime``
    (ARCHITECTURE.md: the schema compiler runs once per constraint, engines compile from its prepared form,
    the runtime drives the engines)."""
    prefix = "neuron_constrain.structured."
    rank = {room: i for i, room in enumerate(STRUCTURED_ROOMS)}
    bad = []
    for module in MODULES:
        if not module.startswith(prefix) or module[len(prefix):].split(".")[0] not in rank:
            continue
        source = rank[module[len(prefix):].split(".")[0]]
        for target in GRAPH[module]:
            room = target[len(prefix):].split(".")[0] if target.startswith(prefix) else None
            if room in rank and rank[room] > source:
                bad.append(f"{module} imports {target}")
    assert not bad, "an import against structured/'s direction (schema <- engines <- runtime):\n" + "\n".join(bad)


def test_no_folder_holds_more_than_15_modules():
    counts = {}
    for path in MODULES.values():
        counts[path.parent] = counts.get(path.parent, 0) + 1
    crowded = {str(folder.relative_to(ROOT)): n for folder, n in counts.items() if n > 15}
    assert not crowded, f"folders over 15 modules (give them rooms by role): {crowded}"


@pytest.mark.parametrize("package", ["neuron_constrain.structured.schema", "neuron_constrain.structured.engines",
                                     "neuron_constrain.structured.runtime"])
def test_a_room_says_which_of_its_modules_are_public(package):
    """Each of structured/'s rooms lists its modules in ``__all__`` (what others may import), or names one
    private (``_name.py``)."""
    init = MODULES[package]
    tree = ast.parse(init.read_text())
    listed = next((ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                   and any(getattr(target, "id", None) == "__all__" for target in node.targets)), None)
    assert listed is not None, f"{init.relative_to(ROOT)} has no __all__"
    modules_here = {path.stem for path in init.parent.iterdir() if path.suffix == ".py" and path.stem != "__init__"}
    modules_here |= {path.name for path in init.parent.iterdir() if (path / "__init__.py").exists()}
    unlisted = sorted(m for m in modules_here if not m.startswith("_") and m not in listed)
    assert not unlisted, f"{package}: modules neither private nor in __all__: {unlisted}"
