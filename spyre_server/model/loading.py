"""Loads the configured model: path, dtype, torch threads, fms model, tokenizer, KV size."""

from __future__ import annotations

import json
import logging
import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from spyre_server.config import Config
from spyre_server.model.native_kernels import cpu_flags
from spyre_server.model.runner import kv_cache_shape
from spyre_server.model.store import default_cache_dir, prepare_default_model

logger = logging.getLogger(__name__)

_FAST_BF16_FLAGS = {"amx_bf16", "avx512_bf16"}


class ModelLoadError(RuntimeError):
    """The configured model cannot be served; the message says why."""


@dataclass(frozen=True, slots=True)
class LoadedModel:
    path: Path
    name: str
    model: torch.nn.Module
    tokenizer: Any
    dtype: torch.dtype
    eos_token_id: int | None
    vocab_size: int


def served_model_name(config: Config, loaded: LoadedModel) -> str:
    """The name clients use for the model: ``model.served_model_name``, else the loaded one's."""
    return config.model.served_model_name or loaded.name


def resolve_dtype(
    name: str, *, backend: str = "cpu", compile_backend: str = "sendnn"
) -> torch.dtype:
    """``auto`` on the cpu backend: bfloat16 where the CPU multiplies it natively (AMX /
    AVX512-BF16), else float32. ``auto`` on the spyre backend: float16 on the card (``sendnn``),
    float32 for its CPU fidelity runs (``eager`` / ``inductor``), as vllm-spyre does."""
    if name == "auto":
        if backend == "spyre":
            return torch.float16 if compile_backend == "sendnn" else torch.float32
        return torch.bfloat16 if cpu_flags() & _FAST_BF16_FLAGS else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def model_dtype(config: Config) -> torch.dtype:
    model = config.model
    return resolve_dtype(model.dtype, backend=model.backend, compile_backend=model.compile_backend)


def physical_cores() -> int:
    """Physical cores this process may use (hyper-threads do not speed up matrix products)."""
    available = len(os.sched_getaffinity(0))
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return available
    socket = ""
    cores = set()
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() == "physical id":
            socket = value.strip()
        elif key.strip() == "core id":
            cores.add((socket, value.strip()))
    return max(1, min(len(cores), available) if cores else available)


def compute_threads(config: Config) -> int:
    """Torch threads for the model's steps: ``model.num_threads``, default the physical cores."""
    return config.model.num_threads or physical_cores()


def configure_torch(config: Config) -> None:
    """For a process whose one thread loads the model and runs every step (offline use)."""
    torch.set_num_threads(compute_threads(config))


def resolve_model_path(config: Config, progress: Any = None) -> Path:
    if config.model.path is not None:
        path = config.model.path.expanduser()
        if not (path / "config.json").is_file():
            raise ModelLoadError(
                f"model.path {path} is not an HF-format model folder (no config.json there)"
            )
        return path
    cache_dir = config.model.cache_dir or default_cache_dir()
    return prepare_default_model(cache_dir, progress=progress)


def load_model(path: Path, dtype: torch.dtype) -> LoadedModel:
    """Load an HF-format checkpoint with fms and its tokenizer from the same folder."""
    from fms.models import get_model
    from transformers import AutoTokenizer

    check_readable(path)
    check_temp_dir()
    try:
        model = get_model("hf_pretrained", model_path=str(path), data_type=dtype, device_type="cpu")
    except Exception as exc:
        architectures = _architectures(path)
        raise ModelLoadError(
            f"fms cannot load the model at {path} (architectures {architectures}): "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    model.eval()
    kv_cache_shape(model)  # fails early for models without fms attention modules
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    embeddings = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    if not embeddings:
        raise ModelLoadError(f"the model at {path} has no token embedding")
    return LoadedModel(
        path=path,
        name=path.name,
        model=model,
        tokenizer=tokenizer,
        dtype=dtype,
        eos_token_id=tokenizer.eos_token_id,
        vocab_size=embeddings[0].num_embeddings,
    )


def check_readable(path: Path) -> None:
    """Raise ModelLoadError naming the first file of the model folder this process cannot read.

    fms reports an unreadable checkpoint as a missing one ("No such file or directory"); the
    real cause, and the fix, are about permissions (e.g. a container run with another UID).
    """
    entries = [path, *sorted(path.iterdir())] if os.access(path, os.R_OK | os.X_OK) else [path]
    for entry in entries:
        if entry.name.startswith(".") and entry != path:
            continue
        wanted = os.R_OK | (os.X_OK if entry.is_dir() else 0)
        if os.access(entry, wanted):
            continue
        info = entry.stat()
        raise ModelLoadError(
            f"cannot read {entry}: permission denied (mode {stat.filemode(info.st_mode)}, "
            f"owner uid {info.st_uid} gid {info.st_gid}; this process runs as uid "
            f"{os.getuid()} gid {os.getgid()}). Make the model folder readable by this user, "
            f"e.g. chmod -R a+rX {path}"
        )


def check_temp_dir() -> None:
    """Raise ModelLoadError when no temporary directory is writable (loading the model with fms
    needs one): on a read-only root filesystem, say so instead of "cannot load the model"."""
    try:
        tempfile.gettempdir()
    except FileNotFoundError as exc:
        raise ModelLoadError(
            f"no writable temporary directory ({exc}). On a read-only root filesystem mount "
            "one at /tmp (docker/podman run --read-only --tmpfs /tmp; an emptyDir volume in "
            "Kubernetes), or point TMPDIR at a writable directory"
        ) from None


def _architectures(path: Path) -> list[str]:
    try:
        return list(json.loads((path / "config.json").read_text()).get("architectures", []))
    except (OSError, ValueError):
        return []


def num_kv_blocks(config: Config, model: torch.nn.Module, dtype: torch.dtype) -> int:
    """``cache.num_blocks`` if set, else as many blocks as ``cache.kv_cache_memory`` holds."""
    if config.cache.num_blocks is not None:
        return config.cache.num_blocks
    per_block = kv_cache_shape(model).bytes_per_block(config.cache.block_size, dtype)
    num_blocks = config.cache.kv_cache_bytes // per_block
    if num_blocks < 2:
        raise ModelLoadError(
            f"cache.kv_cache_memory ({config.cache.kv_cache_memory}) holds fewer than 2 KV blocks "
            f"of {per_block} bytes each"
        )
    return num_blocks
