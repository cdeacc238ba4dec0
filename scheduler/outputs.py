"""What crosses the scheduler's boundary: the step plan for the runner, and what comes back.

A step is EITHER one ``PrefillChunk`` of one request OR one ``DecodeBatch`` (DESIGN §3).
Block tables and slots are plain ints; slot = block_id * block_size + offset, and every slot in
block 0 (slot < block_size) is the write sink whose content is never read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from scheduler.request import FinishReason


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    request_id: str
    chunk_index: int
    num_chunks: int
    num_left_pad_tokens: int
    """Whole blocks of padding before the prompt on the chunk grid (not only in this chunk)."""
    window_offset: int
    """Index in the chunk's C-position window of the first real token (left padding before it);
    window positions after the last real token are right padding. Padding writes to block 0."""
    token_ids: tuple[int, ...]
    """The real tokens of the chunk, in order."""
    positions: tuple[int, ...]
    """Their positions (RoPE): token t has position t, never shifted by padding."""
    slot_mapping: tuple[int, ...]
    """Where each real token's KV goes; a slot in block 0 means 'do not store' (already cached)."""
    block_table: tuple[int, ...]
    """The request's blocks, covering at least every position up to the end of the chunk."""
    is_last_chunk: bool
    """The chunk that ends the prompt: it must produce logits and sample one token."""
    tkv: int
    """Context length this step attends over on the padded grid: (chunk_index + 1) * chunk_size."""
    needs_prompt_logits: bool = False
    """The runner must return logits at every position of the chunk (echo with logprobs)."""

    @property
    def num_context_tokens(self) -> int:
        """Real tokens in the context once this chunk is done (= last position + 1)."""
        return self.positions[-1] + 1


@dataclass(slots=True)  # not frozen: built for every request at every decode step
class DecodeEntry:
    request_id: str
    token_id: int
    """The latest token; its KV is written by this step."""
    position: int
    slot: int
    block_table: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class DecodeBatch:
    entries: tuple[DecodeEntry, ...]
    tkv: int
    """Longest context in the batch (position + 1); shorter rows are padded on the left."""


ScheduledStep = PrefillChunk | DecodeBatch


@dataclass(frozen=True, slots=True)
class ModelRunnerOutput:
    """What the engine reports after a step ran: one sampled token per request that had to
    produce one (the last prefill chunk, every decode entry), and what that token completed in
    the request's text. The scheduler decides from it whether and why each request finishes."""

    sampled_token_ids: Mapping[str, int]
    stop_strings: Mapping[str, str] = field(default_factory=dict)
    """Requests whose output text now contains one of their stop strings: the one found."""
    completed_grammars: frozenset[str] = frozenset()
    """Requests whose structured-output grammar the sampled token completed (or left)."""


@dataclass(slots=True)  # not frozen: built for every request at every decode step
class RequestOutput:
    request_id: str
    new_token_ids: tuple[int, ...]
    finish_reason: FinishReason | None
    num_cached_tokens: int
    """Prompt tokens whose compute was skipped thanks to the prefix cache."""
    stop_reason: int | str | None = None
    """With finish reason STOP: the stop token id or the stop string; ``None`` for EOS and a
    completed grammar."""


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """Gauges now and counters since start (counters only grow)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_prefill_chunks_computed: int
    num_prefill_chunks_skipped: int
    num_decode_steps: int
    num_preemptions: int
