"""The Docker image, built and run for real, on a Debian base and on a Spyre-like base.

The image is built from the project's own Dockerfile, unchanged; only the host is adapted
(scripts/container-host.sh: a local base image, a local torch index). Containers use the host
network and the server listens on 127.0.0.1.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.container.conftest import CPU_TAG
from tests.container.docker_host import ROOT, Build, Container, DockerHost
from tests.deploy.local import free_port

pytestmark = [pytest.mark.container, pytest.mark.slow]

MODEL = "SmolLM2-135M-Instruct"
STOP_TIMEOUT = 30  # docs/deployment.md's `docker run --stop-timeout 30` / `docker stop --time 30`


def _samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _complete(container: Container) -> Any:
    client = openai.OpenAI(base_url=f"{container.base_url}/v1", api_key="unused", max_retries=0)
    return client.completions.create(
        model=MODEL,
        prompt="The capital of France is",
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
        timeout=120,
    )


def test_the_build_context_is_small_and_a_code_change_rebuilds_only_the_last_layers(
    docker_host: DockerHost, cpu_image: Build, tmp_path: Path
) -> None:
    # .dockerignore: the context is the sources, not .venv or caches
    assert cpu_image.context_bytes() < 5 * 10**6, cpu_image.context_bytes()
    # the same tree with one changed line in a module: dependencies and model come from cache
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for name in files:
        if (ROOT / name).is_file():
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, tmp_path / name)
    module = tmp_path / "spyre_server" / "entrypoints" / "healthcheck.py"
    module.write_text(module.read_text() + "\n# a one-line change\n")
    changed, _ = docker_host.build(
        f"{CPU_TAG}-changed",
        f"BASE_IMAGE={docker_host.base_image}",
        f"TORCH_INDEX_URL={docker_host.torch_index_url}",
        context=tmp_path,
    )
    cached = changed.cached_steps()
    assert any(step.startswith("[deps") and " RUN " in step for step in cached), cached
    assert any(step.startswith("[model") and " RUN " in step for step in cached), cached
    assert any("COPY --from=deps /opt/venv" in step for step in cached), cached
    assert not any("pip install --no-deps --no-build-isolation" in s for s in cached), cached
    history = docker_host.docker(
        "history", "--format", "{{.Size}}\t{{.CreatedBy}}", changed.tag
    ).stdout
    print(f"layers of the rebuilt image:\n{history}")


def test_pip_index_url_is_consumed_by_the_build(docker_host: DockerHost) -> None:
    # An unreachable index must make the dependency install fail: the argument reaches pip.
    # (TORCH=base skips the torch download, so pip turns to that index at once.)
    build, result = docker_host.build(
        f"{CPU_TAG}-no-index",
        f"BASE_IMAGE={docker_host.base_image}",
        "TORCH=base",
        "PIP_INDEX_URL=http://127.0.0.1:9/simple",
        check=False,
    )
    assert result.returncode != 0
    assert "127.0.0.1:9" in build.output, build.output[-3000:]


def test_serves_as_an_arbitrary_uid_with_a_read_only_root_on_a_non_default_port(
    docker_host: DockerHost, cpu_image: Build
) -> None:
    port = free_port()
    container = docker_host.run(
        cpu_image.tag, "--user", "12345:0", "--read-only", "--tmpfs", "/tmp", port=port
    )
    seconds = container.wait_healthy()
    print(f"healthy after {seconds:.1f} s on port {port} as uid 12345 with a read-only root")
    assert docker_host.docker("exec", container.name, "id", "-u").stdout.strip() == "12345"
    assert docker_host.docker("exec", container.name, "id", "-g").stdout.strip() == "0"
    out = _complete(container)
    assert out.usage.completion_tokens == 8
    assert out.choices[0].text
    samples = _samples(container.metrics_text())
    labels = frozenset({("model_name", MODEL)})
    assert samples[("vllm:generation_tokens_total", labels)] == 8
    assert samples[("vllm:prefix_cache_queries_total", labels)] == out.usage.prompt_tokens
    assert samples[("process_resident_memory_bytes", frozenset())] > 100 * 2**20
    docker_host.docker("stop", "--time", str(STOP_TIMEOUT), container.name)
    assert container.wait_exit() == 0


def test_an_unreadable_model_folder_is_reported_as_a_permission_problem(
    docker_host: DockerHost, cpu_image: Build, tmp_path: Path
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    model.chmod(0o755)
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (model / "config.json").chmod(0o644)
    (model / "model.safetensors").write_bytes(b"\0" * 64)
    (model / "model.safetensors").chmod(0o600)  # owned by root: unreadable for uid 12345
    container = docker_host.run(
        cpu_image.tag,
        *("--user", "12345:0", "-v", f"{model}:/models/m:ro"),
        port=free_port(),
        env={"SPYRE_SERVER_MODEL__PATH": "/models/m"},
    )
    assert container.wait_exit() == 2
    logs = container.logs()
    assert "cannot read /models/m/model.safetensors: permission denied" in logs, logs
    assert "this process runs as uid 12345 gid 0" in logs, logs
    assert "No such file or directory" not in logs, logs


def test_a_read_only_root_without_a_writable_tmp_says_so(
    docker_host: DockerHost, cpu_image: Build
) -> None:
    container = docker_host.run(cpu_image.tag, "--read-only", "--user", "12345:0", port=free_port())
    assert container.wait_exit() == 2
    logs = container.logs()
    assert "no writable temporary directory" in logs, logs
    assert "--tmpfs /tmp" in logs, logs
    assert "cannot load the model" not in logs, logs


@dataclass
class Outcome:
    """How one request ended: ``complete``, ``sse-error`` (an error event, then ``[DONE]``),
    ``http-error`` (an error status with the OpenAI envelope) or ``broken`` (anything else)."""

    stream: bool
    kind: str = "pending"
    detail: str = ""
    first_chunk: threading.Event = field(default_factory=threading.Event)


def _long_request(base_url: str, outcome: Outcome) -> None:
    body = {
        "model": MODEL,
        "prompt": "Write a very long story about a lighthouse keeper.",
        "max_tokens": 1500,
        "temperature": 0,
        "ignore_eos": True,
        "stream": outcome.stream,
    }
    try:
        if outcome.stream:
            payloads = []
            with httpx.stream(
                "POST", f"{base_url}/v1/completions", json=body, timeout=120
            ) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        payloads.append(line[len("data: ") :])
                        outcome.first_chunk.set()
            outcome.detail = " | ".join(payloads[-2:])[:500]
            if not payloads or payloads[-1] != "[DONE]":
                outcome.kind = "broken"
                return
            events = [json.loads(p) for p in payloads[:-1]]
            if "error" in events[-1]:
                outcome.kind = "sse-error"
            elif events[-1]["choices"][0]["finish_reason"] == "length":
                outcome.kind = "complete"
            else:
                outcome.kind = "broken"
        else:
            outcome.first_chunk.set()
            response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)
            outcome.detail = response.text[:500]
            result = response.json()
            if response.status_code == 200:
                tokens = result["usage"]["completion_tokens"]
                outcome.kind = "complete" if tokens == body["max_tokens"] else "broken"
            else:
                outcome.kind = "http-error" if "message" in result["error"] else "broken"
    except Exception as exc:  # a cut connection, a body that is not JSON
        outcome.kind, outcome.detail = "broken", f"{type(exc).__name__}: {exc}"


def test_docker_stop_with_requests_in_flight_ends_each_one_properly_and_exits_0(
    docker_host: DockerHost, cpu_image: Build
) -> None:
    # As docs/deployment.md runs it: --stop-timeout 30, then a plain `docker stop`. The port is
    # set by flag this time, which the HEALTHCHECK must find as well.
    port = free_port()
    container = docker_host.run(
        cpu_image.tag,
        "--stop-timeout",
        str(STOP_TIMEOUT),
        command=(
            "--config",
            "/etc/spyre-server/config.yaml",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ),
    )
    container.port = port
    container.wait_healthy()
    outcomes = [Outcome(stream=True), Outcome(stream=True), Outcome(stream=False)]
    clients = [
        threading.Thread(target=_long_request, args=(container.base_url, o), daemon=True)
        for o in outcomes
    ]
    for client in clients:
        client.start()
    for outcome in outcomes:
        assert outcome.first_chunk.wait(120), "no output before the stop"
    deadline = time.monotonic() + 60
    while _samples(container.metrics_text())[
        ("vllm:num_requests_running", frozenset({("model_name", MODEL)}))
    ] < len(outcomes):
        assert time.monotonic() < deadline, "the requests did not all start"
        time.sleep(0.2)
    started = time.monotonic()
    docker_host.docker("stop", container.name, timeout=STOP_TIMEOUT + 60)
    stopped = time.monotonic() - started
    for client in clients:
        client.join(60)
        assert not client.is_alive()
    state = container.state()
    print(f"docker stop took {stopped:.1f} s; outcomes: {[o.kind for o in outcomes]}")
    assert state["ExitCode"] == 0, container.logs()[-3000:]
    assert not state["OOMKilled"]
    for outcome in outcomes:
        assert outcome.kind in {"complete", "sse-error", "http-error"}, outcome
        if outcome.stream:
            assert outcome.kind != "http-error", outcome


def test_a_stop_during_model_loading_exits_at_once(
    docker_host: DockerHost, cpu_image: Build
) -> None:
    container = docker_host.run(cpu_image.tag, port=free_port())
    container.wait_for_log("loading the model")
    started = time.monotonic()
    # Were SIGTERM ignored (PID 1 without a handler), this would end in SIGKILL: exit 137.
    docker_host.docker("stop", "--time", str(STOP_TIMEOUT), container.name, timeout=120)
    print(f"stopped during loading in {time.monotonic() - started:.1f} s")
    assert container.wait_exit() == 0
    logs = container.logs()
    assert "SIGTERM during start-up: stopping before serving" in logs, logs
    assert "serving " not in logs, logs


def test_builds_on_a_spyre_like_base_and_keeps_its_torch(
    docker_host: DockerHost, spyre_like_image: Build
) -> None:
    tag = spyre_like_image.tag
    check = (
        "import os, torch; print(torch.__file__); "
        "print(os.path.exists(os.path.join(os.path.dirname(torch.__file__), 'SPYRE_LIKE_BASE')))"
    )
    out = docker_host.docker("run", "--rm", "--entrypoint", "python3", tag, "-c", check).stdout
    assert out.split() == ["/opt/runtime/lib/python3.11/site-packages/torch/__init__.py", "True"]
    venv_packages = docker_host.docker(
        "run", "--rm", "--entrypoint", "ls", tag, "/opt/venv/lib/python3.11/site-packages"
    ).stdout.split()
    # torch itself is the base's (torchao, the spyre backend's FP8 addon's, is the venv's)
    assert not [p for p in venv_packages if p == "torch" or p.startswith("torch-")], venv_packages
    # the base's UID 1000 user is kept, and the server runs as it (group 0)
    who = docker_host.docker("run", "--rm", "--entrypoint", "id", tag).stdout
    assert who.startswith("uid=1000(senuser) gid=0(root)"), who
    port = free_port()
    container = docker_host.run(tag, port=port)
    container.wait_healthy()
    assert _complete(container).usage.completion_tokens == 8
    docker_host.docker("stop", "--time", str(STOP_TIMEOUT), container.name)
    assert container.wait_exit() == 0


AIU_SETUP = """\
# A stand-in for the Spyre runtime image's setup script: records that it ran, and what the
# entrypoint had set by then.
echo "FLEX_COMPUTE=$FLEX_COMPUTE FLEX_DEVICE=$FLEX_DEVICE" >/tmp/ibm-aiu-setup.ran
export IBM_AIU_SETUP_RAN=yes
"""


def _process_1(docker_host: DockerHost, container: Container) -> tuple[list[str], dict[str, str]]:
    """PID 1's command line and environment, as the container's user reads them."""
    argv = docker_host.docker("exec", container.name, "cat", "/proc/1/cmdline").stdout
    environ = docker_host.docker("exec", container.name, "cat", "/proc/1/environ").stdout
    variables = dict(item.split("=", 1) for item in environ.split("\0") if "=" in item)
    return argv.split("\0"), variables


def test_the_entrypoint_sets_up_the_card_on_the_spyre_backend_only(
    docker_host: DockerHost, spyre_like_image: Build, tmp_path: Path
) -> None:
    """On an image whose /etc/profile.d/ibm-aiu-setup.sh records that it ran (as the Spyre
    runtime image's configures the cards): the spyre backend gets the reference image's
    environment and the sourced script, then the server is PID 1; the cpu backend neither."""
    (tmp_path / "ibm-aiu-setup.sh").write_text(AIU_SETUP)
    (tmp_path / "Dockerfile").write_text(
        f"FROM {spyre_like_image.tag}\n"
        "USER 0\n"
        "COPY ibm-aiu-setup.sh /etc/profile.d/ibm-aiu-setup.sh\n"
        "USER 1000:0\n"
    )
    tag = f"{spyre_like_image.tag}-aiu-setup"
    docker_host.build(tag, context=tmp_path)
    senlib = docker_host.docker(
        "run", "--rm", "--entrypoint", "cat", tag, "/home/spyre/.senlib.json"
    )
    assert json.loads(senlib.stdout)["RISCV"]["DOOM"]["enable"] is False

    spyre = {"SPYRE_SERVER_MODEL__BACKEND": "spyre", "SPYRE_SERVER_MODEL__COMPILE_BACKEND": "eager"}
    container = docker_host.run(tag, port=free_port(), env=spyre | {"FLEX_DEVICE": "VF"})
    container.wait_for_log("loading the model")
    argv, variables = _process_1(docker_host, container)
    # exec: PID 1 is the server (python running the spyre-server script), not the shell.
    assert argv[1].endswith("/spyre-server") and argv[2:4] == ["serve", "--config"], argv
    assert variables["IBM_AIU_SETUP_RAN"] == "yes"
    assert variables["FLEX_COMPUTE"] == "SENTIENT"
    assert variables["FLEX_DEVICE"] == "VF"  # what the container sets wins
    assert variables["DISTRIBUTED_STRATEGY_IGNORE_MODULES"] == "WordEmbedding,Embedding"
    ran = docker_host.docker("exec", container.name, "cat", "/tmp/ibm-aiu-setup.ran").stdout
    assert ran.strip() == "FLEX_COMPUTE=SENTIENT FLEX_DEVICE=VF"  # set before it was sourced
    docker_host.docker("stop", "--time", str(STOP_TIMEOUT), container.name, timeout=120)
    assert container.wait_exit() == 0

    container = docker_host.run(tag, port=free_port())  # the cpu backend, as configured
    container.wait_for_log("loading the model")
    argv, variables = _process_1(docker_host, container)
    assert argv[1].endswith("/spyre-server"), argv
    assert argv[2:] == ["serve", "--config", "/etc/spyre-server/config.yaml", ""], argv
    assert not {"IBM_AIU_SETUP_RAN", "FLEX_COMPUTE", "FLEX_DEVICE"} & set(variables), variables
    ls = docker_host.docker("exec", container.name, "ls", "/tmp").stdout
    assert "ibm-aiu-setup.ran" not in ls
    docker_host.docker("stop", "--time", str(STOP_TIMEOUT), container.name, timeout=120)
    assert container.wait_exit() == 0
