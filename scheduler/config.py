from __future__ import annotations

import enum
from dataclasses import dataclass


class PrefillCompute(enum.StrEnum):
    """What the model runner computes of a scheduled prefill chunk, as the runner declares it.
    The step plan is the same either way; only the cached-token accounting follows it."""

    NEW_POSITIONS = "new_positions"
    """Only the positions whose KV must be written, plus the one whose logits are needed
    (the ``cpu`` backend): every position of a shared hit block is skipped but the logits one."""
    WHOLE_WINDOWS = "whole_windows"
    """Every position of each scheduled chunk window (the ``spyre`` backend, as on the card):
    only the chunks the scheduler skips on the grid are saved."""


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Scheduling limits. All lengths are in tokens; validated on construction."""

    block_size: int = 64
    """Tokens per KV block. Spyre requires 64."""
    chunk_size: int = 256
    """Token positions per prefill chunk; a multiple of block_size (Spyre commonly uses 512)."""
    max_num_seqs: int = 8
    """Most requests running at once (prefilling + decoding): the decode batch size."""
    max_model_len: int = 2048
    """Most tokens a request may hold: prompt + max_tokens."""
    num_blocks: int = 256
    """KV blocks in the pool, block 0 (padding / write sink) included."""
    max_batch_tkv_limit: int | None = None
    """Volumetric limit: batch_size * padded tkv (every row left-padded to the widest block
    table) must stay within it at every decode step. ``None`` means max_model_len, in whole
    blocks, * max_num_seqs: every batch of max_model_len requests fits."""
    interleave: bool = True
    """While any request decodes, alternate prefill and decode steps."""
    enable_prefix_caching: bool = True
    """Share and skip cached prompt blocks."""
    cache_decode_blocks: bool = True
    """Also cache blocks whose KV was (partly) written by decode steps."""
    prefill_compute: PrefillCompute = PrefillCompute.WHOLE_WINDOWS
    """What the runner computes of a prefill chunk; ``cached_tokens`` counts what it skips."""

    def __post_init__(self) -> None:
        for name in ("block_size", "chunk_size", "max_num_seqs", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(
                    f"scheduler config: {name} must be a positive integer, got {value!r}"
                )
        if self.chunk_size % self.block_size:
            raise ValueError(
                f"scheduler config: chunk_size ({self.chunk_size}) must be a multiple of "
                f"block_size ({self.block_size})"
            )
        if self.num_blocks < 2:
            raise ValueError(
                f"scheduler config: num_blocks must be >= 2 (block 0 is reserved), got {self.num_blocks}"
            )
        if self.max_batch_tkv_limit is not None and self.max_batch_tkv_limit <= 0:
            raise ValueError(
                "scheduler config: max_batch_tkv_limit must be positive or unset, "
                f"got {self.max_batch_tkv_limit}"
            )

    @property
    def batch_tkv_limit(self) -> int:
        if self.max_batch_tkv_limit is None:
            blocks = -(-self.max_model_len // self.block_size)
            return blocks * self.block_size * self.max_num_seqs
        return self.max_batch_tkv_limit
