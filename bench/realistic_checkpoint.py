"""Save one of ``bench_engine.RANDOM_MODELS`` (random weights, the default model's tokenizer) as
an HF folder, for servers that load it from disk (``bench/peers/decode_1b.sh``)::

    .venv/bin/python -m bench.realistic_checkpoint llama1b /work/peers/models/llama1b [--layers N]

Run from the repository root: it builds with the conformance suite's builder.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from bench.bench_engine import RANDOM_MODELS, random_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", choices=sorted(RANDOM_MODELS))
    parser.add_argument("directory", type=Path, help="the folder to create (must not exist)")
    parser.add_argument("--layers", type=int, default=None, help="default: the model's own")
    args = parser.parse_args()
    if args.directory.exists():
        raise SystemExit(f"{args.directory} exists; remove it or name another")
    layers = args.layers or RANDOM_MODELS[args.model][2]["num_hidden_layers"]
    args.directory.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.directory.parent) as scratch:
        built = random_checkpoint(args.model, layers, Path(scratch))
        shutil.move(built, args.directory)
    print(args.directory)


if __name__ == "__main__":
    main()
