"""Precompiled programs: the graph cache that ``spyre-server compile`` fills without serving, and
the checks of ``model.require_precompiled``, after the reference stack (sendnn-inference 2.6.3).

The cache is ``model.graph_cache_dir``, else the compiler's own variable:

- ``sendnn``: torch_sendnn's graph cache (``TORCH_SENDNN_CACHE_ENABLE=1``,
  ``TORCH_SENDNN_CACHE_DIR``). ``compile`` compiles as the reference does on a machine without
  a card: the ``sendnn_compile_only`` backend with ``FLEX_DEVICE=COMPILE`` (its platform.py).
  ``require_precompiled`` checks what the reference checks (compilation_utils.py,
  ``handle_disable_compilation``): the cache enabled and its directory there, a catalog in it
  (``pre_compiled_cache_catalog.json``, or ``model_compile.log.json``), a warning naming what
  differs when no entry matches this configuration; and it sets ``DISABLE_COMPILATION=true``,
  with which torch_sendnn refuses to compile a program its cache lacks: the warm-up then
  fails and the server does not start.
- ``inductor``: inductor's persistent FX graph cache (``TORCHINDUCTOR_CACHE_DIR``), the
  compiled code of each graph. inductor cannot be told not to compile, so
  ``require_precompiled`` refuses before loading the model when the catalog has no entry for
  this configuration, and after the warm-up when a graph missed the cache (the graph was then
  compiled, and is in the cache from then on).
- ``eager`` compiles nothing that lasts: ``compile`` and ``require_precompiled`` are refused.

``compile`` writes the catalog entry in the reference's format (``data``: ``MODEL_NAME``,
``NUM_AIUS``, ``VLLM_DT_MAX_CONTEXT_LEN``, ``VLLM_DT_MAX_BATCH_SIZE``, which the reference
matches) with the other limits the programs depend on (chunk, batch x tkv limit, compile
backend, dtype), which we match too where an entry has them.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from spyre_server.config import Config
from spyre_server.model.errors import ModelLoadError
from spyre_server.model.spyre.compile import GraphCacheCounts

logger = logging.getLogger(__name__)

CATALOG = "pre_compiled_cache_catalog.json"
MODEL_COMPILE_LOG = "model_compile.log.json"
"""The reference's two catalog files (compilation_utils.py): a list of entries, or one entry."""

CACHE_VARIABLES = {"sendnn": "TORCH_SENDNN_CACHE_DIR", "inductor": "TORCHINDUCTOR_CACHE_DIR"}


class PrecompiledError(ModelLoadError):
    """The graph cache cannot give what ``compile`` or ``require_precompiled`` needs."""


def graph_cache_dir(config: Config) -> Path | None:
    """``model.graph_cache_dir``, else the compile backend's own variable; None without."""
    if config.model.graph_cache_dir is not None:
        return config.model.graph_cache_dir.expanduser()
    variable = CACHE_VARIABLES.get(config.model.compile_backend)
    value = os.environ.get(variable) if variable else None
    return Path(value) if value else None


def catalog_entry(config: Config, limits: Any, dtype: torch.dtype) -> dict[str, Any]:
    """This configuration's catalog entry. ``limits``: the schedule's (a SchedulerConfig, with
    any known-good configuration applied)."""
    return {
        "spyre_server_version": _version(),
        "data": {
            "MODEL_NAME": str(config.model.path) if config.model.path else "",
            "NUM_AIUS": 1,
            "VLLM_DT_MAX_CONTEXT_LEN": limits.max_model_len,
            "VLLM_DT_MAX_BATCH_SIZE": limits.max_num_seqs,
            "VLLM_DT_CHUNK_LEN": limits.chunk_size,
            "VLLM_DT_MAX_BATCH_TKV_LIMIT": limits.batch_tkv_limit,
            "COMPILE_BACKEND": config.model.compile_backend,
            "DTYPE": str(dtype).removeprefix("torch."),
            "TORCH_VERSION": torch.__version__,
        },
    }


MATCHED = (
    "NUM_AIUS",
    "VLLM_DT_MAX_CONTEXT_LEN",
    "VLLM_DT_MAX_BATCH_SIZE",
    "VLLM_DT_CHUNK_LEN",
    "VLLM_DT_MAX_BATCH_TKV_LIMIT",
    "COMPILE_BACKEND",
    "DTYPE",
)
"""What an entry must agree on (the reference's three, then ours where the entry has them)."""


def check_settings(config: Config, *, compile_only: bool) -> None:
    """Refuse ``compile`` (``compile_only``) and ``model.require_precompiled`` where no
    compiled program can last: the cpu backend, eager, no graph cache directory."""
    model = config.model
    if not compile_only and not model.require_precompiled:
        return
    what = "spyre-server compile" if compile_only else "model.require_precompiled"
    if compile_only and model.require_precompiled:
        raise PrecompiledError(
            "model.require_precompiled is for serving; spyre-server compile fills the cache"
        )
    if model.backend != "spyre":
        raise PrecompiledError(
            f"{what} is for model.backend spyre, whose programs are compiled; the cpu backend "
            "compiles nothing"
        )
    if model.compile_backend == "eager":
        raise PrecompiledError(
            f"{what}: model.compile_backend eager keeps no compiled programs between starts "
            "(it only traces them); use sendnn, or inductor, whose graph cache persists"
        )
    if graph_cache_dir(config) is None:
        raise PrecompiledError(
            f"{what} needs a graph cache: set model.graph_cache_dir (or "
            f"{CACHE_VARIABLES[model.compile_backend]})"
        )


def prepare_graph_cache(
    config: Config, limits: Any, dtype: torch.dtype, *, compile_only: bool
) -> dict[str, str]:
    """The environment the compiler must see before it is imported for ``compile``
    (``compile_only``) or a start: the cache variables; on sendnn ``FLEX_DEVICE=COMPILE`` to
    compile, ``DISABLE_COMPILATION=true`` with ``require_precompiled``. With
    ``require_precompiled``, PrecompiledError when the cache lacks this configuration's
    programs (on sendnn: what the reference refuses; it only warns about the catalog's
    entries). ``limits``: the schedule's (a SchedulerConfig, with any known-good configuration
    applied); ``check_settings`` must have passed."""
    model = config.model
    backend = model.compile_backend
    if not compile_only and not model.require_precompiled:
        directory = model.graph_cache_dir
        return {} if directory is None else _cache_environment(backend, directory.expanduser())
    directory = graph_cache_dir(config)
    assert directory is not None, "check_settings first"
    environment = _cache_environment(backend, directory)
    if compile_only:
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise PrecompiledError(f"cannot create the graph cache {directory}: {exc}") from exc
        if backend == "sendnn":
            environment["FLEX_DEVICE"] = "COMPILE"  # the reference's sendnn_compile_only
        return environment
    enabled = os.environ.get("TORCH_SENDNN_CACHE_ENABLE", "0") == "1"
    if backend == "sendnn" and model.graph_cache_dir is None and not enabled:
        raise PrecompiledError(
            "model.require_precompiled needs torch_sendnn's graph cache enabled: "
            "TORCH_SENDNN_CACHE_ENABLE=1 with TORCH_SENDNN_CACHE_DIR, or set "
            "model.graph_cache_dir"
        )
    if not directory.is_dir():
        raise PrecompiledError(
            f"model.require_precompiled: the graph cache {directory} is not a directory; fill "
            "it with spyre-server compile and this configuration"
        )
    entries = read_catalog(directory)
    wanted = catalog_entry(config, limits, dtype)["data"]
    if not any(_matches(entry, wanted) for entry in entries):
        listing = "; ".join(_describe(e) for e in entries) or "none"
        message = (
            f"no program in the graph cache {directory} was compiled for this configuration "
            f"({_describe({'data': wanted})}); its catalog lists: {listing}. Compile them with "
            "spyre-server compile and the same configuration"
        )
        if backend == "inductor":
            raise PrecompiledError(f"model.require_precompiled: {message}")
        # The reference warns and lets torch_sendnn decide (DISABLE_COMPILATION).
        logger.warning("[PRECOMPILED_WARN] %s", message)
    else:
        entry = next(e for e in entries if _matches(e, wanted))
        _warn_about(entry, wanted, directory)
    if backend == "sendnn":
        environment["DISABLE_COMPILATION"] = "true"
    return environment


def _warn_about(entry: Mapping[str, Any], wanted: Mapping[str, Any], directory: Path) -> None:
    """What the reference warns about in a matching entry: another model, another version."""
    model = entry["data"].get("MODEL_NAME")
    if model != wanted["MODEL_NAME"]:
        logger.warning(
            "[PRECOMPILED_WARN] the programs in %s were compiled for the model %r, this server "
            "loads %r: make sure it is the same model",
            directory,
            model,
            wanted["MODEL_NAME"],
        )
    versions = [("spyre_server_version", entry.get("spyre_server_version"), _version())]
    versions.append(("TORCH_VERSION", entry["data"].get("TORCH_VERSION"), torch.__version__))
    for name, theirs, ours in versions:
        if theirs is not None and theirs != ours:
            logger.warning(
                "[PRECOMPILED_WARN] the programs in %s were compiled with %s %s, this server "
                "runs %s",
                directory,
                name,
                theirs,
                ours,
            )


def read_catalog(directory: Path) -> list[dict[str, Any]]:
    """The entries of the catalog in ``directory`` (the reference's catalog, else its single
    model_compile.log.json); PrecompiledError without one, or when it is not JSON."""
    for name in (CATALOG, MODEL_COMPILE_LOG):
        path = directory / name
        if not path.exists():
            continue
        try:
            content = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise PrecompiledError(f"the precompiled catalog {path} is unreadable: {exc}") from exc
        entries = content if isinstance(content, list) else [content]
        return [e for e in entries if isinstance(e, dict) and isinstance(e.get("data"), dict)]
    raise PrecompiledError(
        f"model.require_precompiled: the graph cache {directory} has no catalog ({CATALOG} or "
        f"{MODEL_COMPILE_LOG}): nothing was compiled into it with spyre-server compile"
    )


def write_catalog(directory: Path, entry: Mapping[str, Any]) -> Path:
    """Add ``entry`` to the catalog in ``directory``, replacing any entry for the same
    configuration; the catalog's path."""
    path = directory / CATALOG
    entries: list[Any] = []
    if path.exists():
        try:
            content = json.loads(path.read_text())
            entries = content if isinstance(content, list) else []
        except ValueError:
            logger.warning("replacing the unreadable catalog %s", path)
    entries = [e for e in entries if not (isinstance(e, dict) and _same(e, entry))]
    entries.append(dict(entry))
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(entries, indent=2) + "\n")
    temporary.replace(path)
    return path


def check_warmup_cache(config: Config, counts: GraphCacheCounts | None, graphs: int) -> None:
    """After the warm-up of ``graphs`` graphs on inductor: with ``require_precompiled``, every
    one must have come from the cache; when compiling, every one must have gone into it."""
    if counts is None or config.model.compile_backend != "inductor":
        return
    directory = graph_cache_dir(config)
    if config.model.require_precompiled and (
        counts.misses or counts.bypasses or counts.hits < graphs
    ):
        raise PrecompiledError(
            f"model.require_precompiled: {counts.misses + counts.bypasses} of {graphs} "
            f"graph(s) were not in inductor's graph cache {directory} (compiled now, and "
            "cached from now on); compile them with spyre-server compile and this "
            "configuration"
        )
    if config.model.require_precompiled:
        logger.info("all %d graphs came from inductor's graph cache %s", graphs, directory)


def check_compiled_into_cache(config: Config, counts: GraphCacheCounts | None, graphs: int) -> None:
    """After ``compile``'s warm-up on inductor: every graph went into (or was already in) the
    cache, else the catalog would promise programs that are not there."""
    if counts is None:
        return
    if counts.bypasses or counts.hits + counts.misses < graphs:
        raise PrecompiledError(
            f"inductor did not cache {graphs - counts.hits - counts.misses + counts.bypasses} "
            f"of the {graphs} graph(s) (is its FX graph cache off? TORCHINDUCTOR_FX_GRAPH_CACHE)"
        )


def _cache_environment(backend: str, directory: Path) -> dict[str, str]:
    if backend == "sendnn":
        return {"TORCH_SENDNN_CACHE_ENABLE": "1", "TORCH_SENDNN_CACHE_DIR": str(directory)}
    if backend == "inductor":
        return {"TORCHINDUCTOR_CACHE_DIR": str(directory)}
    return {}


def _matches(entry: Mapping[str, Any], wanted: Mapping[str, Any]) -> bool:
    data = entry.get("data", {})
    return all(data[key] == wanted[key] for key in MATCHED if key in data) and all(
        key in data for key in MATCHED[:3]
    )


def _same(entry: Mapping[str, Any], other: Mapping[str, Any]) -> bool:
    return bool(
        _matches(entry, other["data"])
        and entry["data"].get("MODEL_NAME") == other["data"].get("MODEL_NAME")
    )


def _describe(entry: Mapping[str, Any]) -> str:
    data = entry.get("data", {})
    return ", ".join(f"{key} {data[key]}" for key in MATCHED if key in data)


def _version() -> str:
    try:
        return importlib.metadata.version("spyre-server")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
