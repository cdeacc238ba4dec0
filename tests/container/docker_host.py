"""The Docker engine of the container tests: started by scripts/container-host.sh, driven through
Debian's docker client, with the helpers the tests share (builds, runs, health, logs)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
HOST_SCRIPT = ROOT / "scripts" / "container-host.sh"
BUILD_TIMEOUT = 1800.0
START_TIMEOUT = 300.0
PIP_INDEX_SETTINGS = ("index-url", "extra-index-url", "trusted-host")
"""pip's settings that say where packages come from, passed on to image builds."""


def host_pip_build_args() -> list[str]:
    """This host's pip index settings as ``NAME=value`` build arguments (``PIP_INDEX_URL``, ...),
    so that image builds use the indexes the host's pip uses: from the environment, else from
    pip's configuration files. Indexes on the local file system are left out (a build cannot
    read them); none at all leaves pip's default."""
    args = []
    for setting in PIP_INDEX_SETTINGS:
        name = "PIP_" + setting.upper().replace("-", "_")
        value = os.environ.get(name)
        if value is None:
            for key in (f"global.{setting}", f"install.{setting}"):
                found = subprocess.run(
                    [sys.executable, "-m", "pip", "config", "get", key],
                    capture_output=True,
                    text=True,
                    timeout=60,
                )
                if found.returncode == 0 and found.stdout.strip():
                    value = found.stdout.strip()
        if setting != "trusted-host":
            value = " ".join(v for v in (value or "").split() if not v.startswith("file:"))
        if value:
            args.append(f"{name}={value}")
    return args


@dataclass
class Build:
    tag: str
    output: str  # BuildKit's plain progress output

    def context_bytes(self) -> int:
        """Size of the build context sent to the engine, from 'transferring context: 1.2MB'."""
        units = {"B": 1, "kB": 10**3, "MB": 10**6, "GB": 10**9}
        sizes = re.findall(r"transferring context: ([\d.]+)([kMG]?B)", self.output)
        assert sizes, self.output[-2000:]
        return max(int(float(value) * units[unit]) for value, unit in sizes)

    def cached_steps(self) -> set[str]:
        """Names (e.g. '[deps 3/3] RUN ...') of the steps BuildKit took from its cache."""
        names: dict[str, str] = {}
        cached = set()
        for line in self.output.splitlines():
            match = re.match(r"#(\d+) (\[.*)", line)
            if match:
                names.setdefault(match.group(1), match.group(2))
            match = re.match(r"#(\d+) CACHED", line)
            if match:
                cached.add(match.group(1))
        return {names[step] for step in cached if step in names}


@dataclass
class Container:
    host: DockerHost
    name: str
    port: int | None = None
    started: float = field(default_factory=time.monotonic)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def inspect(self) -> dict[str, object]:
        out = self.host.docker("inspect", self.name).stdout
        return json.loads(out)[0]  # type: ignore[no-any-return]

    def state(self) -> dict[str, object]:
        return self.inspect()["State"]  # type: ignore[return-value]

    def logs(self) -> str:
        result = self.host.docker("logs", self.name, check=False)
        return result.stdout + result.stderr

    def health(self) -> str | None:
        health = self.state().get("Health")
        return None if health is None else str(health["Status"])  # type: ignore[index]

    def wait_healthy(self, timeout: float = START_TIMEOUT) -> float:
        """Seconds from start until Docker reports the container healthy (its own HEALTHCHECK)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.state()
            assert state["Running"], f"the container stopped:\n{self.logs()[-3000:]}"
            if self.health() == "healthy":
                return time.monotonic() - self.started
            time.sleep(0.5)
        raise AssertionError(f"not healthy within {timeout} s ({self.health()}):\n{self.logs()}")

    def wait_for_log(self, text: str, timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.logs():
                return
            assert self.state()["Running"], f"the container stopped:\n{self.logs()[-3000:]}"
            time.sleep(0.1)
        raise AssertionError(f"no {text!r} in the logs within {timeout} s:\n{self.logs()}")

    def wait_exit(self, timeout: float = 120.0) -> int:
        result = self.host.docker("wait", self.name, timeout=timeout)
        return int(result.stdout.strip())

    def metrics_text(self) -> str:
        response = httpx.get(f"{self.base_url}/metrics", timeout=10)
        assert response.status_code == 200, response.text
        return response.text


@dataclass
class DockerHost:
    docker_cli: str
    env: dict[str, str]
    torch_index_url: str
    base_image: str
    spyre_like_image: str
    pip_build_args: list[str] = field(default_factory=host_pip_build_args)
    containers: list[str] = field(default_factory=list)

    @classmethod
    def up(cls, state_dir: Path) -> DockerHost:
        result = subprocess.run(
            [str(HOST_SCRIPT), "up", str(state_dir)],
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        values = dict(line.split("=", 1) for line in result.stdout.splitlines() if "=" in line)
        env = {**os.environ, "DOCKER_HOST": values["DOCKER_HOST"], "DOCKER_BUILDKIT": "1"}
        return cls(
            docker_cli=values["DOCKER"],
            env=env,
            torch_index_url=values["TORCH_INDEX_URL"],
            base_image=values["BASE_IMAGE"],
            spyre_like_image=values["SPYRE_LIKE_IMAGE"],
        )

    @staticmethod
    def down(state_dir: Path) -> None:
        subprocess.run([str(HOST_SCRIPT), "down", str(state_dir)], check=True, timeout=120)

    def docker(
        self, *args: str, check: bool = True, timeout: float = 120.0
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [self.docker_cli, *args], env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if check:
            assert result.returncode == 0, f"docker {' '.join(args)}:\n{result.stderr[-3000:]}"
        return result

    def build(
        self, tag: str, *build_args: str, context: Path = ROOT, check: bool = True
    ) -> tuple[Build, subprocess.CompletedProcess[str]]:
        """``docker build`` of the project's Dockerfile (host network: the torch index is on
        127.0.0.1); ``build_args`` are ``NAME=value``. The host's pip index settings are passed
        on unless ``build_args`` set one of pip's own (``PIP_...``)."""
        args = ["build", "--progress", "plain", "--network", "host", "-t", tag]
        if not any(value.startswith("PIP_") for value in build_args):
            build_args = (*self.pip_build_args, *build_args)
        for value in build_args:
            args += ["--build-arg", value]
        result = self.docker(*args, str(context), check=False, timeout=BUILD_TIMEOUT)
        output = result.stdout + result.stderr
        if check:
            assert result.returncode == 0, output[-5000:]
        return Build(tag, output), result

    def run(
        self,
        image: str,
        *args: str,
        port: int | None = None,
        env: dict[str, str] | None = None,
        command: tuple[str, ...] = (),
    ) -> Container:
        """``docker run -d`` on the host network (the engine has no bridge). With ``port``, the
        server listens on 127.0.0.1:port, set through the environment."""
        name = f"spyre-test-{uuid.uuid4().hex[:8]}"
        environment = dict(env or {})
        if port is not None:
            environment.setdefault("SPYRE_SERVER_SERVER__HOST", "127.0.0.1")
            environment.setdefault("SPYRE_SERVER_SERVER__PORT", str(port))
        flags = ["run", "-d", "--name", name, "--network", "host"]
        for key, value in environment.items():
            flags += ["-e", f"{key}={value}"]
        self.docker(*flags, *args, image, *command)
        self.containers.append(name)
        return Container(self, name, port)

    def remove_containers(self) -> None:
        for name in self.containers:
            self.docker("rm", "-f", name, check=False)
        self.containers.clear()
