"""Assembles a ready engine from the configuration and a loaded model: scheduler, runner of the
configured backend (warmed up), KV cache."""

from __future__ import annotations

import logging
import os

from scheduler import PrefillCompute, Scheduler, SchedulerConfig
from spyre_server.config import Config
from spyre_server.engine.core import LLMEngine
from spyre_server.model.build import build_runner
from spyre_server.model.cpu.runner import CpuModelRunner
from spyre_server.model.errors import ModelLoadError
from spyre_server.model.loading import (
    LoadedModel,
    check_serving_config,
    fp8_scheme,
    model_dtype,
    num_kv_blocks,
    served_model_name,
)
from spyre_server.model.parallel.placement import placements
from spyre_server.model.parallel.runner import start_ranks
from spyre_server.model.runner import ModelRunner
from spyre_server.model.spyre.compile import prepare_backend, sendnn_environment
from spyre_server.model.spyre.fp8 import kv_cache_dtype
from spyre_server.model.spyre.known_configs import registry_config
from spyre_server.model.spyre.kv_blocks import spyre_num_kv_blocks
from spyre_server.model.spyre.precompiled import (
    PrecompiledError,
    check_compiled_into_cache,
    check_settings,
    check_warmup_cache,
    graph_cache_dir,
    prepare_graph_cache,
)
from spyre_server.model.spyre.runner import SpyreModelRunner

logger = logging.getLogger(__name__)


def build_engine(config: Config, loaded: LoadedModel, *, compile_only: bool = False) -> LLMEngine:
    """The one way an engine is made (the server, the offline LLM, tests and benchmarks).
    ``compile_only``: for ``spyre-server compile``, whose warm-up compiles the programs into
    the graph cache (``check_backend`` with the same flag must have run first)."""
    check_serving_config(config, loaded)
    if config.model.backend == "spyre":  # the card's KV rules, its known-good values applied
        config = registry_config(config, loaded.path).apply(config)
        num_blocks = spyre_num_kv_blocks(config)
        kv_dtype = kv_cache_dtype(loaded.dtype, fp8_scheme(loaded))
    else:
        num_blocks = num_kv_blocks(config, loaded.model, loaded.dtype)
        kv_dtype = loaded.dtype
    runner_class = CpuModelRunner if config.model.backend == "cpu" else SpyreModelRunner
    sched_config = scheduler_config(config, num_blocks, runner_class.prefill_compute)
    model_name = served_model_name(config, loaded)
    scheduler = Scheduler(sched_config, hash_seed=config.cache.hash_seed, model_name=model_name)
    tp_size = config.model.tensor_parallel_size
    logger.info(
        "KV cache: %d blocks of %d tokens (%s), %s backend, tensor parallel size %d",
        num_blocks,
        config.cache.block_size,
        kv_dtype,
        config.model.backend,
        tp_size,
    )
    runner: ModelRunner
    if tp_size > 1:
        runner = start_ranks(config, loaded, sched_config)
    else:
        runner = build_runner(config, loaded, sched_config, compile_only=compile_only)
    warm_up(config, runner, compile_only=compile_only)
    return LLMEngine(
        scheduler,
        runner,
        loaded.tokenizer,
        eos_token_id=loaded.eos_token_id,
        vocab_size=loaded.vocab_size,
        model_name=model_name,
    )


def scheduler_config(
    config: Config, num_blocks: int, prefill_compute: PrefillCompute
) -> SchedulerConfig:
    """The scheduler's settings from the configuration, for a pool of ``num_blocks``."""
    return SchedulerConfig(
        block_size=config.cache.block_size,
        chunk_size=config.scheduler.chunk_size,
        max_num_seqs=config.scheduler.max_num_seqs,
        max_model_len=config.model.max_model_len,
        num_blocks=num_blocks,
        max_batch_tkv_limit=config.scheduler.max_batch_tkv_limit,
        interleave=config.scheduler.interleave,
        enable_prefix_caching=config.cache.enable_prefix_caching,
        cache_decode_blocks=config.cache.cache_decode_blocks,
        prefill_compute=prefill_compute,
    )


def warm_up(config: Config, runner: ModelRunner, *, compile_only: bool = False) -> None:
    """Warm ``runner`` up; on the spyre backend, with ``model.require_precompiled``, a failed
    warm-up (torch_sendnn refusing to compile what its cache lacks) or a graph inductor's cache
    did not have stops the start, and ``compile`` checks that inductor cached every graph."""
    if not isinstance(runner, SpyreModelRunner):
        runner.warm_up()
        return
    try:
        runner.warm_up()
    except Exception as exc:
        if not config.model.require_precompiled:
            raise
        raise PrecompiledError(
            "model.require_precompiled: the warm-up failed, so the graph cache "
            f"{graph_cache_dir(config)} lacks a program this configuration needs (compile them "
            f"with spyre-server compile and the same configuration): {type(exc).__name__}: {exc}"
        ) from exc
    stats = runner.program_stats()
    graphs = sum(stats.graphs.values()) if stats else 0
    if compile_only:
        check_compiled_into_cache(config, runner.warmup_graph_cache, graphs)
    else:
        check_warmup_cache(config, runner.warmup_graph_cache, graphs)


def check_backend(config: Config, *, compile_only: bool = False) -> None:
    """Fail now, before the model loads, if the configured backend cannot run here (on the
    spyre backend: import its compiler, with the environment it reads at import time), or
    cannot give ``spyre-server compile`` (``compile_only``) or ``model.require_precompiled``
    what they need (precompiled.py)."""
    check_settings(config, compile_only=compile_only)
    check_tensor_parallel(config, compile_only=compile_only)
    if config.model.backend == "cpu":
        return
    # The card's known-good configurations (with sendnn): their values go into the limits
    # torch_sendnn reads at import; an unverified configuration is refused after the import.
    card = registry_config(config, config.model.path)
    config = card.apply(config)
    # The limits only (the KV size is not known before the model loads).
    limits = SchedulerConfig(
        chunk_size=config.scheduler.chunk_size,
        max_num_seqs=config.scheduler.max_num_seqs,
        max_model_len=config.model.max_model_len,
        max_batch_tkv_limit=config.scheduler.max_batch_tkv_limit,
    )
    # The graph cache's variables, before the compiler reads them (any compile backend).
    os.environ.update(
        prepare_graph_cache(config, limits, model_dtype(config), compile_only=compile_only)
    )
    prepare_backend(
        config.model.compile_backend,
        sendnn_environment(
            chunk_size=limits.chunk_size,
            max_model_len=limits.max_model_len,
            max_num_seqs=limits.max_num_seqs,
            max_batch_tkv_limit=limits.batch_tkv_limit,
        )
        | dict(card.env),
    )
    card.check(config.model.allow_unverified_config)


def check_tensor_parallel(config: Config, *, compile_only: bool = False) -> None:
    """With ``model.tensor_parallel_size`` above 1: refuse what the ranks do not do yet
    (``spyre-server compile``, ``model.require_precompiled``: the graph cache is per process)
    and ranks that do not fit on this host (``placement.placements``)."""
    size = config.model.tensor_parallel_size
    if size == 1:
        return
    if compile_only or config.model.require_precompiled:
        raise ModelLoadError(
            f"model.tensor_parallel_size {size}: spyre-server compile and "
            "model.require_precompiled run with tensor_parallel_size 1 only"
        )
    placements(config)
