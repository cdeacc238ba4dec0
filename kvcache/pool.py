"""The KV block pool: allocation, sharing, hash-chained prefix cache, LRU eviction.

Block 0 is reserved (padding / write sink): never allocated, never cached. Every other block is
either free (ref count 0, in the free queue, possibly still cached) or in use (ref count > 0, not
queued). A cached block keeps its hash while free and loses it only when an allocation takes it
(lazy eviction) or on ``reset()``. Every operation is O(1) per block touched.

Subscribers hear ``BlockStored`` when a block is registered, or earlier, when the scheduler
``announce``s the blocks a scheduled prefill will write (then registering publishes nothing
more, and ``withdraw`` publishes ``BlockRemoved`` for what is abandoned); ``BlockRemoved`` on
eviction; ``AllBlocksCleared`` on ``reset()``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

from kvcache.block import BlockIdentity, KVBlock
from kvcache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventSubscriber,
    KVCacheEvent,
)
from kvcache.free_queue import FreeBlockQueue
from kvcache.hashing import BlockHash, BlockHashChain, decode_token_ids
from kvcache.stats import PrefixCacheStats

PAD_BLOCK_ID = 0


class IntegrityError(AssertionError):
    """An invariant of the pool does not hold: a bug, never a user error."""


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, *, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free = FreeBlockQueue(self._blocks[1:])
        self._cached: dict[BlockHash, KVBlock] = {}
        self._announced: Counter[BlockHash] = Counter()
        self._subscribers: list[EventSubscriber] = []
        self.stats = PrefixCacheStats()

    # ----------------------------------------------------------------- queries
    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (free cached blocks included)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        """Blocks in use / usable blocks, in 0..1."""
        return (self.num_usable_blocks - len(self._free)) / self.num_usable_blocks

    def ref_count(self, block_id: int) -> int:
        return self._blocks[block_id].ref_count

    def block_hash(self, block_id: int) -> BlockHash | None:
        return self._blocks[block_id].block_hash

    def free_block_ids(self) -> list[int]:
        """The free queue, front (evicted first) to back. O(n): for tests and diagnostics."""
        return [block.block_id for block in self._free]

    def num_free_among(self, block_ids: Iterable[int]) -> int:
        """How many of these blocks sit in the free queue (sharing them takes them out)."""
        return sum(1 for block_id in block_ids if self._user_block(block_id).ref_count == 0)

    # -------------------------------------------------------------- allocation
    def allocate(self, num_blocks: int) -> list[int] | None:
        """Take ``num_blocks`` from the front of the free queue, or ``None`` (and change nothing).

        A taken block that is still cached loses its hash here (lazy eviction).
        """
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > len(self._free):
            return None
        blocks = self._free.popleft_many(num_blocks)
        evicted: list[BlockHash] = []
        for block in blocks:
            block.ref_count = 1
            if block.block_hash is not None:
                evicted.append(block.block_hash)
                del self._cached[block.block_hash]
                block.drop_hash()
        if evicted and self._subscribers:
            for block_hash in evicted:
                self._emit(BlockRemoved(block_hash))
        return [block.block_id for block in blocks]

    def share(self, block_ids: Sequence[int]) -> None:
        """Add one holder to each block (a cache hit); a free block leaves the queue, hash kept."""
        blocks = [self._user_block(block_id) for block_id in block_ids]
        for block in blocks:
            if block.ref_count == 0:
                self._free.remove(block)
            block.ref_count += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one holder from each block of a block table (given in table order).

        Released tail first, so a chain's end is evicted before its root; a block without a hash
        goes to the front of the queue since nobody can hit it. All or nothing: a bad id or a
        block without holders raises before anything changes.
        """
        blocks = [self._user_block(block_id) for block_id in reversed(block_ids)]
        if any(block.ref_count <= 0 for block in blocks) or len(set(block_ids)) != len(blocks):
            counts = Counter(block_ids)
            bad = next(b for b in blocks if b.ref_count < counts[b.block_id])
            raise ValueError(f"block {bad.block_id} freed more often than it was taken")
        released = []
        for block in blocks:
            block.ref_count -= 1
            if block.ref_count == 0:
                released.append(block)
        self._free.push_released(released)

    # ------------------------------------------------------------ prefix cache
    def register(
        self, block_id: int, chain: BlockHashChain, index: int, parent_id: int | None
    ) -> int | None:
        """Offer block ``block_id`` (in use, all its KV written) to the cache as full block
        ``index`` of ``chain``, chained onto ``parent_id``: the cached block that holds block
        ``index - 1`` of the chain (``None`` for block 0), which the caller must hold.

        Returns the block that now holds this content in the cache: ``block_id`` itself, or an
        equal block registered earlier (the first one stays; ``block_id`` stays unhashed). Hold
        the returned block (e.g. swap it for ``block_id``) and chain the next block onto it. ``None`` when the content cannot be cached: caching
        is off, ``parent_id`` is not cached as the previous link, or a different block in use
        holds the same hash (a collision).
        """
        if not self.enable_caching:
            return None
        block = self._user_block(block_id)
        if block.ref_count <= 0:
            raise ValueError(f"block {block_id} is not in use and cannot be registered")
        block_hash = chain.hashes[index]
        parent_hash = chain.parent_of(index)
        parent: BlockIdentity | None = None
        if index > 0:
            if parent_id is None:
                raise ValueError(f"block index {index} > 0 needs its parent block id")
            parent_block = self._user_block(parent_id)
            if parent_block.ref_count <= 0:
                raise ValueError(
                    f"parent block {parent_id} is not held by anyone: hold the parent you chain "
                    "onto, or it may be recycled under you"
                )
            if parent_block.block_hash != parent_hash:
                return None
            parent = parent_block.identity
        if block.block_hash is not None:  # already cached: a shared hit
            return block_id if self._holds(block, chain, index, parent) else None
        existing = self._cached.get(block_hash)
        if existing is not None:
            if self._holds(existing, chain, index, parent):
                self._take_announcement(block_hash)
                return existing.block_id
            if existing.ref_count > 0:
                return None
            self._evict(existing)  # free and unreachable or colliding: the new block takes over
        block.block_hash = block_hash
        block.token_bytes = chain.token_bytes[index]
        block.extra = chain.extra
        block.parent = parent
        block.parent_hash = parent_hash
        self._cached[block_hash] = block
        if not self._take_announcement(block_hash) and self._subscribers:
            self._emit(self._stored_event(chain, index))
        return block_id

    def announce(self, chain: BlockHashChain, indices: range) -> None:
        """Publish ``BlockStored`` now for the full blocks ``indices`` of ``chain`` that a
        scheduled step commits to computing (as vLLM publishes at schedule time), so a router
        can send their prefix here while the KV is still being written. Lookups do not see
        them before ``register``: hits stay exact. Each announced index must later be
        registered (which then publishes nothing more) or withdrawn. No-op with caching off."""
        if not self.enable_caching:
            return
        for index in indices:
            self._announced[chain.hashes[index]] += 1
            if self._subscribers:
                self._emit(self._stored_event(chain, index))

    def withdraw(self, chain: BlockHashChain, indices: range) -> None:
        """Blocks ``indices`` of ``chain``, announced, will not be registered (an abort, a
        preemption, a broken chain): publish ``BlockRemoved`` for each whose content no other
        announcement or cached block holds. Indices not announced (any more) are ignored."""
        for index in indices:
            block_hash = chain.hashes[index]
            if not self._take_announcement(block_hash):
                continue
            held = block_hash in self._announced or block_hash in self._cached
            if not held and self._subscribers:
                self._emit(BlockRemoved(block_hash))

    @property
    def num_announced_blocks(self) -> int:
        """Announced blocks neither registered nor withdrawn yet."""
        return self._announced.total()

    def announced_hashes(self) -> Counter[BlockHash]:
        """The announced block hashes (with multiplicity) neither registered nor withdrawn yet:
        a registration of equal content by anyone takes one. For integrity checks."""
        return Counter(self._announced)

    def _take_announcement(self, block_hash: BlockHash) -> bool:
        """Consume one announcement of ``block_hash``; False if there was none."""
        count = self._announced.get(block_hash, 0)
        if count == 0:
            return False
        if count == 1:
            del self._announced[block_hash]
        else:
            self._announced[block_hash] = count - 1
        return True

    def _stored_event(self, chain: BlockHashChain, index: int) -> BlockStored:
        return BlockStored(
            block_hash=chain.hashes[index],
            parent_block_hash=chain.parent_of(index),
            token_ids=decode_token_ids(chain.token_bytes[index]),
            block_size=self.block_size,
            extra_keys=chain.extra,
        )

    def lookup(self, chain: BlockHashChain, max_blocks: int | None = None) -> list[int]:
        """Longest cached prefix of ``chain``: the block ids of its leading full blocks that hit.

        A hit is exact: same hash, same stored token ids and extra keys, and its recorded parent is
        the very block (id and generation) that hit just before it. Changes nothing.
        """
        if not self.enable_caching:
            return []
        limit = chain.num_blocks if max_blocks is None else min(max_blocks, chain.num_blocks)
        cached = self._cached
        holds = self._holds
        hits: list[int] = []
        parent = None
        for index in range(limit):
            block = cached.get(chain.hashes[index])
            if block is None or not holds(block, chain, index, parent):
                break
            hits.append(block.block_id)
            parent = block.identity
        return hits

    @staticmethod
    def _holds(
        block: KVBlock, chain: BlockHashChain, index: int, parent: BlockIdentity | None
    ) -> bool:
        """Whether cached ``block`` holds exactly block ``index`` of ``chain`` after ``parent``."""
        return (
            block.parent == parent
            and block.token_bytes == chain.token_bytes[index]
            and block.extra is not None
            and block.extra.encoded == chain.extra.encoded
        )

    def record_admission(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (never called for lookups that did not admit)."""
        if not 0 <= num_hit_tokens <= num_prompt_tokens:
            raise ValueError(
                f"hits {num_hit_tokens} not within 0..{num_prompt_tokens} prompt tokens"
            )
        self.stats.num_requests += 1
        self.stats.num_query_tokens += num_prompt_tokens
        self.stats.num_hit_tokens += num_hit_tokens

    def reset(self) -> int:
        """Make every cached block unfindable at once; returns how many were dropped.

        Blocks in use stay valid for their holders and return to the queue unhashed when freed.
        """
        dropped = len(self._cached)
        for block in self._cached.values():
            block.drop_hash()
        self._cached.clear()
        self._announced.clear()  # routers forget them too: a later register publishes again
        if self._subscribers:
            self._emit(AllBlocksCleared())
        return dropped

    # ------------------------------------------------------------------ events
    def subscribe(self, subscriber: EventSubscriber) -> None:
        self._subscribers.append(subscriber)

    def _emit(self, event: KVCacheEvent) -> None:
        for subscriber in self._subscribers:
            subscriber(event)

    def _evict(self, block: KVBlock) -> None:
        block_hash = block.block_hash
        assert block_hash is not None
        del self._cached[block_hash]
        block.drop_hash()
        if self._subscribers:
            self._emit(BlockRemoved(block_hash))

    def _user_block(self, block_id: int) -> KVBlock:
        if not 0 < block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} is not a user block (1..{self.num_blocks - 1})")
        return self._blocks[block_id]

    # --------------------------------------------------------------- integrity
    def check_integrity(self, holders: Mapping[str, Sequence[int]] | None = None) -> None:
        """Verify every invariant; raise IntegrityError naming the first one broken.

        ``holders`` (owner -> block table), when given, must account for every reference exactly.
        """
        pad = self._blocks[PAD_BLOCK_ID]
        if pad.ref_count or pad.block_hash is not None or FreeBlockQueue.contains(pad):
            raise IntegrityError(
                f"block 0 touched: ref_count={pad.ref_count}, hash={pad.block_hash!r}, "
                f"queued={FreeBlockQueue.contains(pad)}"
            )
        broken = self._free.broken_link()
        if broken is not None:
            raise IntegrityError(broken)
        queued: set[int] = set()
        for block in self._free:
            if block.block_id in queued:
                raise IntegrityError(f"block {block.block_id} appears twice in the free queue")
            queued.add(block.block_id)
        for block in self._blocks[1:]:
            if block.ref_count < 0:
                raise IntegrityError(f"block {block.block_id} has ref_count {block.ref_count}")
            in_queue = block.block_id in queued
            if in_queue != (block.ref_count == 0):
                raise IntegrityError(
                    f"block {block.block_id}: ref_count={block.ref_count} but in free queue={in_queue}"
                )
            if block.block_hash is not None and self._cached.get(block.block_hash) is not block:
                raise IntegrityError(
                    f"block {block.block_id} has a hash that the hash map does not map to it"
                )
        for block_hash, block in self._cached.items():
            if block.block_hash != block_hash or block.block_id == PAD_BLOCK_ID:
                raise IntegrityError(f"hash map entry for block {block.block_id} is stale")
            if block.token_bytes is None or len(block.token_bytes) != 4 * self.block_size:
                raise IntegrityError(f"cached block {block.block_id} does not hold a full block")
        if holders is not None:
            counts = Counter(block_id for table in holders.values() for block_id in table)
            for block in self._blocks:
                if counts.get(block.block_id, 0) != block.ref_count:
                    owners = sorted(o for o, t in holders.items() if block.block_id in t)
                    raise IntegrityError(
                        f"block {block.block_id}: ref_count={block.ref_count} but held "
                        f"{counts.get(block.block_id, 0)} times (by {owners})"
                    )
