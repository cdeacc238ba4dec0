"""``spyre-server serve`` as a real process on SmolLM2: it serves, and SIGTERM drains in-flight
requests before exiting 0."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from spyre_server.model.store import default_cache_dir, prepare_default_model

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_healthy(base: str, process: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, "the server exited during start-up"
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise AssertionError(f"the server was not healthy within {timeout} s")


def test_sigterm_finishes_in_flight_requests_then_exits_0(tmp_path: Path) -> None:
    model = prepare_default_model(default_cache_dir())
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "SPYRE_SERVER_CACHE__NUM_BLOCKS": "64",
        "SPYRE_SERVER_MODEL__DTYPE": "float32",
        "SPYRE_SERVER_SERVER__LOG_LEVEL": "warning",
    }
    process = subprocess.Popen(
        [
            *(sys.executable, "-m", "spyre_server.cli", "serve"),
            *("--host", "127.0.0.1", "--port", str(port), "--model", str(model)),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        _wait_healthy(base, process, timeout=120)
        body = {"prompt": "Once upon a time", "max_tokens": 40, "temperature": 0, "stream": True}
        frames: list[str] = []
        first_frame = threading.Event()

        def stream() -> None:
            with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        frames.append(line[len("data: ") :])
                        first_frame.set()

        client = threading.Thread(target=stream)
        client.start()
        assert first_frame.wait(60), "no output before SIGTERM"
        process.send_signal(signal.SIGTERM)
        client.join(60)
        assert not client.is_alive()
        assert process.wait(60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert frames[-1] == "[DONE]"
    chunks = [json.loads(f) for f in frames[:-1]]
    assert all("error" not in c for c in chunks), chunks
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert len(text) > 40  # all 40 tokens arrived
