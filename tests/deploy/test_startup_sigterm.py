"""SIGTERM while the model loads stops ``spyre-server serve`` at once with exit 0 (as a
container's PID 1 a process without a SIGTERM handler would ignore it; outside a container the
default action would kill it with -15). tests/container checks the same inside Docker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.local import free_port

pytestmark = pytest.mark.slow


def test_sigterm_during_model_loading_exits_0_before_serving(smollm2_path: Path) -> None:
    env = {**os.environ, "SPYRE_SERVER_MODEL__DTYPE": "float32", "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [
            *(sys.executable, "-m", "spyre_server.entrypoints.cli", "serve", "--host", "127.0.0.1"),
            *("--port", str(free_port()), "--model", str(smollm2_path)),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = []
    try:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            if "loading the model" in line:
                process.send_signal(signal.SIGTERM)
                break
        rest, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    output = "".join(lines) + rest
    assert process.returncode == 0, output
    assert "SIGTERM during start-up: stopping before serving" in output
    assert "serving " not in output, output
