"""The ``spyre-server`` command: ``prepare-model`` and ``serve``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from spyre_server.config import ConfigError, load_config
from spyre_server.model_store import ModelStoreError, default_cache_dir, prepare_default_model


def _progress(message: str) -> None:
    print(f"spyre-server: {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="spyre-server", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    prepare = commands.add_parser(
        "prepare-model", help="convert the default model (SmolLM2-135M-Instruct) into the cache"
    )
    prepare.add_argument("--config", type=Path, help="config file (for model.cache_dir)")
    prepare.add_argument("--cache-dir", type=Path, help="overrides model.cache_dir")
    commands.add_parser("serve", help="start the OpenAI-compatible server")
    args = parser.parse_args(argv)
    try:
        if args.command == "prepare-model":
            config = load_config(args.config)
            cache_dir = args.cache_dir or config.model.cache_dir or default_cache_dir()
            print(prepare_default_model(cache_dir, progress=_progress))
            return 0
        _progress(
            "setup is complete, but the HTTP server is not built yet (it is the next issue); "
            "nothing to start."
        )
        return 1
    except (ConfigError, ModelStoreError) as exc:
        _progress(f"error: {exc}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
