"""A prepared model folder is readable by other users (a container's arbitrary UID): files get
the umask's permissions whatever their writer chose (safetensors writes 0600)."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from spyre_server.model.store import ensure_folder


@pytest.fixture
def umask_022() -> Iterator[None]:
    previous = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(previous)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_finished_folder_gets_umask_permissions(tmp_path: Path, umask_022: None) -> None:
    def build(folder: Path) -> None:
        weights = folder / "model.safetensors"
        weights.write_bytes(b"w")
        weights.chmod(0o600)
        (folder / "sub").mkdir(mode=0o700)
        (folder / "sub" / "tokenizer.json").write_text("{}")
        (folder / "sub" / "tokenizer.json").chmod(0o640)

    target = ensure_folder(tmp_path / "m", "stamp-1", build)
    assert _mode(target) == 0o755
    assert _mode(target / "model.safetensors") == 0o644
    assert _mode(target / "sub") == 0o755
    assert _mode(target / "sub" / "tokenizer.json") == 0o644
    assert _mode(target / ".spyre-complete") == 0o644


def test_a_stricter_umask_is_respected(tmp_path: Path) -> None:
    previous = os.umask(0o077)
    try:
        target = ensure_folder(tmp_path / "m", "s", lambda f: (f / "x").write_bytes(b"x"))
    finally:
        os.umask(previous)
    assert _mode(target / "x") == 0o600
    assert _mode(target) == 0o700
