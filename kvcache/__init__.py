"""Hash-chained KV block pool with exact prefix matching (DESIGN.md §4). Pure Python + xxhash."""

from kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvcache.hashing import (
    NO_EXTRA_KEYS,
    BlockHash,
    BlockHashChain,
    ExtraKeys,
    hash_block,
    root_hash,
)
from kvcache.pool import PAD_BLOCK_ID, BlockPool, IntegrityError
from kvcache.stats import PrefixCacheStats

__all__ = [
    "NO_EXTRA_KEYS",
    "PAD_BLOCK_ID",
    "AllBlocksCleared",
    "BlockHash",
    "BlockHashChain",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "ExtraKeys",
    "IntegrityError",
    "KVCacheEvent",
    "PrefixCacheStats",
    "hash_block",
    "root_hash",
]
