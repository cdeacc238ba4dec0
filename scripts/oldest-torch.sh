#!/usr/bin/env bash
# Makes a venv with the oldest torch pyproject.toml admits (its torch>= bound: the torch of
# torch_sendnn 1.2's Spyre runtime images), for running tests against it (.ci/run runs the
# spyre backend's). Everything else comes from .venv: the new venv sees .venv's packages after
# its own (a .pth file), so only torch is installed twice. Run scripts/setup.sh first.
#
# Usage: scripts/oldest-torch.sh VENV     make VENV (it must not exist)
#        scripts/oldest-torch.sh --version print the version only
#
# torch comes from pip's configured index, with --no-deps: the index's x86-64 wheels are CUDA
# builds, which pull triton and, with it, about 3 GB of NVIDIA packages. torch's libraries are
# linked against the CUDA runtime libraries, so those that the wheel's own metadata pins
# (nvidia-*) are installed too, again with --no-deps; triton (GPU kernels) and cuda-bindings
# are not. A CPU build of torch (where the index offers one) pins no nvidia-* package.
set -euo pipefail
cd "$(dirname "$0")/.."
python=.venv/bin/python
version=$("$python" - <<'EOF'
import tomllib

from packaging.requirements import Requirement

for text in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]:
    requirement = Requirement(text)
    if requirement.name == "torch":
        (bound,) = [s.version for s in requirement.specifier if s.operator == ">="]
        print(bound)
EOF
)
if [ "${1:-}" = "--version" ]; then
    echo "$version"
    exit 0
fi
venv=${1:?usage: scripts/oldest-torch.sh VENV}
[ ! -e "$venv" ] || { echo "$venv exists already" >&2; exit 1; }
# The interpreter .venv was made with: the packages seen through the .pth file are built for it.
"$("$python" -c 'import sys; print(sys._base_executable)')" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --no-deps "torch==$version"
purelib() { "$1" -c 'import sysconfig; print(sysconfig.get_path("purelib"))'; }
site=$(purelib "$venv/bin/python")
cuda_libraries=$("$python" - "$site" <<'EOF'
import sys
from importlib import metadata

from packaging.requirements import Requirement

(torch,) = metadata.distributions(name="torch", path=[sys.argv[1]])
for text in torch.requires or []:
    requirement = Requirement(text)
    if requirement.name.startswith("nvidia-") and (
        requirement.marker is None or requirement.marker.evaluate({"extra": ""})
    ):
        print(f"{requirement.name}{requirement.specifier}")
EOF
)
if [ -n "$cuda_libraries" ]; then
    # shellcheck disable=SC2086
    "$venv/bin/python" -m pip install --quiet --no-deps $cuda_libraries
fi
purelib "$python" >"$site/spyre-server-venv.pth"
"$venv/bin/python" -c 'import torch; print(f"torch {torch.__version__} in '"$venv"'")'
