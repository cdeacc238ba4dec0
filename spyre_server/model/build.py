"""The runner of the configured backend for a loaded model, in this process: the whole model, or
one tensor-parallel rank's shard of it (``parallel.worker`` builds those)."""

from __future__ import annotations

import logging

from scheduler import SchedulerConfig
from spyre_server.config import Config
from spyre_server.model.cpu.kernels.library import NativeKernelSettings
from spyre_server.model.cpu.prepare import (
    cpu_attention_kernel,
    cpu_decoder,
    cpu_inference_copy,
    warn_unless_row_invariant,
)
from spyre_server.model.cpu.runner import CpuModelRunner
from spyre_server.model.loading import LoadedModel, fp8_scheme
from spyre_server.model.parallel.group import RankGroup
from spyre_server.model.parallel.shard import sum_partial_outputs
from spyre_server.model.runner import LocalModelRunner, attention_window, kv_cache_shape
from spyre_server.model.spyre.fp8 import kv_cache_dtype
from spyre_server.model.spyre.runner import SpyreModelRunner

logger = logging.getLogger(__name__)


def build_runner(
    config: Config,
    loaded: LoadedModel,
    sched: SchedulerConfig,
    *,
    compile_only: bool = False,
    group: RankGroup | None = None,
) -> LocalModelRunner:
    """The configured backend's runner for ``loaded``, its KV cache sized by ``sched`` (not
    warmed up). ``check_backend`` must have run first. ``group``: ``loaded`` is this rank's
    shard (``parallel.shard.shard_``); its output projections are summed across the ranks."""
    window = attention_window(loaded.model, sched.max_model_len)
    if window is not None:
        logger.info("attention: a sliding window of %d keys on every layer", window)
    if config.model.backend == "cpu":
        return _cpu_runner(config, loaded, sched, window, group)
    if config.model.compile_backend != "sendnn":
        kv_bytes = sched.num_blocks * kv_cache_shape(loaded.model).bytes_per_block(
            sched.block_size, kv_cache_dtype(loaded.dtype, fp8_scheme(loaded))
        )
        logger.warning(
            "spyre backend on a CPU (%s): fms's reference spyre_paged_attn copies the whole KV "
            "cache (%.0f MiB) at every layer of every step; a small cache.num_blocks keeps it "
            "bearable",
            config.model.compile_backend,
            kv_bytes / 2**20,
        )
    if group is not None:
        sum_partial_outputs(loaded.model, group.all_reduce)
    return SpyreModelRunner(
        loaded.model,
        num_blocks=sched.num_blocks,
        block_size=sched.block_size,
        dtype=loaded.dtype,
        chunk_size=sched.chunk_size,
        max_num_seqs=sched.max_num_seqs,
        max_model_len=sched.max_model_len,
        compile_backend=config.model.compile_backend,
        sliding_window=window,
        fp8_scheme=fp8_scheme(loaded),
        special_token_ids=[] if loaded.eos_token_id is None else [loaded.eos_token_id],
        compile_only=compile_only,
    )


def _cpu_runner(
    config: Config,
    loaded: LoadedModel,
    sched: SchedulerConfig,
    window: int | None,
    group: RankGroup | None,
) -> CpuModelRunner:
    kernels = NativeKernelSettings(
        config.model.kernel_dir, config.model.native_avx512, config.model.native_amx
    )
    model = cpu_inference_copy(
        loaded.model,
        linear_kernel=config.model.linear_kernel,
        dtype=loaded.dtype,
        kernel_settings=kernels,
    )
    head_dim = kv_cache_shape(model).head_dim
    attention = cpu_attention_kernel(
        config.model.attention_kernel,
        dtype=loaded.dtype,
        head_dim=head_dim,
        kernel_settings=kernels,
    )
    if group is None or group.rank == 0:
        warn_unless_row_invariant(
            config.model.linear_kernel,
            config.model.attention_kernel,
            dtype=loaded.dtype,
            head_dim=head_dim,
            prefix_caching=config.cache.enable_prefix_caching,
        )
    reduce = None if group is None else group.sum_
    decoder = cpu_decoder(model, attention, reduce)
    if decoder is None and reduce is not None:
        sum_partial_outputs(model, reduce)  # fms's forward runs the steps
    return CpuModelRunner(
        model,
        num_blocks=sched.num_blocks,
        block_size=sched.block_size,
        dtype=loaded.dtype,
        attention=attention,
        decoder=decoder,
        sliding_window=window,
    )
