"""Spyre chunked-prefill scheduler that owns num_computed_tokens and skips cached chunks.

Pure Python; depends only on ``kvcache``.
"""

from scheduler.config import PrefillCompute, SchedulerConfig
from scheduler.grid import ChunkGrid
from scheduler.outputs import (
    DecodeBatch,
    DecodeEntry,
    ModelRunnerOutput,
    PrefillChunk,
    RequestOutput,
    ScheduledStep,
    SchedulerStats,
)
from scheduler.request import FinishReason, Request, RequestStatus
from scheduler.scheduler import Scheduler

__all__ = [
    "ChunkGrid",
    "DecodeBatch",
    "DecodeEntry",
    "FinishReason",
    "ModelRunnerOutput",
    "PrefillChunk",
    "PrefillCompute",
    "Request",
    "RequestOutput",
    "RequestStatus",
    "ScheduledStep",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
]
