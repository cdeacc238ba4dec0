"""Which block-pool events leave the replica, turned into wire events (runs on the engine thread).

Rules (DESIGN §4): only full blocks are ever stored, so every ``BlockStored`` is a full block.
Blocks with a ``cache_salt`` (a request's salt or a per-API-key HMAC) are never published: they
hold a tenant's tokens, and a router would credit them to unsalted requests. A ``BlockRemoved``
goes out only for a block that was published. The first block of a chain has no parent on the
wire (``null``), as in vLLM. If the publisher's queue is full an event is dropped; the replica's
published state is then unknown to routers, so the next event that fits is preceded by
``AllBlocksCleared``: routers forget blocks that may still be cached (a lost hit, never a wrong
route to a replica that no longer holds a block).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvcache import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KVCacheEvent
from spyre_server.kv_events import wire

logger = logging.getLogger(__name__)


class EventCollector:
    """A ``BlockPool`` subscriber. ``offer(event)`` must not block; it returns False when the
    event could not be queued. O(1) per event."""

    def __init__(self, root_hash: BlockHash, offer: Callable[[wire.WireEvent], bool]) -> None:
        self._root_hash = root_hash
        self._offer = offer
        self._published: set[BlockHash] = set()
        self._lost = False
        self.num_dropped = 0
        """Events that could not be queued (the publisher fell behind)."""

    def __call__(self, event: KVCacheEvent) -> None:
        if isinstance(event, BlockStored):
            if event.extra_keys.cache_salt is not None:
                return
            parent = None if event.parent_block_hash == self._root_hash else event.parent_block_hash
            stored = wire.block_stored(event.block_hash, parent, event.token_ids, event.block_size)
            if self._send(stored):
                self._published.add(event.block_hash)
        elif isinstance(event, BlockRemoved):
            if event.block_hash in self._published:
                self._published.discard(event.block_hash)
                self._send(wire.block_removed(event.block_hash))
        elif isinstance(event, AllBlocksCleared):
            self._published.clear()
            self._lost = False  # this clear supersedes the one owed
            self._send(wire.all_blocks_cleared())

    def _send(self, event: wire.WireEvent) -> bool:
        if self._lost:
            if not self._offer(wire.all_blocks_cleared()):
                self.num_dropped += 1
                return False
            self._lost = False
        if self._offer(event):
            return True
        if self.num_dropped == 0:
            logger.warning("KV event queue full: dropping events; routers will be told to clear")
        self.num_dropped += 1
        self._lost = True
        self._published.clear()
        return False
