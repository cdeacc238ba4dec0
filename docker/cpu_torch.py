"""Build-time check that the torch the Dockerfile installed for ``TORCH=cpu`` is a CPU build.

With ``TORCH_INDEX_URL`` empty, torch comes from pip's own index settings, and an index without
the CPU build offers a CUDA one: installed without its dependencies (as the Dockerfile installs
it) it does not even import. Exits non-zero, saying which build argument to set, if torch's
metadata requires NVIDIA's CUDA packages. Reads metadata only (no ``import torch``).
"""

from __future__ import annotations

import re
import sys
from importlib import metadata


def cuda_requirements(requires: list[str]) -> list[str]:
    """The names of NVIDIA's CUDA packages among a distribution's requirements."""
    names = (re.split(r"[\s;<>=!~\[(]", requirement, maxsplit=1)[0] for requirement in requires)
    return sorted({name for name in names if name.lower().startswith("nvidia-")})


def main() -> int:
    version = metadata.version("torch")
    cuda = cuda_requirements(metadata.requires("torch") or [])
    if not cuda:
        print(f"torch {version}: a CPU build")
        return 0
    print(
        f"TORCH=cpu, but pip installed a CUDA build of torch {version} (it requires "
        f"{', '.join(cuda[:3])}, ...): set TORCH_INDEX_URL to an index with the CPU build of "
        "torch 2.13.0 (PyTorch's CPU wheel index or a mirror of it), or pass a PIP_INDEX_URL "
        "that offers it",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
