"""Events the pool reports to subscribers (the basis for a cache-aware router).

Events carry hashes, token ids and extra keys; never a secret (salts are HMACs, see DESIGN §4).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvcache.hashing import BlockHash, ExtraKeys


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hash: BlockHash
    parent_block_hash: BlockHash
    token_ids: tuple[int, ...]
    block_size: int
    extra_keys: ExtraKeys


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hash: BlockHash


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
EventSubscriber = Callable[[KVCacheEvent], None]
