"""LRU queue of free blocks: an intrusive doubly linked list, O(1) for every operation.

The front is evicted first. Blocks link through their own ``prev_free``/``next_free`` fields, so
removing a block from the middle (a cache hit on a free block) needs no search.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from kvcache.block import KVBlock


class FreeBlockQueue:
    __slots__ = ("_head", "_len", "_tail")

    def __init__(self, blocks: Iterable[KVBlock] = ()) -> None:
        self._head = KVBlock(-1)  # sentinels; never handed out
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    @staticmethod
    def contains(block: KVBlock) -> bool:
        return block.prev_free is not None

    def append(self, block: KVBlock) -> None:
        """Queue at the back (evicted last)."""
        self._link(block, self._tail.prev_free, self._tail)

    def appendleft(self, block: KVBlock) -> None:
        """Queue at the front (evicted first)."""
        self._link(block, self._head, self._head.next_free)

    def popleft(self) -> KVBlock | None:
        first = self._head.next_free
        if first is self._tail or first is None:
            return None
        self.remove(first)
        return first

    def popleft_many(self, count: int) -> list[KVBlock]:
        """Unlink the first ``count`` blocks (the caller checked there are that many)."""
        if not 0 <= count <= self._len:
            raise ValueError(f"cannot take {count} blocks from a queue of {self._len}")
        taken = []
        node = self._head.next_free
        for _ in range(count):
            assert node is not None
            taken.append(node)
            nxt = node.next_free
            node.prev_free = node.next_free = None
            node = nxt
        assert node is not None
        self._head.next_free = node
        node.prev_free = self._head
        self._len -= count
        return taken

    def push_released(self, blocks: Iterable[KVBlock]) -> None:
        """Queue blocks in the given order: cached ones (with a hash) at the back, so they are
        evicted last; the others at the front, since nobody can hit them."""
        blocks = list(blocks)
        queued = next((b for b in blocks if b.prev_free is not None), None)
        if queued is not None or len({id(b) for b in blocks}) != len(blocks):
            bad = queued or blocks[0]
            raise ValueError(f"block {bad.block_id} is already in the free queue")
        head, tail = self._head, self._tail
        count = 0
        for block in blocks:
            prev: KVBlock | None
            nxt: KVBlock | None
            if block.block_hash is None:
                prev, nxt = head, head.next_free
            else:
                prev, nxt = tail.prev_free, tail
            assert prev is not None and nxt is not None
            block.prev_free = prev
            block.next_free = nxt
            prev.next_free = block
            nxt.prev_free = block
            count += 1
        self._len += count

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def __iter__(self) -> Iterator[KVBlock]:
        node = self._head.next_free
        while node is not None and node is not self._tail:
            yield node
            node = node.next_free

    def broken_link(self) -> str | None:
        """Describe the first inconsistent link (for integrity checks), or ``None``."""
        prev = self._head
        count = 0
        node = self._head.next_free
        while node is not None and node is not self._tail:
            if node.prev_free is not prev:
                return f"free queue back link broken at block {node.block_id}"
            count += 1
            if count > self._len:
                return f"free queue holds more blocks than its length {self._len} (a cycle?)"
            prev, node = node, node.next_free
        if node is None or node.prev_free is not prev:
            return "free queue does not end at its tail"
        if count != self._len:
            return f"free queue length {self._len} != {count} linked blocks"
        return None

    def _link(self, block: KVBlock, prev: KVBlock | None, nxt: KVBlock | None) -> None:
        if block.prev_free is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        assert prev is not None and nxt is not None
        block.prev_free = prev
        block.next_free = nxt
        prev.next_free = block
        nxt.prev_free = block
        self._len += 1
