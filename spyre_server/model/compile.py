"""torch.compile backends for the ``spyre`` backend's programs (as vllm-spyre compiles fms).

``sendnn`` is the Spyre compiler: IBM's ``torch_sendnn`` package, which ships in the Spyre runtime
images and is not on PyPI. ``eager`` and ``inductor`` run the very same traced programs on a CPU,
which is how the Spyre path is tested without a card.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from spyre_server.model.loading import ModelLoadError

COMPILE_BACKENDS = ("eager", "inductor", "sendnn")


class CompileBackendError(ModelLoadError):
    """The configured compile backend cannot be used here; the message says why."""


def sendnn_environment(
    *, chunk_size: int, max_model_len: int, max_num_seqs: int, max_batch_tkv_limit: int
) -> dict[str, str]:
    """What torch_sendnn reads at import time for a generative model with chunked prefill
    (vllm-spyre's platform sets the same variables): the programs it compiles must match the
    schedule's limits."""
    return {
        "FLEX_OVERWRITE_NMB_FRAME": "true",
        "COMPILATION_MODE": "offline_decoder",
        "VLLM_DT_CHUNK_LEN": str(chunk_size),
        "VLLM_DT_MAX_CONTEXT_LEN": str(max_model_len),
        # The compiler needs at least 2; decode batches of 1 still run.
        "VLLM_DT_MAX_BATCH_SIZE": str(max(max_num_seqs, 2)),
        "VLLM_DT_MAX_BATCH_TKV_LIMIT": str(max_batch_tkv_limit),
    }


def prepare_backend(backend: str, environment: Mapping[str, str]) -> None:
    """Check that ``backend`` can run here; for ``sendnn``, set its environment and import
    ``torch_sendnn`` (which registers the backend with torch.compile)."""
    if backend not in COMPILE_BACKENDS:
        raise CompileBackendError(
            f"model.compile_backend {backend!r} is not one of {', '.join(COMPILE_BACKENDS)}"
        )
    if backend != "sendnn":
        return
    os.environ.update(environment)
    try:
        importlib.import_module("torch_sendnn")
    except ImportError as exc:
        raise CompileBackendError(
            "model.compile_backend: sendnn needs the torch_sendnn package, which comes with "
            "IBM's Spyre runtime image (it is not on PyPI); build the image on that base "
            f"(see the README's 'Spyre node' section). Importing it failed: {exc}"
        ) from exc


def compile_model(model: torch.nn.Module, backend: str) -> Any:
    options = {"sendnn.dynamic": True} if backend == "sendnn" else None
    # One graph per program is expected; leave room for the prefill/decode variants.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    return torch.compile(model, backend=backend, options=options)


def warmup_context(backend: str) -> contextlib.AbstractContextManager[Any]:
    """Where warm-up compiles run: torch_sendnn's warm-up mode on a card, nothing special on
    a CPU."""
    if backend == "sendnn":
        return importlib.import_module("torch_sendnn").warmup_mode()  # type: ignore[no-any-return]
    return contextlib.nullcontext()


@contextlib.contextmanager
def size_oblivious() -> Iterator[None]:
    """Let a dynamic dimension be 1 (a decode batch of one, a one-block table) without its own
    specialised program, as vllm-spyre does for its warm-up."""
    from torch.fx.experimental import _config

    previous = _config.backed_size_oblivious
    _config.backed_size_oblivious = True
    try:
        yield
    finally:
        _config.backed_size_oblivious = previous
