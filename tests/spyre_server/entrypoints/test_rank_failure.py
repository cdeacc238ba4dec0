"""A tensor-parallel rank that dies under load ends the server cleanly: the requests in flight
get an error (an SSE error event, then ``[DONE]``), ``/health`` is no longer 200, the process
exits 1, and no rank process is left behind. A Ctrl-C to the whole process group (a terminal)
is a graceful stop: exit 0, ranks gone."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.spyre_server.entrypoints.test_serve_process import _free_port, _wait_healthy
from tests.spyre_server.model.parallel.checkpoints import build_tp_checkpoint

pytestmark = pytest.mark.slow


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid ...: comm may hold spaces and parentheses.
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def start_server(
    tmp_path: Path, smollm2_path: Path, *, new_session: bool = False
) -> tuple[subprocess.Popen[bytes], str, list[int], Path]:
    """A server with 2 ranks on a tiny llama: the process, its URL, its ranks' pids, its log."""
    model = build_tp_checkpoint("llama", tmp_path / "llama", smollm2_path)
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "SPYRE_SERVER_CACHE__NUM_BLOCKS": "64"}
    command = [sys.executable, "-m", "spyre_server.entrypoints.cli", "serve", str(model)]
    command += ["--host", "127.0.0.1", "--port", str(port), "--dtype", "float32"]
    command += ["--tensor-parallel-size", "2", "--max-model-len", "1024"]
    log = tmp_path / "server.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(
            command,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=new_session,
        )
    try:
        _wait_healthy(base, process, timeout=180)
        started = re.search(r"tensor parallel: 2 ranks \(pids (\d+), (\d+)\)", log.read_text())
        assert started is not None, log.read_text()
        ranks = [int(pid) for pid in started.groups()]
        assert set(ranks) <= set(children(process.pid))
    except BaseException:
        process.kill()
        process.wait()
        raise
    return process, base, ranks, log


def wait_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in pids if alive(pid)], "rank processes outlived the server"


def test_a_dead_rank_ends_the_server_with_errors_and_no_orphans(
    tmp_path: Path, smollm2_path: Path
) -> None:
    process, base, ranks, log = start_server(tmp_path, smollm2_path)
    try:
        metrics = httpx.get(f"{base}/metrics", timeout=5).text
        assert 'spyre:tensor_parallel_size{model_name="llama"} 2.0' in metrics
        frames: dict[int, list[str]] = {0: [], 1: []}
        streaming = threading.Barrier(3)

        def stream(index: int) -> None:
            body = {"prompt": [5 + index] * 20, "max_tokens": 900, "stream": True}
            with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as resp:
                first = True
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        frames[index].append(line.removeprefix("data: "))
                        if first:
                            first = False
                            streaming.wait(30)

        clients = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
        for client in clients:
            client.start()
        streaming.wait(60)  # both requests are decoding
        os.kill(ranks[-1], signal.SIGKILL)
        for client in clients:
            client.join(60)
            assert not client.is_alive(), "a client still waits"
        try:
            health = httpx.get(f"{base}/health", timeout=5).status_code
        except httpx.TransportError:
            health = None  # the server has already closed its port
        assert health in (503, None)
        assert process.wait(60) == 1, log.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    output = log.read_text(errors="replace")
    for index in (0, 1):
        assert frames[index][-1] == "[DONE]", frames[index][-3:]
        last = json.loads(frames[index][-2])
        assert "error" in last, last
        assert "rank 1" in last["error"]["message"], last
    assert "rank 1 (pid" in output and "ended with exit code -9" in output, output
    wait_gone(ranks)


def test_ctrl_c_to_the_process_group_stops_server_and_ranks_gracefully(
    tmp_path: Path, smollm2_path: Path
) -> None:
    process, _, ranks, log = start_server(tmp_path, smollm2_path, new_session=True)
    try:
        os.killpg(process.pid, signal.SIGINT)  # as a terminal's Ctrl-C: every process of it
        assert process.wait(60) == 0, log.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert "Traceback" not in log.read_text(errors="replace"), log.read_text()
    wait_gone(ranks)
