"""Assembles a ready engine from the configuration and a loaded model: scheduler, runner, KV cache."""

from __future__ import annotations

import logging

from scheduler import Scheduler, SchedulerConfig
from spyre_server.config import Config
from spyre_server.engine import LLMEngine
from spyre_server.model.loading import LoadedModel, num_kv_blocks
from spyre_server.model.runner import ModelRunner

logger = logging.getLogger(__name__)


def build_engine(config: Config, loaded: LoadedModel) -> LLMEngine:
    num_blocks = num_kv_blocks(config, loaded.model, loaded.dtype)
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
    )
    scheduler = Scheduler(
        sched_config,
        hash_seed=config.cache.hash_seed,
        model_name=config.model.served_model_name or loaded.name,
    )
    runner = ModelRunner(
        loaded.model, num_blocks=num_blocks, block_size=config.cache.block_size, dtype=loaded.dtype
    )
    logger.info(
        "KV cache: %d blocks of %d tokens (%s)", num_blocks, config.cache.block_size, loaded.dtype
    )
    return LLMEngine(
        scheduler,
        runner,
        loaded.tokenizer,
        eos_token_id=loaded.eos_token_id,
        vocab_size=loaded.vocab_size,
    )
