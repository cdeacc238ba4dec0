"""Three micro replicas on loopback (each with its KV-event publisher) and a real vllm-router
process in front of them; which replica served which request is recorded."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROUTER_BIN = Path(sys.executable).parent / "vllm-router"
READY_TRIES = 600  # x 0.1 s: a bound on waiting for the router, never an assertion on time


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class ServedBy:
    """ASGI wrapper of a replica's app: records the prompt of every /v1/completions request."""

    app: Any
    replica: int
    log: list[tuple[int, Any]] = field(default_factory=list)

    def __getattr__(self, name: str) -> Any:  # app.state etc. for the test helpers
        return getattr(self.app, name)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != "/v1/completions":
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        more = True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        self.log.append((self.replica, json.loads(body).get("prompt")))
        sent = False

        async def replay() -> Any:
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


@contextmanager
def vllm_router(
    worker_urls: list[str], policy: str, event_endpoints: list[str] | None = None
) -> Iterator[str]:
    """``vllm-router`` on a free loopback port; yields its URL. ``kv_aware`` gets one static
    event source per worker, block size 64 and the model name."""
    port = free_port()
    cmd = [str(ROUTER_BIN), "--host", "127.0.0.1", "--port", str(port), "--policy", policy]
    cmd += ["--worker-urls", *worker_urls]
    for url, endpoint in zip(worker_urls, event_endpoints or [], strict=False):
        cmd += ["--kv-event-source", f"{url}={endpoint}"]
    if event_endpoints:
        cmd += ["--kv-event-block-size", "64", "--kv-event-model", "micro"]
    cmd += ["--prometheus-port", str(free_port()), "--prometheus-host", "127.0.0.1"]
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(READY_TRIES):
            if process.poll() is not None:
                raise RuntimeError(f"vllm-router exited: {process.stderr.read()!r}")  # type: ignore[union-attr]
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        else:
            raise RuntimeError("vllm-router did not become ready")
        time.sleep(0.5)  # its ZMQ subscribers join (a slow joiner misses the first batches)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
