"""The spyre-server command: prepare-model, serve, compile and bench."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

from spyre_server.benchmark.cli import add_parser as add_bench_parser
from spyre_server.config import Config, ConfigError, load_config
from spyre_server.entrypoints.serve_flags import (
    add_compile_parser,
    add_serve_parser,
    serve_overrides,
)
from spyre_server.model.store import ModelStoreError, default_cache_dir, prepare_default_model


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
    add_serve_parser(commands)
    add_compile_parser(commands)
    add_bench_parser(commands)
    args = parser.parse_args(argv)
    if args.command == "bench":
        # Imported here: the benchmark needs httpx, tqdm and transformers, serving does not.
        from spyre_server.benchmark.cli import run as run_bench

        return run_bench(args)
    try:
        if args.command == "prepare-model":
            config = load_config(args.config)
            cache_dir = args.cache_dir or config.model.cache_dir or default_cache_dir()
            print(prepare_default_model(cache_dir, progress=_progress))
            return 0
        overrides, sources = serve_overrides(args)
        config = load_config(args.config, overrides=overrides, override_sources=sources)
        if args.command == "compile":
            return _compile(config)
        return _serve(config)
    except (ConfigError, ModelStoreError) as exc:
        _progress(f"error: {exc}")
        return 2
    except KeyboardInterrupt:  # Ctrl-C while preparing or loading the model
        _progress("interrupted")
        return 0 if args.command == "serve" else 130


def _serve(config: Config) -> int:
    # Before the imports and the model load: as a container's PID 1, a process that has no
    # SIGTERM handler ignores SIGTERM, so `docker stop` would wait for its timeout and kill.
    # serve() hands SIGTERM over to uvicorn's drain once the server is built.
    signal.signal(signal.SIGTERM, _stop_during_startup)
    # Imported here: torch, fms and uvicorn take seconds to import.
    from spyre_server.engine.async_engine import EngineDeadError
    from spyre_server.entrypoints.listen_socket import ListenError
    from spyre_server.entrypoints.serve import serve
    from spyre_server.model.loading import ModelLoadError

    try:
        serve(config)
    except (ListenError, ModelLoadError) as exc:
        _progress(f"error: {exc}")
        return 2
    except EngineDeadError as exc:
        _progress(f"error: {exc}")
        return 1
    except KeyboardInterrupt:
        # Ctrl-C: uvicorn drained the requests in flight and raised the signal again, or the
        # model was still loading.
        global _interrupted
        _interrupted = True
    return 0


def _compile(config: Config) -> int:
    """Load the model and warm up its programs into the graph cache, as serve would with the
    same configuration, and record them in the cache's catalog; no port, no server."""
    logging.basicConfig(
        level=config.server.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # Imported here: torch and fms take seconds to import.
    import torch

    from spyre_server.engine.factory import build_engine, check_backend
    from spyre_server.model.loading import (
        ModelLoadError,
        compute_threads,
        fp8_scale_dtype_for,
        fused_weights_for,
        load_model,
        model_dtype,
        resolve_model_path,
    )
    from spyre_server.model.spyre.precompiled import catalog_entry, graph_cache_dir, write_catalog

    try:
        check_backend(config, compile_only=True)
        # The torch threads of serve's step thread, which serve warms up with
        # (serve.build_engine_at): inductor's CPU code, and so its cache key, depends on the
        # thread count, and dynamo guards the traced graphs on it.
        torch.set_num_threads(compute_threads(config))
        dtype = model_dtype(config)
        path = resolve_model_path(config, progress=_progress)
        loaded = load_model(
            path,
            dtype,
            fused_weights=fused_weights_for(config),
            fp8_scale_dtype=fp8_scale_dtype_for(config),
        )
        engine = build_engine(config, loaded, compile_only=True)
    except ModelLoadError as exc:
        _progress(f"error: {exc}")
        return 2
    directory = graph_cache_dir(config)
    assert directory is not None  # check_backend refuses compile without one
    catalog = write_catalog(directory, catalog_entry(config, engine.scheduler.config, dtype))
    stats = engine.runner.program_stats()
    graphs = dict(stats.graphs) if stats else {}
    _progress(
        f"compiled {graphs.get('prefill', 0)} prefill and {graphs.get('decode', 0)} decode "
        f"graph(s) ({config.model.compile_backend}) into {directory}; catalog {catalog}"
    )
    return 0


_interrupted = False
"""A Ctrl-C ended ``serve``: the process should exit without finalizing (see ``run``)."""


def run() -> None:
    """The ``spyre-server`` command. After a Ctrl-C it exits at once: the interpreter's
    finalization restores the default SIGINT action while torch's threads wind down, and a
    Ctrl-C then would kill the process with -2 after all (seen about once in ten Ctrl-Cs during
    model loading). ``main`` itself returns, so it can be called in-process."""
    code = main()
    if _interrupted:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def _stop_during_startup(signum: int, frame: object) -> None:
    """SIGTERM before the server serves: nothing to drain, stop at once (exit 0, as asked)."""
    _progress("SIGTERM during start-up: stopping before serving")
    raise SystemExit(0)


if __name__ == "__main__":
    run()
