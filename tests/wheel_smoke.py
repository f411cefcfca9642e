"""Run the README's Python snippets against an installed neuron-constrain (``make test-wheel``: the built
wheel alone in a fresh venv), then a structured request whose schema needs the schema algebra and the item
tracker (``allOf``, ``not``, ``uniqueItems``) on the default engine.

    python tests/wheel_smoke.py README.md        # from a folder outside the checkout

A snippet preceded by ``<!-- not run: REASON -->`` is skipped, as tests/test_readme.py skips it. Run from
outside the checkout, so ``import neuron_constrain`` finds the installed package, never the source tree.
"""
from __future__ import annotations

import json
import pathlib
import re
import sys
import time

FENCE = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
NOT_RUN = re.compile(r"<!-- not run: .+? -->\n\Z")


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


def main(readme_path: str) -> int:
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
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
