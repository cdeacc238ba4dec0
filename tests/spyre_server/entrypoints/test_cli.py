"""The ``spyre-server`` command (spyre_server/entrypoints/cli.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from spyre_server.entrypoints import cli
from spyre_server.model.store import (
    DEFAULT_MODEL_NAME,
    INSTALL_COMMAND,
    ModelStoreError,
    default_cache_dir,
)
from tests.conftest import needs_default_model_package


class FakePrepare:
    def __init__(self, error: Exception | None = None) -> None:
        self.error = error
        self.cache_dirs: list[Path] = []

    def __call__(self, cache_dir: Path, *, progress: object = None) -> Path:
        self.cache_dirs.append(Path(cache_dir))
        if self.error is not None:
            raise self.error
        return Path(cache_dir) / DEFAULT_MODEL_NAME


@pytest.fixture
def fake_prepare(monkeypatch: pytest.MonkeyPatch) -> FakePrepare:
    fake = FakePrepare()
    monkeypatch.setattr(cli, "prepare_default_model", fake)
    return fake


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


# --- prepare-model: which cache folder ------------------------------------------------------------


def test_prepare_model_cache_dir_flag(
    fake_prepare: FakePrepare, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run_main(["prepare-model", "--cache-dir", str(tmp_path / "c")], capsys)
    assert code == 0
    assert out == f"{tmp_path / 'c' / DEFAULT_MODEL_NAME}\n"
    assert fake_prepare.cache_dirs == [tmp_path / "c"]


def test_prepare_model_cache_dir_from_config_and_flag_precedence(
    fake_prepare: FakePrepare,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("SPYRE_SERVER_MODEL__CACHE_DIR", raising=False)
    config = tmp_path / "config.yaml"
    config.write_text(f"model:\n  cache_dir: {tmp_path / 'from-config'}\n")
    assert run_main(["prepare-model", "--config", str(config)], capsys)[0] == 0
    flag = ["prepare-model", "--config", str(config), "--cache-dir", str(tmp_path / "flag")]
    assert run_main(flag, capsys)[0] == 0
    assert fake_prepare.cache_dirs == [tmp_path / "from-config", tmp_path / "flag"]


def test_prepare_model_default_cache_dir(
    fake_prepare: FakePrepare,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("SPYRE_SERVER_MODEL__CACHE_DIR", raising=False)
    assert run_main(["prepare-model"], capsys)[0] == 0
    assert fake_prepare.cache_dirs == [tmp_path / "xdg" / "spyre-server" / "models"]


def test_prepare_model_environment_cache_dir(
    fake_prepare: FakePrepare,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    monkeypatch.setenv("SPYRE_SERVER_MODEL__CACHE_DIR", str(tmp_path / "env"))
    assert run_main(["prepare-model"], capsys)[0] == 0
    assert fake_prepare.cache_dirs == [tmp_path / "env"]


# --- errors: exit code 2 and a message ------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("model: [unclosed\n", "cannot read config file"),
        ("model:\n  pth: /x\n", "model.pth"),
        ("scheduler:\n  chunk_size: 100\n", "scheduler.chunk_size"),
        ("- a list\n", "must be a mapping"),
    ],
)
def test_bad_config_file_exits_2_with_a_message(
    fake_prepare: FakePrepare,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    text: str,
    message: str,
) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    code, out, err = run_main(["prepare-model", "--config", str(config)], capsys)
    assert code == 2
    assert out == ""
    assert err.startswith("spyre-server: error: ")
    assert message in err
    assert fake_prepare.cache_dirs == []  # nothing was prepared


def test_missing_config_file_exits_2(
    fake_prepare: FakePrepare, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run_main(["prepare-model", "--config", str(tmp_path / "none.yaml")], capsys)
    assert code == 2
    assert "none.yaml" in err


def test_bad_environment_exits_2(
    fake_prepare: FakePrepare, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPYRE_SERVER_MODEL__MAX_MODEL_LEN", "-5")
    code, _, err = run_main(["prepare-model"], capsys)
    assert code == 2
    assert "model.max_model_len" in err


def test_model_store_error_exits_2_with_the_instructions(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    fake = FakePrepare(ModelStoreError(f"not installed. Install it with:\n    {INSTALL_COMMAND}"))
    monkeypatch.setattr(cli, "prepare_default_model", fake)
    code, out, err = run_main(["prepare-model", "--cache-dir", str(tmp_path)], capsys)
    assert code == 2
    assert out == ""
    assert INSTALL_COMMAND in err


@pytest.mark.parametrize("argv", [[], ["no-such-command"], ["prepare-model", "--bogus"]])
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    assert "usage: spyre-server" in capsys.readouterr().err


@pytest.mark.slow  # a fresh interpreter importing torch: seconds
def test_console_script_bad_config_exits_2(tmp_path: Path) -> None:
    """The installed entry point (a real process) turns a bad config into exit code 2."""
    config = tmp_path / "bad.yaml"
    config.write_text("cache:\n  block_size: 32\n")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "spyre_server.entrypoints.cli",
            "prepare-model",
            "--config",
            str(config),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "cache.block_size" in proc.stderr
    assert proc.stdout == ""


# --- the real conversion (slow) -------------------------------------------------------------------


@pytest.mark.slow
@needs_default_model_package
def test_prepare_model_prints_the_folder() -> None:
    cache_dir = default_cache_dir()  # reuses a complete conversion if there is one
    script = Path(sys.executable).with_name("spyre-server")
    command = (
        [str(script)] if script.exists() else [sys.executable, "-m", "spyre_server.entrypoints.cli"]
    )
    proc = subprocess.run(
        [*command, "prepare-model", "--cache-dir", str(cache_dir)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr
    folder = Path(proc.stdout.strip())
    assert proc.stdout == f"{cache_dir / DEFAULT_MODEL_NAME}\n"
    assert (folder / "config.json").is_file()
    assert (folder / "tokenizer.json").is_file()
