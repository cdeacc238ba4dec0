"""Issue 12's bursts in-process: the engine's own steps, without HTTP, split by step kind.

The same workload as ``bench/side_by_side.py``'s burst columns: 8 requests at once on a new
1,536-token prefix, each with its own 64 tokens and 16 tokens out (greedy, ``ignore_eos``), then
8 more on the now-cached prefix. The engine is the server's (``load`` + ``build_engine`` with the
server's config and compute threads), stepped in a loop on this thread. Per burst it prints the
wall time, the time inside the model runner per step kind (prefill chunks by size, decode steps
by batch size) and the rest (scheduler, sampling, detokenizing: the engine outside the runner).
A server's burst time from ``side_by_side.py`` minus this wall time is what HTTP and the
asyncio thread add.

    .venv/bin/python bench/burst_trace.py [--rounds 3] [--dtype float32] [--no-native-avx512]
        [--detail]

Config overrides take the server's environment variables (``SPYRE_SERVER_MODEL__...``), so an
AVX2 run as ``side_by_side.sh``'s ``spyre-avx2`` is::

    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 .venv/bin/python bench/burst_trace.py \\
        --dtype float32 --no-native-avx512
"""

from __future__ import annotations

import argparse
import os
import random
import time
from collections import defaultdict
from typing import Any

import torch

from scheduler import PrefillChunk
from spyre_server.config import load_config
from spyre_server.engine.core import LLMEngine
from spyre_server.engine.factory import build_engine
from spyre_server.entrypoints.serve import load
from spyre_server.model.loading import compute_threads
from spyre_server.sample.params import SamplingParams

PREFIX_TOKENS, OWN_TOKENS, OUTPUT_TOKENS, BURST = 1536, 64, 16, 8


def step_kind(step: Any, block_size: int) -> str:
    """``prefill N``: a chunk that computes N tokens (the others of its window are cached: their
    slots are in block 0); ``decode batch B``."""
    if isinstance(step, PrefillChunk):
        return f"prefill {sum(1 for slot in step.slot_mapping if slot >= block_size)}"
    return f"decode batch {len(step.entries)}"


class TimedRunner:
    """Wraps ``engine.runner.execute`` and records (step kind, seconds) per call."""

    def __init__(self, engine: LLMEngine, block_size: int) -> None:
        self.calls: list[tuple[str, float, Any]] = []
        self._block_size = block_size
        self._execute = engine.runner.execute
        engine.runner.execute = self  # type: ignore[method-assign]

    def __call__(self, step: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = self._execute(step, *args, **kwargs)
        self.calls.append((step_kind(step, self._block_size), time.perf_counter() - start, step))
        return out


def burst(
    engine: LLMEngine, timed: TimedRunner, prefix: list[int], rng: random.Random, vocab: int
) -> tuple[float, list[tuple[str, float, Any]]]:
    """Wall seconds for BURST requests on ``prefix``, and the runner calls they made."""
    timed.calls.clear()
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, ignore_eos=True, temperature=0.0)
    start = time.perf_counter()
    for i in range(BURST):
        own = [rng.randrange(vocab) for _ in range(OWN_TOKENS)]
        engine.add_request(f"burst-{rng.random()}-{i}", prefix + own, params)
    while engine.has_unfinished_requests:
        engine.step()
    return time.perf_counter() - start, list(timed.calls)


def report(
    name: str, wall: float, calls: list[tuple[str, float, Any]], detail: bool, block_size: int
) -> None:
    kinds: dict[str, list[float]] = defaultdict(list)
    for kind, seconds, _ in calls:
        kinds[kind].append(seconds)
    inside = sum(seconds for _, seconds, _ in calls)
    print(
        f"{name}: {wall:.3f} s, {len(calls)} steps; runner {inside:.3f} s, "
        f"engine outside the runner {wall - inside:.3f} s"
    )
    for kind in sorted(kinds, key=lambda k: (k.split()[0], int(k.split()[-1]))):
        times = kinds[kind]
        print(f"  {kind:18} {len(times):3d} steps {sum(times):7.3f} s")
    if detail:
        for kind, seconds, step in calls:
            where = ""
            if isinstance(step, PrefillChunk):  # the first position it computes
                first = next(
                    p
                    for p, slot in zip(step.positions, step.slot_mapping, strict=True)
                    if slot >= block_size
                )
                where = f" at {first}"
            print(f"    {kind:18}{where:9} {seconds * 1e3:8.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", help="model.dtype (default: the config's, auto)")
    parser.add_argument(
        "--no-native-avx512",
        dest="native_avx512",
        action="store_false",
        help="model.native_avx512: false (the native kernels' AVX2 code on AVX512F CPUs)",
    )
    parser.add_argument("--detail", action="store_true", help="every step of the last round")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    overrides: dict[str, Any] = {}
    if args.dtype:
        overrides["model.dtype"] = args.dtype
    if not args.native_avx512:
        overrides["model.native_avx512"] = False
    config = load_config(environ=os.environ, overrides=overrides)
    loaded = load(config)  # on one torch thread, as the server loads
    engine = build_engine(config, loaded)
    torch.set_num_threads(compute_threads(config))
    vocab = loaded.vocab_size
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"model {config.model.dtype} -> {loaded.dtype}"
    )
    timed = TimedRunner(engine, config.cache.block_size)
    rng = random.Random(args.seed)
    for round_index in range(args.rounds):
        prefix = [rng.randrange(vocab) for _ in range(PREFIX_TOKENS)]
        last = round_index == args.rounds - 1
        for name in ("burst cold", "burst cached"):
            wall, calls = burst(engine, timed, prefix, rng, vocab)
            report(
                f"round {round_index + 1}, {name}",
                wall,
                calls,
                args.detail and last,
                config.cache.block_size,
            )


if __name__ == "__main__":
    main()
