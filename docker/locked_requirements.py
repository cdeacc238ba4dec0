"""Prints the pinned lines of docker/requirements.lock for ``pip install --no-deps -r``.

``--skip-installed`` (the Dockerfile's ``TORCH=base``) leaves out every package this Python can
already import from the base image, at whatever version it has there: torch's own dependencies
and anything else a Spyre runtime image ships stay as its vendor tested them. The build then
checks that spyre-server's requirements still hold (docker/check_install.py). Build tools are
never left out: they only build spyre-server, and a base image's may be too old for that (a
setuptools without bdist_wheel).
"""

from __future__ import annotations

import argparse
import re
import sys
from importlib import metadata

BUILD_TOOLS = frozenset({"setuptools"})
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)$")


def pinned(lines: list[str]) -> list[tuple[str, str]]:
    """``(name, version)`` of every ``name==version`` line; comments and blanks skipped."""
    pins = []
    for raw in lines:
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _PIN.match(line)
        if match is None:
            raise SystemExit(f"not a name==version line: {raw!r}")
        pins.append((match.group(1), match.group(2)))
    return pins


def is_installed(name: str) -> bool:
    try:
        metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("lock", type=argparse.FileType("r"))
    parser.add_argument("--skip-installed", action="store_true")
    args = parser.parse_args()
    for name, version in pinned(args.lock.read().splitlines()):
        if args.skip_installed and name not in BUILD_TOOLS and is_installed(name):
            print(f"keeping the base image's {name} {metadata.version(name)}", file=sys.stderr)
            continue
        print(f"{name}=={version}")


if __name__ == "__main__":
    main()
