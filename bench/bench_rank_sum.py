"""The sum across tensor-parallel ranks that every layer of a cpu step makes twice: 2 rank
processes, each pinned to its own core with one torch thread, add a ``[rows, hidden]`` float32
tensor through shared memory (``parallel/shared_sum.py``) and through a gather over gloo, in ms
per sum, beside a plain copy of the same bytes (the least a sum moves).

    .venv/bin/python bench/bench_rank_sum.py [--hidden 2048] [--rows 1,8,256]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable

import torch
import torch.multiprocessing as mp

from spyre_server.model.cpu.kernels.library import NativeKernelSettings
from spyre_server.model.parallel.group import init_rank_group
from spyre_server.model.parallel.shared_sum import SharedSum, SharedSumBuffers

RANKS = 2


def per_call_ms(fn: Callable[[], object], reps: int) -> float:
    for _ in range(max(3, reps // 10)):
        fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e3


def rank_main(
    rank: int, rendezvous: str, buffers: SharedSumBuffers, hidden: int, rows: list[int], out: object
) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    torch.set_num_threads(1)
    group = init_rank_group(rank, RANKS, rendezvous)
    shared = SharedSum(buffers, rank, NativeKernelSettings().load())
    results = {}
    for n in rows:
        tensor = torch.randn(n, hidden)
        reps = 2000 if n < 64 else 200
        group.shared = None
        gloo = per_call_ms(lambda t=tensor: group.sum_(t), reps)
        group.shared = shared
        shm = per_call_ms(lambda t=tensor: group.sum_(t), reps)
        target = tensor.clone()
        copy = per_call_ms(lambda t=tensor, c=target: c.copy_(t), reps)
        results[n] = (gloo, shm, copy)
    if rank == 0:
        out.put(results)  # type: ignore[attr-defined]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--rows", default="1,8,256")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    context = mp.get_context("spawn")
    queue = context.Queue()
    buffers = SharedSumBuffers.allocate(RANKS, max(rows) * args.hidden, torch.float32)
    rendezvous = os.path.join(tempfile.mkdtemp(), "rendezvous")
    ranks = [
        context.Process(target=rank_main, args=(r, rendezvous, buffers, args.hidden, rows, queue))
        for r in range(RANKS)
    ]
    for process in ranks:
        process.start()
    results = queue.get()
    for process in ranks:
        process.join()
    print(f"{RANKS} ranks, hidden {args.hidden}, float32, ms per sum")
    print("| rows | MB | gloo gather | shared memory | gloo / shared | a copy of the bytes |")
    print("|---|---|---|---|---|---|")
    for n, (gloo, shm, copy) in results.items():
        mb = n * args.hidden * 4 / 1e6
        print(f"| {n} | {mb:.3f} | {gloo:.3f} | {shm:.3f} | {gloo / shm:.1f}x | {copy:.4f} |")


if __name__ == "__main__":
    main()
