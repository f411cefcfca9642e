"""The API reference is complete: every public name has an anchor, every public function, class and
method says what it takes, returns and raises, and the CLI page is the parser's.

Public: every name of a public module's ``__all__`` (``docs/hooks.py``'s ``public_names``: the front
doors of ``neuron_constrain`` and its subpackages, ``passes``, ``kernels``, the graph core's documented
modules, the decoding modules the guides import), and the public methods of the classes among them.

- Anchors: the site's object inventory (``build/site/objects.inv``, written by ``make docs``) has an
  entry for each public name, of the kind the name is (a function documented as a function). The
  docs build checks the same (``docs/hooks.py``'s ``on_post_build``); here it also meets the package as
  it imports, so the hook's static reading of ``__all__`` is checked too.
- Docstrings, read with ``ast`` (Google style): a docstring; an ``Args:`` section naming each argument
  (``self`` / ``cls`` aside) where there are any; ``Returns:`` (or ``Yields:``) where the function returns
  a value (its annotation is not ``None``, or, unannotated, it returns or yields one); ``Raises:`` where
  its own body raises. A class's constructor arguments are its ``__init__``'s, documented in the class's
  docstring or the ``__init__``'s; a property needs no ``Returns:`` (it reads as an attribute, and its
  setter no docstring).
- The CLI page, ``docs/reference/cli.md``, is what ``docs/gen_cli.py`` writes from ``build_parser()``; it
  names every argument of every command, each has a help text, and the help says what the code does.
"""
from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import inspect
import pathlib
import re
import textwrap

import pytest

# what this file checks is host-side, the same on every torch: the main lane runs it (see the torch_agnostic marker)
pytestmark = pytest.mark.torch_agnostic

ROOT = pathlib.Path(__file__).resolve().parent.parent
INVENTORY = ROOT / "build" / "site" / "objects.inv"
CLI_PAGE = ROOT / "docs" / "reference" / "cli.md"


def load_file(name: str, path: pathlib.Path):
    """A Python file of the docs folder, imported by path (``docs/`` is no package)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


hooks = load_file("docs_hooks", ROOT / "docs" / "hooks.py")
PUBLIC = hooks.public_names()


# ----------------------------------------------------------------------------- anchors

def test_the_hook_reads_the_all_the_package_exports():
    """The docs build reads ``__all__`` with ``ast`` (its environment has no torch): what it reads is what
    each module exports when imported, and every exported name is there."""
    assert {"neuron_constrain", "neuron_constrain.structured", "neuron_constrain.replacement", "neuron_constrain.vllm",
            "neuron_constrain.passes", "neuron_constrain.kernels", "neuron_constrain.decoding.xla"} <= set(PUBLIC)
    for module, names in PUBLIC.items():
        imported = importlib.import_module(module)
        assert list(imported.__all__) == names, module
        absent = [name for name in names if not hasattr(imported, name)]
        assert not absent, f"{module}.__all__ names what it does not define: {absent}"


def test_the_anchor_check_names_each_missing_name():
    everything = {hooks.source_name(f"{module}.{name}"): "py:function" for module, names in PUBLIC.items() for name in names}
    assert hooks.missing_anchors(everything) == []
    del everything["neuron_constrain.replacement.localize"], everything["kernels.apply_bitmask"]
    assert hooks.missing_anchors(everything) == ["neuron_constrain.kernels.apply_bitmask",
                                                 "neuron_constrain.replacement.localize"]


def expected_role(value) -> set[str]:
    """The inventory roles an object may be documented under."""
    if inspect.ismodule(value):
        return {"py:module"}
    if inspect.isclass(value):
        return {"py:class"}
    if inspect.isroutine(value):
        return {"py:function"}
    return {"py:data", "py:attribute"}


def test_every_public_name_has_an_anchor_of_its_kind():
    if not INVENTORY.is_file():
        pytest.skip(f"{INVENTORY.relative_to(ROOT)} does not exist: build the site first (make docs); "
                    "the docs build runs this check itself")
    inventory = hooks.read_inventory(INVENTORY)
    missing = hooks.missing_anchors(inventory)
    assert not missing, f"no anchor in the API reference for: {', '.join(missing)} (document each in docs/reference/)"
    wrong = []
    for module, names in PUBLIC.items():
        for name in names:
            value = getattr(importlib.import_module(module), name)
            anchor = hooks.source_name(f"{module}.{name}")
            role = inventory[anchor]
            # a pass lives in a file of its own name (passes/<name>_pass.py defines <name>_pass): the name
            # documents that module, whose section documents the function
            same_named = role == "py:module" and inventory.get(f"{anchor}.{name}") in expected_role(value)
            if role not in expected_role(value) and not same_named:
                wrong.append(f"{module}.{name} is a {type(value).__name__} documented as {role}")
    assert not wrong, "\n".join(wrong)


def test_localize_is_documented_as_the_function():
    if not INVENTORY.is_file():
        pytest.skip(f"{INVENTORY.relative_to(ROOT)} does not exist: build the site first (make docs)")
    inventory = hooks.read_inventory(INVENTORY)
    assert inventory["neuron_constrain.replacement.localize"] == "py:function"
    assert inventory["neuron_constrain.structured.generate"] == "py:function"


# ----------------------------------------------------------------------------- docstrings

def module_files() -> dict[str, pathlib.Path]:
    """Installed module name -> its file, for every module of the package."""
    out = {}
    for package, folder in {"neuron_constrain": ROOT / "neuron_constrain", "neuron_constrain.passes": ROOT / "passes",
                            "neuron_constrain.kernels": ROOT / "kernels"}.items():
        for path in sorted(folder.rglob("*.py")):
            out[".".join((package, *path.relative_to(folder).with_suffix("").parts)).removesuffix(".__init__")] = path
    return out


MODULE_FILES = module_files()
_TREES: dict[str, ast.Module] = {}


def tree(module: str) -> ast.Module:
    if module not in _TREES:
        _TREES[module] = ast.parse(MODULE_FILES[module].read_text(), str(MODULE_FILES[module]))
    return _TREES[module]


def imported_from(module: str, node: ast.ImportFrom) -> str:
    """The module a ``from ... import`` statement of ``module`` reads (relative imports resolved)."""
    if not node.level:
        return node.module
    package = module if MODULE_FILES[module].name == "__init__.py" else module.rpartition(".")[0]
    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
    return ".".join(parts + ([node.module] if node.module else []))


def definition(module: str, name: str):
    """Where ``module.name`` is defined: ``(module, the def / class node)``, following imports; None for a
    module or a value (data has no signature to document)."""
    bound = None
    for node in tree(module).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            bound = (module, node)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(name in {n.id for n in ast.walk(t) if isinstance(n, ast.Name)} for t in targets):
                bound = None
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    source = imported_from(module, node)
                    bound = None if f"{source}.{alias.name}" in MODULE_FILES else ("import", source, alias.name)
    if bound is not None and bound[0] == "import":
        return definition(bound[1], bound[2])
    return bound


SECTION = re.compile(r"^(Args|Arguments|Parameters|Returns|Yields|Raises|Attributes|Examples?|Notes?):\s*$")


def sections(docstring: str) -> dict[str, str]:
    """A Google-style docstring's sections: title -> its (indented) body."""
    out: dict[str, list[str]] = {}
    current = None
    for line in docstring.splitlines():
        match = SECTION.match(line)
        if match:
            current = {"Arguments": "Args", "Parameters": "Args"}.get(match[1], match[1])
            out[current] = []
        elif current is not None:
            if line.strip() and not line[0].isspace():
                current = None
            else:
                out[current].append(line)
    return {title: "\n".join(body) for title, body in out.items()}


def own_nodes(function: ast.AST):
    """The nodes of a function's body, nested functions, lambdas and classes left out."""
    stack = list(function.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def parameters(function: ast.FunctionDef | ast.AsyncFunctionDef, method: bool) -> list[str]:
    a = function.args
    names = [p.arg for p in a.posonlyargs + a.args]
    decorators = {ast.unparse(d) for d in function.decorator_list}
    if method and "staticmethod" not in decorators:
        names = names[1:]
    names += [p.arg for p in a.kwonlyargs]
    names += [f"*{a.vararg.arg}"] if a.vararg else []
    names += [f"**{a.kwarg.arg}"] if a.kwarg else []
    return names


def missing_args(docstring: str, names: list[str]) -> list[str]:
    body = sections(docstring).get("Args", "")
    return [n for n in names if not re.search(r"^\s+(\\?\*){0,2}" + re.escape(n.lstrip("*")) + r"\b", body, re.M)]


def returns_a_value(function) -> bool:
    if function.returns is not None:
        return not (isinstance(function.returns, ast.Constant) and function.returns.value is None)
    return any(isinstance(n, (ast.Yield, ast.YieldFrom, ast.Return)) and n.value is not None
               and not (isinstance(n.value, ast.Constant) and n.value.value is None) for n in own_nodes(function))


def raises(function) -> bool:
    return any(isinstance(n, ast.Raise) and n.exc is not None for n in own_nodes(function))


def function_problems(function, where: str, method: bool = False) -> list[str]:
    """What a function's (or method's) docstring lacks."""
    docstring = ast.get_docstring(function)
    if docstring is None:
        return [f"{where}: no docstring"]
    found = sections(docstring)
    problems = []
    names = parameters(function, method)
    if names and "Args" not in found:
        problems.append(f"{where}: no Args section ({', '.join(names)})")
    elif names and missing_args(docstring, names):
        problems.append(f"{where}: Args does not name {', '.join(missing_args(docstring, names))}")
    decorators = {ast.unparse(d).rpartition(".")[2] for d in function.decorator_list}
    if returns_a_value(function) and not decorators & {"property", "cached_property"} \
            and not {"Returns", "Yields"} & set(found):
        problems.append(f"{where}: no Returns section")
    if raises(function) and "Raises" not in found:
        problems.append(f"{where}: no Raises section (its body raises)")
    return problems


def class_problems(cls: ast.ClassDef, where: str) -> list[str]:
    """What a class's docstring, its constructor's and its public methods' lack."""
    docstring = ast.get_docstring(cls)
    problems = [] if docstring is not None else [f"{where}: no docstring"]
    init = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
    if init is not None:
        text = f"{docstring or ''}\n{ast.get_docstring(init) or ''}"
        names = parameters(init, method=True)
        if names and "Args" not in sections(text):
            problems.append(f"{where}: its constructor's arguments are not documented (an Args section: {', '.join(names)})")
        elif names and missing_args(text, names):
            problems.append(f"{where}: Args does not name {', '.join(missing_args(text, names))}")
        if raises(init) and "Raises" not in sections(text):
            problems.append(f"{where}: no Raises section (its __init__ raises)")
    for node in cls.body:
        setter = any(ast.unparse(d).endswith((".setter", ".deleter")) for d in getattr(node, "decorator_list", ()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_") and not setter:
            problems += function_problems(node, f"{where}.{node.name}", method=True)
    return problems


def problems_of(module: str, node) -> list[str]:
    where = f"{MODULE_FILES[module].relative_to(ROOT)}:{node.lineno}: {module}.{node.name}"
    return class_problems(node, where) if isinstance(node, ast.ClassDef) else function_problems(node, where)


def test_the_docstring_check_has_teeth():
    source = textwrap.dedent('''
        def bare(x):
            return x

        def good(x, *rest, flag=False, **options) -> int:
            """Does.

            Args:
                x: one.
                *rest: more.
                flag: a switch.
                **options: the rest.

            Returns:
                A number.

            Raises:
                ValueError: never mind.
            """
            if flag:
                raise ValueError("x")
            return 1

        def no_returns(x) -> int:
            """Does.

            Args:
                x: one.
            """

        def unnamed(x, y) -> None:
            """Does.

            Args:
                x: one.
            """

        def raising():
            """Does."""
            raise ValueError("no")

        class C:
            """A class."""

            def __init__(self, size):
                self.size = size

            def method(self):
                """Returns its size, undeclared."""
                return self.size

            @property
            def area(self) -> int:
                """The area."""
                return self.size ** 2
    ''')
    found = {}
    for node in ast.parse(source).body:
        report = class_problems(node, node.name) if isinstance(node, ast.ClassDef) else function_problems(node, node.name)
        found[node.name] = report
    assert found["bare"] == ["bare: no docstring"]
    assert found["good"] == []
    assert found["no_returns"] == ["no_returns: no Returns section"]
    assert found["unnamed"] == ["unnamed: Args does not name y"]
    assert found["raising"] == ["raising: no Raises section (its body raises)"]
    assert found["C"] == ["C: its constructor's arguments are not documented (an Args section: size)",
                          "C.method: no Returns section"]


def public_definitions() -> list[tuple[str, ast.AST]]:
    """Every public function and class, once (re-exported names point at one definition)."""
    seen, out = set(), []
    for module, names in PUBLIC.items():
        for name in names:
            found = definition(module, name)
            if found is not None and (found[0], found[1].name) not in seen:
                seen.add((found[0], found[1].name))
                out.append(found)
    return out


def test_the_walk_reaches_the_public_objects():
    reached = {f"{module}.{node.name}" for module, node in public_definitions()}
    assert {"neuron_constrain.structured.runtime.structured_runtime.StructuredRuntime",
            "neuron_constrain.structured.runtime.reasoning.Reasoning", "neuron_constrain.vllm.server_args",
            "neuron_constrain.replacement.localization.localize", "neuron_constrain.passes.split_at_mask_pass.SplitReport",
            "neuron_constrain.kernels.bitmask.apply_bitmask", "neuron_constrain.core.transform.transform"} <= reached
    assert len(reached) > 150


def test_every_public_object_documents_its_arguments_returns_and_raises():
    problems = [p for module, node in public_definitions() for p in problems_of(module, node)]
    assert not problems, f"{len(problems)} docstring(s) to complete (Google style: Args, Returns, Raises):\n" + \
        "\n".join(problems)


# ----------------------------------------------------------------------------- the CLI page

gen_cli = load_file("docs_gen_cli", ROOT / "docs" / "gen_cli.py")


def parser_and_commands() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    from neuron_constrain.cli import build_parser

    parser = build_parser()
    return parser, {name: sub for name, _, sub in gen_cli.commands(parser)}


def test_the_cli_page_is_the_parser_s():
    parser, _ = parser_and_commands()
    assert CLI_PAGE.read_text() == gen_cli.cli_reference(parser), \
        "docs/reference/cli.md is not the parser's: regenerate it with `python docs/gen_cli.py`"


def page_sections(page: str) -> dict[str, str]:
    """The page's text under each ``## command`` heading (``""``: the text before the first)."""
    parts = re.split(r"^## (\w+)$", page, flags=re.M)
    return {"": parts[0], **dict(zip(parts[1::2], parts[2::2]))}


def test_every_argument_of_every_command_is_on_the_page():
    parser, commands = parser_and_commands()
    assert list(commands) == ["rewrite", "show", "diff", "check", "hlo", "localize", "generate", "demo"]
    page = page_sections(CLI_PAGE.read_text())
    missing = []
    for name, command in [("", parser), *commands.items()]:
        for action in gen_cli.arguments(command):
            spellings = action.option_strings or [action.metavar or action.dest]
            missing += [f"{name or 'neuron-constrain'} {s}" for s in spellings if f"`{s}" not in page.get(name, "")]
            if not (action.help or "").strip():
                missing.append(f"{name or 'neuron-constrain'} {spellings[0]}: no help text")
    assert not missing, f"not on docs/reference/cli.md: {missing} (give each a help=, then `python docs/gen_cli.py`)"
    for name, flag in [("", "--debug"), ("", "--version"), ("rewrite", "--empty-row"), ("rewrite", "--tp-degree"),
                       ("rewrite", "--passes"), ("localize", "--atol")]:
        assert f"`{flag}" in page[name], (name, flag)


def test_the_page_check_has_teeth():
    parser, commands = parser_and_commands()
    page = gen_cli.cli_reference(parser)
    assert "`--tp-degree N`" in page and "`IN.pt2`" in page and "(default `1e-05`)" in page
    commands["rewrite"].add_argument("--new-flag", help="a new flag")
    assert gen_cli.cli_reference(parser) != page and "`--new-flag NEW_FLAG`: a new flag" in gen_cli.cli_reference(parser)


def test_the_help_says_what_the_code_does():
    from neuron_constrain import cli

    _, commands = parser_and_commands()
    options = {name: {o: a for a in command._actions for o in a.option_strings} for name, command in commands.items()}
    passes = options["rewrite"]["--passes"].help
    # the passes rewrite runs when --passes is not given, as its help says
    assert cli._parse_passes(None, None) == ["mask_logits"] and "default: mask_logits" in passes
    assert cli._parse_passes(None, ["model.layers.*"]) == ["tap_modules", "mask_logits"]
    assert "and tap_modules with --tap" in passes and "all" not in passes
    assert all(name in passes for name in cli.PASSES)
    # defaults the code applies where argparse leaves None are named in the help
    assert cli._parse_empty_row("flag") == "flag" and "'flag' (default" in options["rewrite"]["--empty-row"].help
    assert options["rewrite"]["--logit-mask"].default is None and "packed int32 xgrammar bitmask (default)" in \
        options["rewrite"]["--logit-mask"].help
    assert "(default 1: not sharded)" in options["rewrite"]["--tp-degree"].help
    assert "required|auto|none|NAME" == options["generate"]["--tool-choice"].metavar
    assert options["localize"]["--atol"].default == 1e-5
    # the exit statuses the epilog lists are the ones main returns
    epilog = cli.build_parser().epilog
    assert f"{cli.EXIT_OK} ok; {cli.EXIT_FAILED} a check failed" in epilog and f"{cli.EXIT_USAGE} bad usage" in epilog
