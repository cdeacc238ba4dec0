"""Assembles a ready engine from the configuration and a loaded model: scheduler, runner of the
configured backend (warmed up), KV cache."""

from __future__ import annotations

import logging

from scheduler import Scheduler, SchedulerConfig
from spyre_server.config import Config
from spyre_server.engine import LLMEngine
from spyre_server.model.compile import prepare_backend, sendnn_environment
from spyre_server.model.cpu_backend import CpuModelRunner
from spyre_server.model.cpu_model import cpu_attention_kernel, cpu_decoder, cpu_inference_copy
from spyre_server.model.loading import LoadedModel, num_kv_blocks, served_model_name
from spyre_server.model.runner import ModelRunner, kv_cache_shape
from spyre_server.model.spyre_backend import SpyreModelRunner

logger = logging.getLogger(__name__)


def build_engine(config: Config, loaded: LoadedModel) -> LLMEngine:
    num_blocks = num_kv_blocks(config, loaded.model, loaded.dtype)
    runner_class = CpuModelRunner if config.model.backend == "cpu" else SpyreModelRunner
    sched_config = SchedulerConfig(
        block_size=config.cache.block_size,
        chunk_size=config.scheduler.chunk_size,
        max_num_seqs=config.scheduler.max_num_seqs,
        max_model_len=config.model.max_model_len,
        num_blocks=num_blocks,
        max_batch_tkv_limit=config.scheduler.max_batch_tkv_limit,
        interleave=config.scheduler.interleave,
        enable_prefix_caching=config.cache.enable_prefix_caching,
        cache_decode_blocks=config.cache.cache_decode_blocks,
        prefill_compute=runner_class.prefill_compute,
    )
    scheduler = Scheduler(
        sched_config,
        hash_seed=config.cache.hash_seed,
        model_name=served_model_name(config, loaded),
    )
    runner = _create_runner(config, loaded, sched_config)
    logger.info(
        "KV cache: %d blocks of %d tokens (%s), %s backend",
        num_blocks,
        config.cache.block_size,
        loaded.dtype,
        config.model.backend,
    )
    runner.warm_up()
    return LLMEngine(
        scheduler,
        runner,
        loaded.tokenizer,
        eos_token_id=loaded.eos_token_id,
        vocab_size=loaded.vocab_size,
    )


def check_backend(config: Config) -> None:
    """Fail now, before the model loads, if the configured backend cannot run here (on the
    spyre backend: import its compiler, with the environment it reads at import time)."""
    if config.model.backend == "cpu":
        return
    # The limits only (the KV size is not known before the model loads).
    limits = SchedulerConfig(
        chunk_size=config.scheduler.chunk_size,
        max_num_seqs=config.scheduler.max_num_seqs,
        max_model_len=config.model.max_model_len,
        max_batch_tkv_limit=config.scheduler.max_batch_tkv_limit,
    )
    prepare_backend(
        config.model.compile_backend,
        sendnn_environment(
            chunk_size=limits.chunk_size,
            max_model_len=limits.max_model_len,
            max_num_seqs=limits.max_num_seqs,
            max_batch_tkv_limit=limits.batch_tkv_limit,
        ),
    )


def _create_runner(config: Config, loaded: LoadedModel, sched: SchedulerConfig) -> ModelRunner:
    if config.model.backend == "cpu":
        model = cpu_inference_copy(
            loaded.model,
            linear_kernel=config.model.linear_kernel,
            dtype=loaded.dtype,
            kernel_dir=config.model.kernel_dir,
            native_avx512=config.model.native_avx512,
        )
        attention = cpu_attention_kernel(
            config.model.attention_kernel,
            dtype=loaded.dtype,
            head_dim=kv_cache_shape(model).head_dim,
            kernel_dir=config.model.kernel_dir,
            native_avx512=config.model.native_avx512,
        )
        return CpuModelRunner(
            model,
            num_blocks=sched.num_blocks,
            block_size=sched.block_size,
            dtype=loaded.dtype,
            attention=attention,
            decoder=cpu_decoder(model, attention),
        )
    check_backend(config)
    if config.model.compile_backend != "sendnn":
        kv_bytes = sched.num_blocks * kv_cache_shape(loaded.model).bytes_per_block(
            sched.block_size, loaded.dtype
        )
        logger.warning(
            "spyre backend on a CPU (%s): fms's reference spyre_paged_attn copies the whole KV "
            "cache (%.0f MiB) at every layer of every step; a small cache.num_blocks keeps it "
            "bearable",
            config.model.compile_backend,
            kv_bytes / 2**20,
        )
    return SpyreModelRunner(
        loaded.model,
        num_blocks=sched.num_blocks,
        block_size=sched.block_size,
        dtype=loaded.dtype,
        chunk_size=sched.chunk_size,
        max_num_seqs=sched.max_num_seqs,
        max_model_len=sched.max_model_len,
        compile_backend=config.model.compile_backend,
    )
