"""Per-block metadata kept by the pool. Internal: only block ids cross the pool's boundary."""

from __future__ import annotations

from dataclasses import dataclass

from kvcache.hashing import BlockHash, ExtraKeys

BlockIdentity = tuple[int, int]
"""(block id, reuse generation): names one life of a block; a recycled id gets a new generation."""


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_count: int = 0
    generation: int = 0
    # Set while the block is registered as cached (all None otherwise).
    block_hash: BlockHash | None = None
    token_bytes: bytes | None = None
    extra: ExtraKeys | None = None
    parent: BlockIdentity | None = None
    parent_hash: BlockHash | None = None
    # Intrusive links of the free queue (both None when not queued).
    prev_free: KVBlock | None = None
    next_free: KVBlock | None = None

    @property
    def identity(self) -> BlockIdentity:
        return (self.block_id, self.generation)

    def drop_hash(self) -> None:
        """Forget the cached content; the next life of this id gets a new generation."""
        self.block_hash = None
        self.token_bytes = None
        self.extra = None
        self.parent = None
        self.parent_hash = None
        self.generation += 1
