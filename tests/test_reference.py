"""The API reference is complete: every public name has an anchor.

Public: every name of a public module's ``__all__`` (``docs/hooks.py``'s ``public_names``: the front
doors of ``neuron_constrain`` and its subpackages, ``passes``, ``kernels``, the graph core's documented
modules, the decoding modules the guides import), and the public methods of the classes among them.

- Anchors: the site's object inventory (``build/site/objects.inv``, written by ``make docs``) has an
  entry for each public name, of the kind the name is (a function documented as a function). The
  docs build checks the same (``docs/hooks.py``'s ``on_post_build``); here it also meets the package as
  it imports, so the hook's static reading of ``__all__`` is checked too.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import pathlib

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
