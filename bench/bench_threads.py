"""What the OpenMP thread policy costs a torch op on this box.

Each setting runs in its own process, because libgomp reads ``OMP_WAIT_POLICY`` and
``GOMP_SPINCOUNT`` once, when torch loads it. For each setting it times ``F.linear`` at the
shapes of SmolLM2's MLP (k=576, n=1536) for m = 8 / 64 / 256 rows, back to back and with a
0.5 ms / 5 ms pause before each call (the host work between two ops of a step, and between two
steps), and a large square GEMM for the machine's attainable FLOP/s. Then the same products on a
second thread, after the main thread either ran a 2-thread op (two libgomp worker pools, as when
a server loads its model with 2 threads and steps on another thread) or stayed on 1 thread.

    .venv/bin/python bench/bench_threads.py
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

SETTINGS: list[tuple[str, dict[str, str]]] = [
    ("1 thread", {"THREADS": "1"}),
    ("2 threads, libgomp default", {"THREADS": "2"}),
    ("2 threads, OMP_WAIT_POLICY=ACTIVE", {"THREADS": "2", "OMP_WAIT_POLICY": "ACTIVE"}),
    ("2 threads, OMP_WAIT_POLICY=PASSIVE", {"THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"}),
    ("2 threads, GOMP_SPINCOUNT=10M", {"THREADS": "2", "GOMP_SPINCOUNT": "10000000"}),
]
SHAPES = [(8, 576, 1536), (64, 576, 1536), (256, 576, 1536)]
PAUSES_S = [0.0, 0.0005, 0.005]


def child() -> None:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(int(os.environ["THREADS"]))
    out: dict[str, float] = {}
    for m, k, n in SHAPES:
        x, w = torch.randn(m, k), torch.randn(n, k)
        for pause in PAUSES_S:
            times = []
            for _ in range(60):
                if pause:
                    end = time.perf_counter() + pause
                    while time.perf_counter() < end:  # busy host work, as Python between ops
                        pass
                start = time.perf_counter()
                F.linear(x, w)
                times.append(time.perf_counter() - start)
            out[f"{m}x{k}x{n} pause {pause * 1e3:g} ms"] = statistics.median(times[10:])
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    out["gemm 2048 GFLOP/s"] = 10 * 2 * 2048**3 / (time.perf_counter() - start) / 1e9
    print(json.dumps(out))


def second_pool_child() -> None:
    """F.linear timed on a second thread, after the main thread ran a 2-thread parallel op (so
    libgomp holds two worker pools) or only 1-thread ops (one pool: the timing thread's)."""
    import threading

    import torch
    import torch.nn.functional as F

    torch.set_num_threads(int(os.environ["MAIN_THREADS"]))
    torch.randn(2048, 2048) @ torch.randn(2048, 2048)  # the main thread's pool, if 2 threads
    out: dict[str, float] = {}

    def timed() -> None:
        torch.set_num_threads(2)
        for m, k, n in SHAPES:
            x, w = torch.randn(m, k), torch.randn(n, k)
            times = []
            for _ in range(60):
                start = time.perf_counter()
                F.linear(x, w)
                times.append(time.perf_counter() - start)
            out[f"{m}x{k}x{n}"] = statistics.median(times[10:])

    thread = threading.Thread(target=timed)
    thread.start()
    thread.join()
    print(json.dumps(out))


def second_pool() -> None:
    print("\n== F.linear on a second thread with 2 torch threads (the server's step thread) ==")
    rows = {}
    for main_threads in ("2", "1"):
        env = dict(os.environ, BENCH_THREADS_CHILD="pool", MAIN_THREADS=main_threads)
        text = subprocess.run(
            [sys.executable, __file__], env=env, capture_output=True, text=True, check=True
        ).stdout
        rows[main_threads] = json.loads(text)
    print(f"{'shape':<16}{'main ran 2 threads':>22}{'main ran 1 thread':>22}{'ratio':>8}")
    for key in rows["2"]:
        two, one = rows["2"][key], rows["1"][key]
        print(f"{key:<16}{two * 1e3:>19.3f} ms{one * 1e3:>19.3f} ms{two / one:>7.2f}x")


def main() -> None:
    if os.environ.get("BENCH_THREADS_CHILD") == "pool":
        second_pool_child()
        return
    if os.environ.get("BENCH_THREADS_CHILD"):
        child()
        return
    rows = []
    for label, env in SETTINGS:
        full = {
            k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
        }
        full |= env | {"BENCH_THREADS_CHILD": "1"}
        text = subprocess.run(
            [sys.executable, __file__], env=full, capture_output=True, text=True, check=True
        ).stdout
        rows.append((label, json.loads(text)))
    keys = list(rows[0][1])
    width = max(len(k) for k in keys)
    print(f"{'':<{width}}  " + "  ".join(f"{label:>34}" for label, _ in rows))
    for key in keys:
        cells = []
        for _, values in rows:
            v = values[key]
            cells.append(f"{v:>34.1f}" if "GFLOP" in key else f"{v * 1e3:>31.3f} ms")
        print(f"{key:<{width}}  " + "  ".join(cells))
    for label, values in rows:
        shape = (256, 576, 1536)
        t = values[f"{shape[0]}x{shape[1]}x{shape[2]} pause 0 ms"]
        print(f"{label}: F.linear 256x576x1536 at {2 * 256 * 576 * 1536 / t / 1e9:.1f} GFLOP/s")
    second_pool()


if __name__ == "__main__":
    main()
