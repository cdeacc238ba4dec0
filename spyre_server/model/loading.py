"""Loads the configured model: path, dtype, torch threads, fms model, tokenizer, KV size."""

from __future__ import annotations

import logging
import os
import stat
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from spyre_server.config import Config
from spyre_server.model.checkpoint import load_checkpoint
from spyre_server.model.cpu.kernels.library import cpu_flags
from spyre_server.model.errors import ModelLoadError
from spyre_server.model.fp8 import Fp8Scheme, use_fp8_linears
from spyre_server.model.hf_config import ModelSpec, check_serving, read_model_spec
from spyre_server.model.rope import install_rope, rope_length, rotary_embeddings
from spyre_server.model.runner import attention_window, kv_cache_shape
from spyre_server.model.spyre.fp8 import check_spyre_fp8
from spyre_server.model.store import default_cache_dir, prepare_default_model

logger = logging.getLogger(__name__)

_FAST_BF16_FLAGS = {"amx_bf16", "avx512_bf16"}


@dataclass(frozen=True, slots=True)
class LoadedModel:
    path: Path
    name: str
    model: torch.nn.Module
    tokenizer: Any
    dtype: torch.dtype
    eos_token_id: int | None
    vocab_size: int
    spec: ModelSpec | None = None
    """What config.json says the model is (None for a model not loaded from a checkpoint)."""


def fp8_scheme(loaded: LoadedModel) -> Fp8Scheme | None:
    """The FP8 scheme of ``loaded``'s checkpoint; None when it is not quantized."""
    return None if loaded.spec is None else loaded.spec.fp8


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
    """Torch threads of the engine's step thread: ``model.num_threads``, default the physical
    cores; 1 with tensor parallelism, where the ranks run the model and the engine samples."""
    if config.model.tensor_parallel_size > 1:
        return 1
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


def fused_weights_for(config: Config) -> bool:
    """Whether ``config``'s backend loads the model with fms's fused projections (one
    query-key-value matrix, one gate-up matrix: fms's default, which the cpu backend packs) or
    unfused, as the reference loads it for the Spyre card (sendnn-inference 2.6.3,
    model_executor/model_loader/spyre.py: ``get_model(..., fused_weights=False)``): unfused on
    the spyre backend."""
    return config.model.backend != "spyre"


def fp8_scale_dtype_for(config: Config) -> torch.dtype | None:
    """The dtype an FP8 checkpoint's scales are loaded in for ``config``'s backend: the
    model's (None), as HF transformers casts them, on the cpu backend; float32 on the spyre
    backend, as the reference keeps them (sendnn-inference 2.6.3,
    model_executor/model_loader/spyre.py, ``cast_params_for_spyre``: "fp8 weights and fp32
    scales are left untouched"), since the card's float16 would round small scales."""
    return torch.float32 if config.model.backend == "spyre" else None


def weights_in_process(config: Config) -> bool:
    """Whether the engine's process loads the model's weights: not with
    ``model.tensor_parallel_size`` above 1, whose ranks each load their shard
    (``parallel.worker``); the engine's process then holds the model's modules only."""
    return config.model.tensor_parallel_size == 1


def load_model(
    path: Path,
    dtype: torch.dtype,
    *,
    fused_weights: bool = True,
    fp8_scale_dtype: torch.dtype | None = None,
    weights: bool = True,
) -> LoadedModel:
    """Load an HF-format checkpoint and the tokenizer of the same folder: the fms model that
    config.json describes (``hf_config.read_model_spec``: refused by name where it would not
    compute what HF transformers computes), every parameter filled from the checkpoint and
    every tensor of the checkpoint used (``checkpoint.load_checkpoint``), rotary embeddings as
    HF computes them (``rope.install_rope``). ``fused_weights=False``: the model built with
    unfused projections, which fms's adapters then fill unfused (``fused_weights_for(config)``
    says which a backend wants); fms's Mixtral has no unfused form and stays fused.
    ``fp8_scale_dtype``: an FP8 checkpoint's scales in that dtype (``fp8_scale_dtype_for``);
    None: in ``dtype``.
    ``weights=False``: the model's modules on the meta device, no weights read
    (``weights_in_process``): what the model is, its sizes and its tokenizer."""
    from transformers import AutoTokenizer

    check_readable(path)
    check_temp_dir()
    spec = read_model_spec(path)
    if not fused_weights and spec.fms_architecture != "mixtral":
        spec = replace(spec, fms_config=spec.fms_config.updated(fused_weights=False))
    model = build_model(spec)
    if spec.fp8 is not None:
        use_fp8_linears(model, spec.fp8, fp8_scale_dtype or dtype, head=model.head)
    if weights:
        _fill(model, path, spec, dtype)
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
        spec=spec,
    )


def _fill(model: torch.nn.Module, path: Path, spec: ModelSpec, dtype: torch.dtype) -> None:
    """Every parameter of ``model`` from the checkpoint at ``path``, and HF's rotary tables."""
    try:
        load_checkpoint(model, path, spec, dtype)
    except ModelLoadError:
        raise
    except Exception as exc:  # an unreadable file, a corrupt shard
        raise ModelLoadError(
            f"cannot load the checkpoint at {path} ({spec.architecture}): "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    if spec.rope is not None:
        install_rope(model, spec.rope)  # before post_init, which then keeps these tables
    elif rotary_embeddings(model):
        raise ModelLoadError(f"fms's {spec.fms_architecture} has rotary embeddings, {path} none")
    post_init = getattr(model, "post_init", None)
    if callable(post_init):
        post_init()


def build_model(spec: ModelSpec) -> torch.nn.Module:
    """fms's model of ``spec`` on the meta device (no memory; ``load_checkpoint`` fills it)."""
    from fms.models.gpt_bigcode import GPTBigCode
    from fms.models.granite import Granite
    from fms.models.llama import LLaMA
    from fms.models.mistral import Mistral
    from fms.models.mixtral import Mixtral
    from fms.models.qwen3 import Qwen3

    classes: dict[str, type[torch.nn.Module]] = {
        "llama": LLaMA,
        "granite": Granite,
        "mistral": Mistral,
        "mixtral": Mixtral,
        "gpt_bigcode": GPTBigCode,
        "qwen3": Qwen3,
    }
    try:
        with torch.device("meta"):
            return classes[spec.fms_architecture](spec.fms_config)
    except Exception as exc:
        raise ModelLoadError(
            f"fms cannot build {spec.architecture} from config.json: {type(exc).__name__}: {exc}"
        ) from exc


def sliding_window_attention(config: Config) -> bool:
    """Whether the attention of ``config``'s backend applies the model's sliding window
    (``model.config.sliding_window`` on the layers ``model.config.sliding_window_layers``). This
    is the one place that says so: while it says no, a window shorter than
    ``model.max_model_len`` is refused at start. Both backends apply a window on every layer
    (``runner.attention_window``)."""
    return True


def check_serving_config(config: Config, loaded: LoadedModel) -> None:
    """Refuse serving ``loaded`` with ``config`` where the results would not be HF's
    (``hf_config.check_serving``: rope types exact up to a length, learned positions, sliding
    windows), and make its rotary tables cover ``model.max_model_len`` positions (HF rotates
    any position)."""
    spec = loaded.spec
    if spec is None:
        return
    max_model_len = config.model.max_model_len
    check_serving(spec, max_model_len, sliding_window_attention=sliding_window_attention(config))
    if spec.fp8 is not None:
        _check_fp8_serving(config, loaded)
    if spec.rope is not None and (rope_length(loaded.model) or 0) < max_model_len:
        install_rope(loaded.model, spec.rope, max_model_len)


def _check_fp8_serving(config: Config, loaded: LoadedModel) -> None:
    """Refuse what an FP8 checkpoint cannot be served with: tensor parallelism; on the spyre
    backend, what the reference's FP8 programs cannot run (``spyre.fp8.check_spyre_fp8``,
    which also loads fms-model-optimizer's FP8 addon); on the cpu backend, a dtype other than
    bfloat16 (the FP8 kernel's)."""
    scheme = fp8_scheme(loaded)
    assert scheme is not None
    if config.model.tensor_parallel_size > 1:
        raise ModelLoadError("FP8 checkpoints with model.tensor_parallel_size above 1")
    if config.model.backend == "spyre":
        window = attention_window(loaded.model, config.model.max_model_len)
        check_spyre_fp8(
            scheme,
            max_num_seqs=config.scheduler.max_num_seqs,
            sliding_window=window is not None,
        )
        return
    dtype = loaded.dtype
    if dtype != torch.bfloat16:
        raise ModelLoadError(
            f"FP8 checkpoints compute in bfloat16 here (model.dtype resolved to {dtype}; "
            "auto is float32 on CPUs without AVX512-BF16 or AMX): set model.dtype: bfloat16"
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
