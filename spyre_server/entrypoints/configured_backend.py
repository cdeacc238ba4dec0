"""``python -m spyre_server.entrypoints.configured_backend [ARGS]``: prints the ``model.backend``
(``cpu`` or ``spyre``) that ``spyre-server serve ARGS`` would run with, reading the config file,
the environment and the flags as the server does. The container's entrypoint
(docker/entrypoint.sh) asks it whether to set up the Spyre card. It prints nothing, and exits 0,
when the arguments or the configuration are invalid: the server itself then says why."""

from __future__ import annotations

import argparse
import sys

from spyre_server.config import ConfigError, load_config
from spyre_server.entrypoints.serve_flags import add_serve_parser, serve_overrides


def configured_backend(argv: list[str]) -> str | None:
    parser = argparse.ArgumentParser(prog="spyre-server", add_help=False)
    add_serve_parser(parser.add_subparsers(dest="command"))
    try:
        # Flags of other subcommands than serve (compile's own, say) are no concern here.
        args, _ = parser.parse_known_args(["serve", *argv])
        overrides, sources = serve_overrides(args)
        config = load_config(args.config, overrides=overrides, override_sources=sources)
    except (ConfigError, SystemExit):
        return None
    return config.model.backend


def main(argv: list[str] | None = None) -> int:
    backend = configured_backend(sys.argv[1:] if argv is None else argv)
    if backend is not None:
        print(backend)
    return 0


if __name__ == "__main__":
    sys.exit(main())
