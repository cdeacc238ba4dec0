"""A tensor-parallel rank: a process that holds one shard of the model and of every layer's KV
heads, and runs each step the engine sends it. It decides nothing: the engine's scheduler
plans every step, and every rank runs every step.

The conversation over the rank's pipe: the rank sends ``Ready`` once its shard is loaded and
warmed up, then for each step it receives it sends ``Done`` (having written its columns of the
step's logits into the shared buffer: on the cpu backend each rank its part of the vocabulary,
``shard.shard_head_``; on the spyre backend, whose programs compute every logit on every rank,
rank 0 all of them), until it receives ``None`` (stop). Any error is sent as
``Failed`` and ends the process with status 1. The rank also ends when the engine's process
does (``PR_SET_PDEATHSIG``), so no rank outlives its server.

The rank's environment follows the reference (sendnn-inference 2.6.3,
``model_executor/model_loader/spyre_setup.py`` ``spyre_dist_setup``): ``RANK`` and
``WORLD_SIZE`` (and ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``: every rank runs on this host).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from scheduler import SchedulerConfig
from spyre_server.config import Config
from spyre_server.model.build import build_runner
from spyre_server.model.cpu.kernels.library import NativeKernelError, NativeKernelSettings
from spyre_server.model.loading import (
    check_serving_config,
    fp8_scale_dtype_for,
    fused_weights_for,
    load_model,
)
from spyre_server.model.parallel.group import init_rank_group
from spyre_server.model.parallel.shard import shard_, shard_head_
from spyre_server.model.parallel.shared_sum import SharedSum, SharedSumBuffers
from spyre_server.model.runner import LocalModelRunner, ProgramStats

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True, slots=True)
class RankSetup:
    """What a rank needs to start."""

    rank: int
    size: int
    rendezvous: str
    """The file through which the ranks form their process group."""
    config: Config
    path: Path
    dtype: torch.dtype
    sched: SchedulerConfig
    """The engine's scheduler settings: the KV cache holds ``sched.num_blocks`` blocks."""
    num_threads: int
    shared_sum: SharedSumBuffers | None
    """The cpu backend's shared-memory buffers for the sums across ranks."""
    cpus: tuple[int, ...] | None
    """The CPUs the rank is pinned to (None: not pinned)."""
    engine_pid: int
    """The engine's process: the rank ends with it."""


@dataclass(frozen=True, slots=True)
class Ready:
    kv_cache_bytes: int
    """This rank's KV cache."""
    program_stats: ProgramStats | None


@dataclass(frozen=True, slots=True)
class Done:
    num_rows: int | None
    """The rows of logits the rank wrote to the shared buffer (None: the step samples nothing,
    or the rank writes none)."""
    program_stats: ProgramStats | None = None
    """Rank 0, on a backend with compiled programs: their counts after the step."""


@dataclass(frozen=True, slots=True)
class Failed:
    error: str


def run_rank(setup: RankSetup, conn: Connection, logits: torch.Tensor) -> None:
    """The rank process's entry point. ``logits``: the shared buffer for each step's logits
    (float32, ``[rows, vocab]``)."""
    _end_with(setup.engine_pid)
    # The engine stops its ranks (through the pipe, or by killing them when one fails): a
    # Ctrl-C or SIGTERM sent to the whole process group is the engine's to handle (drain, exit).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=setup.config.server.log_level.upper(),
        format=f"%(asctime)s %(levelname)s rank {setup.rank} %(name)s: %(message)s",
    )
    os.environ.update(
        RANK=str(setup.rank),
        WORLD_SIZE=str(setup.size),
        LOCAL_RANK=str(setup.rank),
        LOCAL_WORLD_SIZE=str(setup.size),
    )
    if setup.cpus is not None:
        os.sched_setaffinity(0, setup.cpus)
    torch.set_num_threads(setup.num_threads)
    try:
        runner, vocabulary = _start(setup)
    except BaseException as exc:
        logger.exception("rank %d failed to start", setup.rank)
        conn.send(Failed(f"{type(exc).__name__}: {exc}"))
        sys.exit(1)
    kv_bytes = sum(k.numel() * k.element_size() * 2 for k, _ in runner.kv_caches)
    conn.send(Ready(kv_bytes, runner.program_stats()))
    try:
        _serve(runner, conn, logits, vocabulary)
    except BaseException as exc:
        logger.exception("rank %d failed", setup.rank)
        with contextlib.suppress(OSError):  # the engine may be gone
            conn.send(Failed(f"{type(exc).__name__}: {exc}"))
        sys.exit(1)


def _start(setup: RankSetup) -> tuple[LocalModelRunner, slice | None]:
    """The rank's runner, warmed up, and the columns of the logits it writes (None: none)."""
    group = init_rank_group(setup.rank, setup.size, setup.rendezvous)
    config = setup.config
    if setup.shared_sum is not None:
        shared = _shared_sum(setup.shared_sum, setup.rank, config)
        if group.use_shared_memory(shared):
            if setup.rank == 0:
                logger.info("tensor parallel: sums across ranks through shared memory")
        else:
            logger.warning(
                "rank %d: sums across ranks over gloo (the native kernels cannot run on every "
                "rank)",
                setup.rank,
            )
    loaded = load_model(
        setup.path,
        setup.dtype,
        fused_weights=fused_weights_for(config),
        fp8_scale_dtype=fp8_scale_dtype_for(config),
    )
    check_serving_config(config, loaded)
    shard_(loaded.model, setup.rank, setup.size)
    if config.model.backend == "cpu":
        vocabulary: slice | None = shard_head_(loaded.model, setup.rank, setup.size)
    else:  # the card's programs compute every logit on every rank
        vocabulary = slice(None) if setup.rank == 0 else None
    runner = build_runner(config, loaded, setup.sched, group=group)
    runner.warm_up()
    return runner, vocabulary


def _shared_sum(buffers: SharedSumBuffers, rank: int, config: Config) -> SharedSum | None:
    """The shared-memory sum, where the native kernels (its signals) load here."""
    try:
        kernels = NativeKernelSettings(
            config.model.kernel_dir, config.model.native_avx512, config.model.native_amx
        ).load()
    except NativeKernelError as exc:
        logger.warning("rank %d: no shared-memory sum: %s", rank, exc)
        return None
    return SharedSum(buffers, rank, kernels)


def _serve(
    runner: LocalModelRunner, conn: Connection, logits: torch.Tensor, vocabulary: slice | None
) -> None:
    while (step := conn.recv()) is not None:
        rows = runner.step_logits(step)
        if vocabulary is None or rows is None:
            conn.send(Done(None))
            continue
        logits[: rows.shape[0], vocabulary].copy_(rows)
        conn.send(Done(rows.shape[0], runner.program_stats()))


def _end_with(engine_pid: int) -> None:
    """Have the kernel end this process when its parent, the engine, ends (Linux)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        logger.warning("cannot ask the kernel to end this rank with its server")
    if os.getppid() != engine_pid:  # the engine ended before the request took effect
        os._exit(1)
