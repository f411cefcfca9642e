"""The built wheel holds the package: every module of the source tree, under the name it imports as.

Editable installs (``make test``, CI's lanes) import from the checkout and hide a package the wheel
leaves out; this builds the wheel the way ``pip install .`` does and compares its files with the tree.
``make test-wheel`` (a CI step) installs that wheel alone into a fresh environment and runs the README.
"""
from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# folder in the tree -> the package it installs as (setup.py finds neuron_constrain's; setup.cfg maps the two)
INSTALLED_AS = {"neuron_constrain": "neuron_constrain", "passes": "neuron_constrain/passes",
                "kernels": "neuron_constrain/kernels"}
DATA = ("*.py", "*.jinja")  # the module files and the package data setup.cfg ships


def tree_files() -> set[str]:
    """Every module and data file the source tree has, as its path inside the installed package."""
    found = set()
    for folder, installed in INSTALLED_AS.items():
        for pattern in DATA:
            for path in (ROOT / folder).rglob(pattern):
                if "__pycache__" not in path.parts:
                    found.add(f"{installed}/{path.relative_to(ROOT / folder).as_posix()}")
    return found


@pytest.mark.torch_agnostic(lane="latest")
def test_the_wheel_holds_every_module_of_the_tree(tmp_path):
    # built from a copy: setuptools builds in the source folder (build/lib), where a module since moved away
    # would still lie and be shipped
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", ".venv*", "build", "*.egg-info", "__pycache__",
                                                                 ".hypothesis", ".pytest_cache", "benchmarks", "docs"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(source)],
                   check=True, capture_output=True, cwd=tmp_path)
    (wheel,) = tmp_path.glob("neuron_constrain-*.whl")
    shipped = {name for name in zipfile.ZipFile(wheel).namelist() if name.startswith("neuron_constrain/")}
    expected = tree_files()
    assert "neuron_constrain/core/program.py" in expected and "neuron_constrain/passes/__init__.py" in expected
    assert expected - shipped == set(), f"the wheel leaves out {sorted(expected - shipped)}"
    assert shipped - expected == set(), f"the wheel holds files the tree does not: {sorted(shipped - expected)}"
    from neuron_constrain import __version__
    assert wheel.name.startswith(f"neuron_constrain-{__version__}-")


@pytest.mark.torch_agnostic(lane="latest")
def test_the_version_is_one_everywhere(capsys):
    """``neuron_constrain.__version__`` is the wheel's (setup.cfg reads it), the CLI's ``--version`` and the docs
    site's name (docs/hooks.py reads it from the source); CHANGELOG.md has its section."""
    import importlib.util

    from neuron_constrain import __version__
    from neuron_constrain.cli import build_parser

    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    assert hooks.package_version() == __version__
    assert hooks.on_config({"site_name": "neuron-constrain"})["site_name"] == f"neuron-constrain {__version__}"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--version"])
    assert capsys.readouterr().out.strip() == f"neuron-constrain {__version__}"
    assert f"## {__version__}" in (ROOT / "CHANGELOG.md").read_text()
