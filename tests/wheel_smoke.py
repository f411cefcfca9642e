"""Run the README's Python snippets against an installed neuron-constrain (``make test-wheel``: the built
wheel alone in a fresh venv), then a structured request whose schema needs the schema algebra and the item
tracker (``allOf``, ``not``, ``uniqueItems``) on the default engine, then each script of ``examples/`` that
needs no server (all but ``vllm_client.py``), each as a reader runs it: a subprocess of this interpreter,
started from an empty temporary folder, exit 0.

    python tests/wheel_smoke.py README.md [examples]       # from a folder outside the checkout

A snippet preceded by ``<!-- not run: REASON -->`` is skipped, as tests/test_readme.py skips it. Run from
outside the checkout, so ``import neuron_constrain`` finds the installed package, never the source tree.
"""
from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys
import tempfile
import time

FENCE = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
NOT_RUN = re.compile(r"<!-- not run: .+? -->\n\Z")
NEEDS_A_SERVER = {"vllm_client.py"}  # the vLLM lane runs it against a server (tests/vllm/test_client_example.py)


def snippets(readme: str) -> list[str]:
    return [m.group(1) for m in FENCE.finditer(readme) if not NOT_RUN.search(readme, 0, m.start())]


def structured_with_the_algebra() -> None:
    import jsonschema

    from neuron_constrain import structured as S
    from neuron_constrain.decoding import export_decoder
    from neuron_constrain.testing import tiny_decoder, toy_tokenizer

    tok = toy_tokenizer()
    schema = {"type": "array", "uniqueItems": True, "maxItems": 3,
              "items": {"allOf": [{"type": "integer"}, {"minimum": 0, "maximum": 999}], "not": {"const": 3}}}
    decoder = export_decoder(tiny_decoder("llama", vocab_size=tok.vocab_size), max_batch=1, max_len=64,
                             vocab_size=tok.vocab_size)
    result = S.generate(decoder, ["Numbers:"], [S.json_schema(schema)], 40, tokenizer=tok)
    output = result.outputs[0]
    assert output.error is None, output.error
    jsonschema.validate(json.loads(output.text), schema)
    print(f"wheel smoke: allOf/not/uniqueItems answered {output.text!r}")


def run_examples(folder: str) -> None:
    """Each example script but those that need a server, as a subprocess of this venv's Python (its
    ``sys.path`` starts at the script's own folder, which holds no package: the installed wheel answers)."""
    paths = sorted(p for p in pathlib.Path(folder).resolve().glob("*.py") if p.name not in NEEDS_A_SERVER)
    if not paths:
        raise SystemExit(f"wheel smoke: no example scripts in {folder}")
    for path in paths:
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as cwd:
            result = subprocess.run([sys.executable, str(path)], cwd=cwd, capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            raise SystemExit(f"wheel smoke: examples/{path.name} exited {result.returncode}\n{result.stdout}\n"
                             f"{result.stderr[-4000:]}")
        print(f"wheel smoke: examples/{path.name} ran ({time.perf_counter() - start:.1f} s)")


def main(readme_path: str, examples: str | None = None) -> int:
    import neuron_constrain

    source = pathlib.Path(neuron_constrain.__file__).resolve()
    if source.parent == pathlib.Path(readme_path).resolve().parent / "neuron_constrain":
        print(f"wheel smoke: neuron_constrain imports from the checkout ({source}); run it outside", file=sys.stderr)
        return 2
    print(f"wheel smoke: neuron_constrain {neuron_constrain.__version__} from {source.parent}")
    for index, code in enumerate(snippets(pathlib.Path(readme_path).read_text()), 1):
        start = time.perf_counter()
        exec(compile(code, f"README snippet {index}", "exec"), {"__name__": "__readme__"})
        print(f"wheel smoke: README snippet {index} ran ({time.perf_counter() - start:.1f} s)")
    structured_with_the_algebra()
    if examples is not None:
        run_examples(examples)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
