"""FreeBlockQueue: the intrusive LRU list, including the bulk ops allocate and free use."""

from __future__ import annotations

import pytest

from kvcache.block import KVBlock
from kvcache.free_queue import FreeBlockQueue

HASH = b"\x11" * 16


def make_blocks(n: int) -> list[KVBlock]:
    return [KVBlock(i) for i in range(n)]


def ids(queue: FreeBlockQueue) -> list[int]:
    return [block.block_id for block in queue]


def assert_consistent(queue: FreeBlockQueue, expected: list[int]) -> None:
    assert ids(queue) == expected
    assert len(queue) == len(expected)
    assert queue.broken_link() is None


def hashed(block: KVBlock) -> KVBlock:
    block.block_hash = HASH
    return block


# ------------------------------------------------------------------------------- basics
def test_initial_order_and_single_ops() -> None:
    blocks = make_blocks(5)
    queue = FreeBlockQueue(blocks[1:])
    assert_consistent(queue, [1, 2, 3, 4])
    assert not FreeBlockQueue.contains(blocks[0])
    assert all(FreeBlockQueue.contains(b) for b in blocks[1:])
    assert queue.popleft() is blocks[1]
    assert not FreeBlockQueue.contains(blocks[1])
    queue.remove(blocks[3])
    assert_consistent(queue, [2, 4])
    queue.append(blocks[3])
    queue.appendleft(blocks[1])
    assert_consistent(queue, [1, 2, 4, 3])
    with pytest.raises(ValueError, match=r"^block 2 is already in the free queue$"):
        queue.append(blocks[2])
    with pytest.raises(ValueError, match=r"^block 0 is not in the free queue$"):
        queue.remove(blocks[0])
    assert_consistent(queue, [1, 2, 4, 3])


def test_popleft_of_an_empty_queue() -> None:
    queue = FreeBlockQueue()
    assert queue.popleft() is None
    assert_consistent(queue, [])


# ------------------------------------------------------------------------- popleft_many
@pytest.mark.parametrize(("count", "rest"), [(0, [1, 2, 3, 4, 5]), (1, [2, 3, 4, 5]), (3, [4, 5])])
def test_popleft_many_takes_from_the_front_in_order(count: int, rest: list[int]) -> None:
    blocks = make_blocks(6)
    queue = FreeBlockQueue(blocks[1:])
    taken = queue.popleft_many(count)
    assert [b.block_id for b in taken] == list(range(1, count + 1))
    assert all(b is blocks[b.block_id] for b in taken)
    assert all(b.prev_free is None and b.next_free is None for b in taken)
    assert_consistent(queue, rest)
    # the rest of the queue still works at both ends
    queue.appendleft(blocks[0])
    assert_consistent(queue, [0, *rest])
    if taken:
        queue.append(taken[0])
        assert_consistent(queue, [0, *rest, 1])


def test_popleft_many_can_empty_the_queue_and_it_refills() -> None:
    blocks = make_blocks(4)
    queue = FreeBlockQueue(blocks)
    assert queue.popleft_many(4) == blocks
    assert_consistent(queue, [])
    assert queue.popleft_many(0) == []
    assert queue.popleft() is None
    queue.append(blocks[2])
    queue.appendleft(blocks[1])
    assert_consistent(queue, [1, 2])


def test_popleft_many_after_a_removal_from_the_middle() -> None:
    blocks = make_blocks(6)
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[1])
    assert [b.block_id for b in queue.popleft_many(3)] == [0, 2, 3]
    assert_consistent(queue, [4, 5])


@pytest.mark.parametrize("count", [4, 5, 100])
def test_popleft_many_rejects_taking_more_than_queued(count: int) -> None:
    blocks = make_blocks(4)
    queue = FreeBlockQueue(blocks[1:])
    with pytest.raises(ValueError, match=f"^cannot take {count} blocks from a queue of 3$"):
        queue.popleft_many(count)
    assert_consistent(queue, [1, 2, 3])
    assert all(FreeBlockQueue.contains(b) for b in blocks[1:])


def test_popleft_many_rejects_a_negative_count() -> None:
    queue = FreeBlockQueue(make_blocks(3))
    try:
        with pytest.raises(ValueError):
            queue.popleft_many(-1)
    finally:
        assert_consistent(queue, [0, 1, 2])


# ------------------------------------------------------------------------ push_released
def test_push_released_unhashed_go_to_the_front_hashed_to_the_back() -> None:
    blocks = make_blocks(10)
    queue = FreeBlockQueue(blocks[1:4])
    # given in release order (a table's tail first): 9 and 7 hashed, 8, 6 and 5 not
    released = [hashed(blocks[9]), blocks[8], hashed(blocks[7]), blocks[6], blocks[5]]
    queue.push_released(released)
    # each unhashed block goes in front of the previous ones; hashed ones queue up at the back
    assert_consistent(queue, [5, 6, 8, 1, 2, 3, 9, 7])
    assert queue.popleft_many(3) == [blocks[5], blocks[6], blocks[8]]
    assert_consistent(queue, [1, 2, 3, 9, 7])


def test_push_released_equals_the_single_ops() -> None:
    """The bulk op is exactly appendleft (unhashed) / append (hashed) in the given order."""
    for pattern in range(2**5):
        bulk_blocks, single_blocks = make_blocks(8), make_blocks(8)
        bulk, single = FreeBlockQueue(bulk_blocks[:3]), FreeBlockQueue(single_blocks[:3])
        for i in range(3, 8):
            if pattern >> (i - 3) & 1:
                hashed(bulk_blocks[i])
                hashed(single_blocks[i])
        bulk.push_released(bulk_blocks[7:2:-1])
        for block in single_blocks[7:2:-1]:
            if block.block_hash is None:
                single.appendleft(block)
            else:
                single.append(block)
        assert ids(bulk) == ids(single), pattern
        assert len(bulk) == len(single) == 8
        assert bulk.broken_link() is None


@pytest.mark.parametrize("into", [[], [1, 2]])
def test_push_released_of_nothing_changes_nothing(into: list[int]) -> None:
    blocks = make_blocks(3)
    queue = FreeBlockQueue(blocks[i] for i in into)
    queue.push_released([])
    assert_consistent(queue, into)


def test_push_released_into_an_empty_queue() -> None:
    blocks = make_blocks(4)
    queue = FreeBlockQueue()
    queue.push_released([hashed(blocks[3]), blocks[2], hashed(blocks[1]), blocks[0]])
    assert_consistent(queue, [0, 2, 3, 1])


@pytest.mark.parametrize("hash_it", [False, True])
def test_push_released_rejects_a_block_already_queued(hash_it: bool) -> None:
    blocks = make_blocks(4)
    queue = FreeBlockQueue(blocks[:3])
    if hash_it:
        hashed(blocks[1])
    with pytest.raises(ValueError, match=r"^block 1 is already in the free queue$"):
        queue.push_released([blocks[1]])
    assert_consistent(queue, [0, 1, 2])
    assert not FreeBlockQueue.contains(blocks[3])


def test_push_released_leaves_a_consistent_queue_when_it_rejects_a_block() -> None:
    blocks = make_blocks(6)
    queue = FreeBlockQueue(blocks[:3])
    with pytest.raises(ValueError, match=r"^block 1 is already in the free queue$"):
        queue.push_released([blocks[4], blocks[1], blocks[5]])
    assert queue.broken_link() is None
    assert len(queue) == len(ids(queue))
