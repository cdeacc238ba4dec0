"""N spyre-server replicas behind vllm-router on loopback, one ``spyre-server bench`` run per
routing policy, plus the same run against one replica alone (the single-node baseline).

Each replica is a ``spyre-server serve`` process (the default model unless ``--model``) with its
KV-event publisher on; ``kv_aware`` gets one static event source per replica. Every run starts
from empty caches (``POST /reset_prefix_cache`` on every replica). The bench arguments after
``--`` are passed through (``--base-url`` is set here); its sum of ``cached_tokens`` is the
routed hit, compared across runs:

    .venv/bin/python bench/router_cluster.py --replicas 3 -- shared-system-prompt \\
        --num-groups 6 --prompts-per-group 4 --output-len 8 --max-concurrency 3

Needs ``vllm-router`` (``pip install vllm-router==0.1.17``, in the dev extras).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

import httpx

BIN = Path(sys.executable).parent
POLICIES = ("kv_aware", "cache_aware", "round_robin")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_ready(url: str, process: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{process.args!r} exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} not ready within {timeout} s")


def start_replicas(
    count: int, model: str | None, threads: int
) -> list[tuple[str, str, subprocess.Popen[bytes]]]:
    # An empty topic (what vllm-router's static sources take) can only come from a file.
    config_file = Path(tempfile.mkdtemp()) / "replica.yaml"
    config_file.write_text('kv_events:\n  enabled: true\n  topic: ""\n')
    replicas = []
    for _ in range(count):
        port, events = free_port(), f"tcp://127.0.0.1:{free_port()}"
        env = os.environ | {
            "SPYRE_SERVER_KV_EVENTS__ENDPOINT": events,
            "SPYRE_SERVER_MODEL__NUM_THREADS": str(threads),
            "SPYRE_SERVER_CACHE__KV_CACHE_MEMORY": "512MiB",
        }
        cmd = [str(BIN / "spyre-server"), "serve", "--config", str(config_file)]
        cmd += ["--host", "127.0.0.1", "--port", str(port)]
        if model:
            cmd += ["--model", model]
        process = subprocess.Popen(
            cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        replicas.append((f"http://127.0.0.1:{port}", events, process))
    for url, _, process in replicas:
        wait_ready(url, process, 600)
    return replicas


def model_name(url: str) -> str:
    return str(httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"])


def cache_counters(url: str) -> tuple[float, float]:
    """(prefix_cache_queries_total, prefix_cache_hits_total) of one replica."""
    from prometheus_client.parser import text_string_to_metric_families

    values = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            values[sample.name] = sample.value
    return values["vllm:prefix_cache_queries_total"], values["vllm:prefix_cache_hits_total"]


def bench(base_url: str, bench_args: list[str]) -> dict[str, object]:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [str(BIN / "spyre-server"), "bench", *bench_args, "--base-url", base_url]
        subprocess.run([*cmd, "--output", out.name, "--disable-tqdm"], check=True)
        return json.loads(Path(out.name).read_text())  # type: ignore[no-any-return]


def run_routed(
    policy: str,
    workers: list[str],
    replicas: list[tuple[str, str, subprocess.Popen[bytes]]],
    name: str,
    bench_args: list[str],
    router_args: list[str],
    router_log: Path | None,
) -> dict[str, object]:
    port = free_port()
    cmd = [str(BIN / "vllm-router"), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--policy", policy, "--worker-urls", *workers]
    if policy == "kv_aware":
        for url, events, _ in replicas:
            cmd += ["--kv-event-source", f"{url}={events}"]
        cmd += ["--kv-event-block-size", "64", "--kv-event-model", name]
    cmd += router_args
    with contextlib.ExitStack() as stack:
        sink: int | IO[bytes] = subprocess.DEVNULL
        if router_log is not None:
            sink = stack.enter_context(open(router_log.with_suffix(f".{policy}.log"), "wb"))
        router = subprocess.Popen(cmd, stdout=sink, stderr=sink)
        try:
            wait_ready(f"http://127.0.0.1:{port}", router, 120)
            time.sleep(1)  # the router's ZMQ subscribers join
            return bench(f"http://127.0.0.1:{port}", bench_args)
        finally:
            router.terminate()
            router.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--model", help="model folder (default: the default model)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    parser.add_argument("--policies", nargs="*", default=list(POLICIES))
    parser.add_argument(
        "--router-arg", action="append", default=[], help="passed to vllm-router (repeatable)"
    )
    parser.add_argument(
        "--router-log", type=Path, help="write each router's output to PATH.<policy>.log"
    )
    parser.add_argument("bench_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    bench_args = [a for a in args.bench_args if a != "--"]
    replicas = start_replicas(args.replicas, args.model, args.threads)
    results: dict[str, dict[str, object]] = {}
    try:
        name = model_name(replicas[0][0])
        runs: list[tuple[str, list[str] | None]] = [("single", None)]
        runs += [(policy, [url for url, _, _ in replicas]) for policy in args.policies]
        for label, workers in runs:
            for url, _, _ in replicas:
                httpx.post(f"{url}/reset_prefix_cache", timeout=30).raise_for_status()
            before = [cache_counters(url) for url, _, _ in replicas]
            if workers is None:
                results[label] = bench(replicas[0][0], bench_args)
            else:
                results[label] = run_routed(
                    label, workers, replicas, name, bench_args, args.router_arg, args.router_log
                )
            after = [cache_counters(url) for url, _, _ in replicas]
            results[label]["per_replica_queried_hit_tokens"] = [
                [a[0] - b[0], a[1] - b[1]] for a, b in zip(after, before, strict=True)
            ]
    finally:
        for _, _, process in replicas:
            process.terminate()
        for _, _, process in replicas:
            process.wait(60)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
