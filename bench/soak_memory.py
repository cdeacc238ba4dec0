"""Server memory across two soak runs on SmolLM2-135M-Instruct.

Starts ``spyre-server serve`` in a child process (float32, one torch thread, 127.0.0.1 on a free
port), waits for /health, runs the soak load of tests/soak/load.py (the same generator as the
soak test) ``--runs`` times, and prints the server's resident memory (VmRSS, and the peak VmHWM,
from /proc/<pid>/status) before the first run and after each run has drained, with each run's
summary line.

Run from the repository root (it imports ``tests.soak.load``):
``.venv/bin/python -m bench.soak_memory`` (about 10 minutes on 2 shared cores with the defaults). Options: ``--num-requests`` (300), ``--concurrency`` (32), ``--seed``, ``--runs`` (2),
``--threads`` (1), ``--num-blocks`` (256 KV blocks, block 0 included; ``0``: the configured
``cache.kv_cache_memory``), ``--verify`` (after each run, send every completed request alone
and compare texts: slower, and those requests then count in the next memory figure).

Reported, not asserted: growth across runs is for a person to judge (the KV cache is allocated
at start, but its pages become resident only as blocks are first written).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.soak.load import full_shape, run_soak


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def memory_mib(pid: int) -> dict[str, float]:
    """VmRSS and VmHWM of ``pid`` in MiB."""
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0]) / 1024  # kB
    return values


def wait_healthy(url: str, process: subprocess.Popen[bytes], timeout: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with {process.returncode} before /health")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"no healthy server at {url} after {timeout} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seed", type=int, default=20250807)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--num-blocks", type=int, default=256)
    parser.add_argument("--verify", action="store_true")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    args = parser.parse_args()

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = os.environ | {
        "SPYRE_SERVER_MODEL__NUM_THREADS": str(args.threads),
        "SPYRE_SERVER_MODEL__DTYPE": "float32",
        "SPYRE_SERVER_SERVER__LOG_LEVEL": "warning",
    }
    if args.num_blocks:
        env["SPYRE_SERVER_CACHE__NUM_BLOCKS"] = str(args.num_blocks)
    command = [
        str(Path(sys.executable).parent / "spyre-server"),
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    print(f"starting: {' '.join(command)} (threads {args.threads}, blocks {args.num_blocks})")
    process = subprocess.Popen(command, env=env)
    rows: list[tuple[str, dict[str, float], str]] = []
    try:
        startup = wait_healthy(url, process, args.startup_timeout)
        print(f"healthy after {startup:.1f} s (pid {process.pid})")
        rows.append(("before run 1", memory_mib(process.pid), ""))
        print(f"before run 1: {rows[-1][1]}", flush=True)
        for run in range(1, args.runs + 1):
            shape = full_shape(args.seed, args.num_requests, args.concurrency)
            report = asyncio.run(
                run_soak(url, shape, ignore_eos=True, verify=args.verify, timeout=1800)
            )
            time.sleep(1.0)  # let the allocator settle after the drain
            summary = report.summary()
            rows.append((f"after run {run}", memory_mib(process.pid), summary))
            print(f"run {run}: {summary}", flush=True)
            for problem in report.problems():
                print(f"  problem: {problem}")
            print(f"after run {run}: {rows[-1][1]}", flush=True)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    print("\nserver memory (MiB)")
    print(f"{'when':<14} {'VmRSS':>8} {'VmHWM':>8}  delta RSS")
    first = rows[0][1]["VmRSS"]
    for when, mem, _ in rows:
        print(f"{when:<14} {mem['VmRSS']:>8.1f} {mem['VmHWM']:>8.1f}  {mem['VmRSS'] - first:+.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
