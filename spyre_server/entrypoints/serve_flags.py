"""The flags of ``spyre-server serve`` (vLLM's spellings where vLLM has the setting) and the
configuration keys they override; ``spyre-server compile`` takes the same."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spyre_server.config import Config, ConfigError, env_name

MODEL_ARGUMENT = "the MODEL argument"
"""How errors name the positional model path."""

DESCRIPTION = """\
Start the OpenAI-compatible server.

Every setting has a default; config.yaml documents them all. Three sources override the
defaults, each the one before it:
  1. the config file given with --config,
  2. environment variables SPYRE_SERVER_<SECTION>__<KEY>, e.g.
     SPYRE_SERVER_SCHEDULER__CHUNK_SIZE=128 (a list as comma-separated values, e.g.
     SPYRE_SERVER_SERVER__API_KEYS=key1,key2; an empty value means null),
  3. the flags below.
So a flag overrides the environment, which overrides the config file. Errors name the file,
variable or flag that set the bad value.

exit status: 0 after a graceful stop (SIGTERM, Ctrl-C), 2 for a bad configuration, a port
that is in use or a model that cannot be loaded, 1 when the engine stops while serving (a
tensor-parallel rank ended: the server answers every request in flight with an error first)."""


@dataclass(frozen=True, slots=True)
class ServeFlag:
    """One flag that overrides one configuration key."""

    flag: str
    key: str
    """``section.key`` in config.yaml."""
    metavar: str
    help: str
    """``{default}`` in it becomes the key's default."""
    type: Callable[[str], Any] = str
    repeatable: bool = False
    """Each use adds a value; the flag's values replace the key's list."""
    switch: bool = False
    """A flag without a value: it sets the key to true (``metavar`` empty)."""

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")


FLAGS: tuple[ServeFlag, ...] = (
    ServeFlag("--host", "server.host", "HOST", "address to listen on (default {default})"),
    ServeFlag("--port", "server.port", "PORT", "port to listen on (default {default})", int),
    ServeFlag(
        "--model",
        "model.path",
        "PATH",
        "the same as the MODEL argument (kept for older scripts)",
        Path,
    ),
    ServeFlag(
        "--api-key",
        "server.api_keys",
        "KEY",
        "require 'Authorization: Bearer KEY'; repeat the flag for several keys",
        repeatable=True,
    ),
    ServeFlag(
        "--max-model-len",
        "model.max_model_len",
        "N",
        "most tokens one request may hold, prompt + max_tokens (default {default})",
        int,
    ),
    ServeFlag(
        "--served-model-name",
        "model.served_model_name",
        "NAME",
        "the model name clients send and metrics carry (default: the model folder's name)",
    ),
    ServeFlag(
        "--dtype",
        "model.dtype",
        "DTYPE",
        "auto, float32, bfloat16, or float16 (spyre backend only); default {default}: the "
        "backend's best on this machine (cpu: bfloat16 with AMX or AVX512-BF16, else float32)",
    ),
    ServeFlag(
        "--tensor-parallel-size",
        "model.tensor_parallel_size",
        "N",
        "ranks one model is split over: cpu sockets or core groups (cpu backend), Spyre cards "
        "(spyre backend); default {default}",
        int,
    ),
    ServeFlag(
        "--chat-template",
        "model.chat_template",
        "TEMPLATE",
        "a Jinja chat template file, or the template itself, replacing the tokenizer's own "
        "for chat requests",
    ),
    ServeFlag(
        "--chunk-size",
        "scheduler.chunk_size",
        "N",
        "token positions per prefill chunk, a multiple of 64 (default {default})",
        int,
    ),
    ServeFlag(
        "--log-level",
        "server.log_level",
        "LEVEL",
        "debug, info, warning or error, in any case (default {default})",
    ),
    ServeFlag(
        "--allow-unverified-config",
        "model.allow_unverified_config",
        "",
        "spyre backend with sendnn: start a model or configuration that is not among the "
        "card's known-good ones (spyre_server/model/spyre/known_configs.yaml), with a warning",
        switch=True,
    ),
    ServeFlag(
        "--graph-cache-dir",
        "model.graph_cache_dir",
        "DIR",
        "spyre backend: where the compiled programs are kept between starts (sendnn's or "
        "inductor's graph cache; default: the compiler's own variable)",
        Path,
    ),
    ServeFlag(
        "--require-precompiled",
        "model.require_precompiled",
        "",
        "spyre backend: refuse to start unless the graph cache holds this configuration's "
        "programs (spyre-server compile puts them there)",
        switch=True,
    ),
)

COMPILE_DESCRIPTION = """\
Compile the spyre backend's programs into the graph cache, without serving.

It takes the configuration serve takes (config file, environment, the same flags), so that
spyre-server compile ARGS compiles what spyre-server serve ARGS runs: it loads the model and
warms up its programs as the server would, with the compiler's persistent cache in
model.graph_cache_dir (--graph-cache-dir), and records the configuration in the cache's
catalog (pre_compiled_cache_catalog.json). serve --require-precompiled then refuses to start
without them.

  sendnn    compiles for the Spyre card on a machine without one (the reference's
            sendnn_compile_only backend, FLEX_DEVICE=COMPILE) into torch_sendnn's cache
  inductor  fills inductor's FX graph cache
  eager     is refused: it keeps nothing between starts

exit status: 0 when the programs are in the cache, 2 for a bad configuration or a model or
program that cannot be loaded or compiled."""


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``serve`` subcommand to ``subparsers`` (``ArgumentParser.add_subparsers()``)."""
    return _add_parser(subparsers, "serve", "start the OpenAI-compatible server", DESCRIPTION)


def add_compile_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``compile`` subcommand: serve's configuration arguments (``serve_overrides``
    reads both)."""
    return _add_parser(
        subparsers,
        "compile",
        "compile the spyre backend's programs into the graph cache, without serving",
        COMPILE_DESCRIPTION,
    )


def _add_parser(
    subparsers: Any, name: str, summary: str, description: str
) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        name,
        help=summary,
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "model_path",
        nargs="?",
        type=Path,
        metavar="MODEL",
        help="HF-format model folder (model.path, SPYRE_SERVER_MODEL__PATH; default: "
        "SmolLM2-135M-Instruct, prepared on first use)",
    )
    parser.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="config file (the format of config.yaml; default: none, built-in defaults)",
    )
    defaults = Config()
    for flag in FLAGS:
        section, _, key = flag.key.partition(".")
        help_text = (
            flag.help.format(default=getattr(getattr(defaults, section), key))
            + f" [{flag.key}, {env_name(section, key)}]"
        )
        if flag.switch:
            parser.add_argument(
                flag.flag, dest=flag.dest, action="store_const", const=True, help=help_text
            )
            continue
        parser.add_argument(
            flag.flag,
            dest=flag.dest,
            type=flag.type,
            metavar=flag.metavar,
            action="append" if flag.repeatable else "store",
            help=help_text,
        )
    return parser


def serve_overrides(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, str]]:
    """The configuration overrides of the parsed ``serve`` arguments, and the flag each came
    from (for error messages). Raises ConfigError for a model given twice, differently."""
    overrides: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for flag in FLAGS:
        value = getattr(args, flag.dest)
        if value is not None:
            overrides[flag.key] = value
            sources[flag.key] = flag.flag
    if args.model_path is not None:
        if overrides.get("model.path", args.model_path) != args.model_path:
            raise ConfigError(
                f"two models given: {args.model_path} ({MODEL_ARGUMENT}) and "
                f"{overrides['model.path']} (--model)"
            )
        overrides["model.path"] = args.model_path
        sources["model.path"] = MODEL_ARGUMENT
    return overrides, sources
