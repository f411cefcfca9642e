"""The generated pages are what their generators write: docs/compatibility.md from the pins (setup.cfg, the
Makefile), docs/errors.md from the ``neuron_constrain.Error`` family. A pin, an error class or an error message
changed without its page fails here; ``python docs/gen_compat.py`` / ``python docs/gen_errors.py`` rewrite them.
"""
from __future__ import annotations

import ast
import importlib.util
import pathlib
import re
import shutil
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def generator(name: str):
    spec = importlib.util.spec_from_file_location(f"docs_{name}", ROOT / "docs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------- compatibility


@pytest.mark.torch_agnostic
def test_the_compatibility_page_is_what_the_pins_give():
    gen = generator("gen_compat")
    assert (ROOT / "docs" / "compatibility.md").read_text() == gen.page(), \
        "docs/compatibility.md is stale: run python docs/gen_compat.py"


@pytest.mark.torch_agnostic
def test_a_changed_pin_changes_the_page(tmp_path, monkeypatch):
    """The page is read from the pins, not written by hand: move one pin in a copy and the page follows."""
    gen = generator("gen_compat")
    for name in ("setup.cfg", "Makefile", "neuron_constrain/vllm/__init__.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    setup = tmp_path / "setup.cfg"
    setup.write_text(setup.read_text().replace("xgrammar==0.2.8", "xgrammar==0.2.9"))
    makefile = tmp_path / "Makefile"
    makefile.write_text(makefile.read_text().replace("MAIN_TORCH := torch==2.9.0", "MAIN_TORCH := torch==2.9.1"))
    monkeypatch.setattr(gen, "ROOT", tmp_path)
    text = gen.page()
    assert "| torch | 2.9.1 | 2.13.0 | 2.13.0 | 2.13.0 |" in text
    assert "| xgrammar | 0.2.9 | 0.2.9 | 0.2.8 | 0.2.9 |" in text  # the vLLM lane pins its own
    assert "| `xgrammar` | `==0.2.9` |" in text


@pytest.mark.torch_agnostic
def test_the_page_names_the_python_the_lanes_run():
    gen = generator("gen_compat")
    running = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert running == gen.TESTED_PYTHON, (
        f"docs/compatibility.md says the lanes run CPython {gen.TESTED_PYTHON}, this one is {running}: set "
        "TESTED_PYTHON in docs/gen_compat.py and regenerate the page")


# ----------------------------------------------------------------------------- errors


def _headings() -> set[str]:
    return set(re.findall(r"^### (\w+)$", (ROOT / "docs" / "errors.md").read_text(), re.M))


def _error_classes_in_the_source() -> set[str]:
    """Every class the source defines that derives, by name, from ``Error`` or one of its subclasses (a fixed
    point over the package, passes/ and kernels/): the modules that need vLLM to import are read too."""
    bases = {}
    for folder in ("neuron_constrain", "passes", "kernels"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    names = {b.id if isinstance(b, ast.Name) else b.attr for b in node.bases
                             if isinstance(b, (ast.Name, ast.Attribute))}
                    bases.setdefault(node.name, set()).update(names)
    errors, grew = {"Error"}, True
    while grew:
        more = {name for name, parents in bases.items() if parents & errors} - errors
        errors |= more
        grew = bool(more)
    return errors


@pytest.mark.torch_agnostic
def test_every_error_class_has_its_section():
    gen = generator("gen_errors")
    imported = set(gen.error_classes())
    assert len(imported) >= 25
    assert imported == _error_classes_in_the_source(), "an error class the import walk does not reach"
    missing = imported - _headings()
    assert not missing, f"docs/errors.md has no section for {sorted(missing)}: add them to docs/gen_errors.py, rerun it"
    assert _headings() <= imported, f"docs/errors.md names classes that are gone: {sorted(_headings() - imported)}"


@pytest.mark.torch_agnostic
def test_the_quoted_messages_are_still_the_codes():
    gen = generator("gen_errors")
    page = (ROOT / "docs" / "errors.md").read_text()
    for name, (example, path, fragments) in gen.QUOTED.items():
        source = (ROOT / path).read_text()
        for fragment in fragments:
            assert fragment in source, f"{name}: {path} no longer writes {fragment!r}; update QUOTED in docs/gen_errors.py"
        assert example in page, name


@pytest.mark.one_lane  # its messages name nodes of the main lane's torch export (linear_14)
def test_the_errors_page_is_what_raising_them_gives():
    gen = generator("gen_errors")
    assert (ROOT / "docs" / "errors.md").read_text() == gen.page(), \
        "docs/errors.md is stale (an error's message or its class changed): run python docs/gen_errors.py"
