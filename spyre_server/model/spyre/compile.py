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
from dataclasses import dataclass
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
            f"(see docs/spyre-backend.md, 'Spyre node'). Importing it failed: {exc}"
        ) from exc


class Float32Logits(torch.nn.Module):
    """The model with its logits cast to float32 inside the compiled graph, as the reference
    compiles it (model_executor/model_loader/spyre.py, ``_Fp32LogitsWrapper``: the card then
    hands float32 to the host instead of a lossy float16)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        logits, caches = self.model(*args, **kwargs)
        return logits.float(), caches


def dynamo_backend(backend: str, *, compile_only: bool = False) -> str:
    """The torch.compile backend name of ``model.compile_backend``: ``sendnn_compile_only``
    (registered by torch_sendnn) to compile for a card on a machine without one, as the
    reference does with FLEX_DEVICE=COMPILE."""
    return "sendnn_compile_only" if compile_only and backend == "sendnn" else backend


class GraphCounter:
    """The torch.compile backend of one runner: the configured compiler, called exactly as
    torch.compile calls a backend given by name (``options`` as a keyword where there are
    any), counting the graphs it is handed. One callable per runner, so that dynamo compiles
    each runner's graphs for it (its BACKEND_MATCH guard) instead of reusing another
    runner's: the count is what this runner had compiled."""

    def __init__(self, backend: str, options: Mapping[str, Any] | None) -> None:
        self.backend = backend
        self._compile = torch._dynamo.lookup_backend(backend)
        self._kwargs: dict[str, Any] = {"options": dict(options)} if options else {}
        self.graphs = 0

    def __repr__(self) -> str:
        return f"{self.backend} (graphs compiled: {self.graphs})"

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        self.graphs += 1
        return self._compile(graph, example_inputs, **self._kwargs)


def compile_model(
    model: torch.nn.Module, backend: str, *, max_model_len: int, compile_only: bool = False
) -> tuple[Any, GraphCounter]:
    """``model`` compiled as the reference compiles it for the card (its model loader):
    float32 logits in the graph, ``sendnn.dynamic`` on sendnn, and dynamo's recompile limits
    raised to the reference's (2.5 x max_model_len; one graph per kind is expected). Returns
    the compiled callable and its backend, which counts the graphs."""
    options = {"sendnn.dynamic": True} if backend == "sendnn" else None
    limit = max(2 * (max_model_len - 64 + 1), int(2.5 * max_model_len))
    config = torch._dynamo.config
    config.cache_size_limit = max(config.cache_size_limit, limit)
    config.accumulated_cache_size_limit = max(config.accumulated_cache_size_limit, limit)
    counter = GraphCounter(dynamo_backend(backend, compile_only=compile_only), options)
    return torch.compile(Float32Logits(model), backend=counter), counter


@dataclass(frozen=True, slots=True)
class GraphCacheCounts:
    """Lookups in inductor's persistent FX graph cache: graphs found, compiled, not cacheable."""

    hits: int = 0
    misses: int = 0
    bypasses: int = 0


def graph_cache_counts(
    backend: str, since: GraphCacheCounts | None = None
) -> GraphCacheCounts | None:
    """inductor's FX graph cache lookups so far in this process (``since`` an earlier count:
    the difference); None for the other backends (eager has no cache; torch_sendnn keeps its
    own, which it checks itself)."""
    if backend != "inductor":
        return None
    from torch._dynamo.utils import counters

    now = counters["inductor"]
    base = since or GraphCacheCounts()
    return GraphCacheCounts(
        hits=now["fxgraph_cache_hit"] - base.hits,
        misses=now["fxgraph_cache_miss"] - base.misses,
        bypasses=now["fxgraph_cache_bypass"] - base.bypasses,
    )


def warmup_context(backend: str) -> contextlib.AbstractContextManager[Any]:
    """Where warm-up compiles run: torch_sendnn's warm-up mode with sendnn (also compiling
    only), nothing special with eager and inductor (the reference's ``_maybe_warmup_context``
    in v1/worker/spyre_worker.py)."""
    if backend == "sendnn":
        return importlib.import_module("torch_sendnn").warmup_mode()  # type: ignore[no-any-return]
    return contextlib.nullcontext()


@contextlib.contextmanager
def size_oblivious() -> Iterator[None]:
    """Let a dynamic dimension be 1 (a decode batch of one, a one-block table) without its own
    specialised graph: the reference's warm-up runs under it (v1/worker/spyre_worker.py,
    ``use_torch_fx_backed_size_oblivious``), its steps do not."""
    from torch.fx.experimental import _config

    previous = _config.backed_size_oblivious
    _config.backed_size_oblivious = True
    try:
        yield
    finally:
        _config.backed_size_oblivious = previous
