"""Build-time check of the image's Python environment (the Dockerfile runs it).

spyre-server and every runtime dependency import; each requirement spyre-server declares is met
by the installed version; torch is the one the ``TORCH`` build argument asked for: ``cpu``, the
venv's own install; ``base``, the base image's, untouched; where the CPU can run them, the
native kernels the ``kernels`` stage built load without a compiler (which the image lacks);
the spyre backend's FP8 addon imports.
Exits non-zero, saying why, if not.
"""

from __future__ import annotations

import argparse
import os
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement


def unmet_requirements(distribution: str) -> list[str]:
    """The requirements of ``distribution`` (no extras) that the installed versions miss."""
    problems = []
    for text in metadata.requires(distribution) or []:
        requirement = Requirement(text)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        try:
            version = metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            problems.append(f"{requirement}: not installed")
            continue
        if not requirement.specifier.contains(version, prereleases=True):
            problems.append(f"{requirement}: {version} is installed")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--torch", choices=["cpu", "base"], required=True)
    args = parser.parse_args()
    import torch

    import spyre_server.entrypoints.serve  # noqa: F401  (imports fastapi, uvicorn, fms, transformers, ...)

    problems = unmet_requirements("spyre-server")
    in_venv = torch.__file__.startswith(sys.prefix + "/")
    if args.torch == "base" and in_venv:
        problems.append(f"TORCH=base, but torch was installed into {sys.prefix}")
    if args.torch == "cpu" and not in_venv:
        problems.append(f"TORCH=cpu, but torch comes from {torch.__file__}")
    print(f"torch {torch.__version__} from {torch.__file__}")
    from spyre_server.model.cpu.kernels import library as native_kernels

    if native_kernels.unsupported_cpu_reason() is None:
        kernel_dir = Path(os.environ["SPYRE_SERVER_MODEL__KERNEL_DIR"])
        try:
            print(f"native kernels: {native_kernels.load_native_kernels(kernel_dir).path}")
        except native_kernels.NativeKernelError as exc:
            problems.append(f"the native kernels do not load: {exc}")
    from spyre_server.model.errors import ModelLoadError
    from spyre_server.model.spyre.fp8 import load_fp8_addon

    try:
        load_fp8_addon()
    except ModelLoadError as exc:
        problems.append(str(exc))
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
