from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvcache import BlockHashChain
from scheduler.grid import ChunkGrid, cdiv


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


class RequestStatus(enum.IntEnum):
    WAITING = 0
    PREFILLING = 1
    DECODING = 2
    # Every status from here on is final.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @staticmethod
    def finished(reason: FinishReason) -> RequestStatus:
        return _FINISHED_STATUS[reason]


_FINISHED_STATUS = {
    FinishReason.STOP: RequestStatus.FINISHED_STOPPED,
    FinishReason.LENGTH: RequestStatus.FINISHED_LENGTH,
    FinishReason.ABORT: RequestStatus.FINISHED_ABORTED,
    FinishReason.ERROR: RequestStatus.FINISHED_ERROR,
}


@dataclass(slots=True, eq=False)
class Request:
    """One request's scheduling state. Only the scheduler writes it."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    """0: the prompt is only prefilled (scored); the request ends with its last chunk."""
    chain: BlockHashChain
    stop_token_ids: frozenset[int] = frozenset()
    eos_token_id: int | None = None
    needs_prompt_logits: bool = False
    """Logits at prompt positions are wanted (echo + logprobs): no prefix lookup."""

    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    """With finish reason STOP: the stop token id or stop string (``None``: EOS, grammar)."""
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    """Leading tokens whose KV is in the blocks of ``block_table``."""
    block_table: list[int] = field(default_factory=list)
    num_hit_blocks: int = 0
    """Leading blocks of ``block_table`` shared from the cache at admission (KV already there)."""
    num_prefill_tokens: int = 0
    """Tokens the current prefill covers: the prompt, plus earlier outputs after a preemption."""
    num_registered_blocks: int = 0
    """Leading blocks already offered to the cache (registered, or found to be duplicates)."""
    announced_blocks: range = range(0)
    """Blocks of the chain announced to the pool's subscribers (the request's prefill will
    compute them); those from ``num_registered_blocks`` on are neither registered nor withdrawn
    yet (``pending_announced_blocks``)."""
    cached_tail_block_id: int | None = None
    """The cached block holding block ``num_registered_blocks - 1`` (in the request's table); the
    next registration chains onto it. ``None``: not cached (or none yet)."""
    num_cached_tokens: int | None = None
    """Prompt tokens whose compute was skipped, fixed at the first admission."""
    num_preemptions: int = 0

    all_token_ids: list[int] = field(init=False)
    """Prompt followed by outputs (kept, not rebuilt, so decode steps stay O(1))."""

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self.chain.update(self.all_token_ids)

    @property
    def pending_announced_blocks(self) -> range:
        """Announced blocks still to be registered or withdrawn."""
        announced = self.announced_blocks
        return range(max(announced.start, self.num_registered_blocks), announced.stop)

    @property
    def num_blocks_needed(self) -> int:
        """Blocks reserved at admission: room for the prompt plus max_tokens."""
        return cdiv(len(self.prompt_token_ids) + self.max_tokens, self.chain.block_size)

    def grid(self, chunk_size: int) -> ChunkGrid:
        return ChunkGrid(self.num_prefill_tokens, self.chain.block_size, chunk_size)

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        tokens = self.all_token_ids
        tokens.append(token_id)
        if len(tokens) % self.chain.block_size == 0:  # a block just filled: hash it
            self.chain.update(tokens)
