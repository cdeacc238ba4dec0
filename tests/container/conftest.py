"""Session fixtures of the container tests: a Docker engine (scripts/container-host.sh) and the
project's image, built once per session on each base.

The tests carry the ``container`` marker: ``pytest -m "not container"`` skips them. They also skip
where they cannot run (not root, no dockerd or debootstrap), except in CI (``CI=true``), which
must run them and fails instead.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.container.docker_host import Build, DockerHost
from tests.deploy.local import skip_or_fail

CPU_TAG = "spyre-server:test"
SPYRE_LIKE_TAG = "spyre-server:test-spyre-like"


def _state_dir() -> Path:
    """Where the engine keeps its images between sessions (a cold build takes minutes). Not a
    SPYRE_SERVER_* variable: the server would reject it as an unknown setting."""
    configured = os.environ.get("SPYRE_CONTAINER_TEST_STATE")
    if configured:
        return Path(configured)
    return Path.home() / ".cache" / "spyre-server" / "container-test"


def _missing_requirements() -> list[str]:
    missing = [tool for tool in ("dockerd", "debootstrap") if shutil.which(tool) is None]
    if not os.path.exists("/usr/bin/docker"):
        missing.append("/usr/bin/docker (Debian's docker.io)")
    if os.geteuid() != 0:
        missing.append("root")
    return missing


@pytest.fixture(scope="session")
def docker_host() -> Iterator[DockerHost]:
    missing = _missing_requirements()
    if missing:
        skip_or_fail(f"the container tests need {', '.join(missing)}")
    state = _state_dir()
    host = DockerHost.up(state)
    try:
        yield host
    finally:
        host.remove_containers()
        DockerHost.down(state)


@pytest.fixture(autouse=True)
def _remove_containers(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "docker_host" in request.fixturenames:
        host: DockerHost = request.getfixturevalue("docker_host")
        host.remove_containers()


@pytest.fixture(scope="session")
def cpu_image(docker_host: DockerHost) -> Build:
    """The image as users build it, on the local stand-in for python:3.11-slim-bookworm."""
    build, _ = docker_host.build(
        CPU_TAG,
        f"BASE_IMAGE={docker_host.base_image}",
        f"TORCH_INDEX_URL={docker_host.torch_index_url}",
    )
    return build


@pytest.fixture(scope="session")
def spyre_like_image(docker_host: DockerHost) -> Build:
    """The image on a Spyre-like base (torch preinstalled, non-root default user, UID 1000 taken,
    no ``python``), keeping the base's torch."""
    build, _ = docker_host.build(
        SPYRE_LIKE_TAG,
        f"BASE_IMAGE={docker_host.spyre_like_image}",
        "TORCH=base",
    )
    return build
