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
            *(sys.executable, "-m", "spyre_server.entrypoints.cli", "serve"),
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


def _serve_process(port: int, log: Path) -> subprocess.Popen[bytes]:
    model = prepare_default_model(default_cache_dir())
    env = {
        **os.environ,
        "SPYRE_SERVER_CACHE__NUM_BLOCKS": "64",
        "SPYRE_SERVER_MODEL__DTYPE": "float32",
        "SPYRE_SERVER_MODEL__NUM_THREADS": "1",
    }
    command = [sys.executable, "-m", "spyre_server.entrypoints.cli", "serve", str(model)]
    command += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "INFO"]
    # As from a terminal: a shell's background job (`pytest &`, CI runners) starts with SIGINT
    # ignored, which a child inherits, and a Python started so keeps ignoring Ctrl-C (as a
    # `nohup` server should). A handled SIGINT here becomes the default in the child.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with log.open("wb") as sink:
            return subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT)
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("when", ["serving", "starting"])
def test_ctrl_c_exits_0_without_a_traceback(tmp_path: Path, when: str) -> None:
    """SIGINT (Ctrl-C) once the server is healthy, or as soon as it loads the model (it holds its
    port from just before): exit status 0, no traceback. The start is read from the log: a probe
    that binds the port to see whether it is taken holds it for a moment, and a server binding
    then fails (it did, once, in CI)."""
    port = _free_port()
    log = tmp_path / "server.log"
    process = _serve_process(port, log)
    try:
        if when == "serving":
            _wait_healthy(f"http://127.0.0.1:{port}", process, timeout=120)
        else:
            deadline = time.monotonic() + 120
            while "loading the model from" not in log.read_text(errors="replace"):
                assert process.poll() is None, log.read_text()
                assert time.monotonic() < deadline, "the server never began to load the model"
                time.sleep(0.01)
        process.send_signal(signal.SIGINT)
        code = process.wait(60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    output = log.read_text(errors="replace")
    assert code == 0, output
    assert "Traceback" not in output, output
    if when == "serving":
        assert f"serving SmolLM2-135M-Instruct on http://127.0.0.1:{port}" in output
