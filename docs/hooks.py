"""MkDocs hooks: the docstrings' Sphinx roles read as code, and a build fails on a public name the
API reference does not document.

mkdocstrings renders Google-style sections but not reStructuredText roles, which would show as
``:func:`` before the name: the role is dropped, and ``~a.b.C`` shows as ``C`` (Sphinx's meaning).

After the build, the object inventory mkdocstrings wrote (``objects.inv``) must hold every name of
every public ``__all__`` (:data:`PUBLIC_MODULES`, read with ``ast``: the docs' environment has no
torch, so the package is never imported); a name it lacks fails the build, each one named.
``tests/test_reference.py`` runs the same check on a built site and checks this list against the
package as it imports.
"""
from __future__ import annotations

import ast
import pathlib
import re
import zlib

ROOT = pathlib.Path(__file__).resolve().parent.parent

ROLES = r":(?:func|class|meth|mod|attr|data|exc|obj):"
SHORT = re.compile(ROLES + r"<code>~(?:[\w.]+\.)?(?=\w+</code>)")
PLAIN = re.compile(ROLES + r"<code>")

# What a user imports, beside the subpackages' front doors (``neuron_constrain/<name>/__init__.py`` with an
# ``__all__``, found by :func:`public_modules`): the graph core's modules the core page documents (``core``
# has no front door) and the decoding modules the guides import.
PUBLIC_MODULES = (
    "neuron_constrain",
    "neuron_constrain.passes",
    "neuron_constrain.kernels",
    "neuron_constrain.core.transform",
    "neuron_constrain.core.pass_manager",
    "neuron_constrain.core.contract",
    "neuron_constrain.core.checks",
    "neuron_constrain.core.report",
    "neuron_constrain.core.errors",
    "neuron_constrain.core.program",
    "neuron_constrain.core.canonical",
    "neuron_constrain.core.graph_diff",
    "neuron_constrain.decoding.pipeline",
    "neuron_constrain.decoding.xla",
    "neuron_constrain.decoding.compiled",
)
# ``passes/`` and ``kernels/`` install as ``neuron_constrain.passes`` / ``neuron_constrain.kernels``;
# mkdocstrings reads them from the checkout, where their names are ``passes`` / ``kernels``.
SOURCE_PACKAGES = {"neuron_constrain.passes": "passes", "neuron_constrain.kernels": "kernels"}
INVENTORY_LINE = re.compile(r"(?P<name>\S+)\s+(?P<domain>\w+):(?P<role>\w+)\s+-?\d+\s+\S*\s+.*")


def package_version(root: pathlib.Path = ROOT) -> str:
    """``neuron_constrain.__version__``, read from the source (this venv has no torch to import the package).

    Args:
        root: the repository.

    Returns:
        The version string.

    Raises:
        ValueError: the front door assigns no ``__version__`` string.
    """
    tree = ast.parse((root / "neuron_constrain" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__version__" for t in node.targets):
            return ast.literal_eval(node.value)
    raise ValueError("neuron_constrain/__init__.py assigns no __version__")


def on_config(config, **kwargs):
    """The site's name carries the package's version (``neuron-constrain 0.2.0``), so a reader knows which
    release a page describes."""
    config["site_name"] = f"{config['site_name']} {package_version()}"
    return config


def on_page_content(html: str, **kwargs) -> str:
    """Drops the Sphinx roles from a page's HTML (``:func:<code>x</code>`` reads ``<code>x</code>``).

    Args:
        html: the page's content, rendered.
        **kwargs: the rest of MkDocs' event arguments (unused).

    Returns:
        The content without the roles; ``~a.b.C`` shortened to ``C``.
    """
    return PLAIN.sub("<code>", SHORT.sub("<code>", html))


def source_name(name: str) -> str:
    """The name mkdocstrings gives an installed dotted name (``neuron_constrain.kernels.x`` -> ``kernels.x``).

    Args:
        name: a dotted name as the package installs it.

    Returns:
        The dotted name as the checkout spells it.
    """
    for installed, source in SOURCE_PACKAGES.items():
        if name == installed or name.startswith(installed + "."):
            return source + name[len(installed):]
    return name


def source_file(module: str, root: pathlib.Path = ROOT) -> pathlib.Path:
    """The file that defines an installed module.

    Args:
        module: an installed module name (``neuron_constrain.decoding.xla``).
        root: the repository.

    Returns:
        Its ``.py`` file, or its package's ``__init__.py``.

    Raises:
        FileNotFoundError: no such module in the checkout.
    """
    path = root.joinpath(*source_name(module).split("."))
    for candidate in (path / "__init__.py", path.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{module}: neither {path}/__init__.py nor {path}.py exists; fix PUBLIC_MODULES in docs/hooks.py")


def read_all(path: pathlib.Path) -> list[str] | None:
    """A module's ``__all__``, read from its source without importing it.

    Args:
        path: the module's file.

    Returns:
        The names, in order; None where the module assigns no ``__all__``.

    Raises:
        ValueError: ``__all__`` is not a literal list or tuple of strings.
    """
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                try:
                    names = ast.literal_eval(node.value)
                except ValueError:
                    names = None
                if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
                    raise ValueError(f"{path}:{node.lineno}: __all__ is not a literal list of strings; write it as one")
                return list(names)
    return None


def public_modules(root: pathlib.Path = ROOT) -> list[str]:
    """Every public module: :data:`PUBLIC_MODULES` and each subpackage of ``neuron_constrain`` with an ``__all__``.

    Args:
        root: the repository.

    Returns:
        The installed module names, sorted.
    """
    found = set(PUBLIC_MODULES)
    for init in sorted((root / "neuron_constrain").glob("*/__init__.py")):
        if read_all(init) is not None:
            found.add(f"neuron_constrain.{init.parent.name}")
    return sorted(found)


def public_names(root: pathlib.Path = ROOT) -> dict[str, list[str]]:
    """Each public module's ``__all__``.

    Args:
        root: the repository.

    Returns:
        Installed module name -> the names its ``__all__`` lists.

    Raises:
        ValueError: a module of :data:`PUBLIC_MODULES` has no ``__all__``.
    """
    out = {}
    for module in public_modules(root):
        names = read_all(source_file(module, root))
        if names is None:
            raise ValueError(f"{module} is public (docs/hooks.py's PUBLIC_MODULES) but has no __all__; "
                             "list its public names in one")
        out[module] = names
    return out


def read_inventory(path: pathlib.Path) -> dict[str, str]:
    """The entries of a Sphinx object inventory (version 2: four header lines, then zlib-compressed lines).

    Args:
        path: an ``objects.inv``.

    Returns:
        Each entry's name -> its ``domain:role`` (``neuron_constrain.transform`` -> ``py:function``).

    Raises:
        ValueError: the file is not a version 2 inventory.
    """
    data = path.read_bytes()
    header = data.split(b"\n", 4)
    if len(header) < 5 or header[0] != b"# Sphinx inventory version 2":
        raise ValueError(f"{path} is not a Sphinx inventory (version 2); rebuild the site with mkdocs build")
    out = {}
    for line in zlib.decompress(header[4]).decode("utf-8").splitlines():
        match = INVENTORY_LINE.fullmatch(line)
        if match:
            out.setdefault(match["name"], f"{match['domain']}:{match['role']}")
    return out


def missing_anchors(inventory: dict[str, str], root: pathlib.Path = ROOT) -> list[str]:
    """The public names the inventory has no entry for.

    Args:
        inventory: what :func:`read_inventory` returned.
        root: the repository.

    Returns:
        The missing names, installed spelling (``neuron_constrain.kernels.x``), in the modules' order.
    """
    return [f"{module}.{name}" for module, names in public_names(root).items() for name in names
            if source_name(f"{module}.{name}") not in inventory]


def on_post_build(config, **kwargs) -> None:
    """Fails the build when the API reference lacks a public name.

    Args:
        config: MkDocs' configuration (its ``site_dir`` holds ``objects.inv``).
        **kwargs: the rest of MkDocs' event arguments (unused).

    Raises:
        mkdocs.exceptions.PluginError: the inventory is missing, or lacks names (each one named).
    """
    from mkdocs.exceptions import PluginError

    inventory = pathlib.Path(config["site_dir"]) / "objects.inv"
    if not inventory.is_file():
        raise PluginError(f"{inventory} was not written: mkdocstrings writes it; keep its plugin in mkdocs.yml")
    missing = missing_anchors(read_inventory(inventory))
    if missing:
        raise PluginError(f"the API reference has no anchor for {len(missing)} public name(s): {', '.join(missing)}; "
                          "document each in docs/reference/*.md (a `::: module` block, in mkdocs.yml's nav). A name "
                          "that is also its package's submodule documents the submodule: rename the module")
