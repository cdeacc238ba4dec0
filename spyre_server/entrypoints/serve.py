"""Assembles the server from a configuration and runs it with uvicorn."""

from __future__ import annotations

import ctypes
import gc
import logging
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType

import torch
import uvicorn
from fastapi import FastAPI

from spyre_server.api.app import create_app
from spyre_server.api.auth import APIKeys, salt_secret
from spyre_server.api.chat_template import load_chat_template
from spyre_server.api.generation import GenerationLimits
from spyre_server.api.generation_defaults import GenerationDefaults
from spyre_server.api.metrics import ServerMetrics
from spyre_server.api.state import ServerState
from spyre_server.config import Config
from spyre_server.engine.async_engine import AsyncEngine, EngineDeadError
from spyre_server.engine.core import LLMEngine
from spyre_server.engine.factory import build_engine, check_backend
from spyre_server.entrypoints.listen_socket import bind_socket
from spyre_server.model.loading import (
    LoadedModel,
    compute_threads,
    fp8_scale_dtype_for,
    fused_weights_for,
    load_model,
    model_dtype,
    resolve_model_path,
    weights_in_process,
)
from spyre_server.sample.structured_output import GrammarCompiler

logger = logging.getLogger("spyre_server")

DEADLINE_MARGIN_SECONDS = 2.0
"""In-flight requests are ended this long before the drain deadline (a quarter of the drain at
most), leaving time for the current engine step to finish and the answers to go out."""


def load(config: Config) -> LoadedModel:
    """Load the model on the calling thread with one torch thread: parallel torch work belongs
    to the engine's step thread alone (see AsyncEngine)."""
    torch.set_num_threads(1)
    check_backend(config)
    path = resolve_model_path(config, progress=lambda message: logger.info("%s", message))
    dtype = model_dtype(config)
    logger.info("loading the model from %s (%s)", path, str(dtype).removeprefix("torch."))
    return load_model(
        path,
        dtype,
        fused_weights=fused_weights_for(config),
        fp8_scale_dtype=fp8_scale_dtype_for(config),
        weights=weights_in_process(config),
    )


def build_engine_at(num_threads: int | None, config: Config, loaded: LoadedModel) -> LLMEngine:
    """``build_engine``; where this process warms the spyre backend's programs up (no tensor
    parallelism: ranks warm up their own), with ``num_threads`` torch threads, the step
    thread's (``None``: as this thread has them). Dynamo guards the traced graphs on torch's
    thread count (part of its global state), so a warm-up at another count than the steps'
    would trace and compile both programs again at the first steps. The warm-up then runs on a
    short-lived thread, whose OpenMP pool ends with it: parallel torch work belongs to the step
    thread (AsyncEngine). A daemon thread, so that Ctrl-C still stops a long warm-up."""
    traced_here = config.model.backend == "spyre" and weights_in_process(config)
    if num_threads is None or not traced_here:
        return build_engine(config, loaded)
    built: list[LLMEngine] = []
    failed: list[BaseException] = []

    def build() -> None:
        torch.set_num_threads(num_threads)
        try:
            built.append(build_engine(config, loaded))
        except BaseException as exc:  # raised again on the caller's thread
            failed.append(exc)

    thread = threading.Thread(target=build, name="spyre-warmup", daemon=True)
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    return built[0]


def build_app(
    config: Config,
    loaded: LoadedModel,
    engine: LLMEngine | None = None,
    *,
    num_threads: int | None = None,
) -> FastAPI:
    """``num_threads``: torch threads the step thread sets when it starts (``None``: whatever
    torch has then)."""
    engine = engine or build_engine_at(num_threads, config, loaded)
    model_name = engine.model_name
    template = config.model.chat_template
    state = ServerState(
        engine=AsyncEngine(engine, num_threads=num_threads),
        tokenizer=loaded.tokenizer,
        config=config,
        model_name=model_name,
        limits=GenerationLimits(
            request=engine.limits,
            default_max_tokens=config.server.default_max_tokens,
            max_waiting=config.scheduler.max_waiting,
        ),
        metrics=ServerMetrics(
            model_name,
            engine.scheduler.make_stats,
            engine.runner.program_stats,
            tensor_parallel_size=config.model.tensor_parallel_size,
        ),
        api_keys=APIKeys(config.server.api_keys, salt_secret(config.cache.hash_seed)),
        created=int(time.time()),
        model_root=str(loaded.path),
        grammars=GrammarCompiler(loaded.tokenizer, loaded.vocab_size),
        generation_defaults=GenerationDefaults.read(loaded.path),
        chat_template=None if template is None else load_chat_template(template),
    )
    return create_app(state)


def serve(config: Config) -> None:
    """Bind the port (ListenError when it is taken, before anything loads), load the model
    (ModelLoadError), serve until SIGTERM or Ctrl-C."""
    logging.basicConfig(
        level=config.server.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    sock = bind_socket(config.server.host, config.server.port)
    loaded = load(config)
    app = build_app(config, loaded, num_threads=compute_threads(config))
    del loaded  # the engine holds what it runs (a packed copy of the weights on the cpu backend)
    # Everything alive now (torch, transformers, the model's modules: over a million objects)
    # lives as long as the server: keep it out of the collector, whose full collections would
    # otherwise scan it in the middle of requests (as vLLM does after start-up).
    gc.collect()
    gc.freeze()
    release_freed_memory()
    logger.info(
        "serving %s on http://%s:%d",
        app.state.server.model_name,
        config.server.host,
        sock.getsockname()[1],
    )
    # Until here SIGTERM stops the start-up at once (entrypoints/cli.py). From here uvicorn drains
    # in-flight requests on SIGTERM, restores the previous handler and raises the signal again:
    # make that previous handler a no-op so a graceful stop exits 0.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    engine: AsyncEngine = app.state.server.engine
    uvicorn_config = uvicorn.Config(
        app,
        host=config.server.host,
        port=config.server.port,
        log_level=config.server.log_level,
        timeout_graceful_shutdown=config.server.graceful_shutdown_seconds,
    )
    server = DrainingServer(uvicorn_config, on_deadline=engine.stop)
    engine.on_death = server.stop_serving
    server.run(sockets=[sock])
    if engine.error is not None:
        raise EngineDeadError(
            f"the engine stopped while serving: {type(engine.error).__name__}: {engine.error}"
        )


def release_freed_memory() -> None:
    """Hand the heap pages freed during loading back to the OS (glibc's ``malloc_trim``).

    Loading frees hundreds of MB in weight-sized chunks (the unpacked linear weights once the cpu
    backend's packed copy exists, fms's pre-fusion tensors), and glibc keeps such chunks in its
    heap. Other C libraries have no ``malloc_trim``; there is nothing to do then."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        logger.debug("no glibc malloc_trim here; freed heap memory stays with the process")
        return
    trim(0)


class DrainingServer(uvicorn.Server):
    """uvicorn's server, plus: shortly before the graceful-shutdown deadline, ``on_deadline``
    ends every request still in flight through the engine, so that each client gets a proper
    answer (an error envelope, or an SSE error event and ``[DONE]``) before uvicorn cancels the
    request tasks (a bare text 500, a cut stream)."""

    def __init__(self, config: uvicorn.Config, on_deadline: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_deadline = on_deadline
        self._deadline_timer: threading.Timer | None = None

    def stop_serving(self) -> None:
        """Stop as after SIGTERM (callable from any thread): the engine has died, every
        request has its error, and the process should exit."""
        self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._deadline_timer is None and self.config.timeout_graceful_shutdown is not None:
            drain = self.config.timeout_graceful_shutdown
            self._deadline_timer = threading.Timer(
                max(0.0, drain - min(DEADLINE_MARGIN_SECONDS, drain / 4)), self._on_deadline
            )
            self._deadline_timer.daemon = True
            self._deadline_timer.start()
        super().handle_exit(sig, frame)
