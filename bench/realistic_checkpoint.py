"""Save one of ``bench_engine.RANDOM_MODELS`` (random weights, the default model's tokenizer) as
an HF folder, for servers that load it from disk (``bench/peers/decode_1b.sh``)::

    .venv/bin/python -m bench.realistic_checkpoint llama1b /work/peers/models/llama1b [--layers N]

``--fp8``: the folder holds its FP8 quantization instead (``quantize_fp8``).

Run from the repository root: it builds with the conformance suite's builder.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from bench.bench_engine import RANDOM_MODELS, random_checkpoint

CALIBRATION = [[1000 + (i * 7919) % 40000 for i in range(256)]]
"""One pseudo-random 256-token prompt: what the FP8 quantization's input scales are taken on."""


def quantize_fp8(path: Path, target: Path) -> Path:
    """The checkpoint at ``path`` as llm-compressor's FP8 scheme writes it, into ``target``:
    float8_e4m3fn weights with a scale per output, static input scales calibrated on
    ``CALIBRATION`` (``tests/conformance/fp8_checkpoints.py``)."""
    from tests.conformance.fp8_checkpoints import quantize

    return quantize(path, target, per_channel=True, inputs="static", prompts=CALIBRATION)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", choices=sorted(RANDOM_MODELS))
    parser.add_argument("directory", type=Path, help="the folder to create (must not exist)")
    parser.add_argument("--layers", type=int, default=None, help="default: the model's own")
    parser.add_argument("--fp8", action="store_true", help="save its FP8 quantization instead")
    args = parser.parse_args()
    if args.directory.exists():
        raise SystemExit(f"{args.directory} exists; remove it or name another")
    layers = args.layers or RANDOM_MODELS[args.model][2]["num_hidden_layers"]
    args.directory.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.directory.parent) as scratch:
        built = random_checkpoint(args.model, layers, Path(scratch))
        if args.fp8:
            built = quantize_fp8(built, Path(scratch) / "fp8")
        shutil.move(built, args.directory)
    print(args.directory)


if __name__ == "__main__":
    main()
