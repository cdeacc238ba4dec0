"""The image's entrypoint, docker/entrypoint.sh, run on this host with a stand-in for the
``spyre-server`` command: which command it runs, with which arguments, and the Spyre card's
environment it sets on the spyre backend only (the reference image's, vllm-spyre's
docker/Dockerfile.amd64). That it sources the runtime image's ibm-aiu-setup.sh, and that the
image runs it, is checked in the container (tests/container/test_image.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from spyre_server.entrypoints.configured_backend import configured_backend

ROOT = Path(__file__).resolve().parents[2]
ENTRYPOINT = ROOT / "docker" / "entrypoint.sh"
CARD_VARIABLES = (
    "FLEX_COMPUTE",
    "FLEX_DEVICE",
    "DISTRIBUTED_STRATEGY_IGNORE_MODULES",
    "DTLOG_LEVEL",
    "DT_DEEPRT_VERBOSE",
    "TORCH_SENDNN_LOG",
    "TOKENIZERS_PARALLELISM",
)
CARD = {
    "FLEX_COMPUTE": "SENTIENT",
    "FLEX_DEVICE": "PF",
    "DISTRIBUTED_STRATEGY_IGNORE_MODULES": "WordEmbedding,Embedding",
    "DTLOG_LEVEL": "error",
    "DT_DEEPRT_VERBOSE": "-1",
    "TORCH_SENDNN_LOG": "WARNING",
    "TOKENIZERS_PARALLELISM": "false",
}

STAND_IN = """#!/bin/bash
echo "pid $$"
echo "argv $*"
for name in {names}; do
    [ -n "${{!name+set}}" ] && echo "env $name=${{!name}}"
done
exit 0
"""


def run(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None
) -> tuple[list[str], dict[str, str]]:
    """The entrypoint's run: the stand-in's argv and the card's variables it saw. Also checks
    that the entrypoint execs it (the server is PID 1 in the container)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    stand_in = bin_dir / "spyre-server"
    stand_in.write_text(STAND_IN.format(names=" ".join(CARD_VARIABLES)))
    stand_in.chmod(0o755)
    environment = {
        k: v
        for k, v in os.environ.items()
        if k not in CARD_VARIABLES and not k.startswith("SPYRE_SERVER_")
    }
    # `python` is the venv's, as in the image (its venv comes first on PATH).
    path = f"{bin_dir}:{Path(sys.executable).parent}:{environment.get('PATH', '')}"
    environment |= {"PATH": path} | (env or {})
    process = subprocess.Popen(
        ["bash", str(ENTRYPOINT), *args],
        env=environment,
        stdout=subprocess.PIPE,
        text=True,
    )
    out, _ = process.communicate(timeout=120)
    assert process.returncode == 0
    lines = out.splitlines()
    assert lines[0] == f"pid {process.pid}"  # exec: the same process
    argv = lines[1].removeprefix("argv ").split()
    variables = dict(line.removeprefix("env ").split("=", 1) for line in lines[2:])
    return argv, variables


@pytest.fixture
def spyre_config(tmp_path: Path) -> Path:
    path = tmp_path / "spyre.yaml"
    path.write_text("model:\n  backend: spyre\n  compile_backend: sendnn\n")
    return path


def test_the_cpu_backend_runs_serve_as_before_with_nothing_set(tmp_path: Path) -> None:
    assert run(tmp_path) == (["serve"], {})
    config = ROOT / "config.yaml"  # the image's CMD
    assert run(tmp_path, "--config", str(config)) == (["serve", "--config", str(config)], {})
    assert run(tmp_path, "/models/m", "--port", "9000")[0] == [
        "serve",
        "/models/m",
        "--port",
        "9000",
    ]


def test_the_spyre_backend_gets_the_cards_environment(tmp_path: Path, spyre_config: Path) -> None:
    argv, variables = run(tmp_path, "--config", str(spyre_config))
    assert argv == ["serve", "--config", str(spyre_config)]
    assert variables == CARD
    # The backend from the environment or a config file alike, whatever the compile backend.
    on_cpu = {
        "SPYRE_SERVER_MODEL__BACKEND": "spyre",
        "SPYRE_SERVER_MODEL__COMPILE_BACKEND": "eager",
    }
    assert run(tmp_path, env=on_cpu)[1] == CARD


def test_what_the_container_sets_wins(tmp_path: Path, spyre_config: Path) -> None:
    own = {"FLEX_DEVICE": "VF", "DTLOG_LEVEL": "", "TOKENIZERS_PARALLELISM": "true"}
    _, variables = run(tmp_path, "--config", str(spyre_config), env=own)
    assert variables == CARD | own


def test_compile_runs_compile_and_compiles_without_a_card(
    tmp_path: Path, spyre_config: Path
) -> None:
    """The reference's compile-only setting (platform.py: FLEX_DEVICE=COMPILE)."""
    argv, variables = run(tmp_path, "compile", "--config", str(spyre_config))
    assert argv == ["compile", "--config", str(spyre_config)]
    assert variables == CARD | {"FLEX_DEVICE": "COMPILE"}


def test_other_commands_and_invalid_arguments_set_nothing(
    tmp_path: Path, spyre_config: Path
) -> None:
    spyre = {"SPYRE_SERVER_MODEL__BACKEND": "spyre"}
    assert run(tmp_path, "prepare-model", env=spyre) == (["prepare-model"], {})
    assert run(tmp_path, "bench", "--help", env=spyre) == (["bench", "--help"], {})
    # The server itself reports a bad configuration; the entrypoint just runs it.
    assert run(tmp_path, "--port", "x", env=spyre) == (["serve", "--port", "x"], {})
    assert run(tmp_path, env=spyre | {"SPYRE_SERVER_MODEL__BACKEND": "tpu"}) == (["serve"], {})


def test_the_backend_is_read_as_the_server_reads_it(
    tmp_path: Path, spyre_config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [n for n in os.environ if n.startswith("SPYRE_SERVER_")]:
        monkeypatch.delenv(name)
    assert configured_backend([]) == "cpu"
    monkeypatch.setenv("SPYRE_SERVER_MODEL__BACKEND", "spyre")
    assert configured_backend([]) == "spyre"
    monkeypatch.delenv("SPYRE_SERVER_MODEL__BACKEND")
    assert configured_backend(["--config", str(spyre_config)]) == "spyre"
    assert configured_backend(["--config", str(spyre_config), "--unknown-flag"]) == "spyre"
    assert configured_backend(["--config", str(tmp_path / "missing.yaml")]) is None
