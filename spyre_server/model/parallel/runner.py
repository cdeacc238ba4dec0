"""The engine's side of tensor parallelism: one runner that starts the ranks (``worker.py``),
sends each step to every one of them and returns rank 0's logits, which the engine samples as
it samples a local runner's. The scheduler stays the one owner of what is computed: the ranks
run the steps it plans, under the block ids it chose.

A rank that dies, or fails a step, leaves the others waiting in a collective: the runner then
stops every rank and raises ``FatalRunnerError``, which ends the engine (the server answers 503
on ``/health``, ends every request with an error and exits non-zero). Ranks also end with the
engine's process, however it ends (``worker.py``).

The logits come back through a shared-memory buffer (``[rows, vocab]`` float32 with rows
enough for a decode batch or, where the backend returns prompt logits, a chunk), so a step
moves no logits through a pipe: on the cpu backend each rank writes the columns of its part of
the LM head, on the spyre backend rank 0 writes them all.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing.connection
import os
import tempfile
from collections.abc import Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import ClassVar, NoReturn, TypeVar

import torch
import torch.multiprocessing

from scheduler import DecodeBatch, PrefillChunk, PrefillCompute, SchedulerConfig
from spyre_server.config import Config
from spyre_server.model.cpu.runner import CpuModelRunner
from spyre_server.model.errors import ModelLoadError
from spyre_server.model.loading import LoadedModel
from spyre_server.model.parallel.placement import RankPlacement, placements
from spyre_server.model.parallel.shard import tensor_parallel_reason
from spyre_server.model.parallel.shared_sum import SharedSumBuffers
from spyre_server.model.parallel.worker import Done, Failed, RankSetup, Ready, run_rank
from spyre_server.model.runner import FatalRunnerError, ModelRunner, ProgramStats
from spyre_server.model.spyre.runner import SpyreModelRunner

logger = logging.getLogger(__name__)

Reply = TypeVar("Reply", Ready, Done)

STOP_SECONDS = 10.0
"""How long a rank may take to stop when asked before it is killed."""


class TensorParallelRunner(ModelRunner):
    """The ranks of one model as a runner (``start_ranks`` picks the backend's subclass)."""

    sums_in_shared_memory: ClassVar[bool]
    """Whether the ranks add their partial results through shared memory (the cpu backend's
    ``RankGroup.sum_``), else in the compiled graphs' all-reduce (spyre)."""

    def __init__(
        self,
        config: Config,
        path: Path,
        dtype: torch.dtype,
        sched: SchedulerConfig,
        *,
        logits_width: int,
        hidden_dim: int,
        placements: Sequence[RankPlacement],
    ) -> None:
        size = len(placements)
        rows = max(sched.max_num_seqs, sched.chunk_size if self.supports_prompt_logits else 1)
        # The cpu backend's sums through shared memory: a step's rows of hidden_dim values.
        sum_numel = max(sched.chunk_size, sched.max_num_seqs) * hidden_dim
        itemsize = torch.empty((), dtype=dtype).element_size()
        check_shared_memory(
            rows * logits_width * 4
            + (2 * size * sum_numel * itemsize if self.sums_in_shared_memory else 0)
        )
        shared_sum = (
            SharedSumBuffers.allocate(size, sum_numel, dtype)
            if self.sums_in_shared_memory
            else None
        )
        self._logits = torch.empty(rows, logits_width, dtype=torch.float32).share_memory_()
        self._program_stats: ProgramStats | None = None
        self._closed = False
        self._dir = tempfile.TemporaryDirectory(prefix="spyre-server-ranks-")
        context = torch.multiprocessing.get_context("spawn")
        self._conns: list[Connection] = []
        self._processes: list[BaseProcess] = []
        atexit.register(self.close)
        for rank, placement in enumerate(placements):
            setup = RankSetup(
                rank=rank,
                size=size,
                rendezvous=os.path.join(self._dir.name, "rendezvous"),
                config=config,
                path=path,
                dtype=dtype,
                sched=sched,
                num_threads=placement.num_threads,
                shared_sum=shared_sum,
                cpus=placement.cpus,
                engine_pid=os.getpid(),
            )
            ours, theirs = context.Pipe()
            process = context.Process(
                target=run_rank,
                args=(setup, theirs, self._logits),
                name=f"spyre-server-rank-{rank}",
            )
            process.start()
            theirs.close()
            self._conns.append(ours)
            self._processes.append(process)
        try:
            replies = self._replies(Ready)
        except FatalRunnerError as exc:
            raise ModelLoadError(f"tensor parallelism: {exc}") from None
        self._program_stats = replies[0].program_stats
        logger.info(
            "tensor parallel: %d ranks (pids %s), KV cache per rank %.1f MiB",
            size,
            ", ".join(str(p.pid) for p in self._processes),
            replies[0].kv_cache_bytes / 2**20,
        )

    @property
    def size(self) -> int:
        return len(self._processes)

    def program_stats(self) -> ProgramStats | None:
        return self._program_stats

    def _prefill(self, step: PrefillChunk) -> torch.Tensor | None:
        return self._run(step)

    def _decode(self, step: DecodeBatch) -> torch.Tensor | None:
        return self._run(step)

    def _prompt_logits(self, step: PrefillChunk) -> torch.Tensor | None:
        return self._run(step)

    def _run(self, step: PrefillChunk | DecodeBatch) -> torch.Tensor | None:
        """Send ``step`` to every rank and wait for all; the logits they wrote (a copy)."""
        if self._closed:
            raise FatalRunnerError("the tensor-parallel ranks are stopped")
        for rank, conn in enumerate(self._conns):
            try:
                conn.send(step)
            except OSError as exc:
                self._fail(f"rank {rank} is unreachable ({exc})")
        done = self._replies(Done)[0]
        if done.program_stats is not None:
            self._program_stats = done.program_stats
        if done.num_rows is None:
            return None
        return self._logits[: done.num_rows].clone()

    def _replies(self, kind: type[Reply]) -> list[Reply]:
        """One ``kind`` message from every rank, in rank order; a rank that ends or fails
        first stops them all (FatalRunnerError)."""
        replies: dict[int, Reply] = {}
        by_sentinel = {p.sentinel: rank for rank, p in enumerate(self._processes)}
        while len(replies) < self.size:
            waiting = [c for rank, c in enumerate(self._conns) if rank not in replies]
            ready = multiprocessing.connection.wait([*waiting, *by_sentinel])
            for item in ready:  # replies before deaths: a rank may reply, then end
                if not isinstance(item, Connection):
                    continue
                rank = self._conns.index(item)
                try:
                    message = item.recv()
                except (EOFError, OSError):
                    self._fail(self._ended(rank))
                if isinstance(message, Failed):
                    self._fail(f"rank {rank} failed: {message.error}")
                if not isinstance(message, kind):
                    self._fail(f"rank {rank} sent {type(message).__name__}, not {kind.__name__}")
                replies[rank] = message
            for item in ready:
                if isinstance(item, int) and by_sentinel[item] not in replies:
                    self._fail(self._ended(by_sentinel[item]))
        return [replies[rank] for rank in range(self.size)]

    def _ended(self, rank: int) -> str:
        process = self._processes[rank]
        process.join(timeout=1.0)
        return f"rank {rank} (pid {process.pid}) ended with exit code {process.exitcode}"

    def _fail(self, message: str) -> NoReturn:
        logger.error("tensor parallel: %s; stopping every rank", message)
        self.close(kill=True)
        raise FatalRunnerError(message)

    def close(self, *, kill: bool = False) -> None:
        """Stop every rank and wait for them: asked to stop, killed after ``STOP_SECONDS``
        (``kill``: at once, for ranks that may wait in a collective for a dead one)."""
        if self._closed:
            return
        self._closed = True
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for process in self._processes:
            if kill:
                process.kill()
            process.join(timeout=STOP_SECONDS)
            if process.is_alive():
                process.kill()
                process.join()
        for conn in self._conns:
            conn.close()
        self._dir.cleanup()
        atexit.unregister(self.close)


class CpuTensorParallelRunner(TensorParallelRunner):
    sums_in_shared_memory = True
    prefill_compute: PrefillCompute = CpuModelRunner.prefill_compute
    supports_prompt_logits = CpuModelRunner.supports_prompt_logits
    supports_inference_mode = CpuModelRunner.supports_inference_mode


class SpyreTensorParallelRunner(TensorParallelRunner):
    sums_in_shared_memory = False
    prefill_compute: PrefillCompute = SpyreModelRunner.prefill_compute
    supports_prompt_logits = SpyreModelRunner.supports_prompt_logits
    supports_inference_mode = SpyreModelRunner.supports_inference_mode


SHARED_MEMORY = Path("/dev/shm")


def check_shared_memory(needed: int, directory: Path = SHARED_MEMORY) -> None:
    """ModelLoadError unless ``directory`` (where torch's shared tensors live) has ``needed``
    bytes free: a shared tensor beyond it would crash the server with SIGBUS when touched."""
    try:
        stat = os.statvfs(directory)
    except OSError:
        return  # no /dev/shm to measure: torch finds its own way, or says why
    free = stat.f_bavail * stat.f_frsize
    if free < needed:
        raise ModelLoadError(
            f"tensor parallelism needs {needed / 2**20:.0f} MiB of shared memory for the logits "
            f"and the sums across ranks; {directory} has {free / 2**20:.0f} MiB free. Give the "
            "container more (docker run --shm-size 1g; in Kubernetes an emptyDir with medium "
            "Memory at /dev/shm)"
        )


def start_ranks(
    config: Config, loaded: LoadedModel, sched: SchedulerConfig
) -> TensorParallelRunner:
    """Start ``model.tensor_parallel_size`` ranks of ``loaded`` (the engine process's copy:
    its modules, no weights needed), each with its shard and a KV cache of ``sched.num_blocks``
    blocks of its heads, placed as ``placement.placements`` says; returns once every rank is
    warmed up. ModelLoadError when the model cannot be split or a rank fails to start."""
    size = config.model.tensor_parallel_size
    if (reason := tensor_parallel_reason(loaded.model, size)) is not None:
        raise ModelLoadError(f"model.tensor_parallel_size {size}: {reason}")
    runner_class = (
        CpuTensorParallelRunner if config.model.backend == "cpu" else SpyreTensorParallelRunner
    )
    head = getattr(loaded.model, "head", None)
    embedding = next(m for m in loaded.model.modules() if isinstance(m, torch.nn.Embedding))
    return runner_class(
        config,
        loaded.path,
        loaded.dtype,
        sched,
        logits_width=getattr(head, "out_features", loaded.vocab_size),
        hidden_dim=embedding.embedding_dim,
        placements=placements(config),
    )
