"""Small helpers of the deployment tests: free loopback ports, and external tools that CI must
have but a developer's machine may lack."""

from __future__ import annotations

import os
import shutil
import socket

import pytest


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def skip_or_fail(message: str) -> None:
    """Skip, except in CI (``CI=true``), where .ci/run installs what these tests need: there a
    test that silently skips would prove nothing, so it fails."""
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


def require_executable(name: str) -> str:
    """The path of ``name`` (a Debian package of the same name provides it)."""
    path = shutil.which(name)
    if path is None:
        skip_or_fail(f"{name} is not installed (Debian: apt-get install {name})")
    assert path is not None
    return path
