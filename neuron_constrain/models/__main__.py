"""``python -m neuron_constrain.models build [--dir DIR]``: convert SmolLM2 once (prints the directory)."""
from __future__ import annotations

import argparse
import sys

from neuron_constrain.models.smollm2 import ModelNotInstalledError, build


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m neuron_constrain.models", description=__doc__)
    parser.add_argument("command", choices=["build"])
    parser.add_argument("--dir", default=None, help="where to write it (default build/smollm2)")
    args = parser.parse_args(argv)
    try:
        print(build(args.dir, log=lambda line: print(line, file=sys.stderr)))
    except ModelNotInstalledError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
