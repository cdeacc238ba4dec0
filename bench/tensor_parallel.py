"""Tensor parallelism on one box: the shared-prefix workload (side_by_side.py) against a server
with 2 ranks of 1 thread each (``--tensor-parallel-size 2``) and one with 1 rank of 2 threads,
both up at once and driven in alternate rounds, with the ratios of the first over the second.

    .venv/bin/python bench/tensor_parallel.py [--model PATH] [--layers 8] [--dtype auto] [--reps 3]

The default model (SmolLM2-135M: 9 query, 3 key/value heads) does not split over 2 ranks, so
without ``--model`` it runs a random-weight checkpoint with granite-3.x-2b's shapes (32 query,
8 key/value heads, hidden 2048, MLP 8192) and ``--layers`` of its 40 layers, built at start by
bench_engine.py's builder.

On a 2-core box the two servers use the same 2 cores: what differs is how the cores share a
step (two processes, each with its own heads and a sum over a pipe per layer, against one
OpenMP pool of 2 threads). The results and the machine go to bench/README.md.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import side_by_side
from router_cluster import free_port, wait_ready

from spyre_server.benchmark.tokenizer import load_tokenizer, ordinary_token_ids

LAYOUTS = (("tp2x1", 2, 1), ("tp1x2", 1, 2))
"""label, ranks, threads per rank."""


def start(
    model: str | None, ranks: int, threads: int, dtype: str
) -> tuple[str, subprocess.Popen[bytes]]:
    port = free_port()
    command = [sys.executable, "-m", "spyre_server.entrypoints.cli", "serve"]
    command += ["--host", "127.0.0.1", "--port", str(port), "--dtype", dtype]
    command += ["--tensor-parallel-size", str(ranks), "--log-level", "warning"]
    if model:
        command += ["--model", model]
    env = os.environ | {
        "SPYRE_SERVER_MODEL__NUM_THREADS": str(threads),
        "SPYRE_SERVER_CACHE__KV_CACHE_MEMORY": "512MiB",
    }
    process = subprocess.Popen(command, env=env)
    return f"http://127.0.0.1:{port}", process


def granite_checkpoint(layers: int) -> str:
    """bench_engine.py's granite-2b-shaped random checkpoint with ``layers`` layers (built in a
    child run from the repository root, where its builder's imports resolve)."""
    directory = Path(tempfile.mkdtemp(prefix="tp-bench-"))
    root = Path(__file__).resolve().parent.parent
    code = (
        "import sys; from pathlib import Path; from bench.bench_engine import random_checkpoint; "
        f"print(random_checkpoint('granite', {layers}, Path(sys.argv[1])))"
    )
    built = subprocess.run(
        [sys.executable, "-c", code, str(directory)], cwd=root, check=True, capture_output=True
    )
    return built.stdout.decode().strip().splitlines()[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="an HF folder (default: granite-2b shapes)")
    parser.add_argument("--layers", type=int, default=8, help="of the default model's 40")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tokenizer", type=Path, default=None)
    args = parser.parse_args()
    model = args.model or granite_checkpoint(args.layers)
    servers = [
        (label, *start(model, ranks, threads, args.dtype)) for label, ranks, threads in LAYOUTS
    ]
    try:
        for _, url, process in servers:
            wait_ready(url, process, 600)
        vocab = ordinary_token_ids(load_tokenizer(args.tokenizer))
        clients = [(side_by_side.Client(url, vocab, 0), label) for label, url, _ in servers]
        results = side_by_side.measure(clients, args.reps)
        print(side_by_side.compare(results, absolute_targets=False))
    finally:
        for _, _, process in servers:
            process.terminate()
        for _, _, process in servers:
            process.wait(60)


if __name__ == "__main__":
    main()
