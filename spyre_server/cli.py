"""The ``spyre-server`` command."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="spyre-server", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("serve", help="start the OpenAI-compatible server")
    args = parser.parse_args(argv)
    if args.command == "serve":
        print(
            "spyre-server: setup is complete, but the server itself is not built yet "
            "(engine and HTTP layer are the next issues); nothing to start.",
            file=sys.stderr,
        )
        return 1
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())
