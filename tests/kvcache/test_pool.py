"""Exact BlockPool behaviour (DESIGN.md §4): free queue order, ref counts, eviction, events, reset."""

from __future__ import annotations

import re
from collections.abc import Sequence

import pytest

from kvcache import (
    NO_EXTRA_KEYS,
    PAD_BLOCK_ID,
    AllBlocksCleared,
    BlockHashChain,
    BlockPool,
    BlockRemoved,
    BlockStored,
    ExtraKeys,
    IntegrityError,
    KVCacheEvent,
    root_hash,
)
from kvcache.hashing import decode_token_ids
from tests.kvcache.registration import register_all

BS = 4
ROOT = root_hash(0)
Snapshot = tuple[object, ...]


def make_chain(token_ids: Sequence[int], extra: ExtraKeys = NO_EXTRA_KEYS) -> BlockHashChain:
    chain = BlockHashChain(BS, ROOT, extra)
    chain.update(token_ids)
    return chain


def toks(start: int, num_blocks: int) -> list[int]:
    """``num_blocks`` full blocks of distinct token ids starting at ``start``."""
    return list(range(start, start + num_blocks * BS))


def snapshot(pool: BlockPool) -> Snapshot:
    ids = range(pool.num_blocks)
    return (
        pool.free_block_ids(),
        [pool.ref_count(b) for b in ids],
        [pool.block_hash(b) for b in ids],
        pool.num_cached_blocks,
        pool.num_free_blocks,
        (pool.stats.num_requests, pool.stats.num_query_tokens, pool.stats.num_hit_tokens),
    )


def recorder(pool: BlockPool) -> list[KVCacheEvent]:
    events: list[KVCacheEvent] = []
    pool.subscribe(events.append)
    return events


@pytest.fixture
def pool() -> BlockPool:
    return BlockPool(8, BS)


# ------------------------------------------------------------------------- construction
def test_initial_state(pool: BlockPool) -> None:
    assert pool.free_block_ids() == [1, 2, 3, 4, 5, 6, 7]
    assert pool.num_usable_blocks == 7
    assert pool.num_free_blocks == 7
    assert pool.num_cached_blocks == 0
    assert pool.usage() == 0.0
    assert [pool.ref_count(b) for b in range(8)] == [0] * 8
    assert [pool.block_hash(b) for b in range(8)] == [None] * 8
    pool.check_integrity({})


@pytest.mark.parametrize("num_blocks", [2, 3, 100])
def test_initial_queue_is_every_user_block_in_order(num_blocks: int) -> None:
    pool = BlockPool(num_blocks, 64)
    assert pool.free_block_ids() == list(range(1, num_blocks))


@pytest.mark.parametrize(("num_blocks", "block_size"), [(1, 4), (0, 4), (8, 0), (8, -1)])
def test_invalid_construction(num_blocks: int, block_size: int) -> None:
    with pytest.raises(ValueError):
        BlockPool(num_blocks, block_size)


@pytest.mark.parametrize("block_size", [1, 3, 16, 64])
def test_any_block_size_works(block_size: int) -> None:
    pool = BlockPool(6, block_size)
    chain = BlockHashChain(block_size, ROOT)
    chain.update(list(range(2 * block_size)) + [99] * (block_size - 1))  # 2 full blocks
    table = pool.allocate(3)
    assert table == [1, 2, 3]
    assert register_all(pool, table, chain) == [1, 2]
    assert pool.lookup(chain) == [1, 2]
    pool.free(table)
    assert pool.free_block_ids() == [3, 4, 5, 2, 1]
    pool.check_integrity({})


# ----------------------------------------------------------------------------- allocate
def test_allocate_takes_from_the_front(pool: BlockPool) -> None:
    assert pool.allocate(3) == [1, 2, 3]
    assert pool.free_block_ids() == [4, 5, 6, 7]
    assert [pool.ref_count(b) for b in range(8)] == [0, 1, 1, 1, 0, 0, 0, 0]
    assert pool.allocate(2) == [4, 5]
    assert pool.free_block_ids() == [6, 7]
    pool.check_integrity({"a": [1, 2, 3], "b": [4, 5]})


def test_allocate_zero_changes_nothing(pool: BlockPool) -> None:
    before = snapshot(pool)
    assert pool.allocate(0) == []
    assert snapshot(pool) == before


def test_allocate_negative_raises(pool: BlockPool) -> None:
    with pytest.raises(ValueError):
        pool.allocate(-1)


def test_allocate_more_than_free_returns_none_and_changes_nothing(pool: BlockPool) -> None:
    # a mixed state: blocks in use, free cached blocks, free unhashed blocks
    events = recorder(pool)
    a = pool.allocate(3)
    assert a is not None
    register_all(pool, a, make_chain(toks(0, 3)))
    pool.free(a)
    b = pool.allocate(2)
    assert b == [4, 5]
    assert pool.free_block_ids() == [6, 7, 3, 2, 1]
    before = snapshot(pool)
    num_events = len(events)
    assert pool.allocate(6) is None
    assert pool.allocate(100) is None
    assert snapshot(pool) == before
    assert len(events) == num_events  # no block was evicted
    assert pool.lookup(make_chain(toks(0, 3))) == [1, 2, 3]
    pool.check_integrity({"b": [4, 5]})


def test_block_zero_is_never_allocated(pool: BlockPool) -> None:
    table = pool.allocate(7)
    assert table == [1, 2, 3, 4, 5, 6, 7]
    assert PAD_BLOCK_ID not in table
    assert pool.free_block_ids() == []
    assert pool.allocate(1) is None
    assert pool.ref_count(PAD_BLOCK_ID) == 0
    assert pool.usage() == 1.0
    pool.check_integrity({"a": table})
    pool.free(table)
    assert pool.free_block_ids() == [1, 2, 3, 4, 5, 6, 7]
    assert pool.allocate(7) == [1, 2, 3, 4, 5, 6, 7]
    assert pool.allocate(1) is None


def test_block_zero_cannot_be_freed_shared_or_registered(pool: BlockPool) -> None:
    chain = make_chain(toks(0, 1))
    with pytest.raises(ValueError, match="not a user block"):
        pool.free([PAD_BLOCK_ID])
    with pytest.raises(ValueError, match="not a user block"):
        pool.share([PAD_BLOCK_ID])
    with pytest.raises(ValueError, match="not a user block"):
        pool.register(PAD_BLOCK_ID, chain, 0, None)
    with pytest.raises(ValueError, match="not a user block"):
        pool.free([8])
    pool.check_integrity({})


# --------------------------------------------------------------------------------- free
def test_free_releases_tail_first_hashed_blocks_to_the_back(pool: BlockPool) -> None:
    table = pool.allocate(3)
    assert table == [1, 2, 3]
    assert register_all(pool, table, make_chain(toks(0, 3))) == [1, 2, 3]
    pool.free(table)
    assert pool.free_block_ids() == [4, 5, 6, 7, 3, 2, 1]
    assert [pool.ref_count(b) for b in range(8)] == [0] * 8
    assert pool.num_cached_blocks == 3
    pool.check_integrity({})


def test_free_puts_unhashed_blocks_at_the_front(pool: BlockPool) -> None:
    table = pool.allocate(3)
    assert table == [1, 2, 3]
    pool.free(table)
    # 3 is pushed to the front first, then 2, then 1
    assert pool.free_block_ids() == [1, 2, 3, 4, 5, 6, 7]


def test_free_mixed_hashed_and_unhashed(pool: BlockPool) -> None:
    table = pool.allocate(4)
    assert table == [1, 2, 3, 4]
    # only the first two blocks got their KV written (the rest were reserved for decode)
    assert register_all(pool, table, make_chain(toks(0, 4)), num=2) == [1, 2]
    pool.free(table)
    # 4 -> front, 3 -> front, 2 -> back, 1 -> back
    assert pool.free_block_ids() == [3, 4, 5, 6, 7, 2, 1]
    pool.check_integrity({})


def test_two_requests_freed_in_turn(pool: BlockPool) -> None:
    a = pool.allocate(2)
    b = pool.allocate(2)
    assert a == [1, 2]
    assert b == [3, 4]
    register_all(pool, a, make_chain(toks(0, 2)))
    register_all(pool, b, make_chain(toks(100, 2)))
    pool.free(b)
    pool.free(a)
    assert pool.free_block_ids() == [5, 6, 7, 4, 3, 2, 1]


def test_free_more_often_than_taken_raises(pool: BlockPool) -> None:
    table = pool.allocate(1)
    assert table == [1]
    pool.free(table)
    with pytest.raises(ValueError, match="freed more often than it was taken"):
        pool.free(table)
    assert pool.free_block_ids() == [1, 2, 3, 4, 5, 6, 7]
    pool.check_integrity({})


def mixed_state(pool: BlockPool) -> dict[str, list[int]]:
    """Blocks with one and with two holders, free cached blocks and free unhashed blocks."""
    a = pool.allocate(3)
    assert a == [1, 2, 3]
    assert register_all(pool, a, make_chain(toks(0, 3))) == [1, 2, 3]
    pool.free(a)
    b = pool.allocate(2)
    assert b == [4, 5]
    assert register_all(pool, b, make_chain(toks(100, 2))) == [4, 5]
    c = pool.lookup(make_chain(toks(0, 2)))
    assert c == [1, 2]
    pool.share(c)
    d = pool.lookup(make_chain(toks(100, 2)))
    assert d == [4, 5]
    pool.share(d)
    assert pool.free_block_ids() == [6, 7, 3]
    assert [pool.ref_count(x) for x in range(8)] == [0, 1, 1, 0, 2, 2, 0, 0]
    holders = {"b": b, "c": c, "d": d}
    pool.check_integrity(holders)
    return holders


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ([4, 0, 5], "block id 0 is not a user block (1..7)"),
        ([4, 8, 5], "block id 8 is not a user block (1..7)"),
        ([4, -1, 5], "block id -1 is not a user block (1..7)"),
        ([4, 6, 5], "block 6 freed more often than it was taken"),  # free, unhashed
        ([1, 3, 2], "block 3 freed more often than it was taken"),  # free, cached
        ([6, 4, 5], "block 6 freed more often than it was taken"),  # bad first: checked last
        ([4, 5, 7], "block 7 freed more often than it was taken"),  # bad last: checked first
    ],
)
def test_free_is_all_or_nothing(pool: BlockPool, table: list[int], message: str) -> None:
    holders = mixed_state(pool)
    events = recorder(pool)
    before = snapshot(pool)
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        pool.free(table)
    assert snapshot(pool) == before
    assert [pool.ref_count(x) for x in range(8)] == [0, 1, 1, 0, 2, 2, 0, 0]
    assert pool.free_block_ids() == [6, 7, 3]
    assert events == []
    pool.check_integrity(holders)
    # the valid part of the table is still held and can be freed normally
    pool.free(holders.pop("d"))
    assert pool.free_block_ids() == [6, 7, 3]
    pool.free(holders.pop("b"))
    assert pool.free_block_ids() == [6, 7, 3, 5, 4]
    pool.check_integrity(holders)


def test_free_of_a_table_naming_a_block_more_often_than_it_is_held_raises(
    pool: BlockPool,
) -> None:
    table = pool.allocate(2)
    assert table == [1, 2]
    before = snapshot(pool)
    message = "block 1 freed more often than it was taken"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        pool.free([1, 2, 1])
    assert snapshot(pool) == before
    pool.check_integrity({"a": table})


# -------------------------------------------------------------------------------- share
def test_share_of_a_free_cached_block_takes_it_out_of_the_queue_and_keeps_its_hash(
    pool: BlockPool,
) -> None:
    chain = make_chain(toks(0, 3))
    table = pool.allocate(3)
    assert table is not None
    register_all(pool, table, chain)
    pool.free(table)
    assert pool.free_block_ids() == [4, 5, 6, 7, 3, 2, 1]
    hashes = [pool.block_hash(b) for b in (1, 2, 3)]
    assert hashes == chain.hashes

    hits = pool.lookup(chain)
    assert hits == [1, 2, 3]
    pool.share(hits[:2])
    assert pool.free_block_ids() == [4, 5, 6, 7, 3]
    assert [pool.ref_count(b) for b in (1, 2, 3)] == [1, 1, 0]
    assert [pool.block_hash(b) for b in (1, 2, 3)] == hashes
    assert pool.num_cached_blocks == 3
    pool.check_integrity({"r": [1, 2]})

    # touched: released again, they are now the most recently used
    pool.free([1, 2])
    assert pool.free_block_ids() == [4, 5, 6, 7, 3, 2, 1]
    pool.check_integrity({})


def test_share_touch_moves_a_chain_behind_a_newer_one(pool: BlockPool) -> None:
    a, b = make_chain(toks(0, 2)), make_chain(toks(100, 2))
    ta = pool.allocate(2)
    tb = pool.allocate(2)
    assert ta == [1, 2]
    assert tb == [3, 4]
    register_all(pool, ta, a)
    register_all(pool, tb, b)
    pool.free(ta)
    pool.free(tb)
    assert pool.free_block_ids() == [5, 6, 7, 2, 1, 4, 3]
    hits = pool.lookup(a)
    assert hits == [1, 2]
    pool.share(hits)
    pool.free(hits)
    assert pool.free_block_ids() == [5, 6, 7, 4, 3, 2, 1]


def test_ref_counts_with_two_holders(pool: BlockPool) -> None:
    chain = make_chain(toks(0, 2))
    first = pool.allocate(2)
    assert first == [1, 2]
    register_all(pool, first, chain)
    second = pool.lookup(chain)
    assert second == [1, 2]
    pool.share(second)
    assert [pool.ref_count(b) for b in (1, 2)] == [2, 2]
    pool.check_integrity({"first": first, "second": second})

    pool.free(first)
    assert [pool.ref_count(b) for b in (1, 2)] == [1, 1]
    assert pool.free_block_ids() == [3, 4, 5, 6, 7]  # still in use: not queued
    assert pool.usage() == 2 / 7
    pool.check_integrity({"second": second})

    pool.free(second)
    assert [pool.ref_count(b) for b in (1, 2)] == [0, 0]
    assert pool.free_block_ids() == [3, 4, 5, 6, 7, 2, 1]
    pool.check_integrity({})


def test_share_of_an_unhashed_free_block(pool: BlockPool) -> None:
    pool.share([5])
    assert pool.ref_count(5) == 1
    assert pool.free_block_ids() == [1, 2, 3, 4, 6, 7]
    pool.check_integrity({"r": [5]})


def test_share_of_a_block_in_use_only_adds_a_holder(pool: BlockPool) -> None:
    table = pool.allocate(1)
    assert table == [1]
    pool.share(table)
    pool.share(table)
    assert pool.ref_count(1) == 3
    assert pool.free_block_ids() == [2, 3, 4, 5, 6, 7]
    pool.check_integrity({"a": [1], "b": [1], "c": [1]})


@pytest.mark.parametrize(
    ("block_ids", "message"),
    [
        ([6, 0, 7], "block id 0 is not a user block (1..7)"),
        ([6, 8, 7], "block id 8 is not a user block (1..7)"),
        ([6, -1, 7], "block id -1 is not a user block (1..7)"),
        ([3, 4, 0], "block id 0 is not a user block (1..7)"),
    ],
)
def test_share_is_all_or_nothing(pool: BlockPool, block_ids: list[int], message: str) -> None:
    holders = mixed_state(pool)
    events = recorder(pool)
    before = snapshot(pool)
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        pool.share(block_ids)
    assert snapshot(pool) == before
    assert [pool.ref_count(x) for x in range(8)] == [0, 1, 1, 0, 2, 2, 0, 0]
    assert pool.free_block_ids() == [6, 7, 3]
    assert pool.block_hash(3) is not None
    assert events == []
    pool.check_integrity(holders)


# ----------------------------------------------------------------------------- eviction
def test_allocation_evicts_lru_front_and_drops_the_hash(pool: BlockPool) -> None:
    events = recorder(pool)
    chain = make_chain(toks(0, 3))
    table = pool.allocate(3)
    assert table is not None
    register_all(pool, table, chain)
    pool.free(table)
    assert pool.free_block_ids() == [4, 5, 6, 7, 3, 2, 1]
    del events[:]

    # unhashed blocks in front are taken first: no eviction
    assert pool.allocate(4) == [4, 5, 6, 7]
    assert events == []
    assert pool.lookup(chain) == [1, 2, 3]

    # the chain's tail goes first
    assert pool.allocate(1) == [3]
    assert events == [BlockRemoved(chain.hashes[2])]
    assert pool.block_hash(3) is None
    assert pool.num_cached_blocks == 2
    assert pool.lookup(chain) == [1, 2]
    assert pool.free_block_ids() == [2, 1]

    assert pool.allocate(1) == [2]
    assert events == [BlockRemoved(chain.hashes[2]), BlockRemoved(chain.hashes[1])]
    assert pool.lookup(chain) == [1]

    assert pool.allocate(1) == [1]
    assert events[-1] == BlockRemoved(chain.hashes[0])
    assert pool.lookup(chain) == []
    assert pool.num_cached_blocks == 0
    pool.check_integrity({"a": [4, 5, 6, 7], "b": [3], "c": [2], "d": [1]})


def test_one_allocation_evicts_several_in_lru_order(pool: BlockPool) -> None:
    events = recorder(pool)
    a, b = make_chain(toks(0, 2)), make_chain(toks(100, 2))
    ta, tb = pool.allocate(2), pool.allocate(2)
    assert ta == [1, 2]
    assert tb == [3, 4]
    register_all(pool, ta, a)
    register_all(pool, tb, b)
    pool.free(ta)  # a released first: a is older
    pool.free(tb)
    assert pool.free_block_ids() == [5, 6, 7, 2, 1, 4, 3]
    del events[:]
    assert pool.allocate(5) == [5, 6, 7, 2, 1]
    assert events == [BlockRemoved(a.hashes[1]), BlockRemoved(a.hashes[0])]
    assert pool.lookup(a) == []
    assert pool.lookup(b) == [3, 4]
    assert pool.free_block_ids() == [4, 3]


def test_eviction_events_are_emitted_after_every_block_is_taken(pool: BlockPool) -> None:
    chain = make_chain(toks(0, 3))
    table = pool.allocate(3)
    assert table == [1, 2, 3]
    assert register_all(pool, table, chain) == [1, 2, 3]
    pool.free(table)
    assert pool.free_block_ids() == [4, 5, 6, 7, 3, 2, 1]
    seen: list[tuple[object, ...]] = []

    def observe(event: KVCacheEvent) -> None:
        seen.append(
            (
                event,
                pool.free_block_ids(),
                [pool.ref_count(b) for b in range(8)],
                [pool.block_hash(b) for b in (1, 2, 3)],
                pool.num_cached_blocks,
            )
        )

    pool.subscribe(observe)
    assert pool.allocate(6) == [4, 5, 6, 7, 3, 2]
    state = ([1], [0, 0, 1, 1, 1, 1, 1, 1], [chain.hashes[0], None, None], 1)
    # one event per evicted block, in the order taken (the chain's tail first), each seen
    # only once the whole allocation is done
    assert seen == [
        (BlockRemoved(chain.hashes[2]), *state),
        (BlockRemoved(chain.hashes[1]), *state),
    ]
    pool.check_integrity({"r": [4, 5, 6, 7, 3, 2]})


def test_a_cached_block_in_use_is_never_evicted(pool: BlockPool) -> None:
    chain = make_chain(toks(0, 2))
    table = pool.allocate(2)
    assert table == [1, 2]
    register_all(pool, table, chain)
    others = pool.allocate(5)
    assert others == [3, 4, 5, 6, 7]
    assert pool.allocate(1) is None
    assert pool.lookup(chain) == [1, 2]
    pool.free(others)
    assert pool.allocate(5) == [3, 4, 5, 6, 7]
    assert pool.lookup(chain) == [1, 2]


def test_a_reallocated_block_is_unhashed_when_freed_again() -> None:
    chain = make_chain(toks(0, 1))
    small = BlockPool(2, BS)
    t = small.allocate(1)
    assert t == [1]
    assert small.register(1, chain, 0, None) == 1
    small.free(t)
    assert small.allocate(1) == [1]
    assert small.block_hash(1) is None
    small.free([1])
    assert small.free_block_ids() == [1]
    assert small.lookup(chain) == []


# ----------------------------------------------------------------------------- register
def test_register_requires_the_block_in_use(pool: BlockPool) -> None:
    chain = make_chain(toks(0, 1))
    with pytest.raises(ValueError, match="not in use"):
        pool.register(1, chain, 0, None)
    table = pool.allocate(1)
    assert table == [1]
    assert pool.register(1, chain, 0, None) == 1
    pool.free(table)
    # a free cached block cannot be registered again either
    with pytest.raises(ValueError, match="not in use"):
        pool.register(1, chain, 0, None)
    assert pool.block_hash(1) == chain.hashes[0]
    pool.check_integrity({})


def test_register_sets_the_chain_hash(pool: BlockPool) -> None:
    chain = make_chain(toks(0, 2))
    table = pool.allocate(2)
    assert table == [1, 2]
    assert register_all(pool, table, chain) == [1, 2]
    assert [pool.block_hash(b) for b in table] == chain.hashes
    assert pool.num_cached_blocks == 2


def test_register_twice_is_idempotent(pool: BlockPool) -> None:
    events = recorder(pool)
    chain = make_chain(toks(0, 1))
    table = pool.allocate(1)
    assert table == [1]
    assert pool.register(1, chain, 0, None) == 1
    assert pool.register(1, chain, 0, None) == 1
    assert len(events) == 1
    assert pool.num_cached_blocks == 1
    # the same block under another hash: refused, the first hash stays
    other = make_chain(toks(50, 1))
    assert pool.register(1, other, 0, None) is None
    assert pool.block_hash(1) == chain.hashes[0]
    assert len(events) == 1


def test_duplicate_registration_keeps_the_first_block(pool: BlockPool) -> None:
    events = recorder(pool)
    chain = make_chain(toks(0, 2))
    a = pool.allocate(2)
    b = pool.allocate(2)
    assert a == [1, 2]
    assert b == [3, 4]
    assert register_all(pool, a, chain) == [1, 2]
    # chained onto b's own (unhashed) copy of block 0, block 1 cannot be cached
    assert pool.register(4, chain, 1, 3) is None
    # b computed the same content (same continuation) but it is registered already: each register
    # returns a's twin, which b then holds instead of its copy (register_all does that swap)
    assert register_all(pool, b, chain) == [1, 2]
    assert b == [1, 2]
    assert [pool.block_hash(x) for x in (1, 2, 3, 4)] == [*chain.hashes, None, None]
    assert [pool.ref_count(x) for x in (1, 2, 3, 4)] == [2, 2, 0, 0]
    assert pool.free_block_ids() == [4, 3, 5, 6, 7]  # b's copies went back, unhashed: front
    assert pool.num_cached_blocks == 2
    assert len(events) == 2
    assert pool.lookup(chain) == [1, 2]
    pool.free(b)
    assert pool.free_block_ids() == [4, 3, 5, 6, 7]  # a still holds 1 and 2
    pool.free(a)
    assert pool.free_block_ids() == [4, 3, 5, 6, 7, 2, 1]
    pool.check_integrity({})


def test_register_with_an_unregistered_parent_returns_none(pool: BlockPool) -> None:
    chain = make_chain(toks(0, 2))
    table = pool.allocate(2)
    assert table == [1, 2]
    assert pool.register(2, chain, 1, 1) is None
    assert pool.block_hash(2) is None
    assert pool.num_cached_blocks == 0
    # once the parent is registered, the child can be
    assert pool.register(1, chain, 0, None) == 1
    assert pool.register(2, chain, 1, 1) == 2
    assert pool.lookup(chain) == [1, 2]


def test_register_with_a_parent_cached_under_another_hash_returns_none(pool: BlockPool) -> None:
    a, b = make_chain(toks(0, 2)), make_chain(toks(100, 2))
    table = pool.allocate(2)
    assert table == [1, 2]
    assert pool.register(1, a, 0, None) == 1
    # block 2 as block 1 of chain b, chained onto a block that holds a's block 0
    assert pool.register(2, b, 1, 1) is None
    assert pool.block_hash(2) is None


def test_register_index_above_zero_needs_a_parent_id(pool: BlockPool) -> None:
    chain = make_chain(toks(0, 2))
    table = pool.allocate(2)
    assert table == [1, 2]
    pool.register(1, chain, 0, None)
    with pytest.raises(ValueError, match="needs its parent block id"):
        pool.register(2, chain, 1, None)
    assert pool.block_hash(2) is None


@pytest.mark.parametrize("bad_parent", [PAD_BLOCK_ID, 8, -1])
def test_register_rejects_a_parent_that_is_not_a_user_block(
    pool: BlockPool, bad_parent: int
) -> None:
    events = recorder(pool)
    chain = make_chain(toks(0, 2))
    table = pool.allocate(2)
    assert table == [1, 2]
    assert pool.register(1, chain, 0, None) == 1
    message = f"block id {bad_parent} is not a user block (1..7)"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        pool.register(2, chain, 1, bad_parent)
    assert pool.block_hash(2) is None
    assert len(events) == 1
    pool.check_integrity({"r": table})


# ------------------------------------------------------------------- twins / takeover
def stored(chain: BlockHashChain, index: int) -> BlockStored:
    """The BlockStored event of block ``index`` of ``chain``."""
    return BlockStored(
        block_hash=chain.hashes[index],
        parent_block_hash=chain.parent_of(index),
        token_ids=decode_token_ids(chain.token_bytes[index]),
        block_size=BS,
        extra_keys=chain.extra,
    )


def test_a_concurrent_duplicate_chains_onto_the_first_requests_blocks(pool: BlockPool) -> None:
    """Two requests computed the same 2 blocks at once; the first to register wins."""
    events = recorder(pool)
    chain = make_chain(toks(0, 2))
    a, b = pool.allocate(2), pool.allocate(2)
    assert a == [1, 2]
    assert b == [3, 4]
    assert pool.register(1, chain, 0, None) == 1
    assert pool.register(3, chain, 0, None) == 1  # b's block 0 duplicates a's: a's id
    assert pool.register(2, chain, 1, 1) == 2
    assert pool.register(4, chain, 1, 1) == 2  # chained onto the returned id: a's block 1
    assert [pool.block_hash(x) for x in range(8)] == [None, *chain.hashes, *[None] * 5]
    assert events == [stored(chain, 0), stored(chain, 1)]
    assert pool.lookup(chain) == [1, 2]
    pool.check_integrity({"a": a, "b": b})
    pool.free(b)
    assert pool.free_block_ids() == [3, 4, 5, 6, 7]
    pool.free(a)
    assert pool.free_block_ids() == [3, 4, 5, 6, 7, 2, 1]
    pool.check_integrity({})


def test_twins_can_win_at_different_positions(pool: BlockPool) -> None:
    """b registers block 1 before a does: b's block 1 is chained onto a's block 0, and a's
    block 1 becomes the duplicate."""
    chain = make_chain(toks(0, 2))
    a, b = pool.allocate(2), pool.allocate(2)
    assert a == [1, 2]
    assert b == [3, 4]
    assert pool.register(1, chain, 0, None) == 1
    assert pool.register(3, chain, 0, None) == 1
    assert pool.register(4, chain, 1, 1) == 4
    assert pool.register(2, chain, 1, 1) == 4
    assert [pool.block_hash(x) for x in (1, 2, 3, 4)] == [
        chain.hashes[0],
        None,
        None,
        chain.hashes[1],
    ]
    assert pool.lookup(chain) == [1, 4]
    pool.check_integrity({"a": a, "b": b})


def test_a_diverging_duplicate_registers_its_own_block_after_the_twin(pool: BlockPool) -> None:
    events = recorder(pool)
    first = make_chain(toks(0, 2))
    second = make_chain(toks(0, 1) + toks(100, 1))  # same block 0, a different block 1
    assert second.hashes[0] == first.hashes[0]
    a, b = pool.allocate(2), pool.allocate(2)
    assert a == [1, 2]
    assert b == [3, 4]
    assert register_all(pool, a, first) == [1, 2]
    assert pool.register(3, second, 0, None) == 1
    assert pool.register(4, second, 1, 1) == 4  # its own id, chained onto a's block 0
    assert [pool.block_hash(x) for x in (1, 2, 3, 4)] == [*first.hashes, None, second.hashes[1]]
    assert events == [stored(first, 0), stored(first, 1), stored(second, 1)]
    assert events[2] == BlockStored(
        block_hash=second.hashes[1],
        parent_block_hash=first.hashes[0],
        token_ids=(100, 101, 102, 103),
        block_size=BS,
        extra_keys=NO_EXTRA_KEYS,
    )
    assert pool.lookup(second) == [1, 4]
    assert pool.lookup(first) == [1, 2]
    pool.check_integrity({"a": a, "b": b})

    # a third request with b's content hits a's block 0 and b's block 1
    c = pool.lookup(second)
    assert c == [1, 4]
    pool.share(c)
    assert [pool.ref_count(x) for x in range(8)] == [0, 2, 1, 1, 2, 0, 0, 0]
    pool.check_integrity({"a": a, "b": b, "c": c})
    pool.free(b)  # 4 is still held by c; 3 is unhashed: front
    assert pool.free_block_ids() == [3, 5, 6, 7]
    pool.free(c)
    assert pool.free_block_ids() == [3, 5, 6, 7, 4]
    pool.free(a)
    assert pool.free_block_ids() == [3, 5, 6, 7, 4, 2, 1]
    pool.check_integrity({})


def test_a_child_is_evicted_before_the_parent_it_was_chained_onto(pool: BlockPool) -> None:
    """b shares a's block 0 content but diverges at block 1: b's block 4 is chained onto a's
    block 1, which b holds instead of its own copy 3. Whoever holds a child holds its parent,
    and tables are released tail first, so the parent is never evicted before its child: no
    cached block is ever left unreachable (stale) in normal operation."""
    events = recorder(pool)
    first = make_chain(toks(0, 2))
    second = make_chain(toks(0, 1) + toks(100, 1))
    a, b = pool.allocate(2), pool.allocate(2)
    assert (a, b) == ([1, 2], [3, 4])
    assert register_all(pool, a, first) == [1, 2]
    assert register_all(pool, b, second) == [1, 4]
    assert b == [1, 4]  # b swapped its copy of block 0 for a's
    assert pool.free_block_ids() == [3, 5, 6, 7]
    assert [pool.ref_count(x) for x in (1, 2, 3, 4)] == [2, 1, 0, 1]
    pool.free(a)
    pool.free(b)
    assert pool.free_block_ids() == [3, 5, 6, 7, 2, 4, 1]
    del events[:]
    assert pool.allocate(7) == [3, 5, 6, 7, 2, 4, 1]
    assert events == [
        BlockRemoved(first.hashes[1]),
        BlockRemoved(second.hashes[1]),
        BlockRemoved(first.hashes[0]),
    ]
    assert pool.num_cached_blocks == 0


def test_a_reachable_free_block_is_returned_not_taken_over(pool: BlockPool) -> None:
    """A request that bypassed the lookup computed content that is cached and free: register
    returns the cached block (nothing is taken over); the caller then holds it."""
    events = recorder(pool)
    chain = make_chain(toks(0, 2))
    a = pool.allocate(2)
    assert a == [1, 2]
    assert register_all(pool, a, chain) == [1, 2]
    pool.free(a)
    b = pool.allocate(2)
    assert b == [3, 4]
    del events[:]
    assert register_all(pool, b, chain) == [1, 2]
    assert events == []
    assert b == [1, 2]  # held instead of b's copies, which return unhashed to the front
    assert pool.free_block_ids() == [4, 3, 5, 6, 7]
    assert [pool.ref_count(x) for x in (1, 2, 3, 4)] == [1, 1, 0, 0]
    assert [pool.block_hash(x) for x in (1, 2, 3, 4)] == [*chain.hashes, None, None]
    pool.check_integrity({"b": b})


# ------------------------------------------------------------------------------- lookup
def test_lookup_returns_the_longest_prefix(pool: BlockPool) -> None:
    base = toks(0, 3)
    table = pool.allocate(3)
    assert table == [1, 2, 3]
    register_all(pool, table, make_chain(base))

    assert pool.lookup(make_chain(base)) == [1, 2, 3]
    assert pool.lookup(make_chain([*base, 7, 7])) == [1, 2, 3]  # partial tail is ignored
    assert pool.lookup(make_chain(base + toks(500, 2))) == [1, 2, 3]
    assert pool.lookup(make_chain(base[:9])) == [1, 2]
    assert pool.lookup(make_chain(base[:3])) == []  # no full block

    changed = list(base)
    changed[9] = 999  # block 2 differs
    assert pool.lookup(make_chain(changed)) == [1, 2]
    changed[4] = 999  # block 1 differs too
    assert pool.lookup(make_chain(changed)) == [1]
    changed = list(base)
    changed[0] = 999  # block 0 differs: blocks 1 and 2 can never hit
    assert pool.lookup(make_chain(changed)) == []


def test_lookup_stops_at_the_first_miss(pool: BlockPool) -> None:
    chain = make_chain(toks(0, 3))
    table = pool.allocate(3)
    assert table == [1, 2, 3]
    register_all(pool, table, chain)
    pool.share([3])  # an extra holder keeps block 3 alive
    pool.free(table)
    assert pool.free_block_ids() == [4, 5, 6, 7, 2, 1]
    assert pool.allocate(5) == [4, 5, 6, 7, 2]  # evicts block 2 (chain block 1)
    assert pool.block_hash(3) == chain.hashes[2]  # block 3 is still cached ...
    assert pool.lookup(chain) == [1]  # ... but unreachable past the miss
    pool.check_integrity({"x": [3], "y": [4, 5, 6, 7, 2]})


def test_lookup_with_max_blocks(pool: BlockPool) -> None:
    chain = make_chain(toks(0, 3))
    table = pool.allocate(3)
    assert table is not None
    register_all(pool, table, chain)
    assert pool.lookup(chain, max_blocks=0) == []
    assert pool.lookup(chain, max_blocks=1) == [1]
    assert pool.lookup(chain, max_blocks=2) == [1, 2]
    assert pool.lookup(chain, max_blocks=3) == [1, 2, 3]
    assert pool.lookup(chain, max_blocks=10) == [1, 2, 3]
    assert pool.lookup(chain, max_blocks=None) == [1, 2, 3]


def test_lookup_has_no_side_effects(pool: BlockPool) -> None:
    events = recorder(pool)
    chain = make_chain(toks(0, 3))
    table = pool.allocate(3)
    assert table is not None
    register_all(pool, table, chain)
    pool.free(table)
    in_use = pool.allocate(2)
    assert in_use == [4, 5]
    register_all(pool, in_use, make_chain(toks(100, 2)))
    before = snapshot(pool)
    num_events = len(events)
    for _ in range(3):
        assert pool.lookup(chain) == [1, 2, 3]
        assert pool.lookup(make_chain(toks(100, 2))) == [4, 5]
        assert pool.lookup(make_chain(toks(200, 2))) == []
    assert snapshot(pool) == before
    assert len(events) == num_events
    pool.check_integrity({"r": in_use})


def test_lookup_of_an_empty_chain(pool: BlockPool) -> None:
    assert pool.lookup(make_chain([])) == []


def test_lookup_respects_extra_keys(pool: BlockPool) -> None:
    seq = toks(0, 2)
    salted = make_chain(seq, ExtraKeys(cache_salt="s"))
    table = pool.allocate(2)
    assert table is not None
    register_all(pool, table, salted)
    assert pool.lookup(make_chain(seq, ExtraKeys(cache_salt="s"))) == [1, 2]
    assert pool.lookup(make_chain(seq)) == []
    assert pool.lookup(make_chain(seq, ExtraKeys(cache_salt="t"))) == []
    assert pool.lookup(make_chain(seq, ExtraKeys(model_name="s"))) == []


# ------------------------------------------------------------------------ caching off
def test_caching_disabled() -> None:
    pool = BlockPool(8, BS, enable_caching=False)
    events = recorder(pool)
    chain = make_chain(toks(0, 2))
    table = pool.allocate(2)
    assert table == [1, 2]
    assert pool.register(1, chain, 0, None) is None
    assert pool.register(2, chain, 1, 1) is None
    assert register_all(pool, table, chain) == [None, None]
    assert [pool.block_hash(b) for b in table] == [None, None]
    assert pool.num_cached_blocks == 0
    assert pool.lookup(chain) == []
    pool.free(table)
    assert pool.free_block_ids() == [1, 2, 3, 4, 5, 6, 7]
    assert events == []
    assert pool.reset() == 0
    pool.check_integrity({})


# --------------------------------------------------------------------------- usage/stats
def test_usage_exact_values() -> None:
    pool = BlockPool(5, BS)  # 4 usable blocks
    chain = make_chain(toks(0, 2))
    assert pool.usage() == 0.0
    a = pool.allocate(1)
    assert a == [1]
    assert pool.usage() == 0.25
    b = pool.allocate(2)
    assert b == [2, 3]
    assert pool.usage() == 0.75
    register_all(pool, b, chain)
    pool.free(b)
    assert pool.usage() == 0.25  # free cached blocks count as free
    hits = pool.lookup(chain)
    pool.share(hits)
    assert pool.usage() == 0.75
    pool.share(hits)  # a second holder costs nothing more
    assert pool.usage() == 0.75
    rest = pool.allocate(1)
    assert rest == [4]
    assert pool.usage() == 1.0
    pool.free(hits)
    pool.free(hits)
    pool.free(a)
    pool.free(rest)
    assert pool.usage() == 0.0


def test_num_free_among(pool: BlockPool) -> None:
    chain = make_chain(toks(0, 3))
    table = pool.allocate(3)
    assert table is not None
    register_all(pool, table, chain)
    assert pool.num_free_among(table) == 0
    pool.free(table)
    assert pool.num_free_among(table) == 3
    pool.share([1])
    assert pool.num_free_among([1, 2, 3]) == 2
    assert pool.num_free_among([]) == 0


@pytest.mark.parametrize("bad", [0, 8, -1])
def test_num_free_among_rejects_block_zero_and_out_of_range_ids(pool: BlockPool, bad: int) -> None:
    message = f"block id {bad} is not a user block (1..7)"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        pool.num_free_among([1, bad])
    assert pool.num_free_among([1, 7]) == 2


def test_record_admission_updates_stats(pool: BlockPool) -> None:
    assert (pool.stats.num_requests, pool.stats.num_query_tokens, pool.stats.num_hit_tokens) == (
        0,
        0,
        0,
    )
    assert pool.stats.hit_rate is None
    pool.record_admission(10, 4)
    assert (pool.stats.num_requests, pool.stats.num_query_tokens, pool.stats.num_hit_tokens) == (
        1,
        10,
        4,
    )
    assert pool.stats.hit_rate == 0.4
    pool.record_admission(6, 0)
    pool.record_admission(4, 4)
    assert (pool.stats.num_requests, pool.stats.num_query_tokens, pool.stats.num_hit_tokens) == (
        3,
        20,
        8,
    )
    assert pool.stats.hit_rate == 0.4


@pytest.mark.parametrize(("prompt", "hits"), [(4, 5), (4, -1), (-1, 0)])
def test_record_admission_rejects_impossible_counts(
    pool: BlockPool, prompt: int, hits: int
) -> None:
    pool.record_admission(8, 8)
    with pytest.raises(ValueError):
        pool.record_admission(prompt, hits)
    assert (pool.stats.num_requests, pool.stats.num_query_tokens, pool.stats.num_hit_tokens) == (
        1,
        8,
        8,
    )


def test_lookups_alone_do_not_count(pool: BlockPool) -> None:
    chain = make_chain(toks(0, 2))
    table = pool.allocate(2)
    assert table is not None
    register_all(pool, table, chain)
    for _ in range(5):
        pool.lookup(chain)
        pool.lookup(make_chain(toks(100, 2)))
    assert (pool.stats.num_requests, pool.stats.num_query_tokens, pool.stats.num_hit_tokens) == (
        0,
        0,
        0,
    )
    assert pool.stats.hit_rate is None


# -------------------------------------------------------------------------------- reset
def test_reset(pool: BlockPool) -> None:
    events = recorder(pool)
    a, b = make_chain(toks(0, 3)), make_chain(toks(100, 2))
    ta = pool.allocate(3)
    assert ta == [1, 2, 3]
    register_all(pool, ta, a)
    pool.free(ta)  # a: free but cached
    tb = pool.allocate(2)
    assert tb == [4, 5]
    register_all(pool, tb, b)  # b: cached and in use
    assert pool.free_block_ids() == [6, 7, 3, 2, 1]
    assert pool.num_cached_blocks == 5
    del events[:]

    assert pool.reset() == 5
    assert events == [AllBlocksCleared()]
    assert pool.num_cached_blocks == 0
    assert [pool.block_hash(x) for x in range(8)] == [None] * 8
    assert pool.lookup(a) == []
    assert pool.lookup(b) == []
    assert pool.lookup(a, max_blocks=1) == []
    # the queue is not reordered and in-use blocks keep their holders
    assert pool.free_block_ids() == [6, 7, 3, 2, 1]
    assert [pool.ref_count(x) for x in range(8)] == [0, 0, 0, 0, 1, 1, 0, 0]
    pool.check_integrity({"b": tb})

    # in-use blocks go to the FRONT (unhashed) when released
    pool.free(tb)
    assert pool.free_block_ids() == [4, 5, 6, 7, 3, 2, 1]
    pool.check_integrity({})
    assert pool.reset() == 0
    assert events == [AllBlocksCleared(), AllBlocksCleared()]


def test_reset_then_register_again(pool: BlockPool) -> None:
    chain = make_chain(toks(0, 3))
    table = pool.allocate(3)
    assert table == [1, 2, 3]
    register_all(pool, table, chain, num=2)
    assert pool.reset() == 2
    # a running request cannot chain its next block onto a block the reset dropped
    assert pool.register(3, chain, 2, 2) is None
    assert pool.lookup(chain) == []
    # a new request with the same prompt caches it again
    pool.free(table)
    fresh = pool.allocate(3)
    assert fresh == [1, 2, 3]
    assert register_all(pool, fresh, chain) == [1, 2, 3]
    assert pool.lookup(chain) == [1, 2, 3]
    pool.check_integrity({"fresh": fresh})


def test_reset_of_in_use_blocks_then_eviction_emits_nothing(pool: BlockPool) -> None:
    events = recorder(pool)
    chain = make_chain(toks(0, 2))
    table = pool.allocate(2)
    assert table is not None
    register_all(pool, table, chain)
    pool.free(table)
    pool.reset()
    del events[:]
    assert pool.allocate(7) == [3, 4, 5, 6, 7, 2, 1]
    assert events == []  # nothing was cached any more


# ------------------------------------------------------------------------------- events
def test_events_in_order_with_exact_content(pool: BlockPool) -> None:
    events = recorder(pool)
    extra = ExtraKeys(cache_salt="hmac-of-key", model_name="m")
    chain = make_chain([*toks(10, 2), 1, 2], extra)
    table = pool.allocate(3)
    assert table == [1, 2, 3]
    register_all(pool, table, chain)
    pool.free(table)
    assert pool.allocate(6) == [3, 4, 5, 6, 7, 2]
    pool.reset()
    assert events == [
        BlockStored(
            block_hash=chain.hashes[0],
            parent_block_hash=ROOT,
            token_ids=(10, 11, 12, 13),
            block_size=BS,
            extra_keys=extra,
        ),
        BlockStored(
            block_hash=chain.hashes[1],
            parent_block_hash=chain.hashes[0],
            token_ids=(14, 15, 16, 17),
            block_size=BS,
            extra_keys=extra,
        ),
        BlockRemoved(chain.hashes[1]),
        AllBlocksCleared(),
    ]
    stored = events[0]
    assert isinstance(stored, BlockStored)
    assert type(stored.token_ids) is tuple
    assert stored.extra_keys.cache_salt == "hmac-of-key"


def test_every_subscriber_gets_every_event(pool: BlockPool) -> None:
    first, second = recorder(pool), recorder(pool)
    chain = make_chain(toks(0, 1))
    table = pool.allocate(1)
    assert table == [1]
    assert pool.register(1, chain, 0, None) == 1
    pool.reset()
    assert first == second
    assert [type(e) for e in first] == [BlockStored, AllBlocksCleared]


def test_no_events_without_changes(pool: BlockPool) -> None:
    events = recorder(pool)
    table = pool.allocate(3)
    assert table is not None
    pool.share(table)
    pool.free(table)
    pool.free(table)
    pool.lookup(make_chain(toks(0, 3)))
    assert events == []


# ---------------------------------------------------------------------------- integrity
def in_use_state(pool: BlockPool) -> dict[str, list[int]]:
    chain = make_chain(toks(0, 3))
    a = pool.allocate(3)
    assert a == [1, 2, 3]
    register_all(pool, a, chain)
    b = pool.lookup(chain, max_blocks=1)
    pool.share(b)
    c = pool.allocate(1)
    assert c == [4]
    return {"a": a, "b": b, "c": c}


def test_check_integrity_passes_for_correct_holders(pool: BlockPool) -> None:
    holders = in_use_state(pool)
    pool.check_integrity(holders)
    pool.check_integrity()
    pool.check_integrity(None)


@pytest.mark.parametrize(
    ("holders", "message"),
    [
        ({}, "block 1: ref_count=2 but held 0 times (by [])"),
        ({"a": [1, 2, 3], "c": [4]}, "block 1: ref_count=2 but held 1 times (by ['a'])"),
        (
            {"a": [1, 2, 3], "b": [1], "c": [4], "d": [1]},
            "block 1: ref_count=2 but held 3 times (by ['a', 'b', 'd'])",
        ),
        ({"a": [1, 2, 3], "b": [1]}, "block 4: ref_count=1 but held 0 times (by [])"),
        (
            {"a": [1, 2, 3], "b": [1], "c": [4, 5]},
            "block 5: ref_count=0 but held 1 times (by ['c'])",
        ),
        (
            {"a": [1, 2, 3], "b": [1, 3], "c": [4]},
            "block 3: ref_count=1 but held 2 times (by ['a', 'b'])",
        ),
        (
            {"a": [0, 1, 2, 3], "b": [1], "c": [4]},
            "block 0: ref_count=0 but held 1 times (by ['a'])",
        ),
    ],
)
def test_check_integrity_rejects_wrong_holders(
    pool: BlockPool, holders: dict[str, list[int]], message: str
) -> None:
    in_use_state(pool)
    with pytest.raises(IntegrityError, match=f"^{re.escape(message)}$"):
        pool.check_integrity(holders)


def test_integrity_error_is_an_assertion_error() -> None:
    assert issubclass(IntegrityError, AssertionError)


def corrupt_and_check(pool: BlockPool, message: str, holders: dict[str, list[int]] | None) -> None:
    with pytest.raises(IntegrityError, match=f"^{re.escape(message)}$"):
        pool.check_integrity(holders)


def test_detects_a_ref_count_that_disagrees_with_holders(pool: BlockPool) -> None:
    holders = in_use_state(pool)
    pool._blocks[2].ref_count = 2
    pool.check_integrity()  # nothing else is wrong
    corrupt_and_check(pool, "block 2: ref_count=2 but held 1 times (by ['a'])", holders)


def test_detects_a_queued_block_with_holders(pool: BlockPool) -> None:
    holders = in_use_state(pool)
    pool._blocks[6].ref_count = 1
    corrupt_and_check(pool, "block 6: ref_count=1 but in free queue=True", holders)


def test_detects_a_block_in_use_with_ref_count_zero(pool: BlockPool) -> None:
    holders = in_use_state(pool)
    pool._blocks[4].ref_count = 0
    corrupt_and_check(pool, "block 4: ref_count=0 but in free queue=False", holders)


def test_detects_a_negative_ref_count(pool: BlockPool) -> None:
    pool._blocks[3].ref_count = -1
    corrupt_and_check(pool, "block 3 has ref_count -1", None)


def test_detects_a_stray_hash_map_entry(pool: BlockPool) -> None:
    holders = in_use_state(pool)
    pool._cached[b"\x00" * 16] = pool._blocks[5]
    corrupt_and_check(pool, "hash map entry for block 5 is stale", holders)


def test_detects_a_second_hash_map_entry_for_a_cached_block(pool: BlockPool) -> None:
    holders = in_use_state(pool)
    pool._cached[b"\x01" * 16] = pool._blocks[2]
    corrupt_and_check(pool, "hash map entry for block 2 is stale", holders)


def test_detects_a_hash_missing_from_the_hash_map(pool: BlockPool) -> None:
    holders = in_use_state(pool)
    block_hash = pool.block_hash(2)
    assert block_hash is not None
    del pool._cached[block_hash]
    corrupt_and_check(pool, "block 2 has a hash that the hash map does not map to it", holders)


def test_detects_a_cached_block_without_a_full_block(pool: BlockPool) -> None:
    holders = in_use_state(pool)
    pool._blocks[1].token_bytes = b"\x00" * 4
    corrupt_and_check(pool, "cached block 1 does not hold a full block", holders)


def test_detects_block_zero_in_use(pool: BlockPool) -> None:
    pool._blocks[0].ref_count = 1
    corrupt_and_check(pool, "block 0 touched: ref_count=1, hash=None, queued=False", None)


def test_detects_block_zero_hashed(pool: BlockPool) -> None:
    bogus = b"\x02" * 16
    pool._blocks[0].block_hash = bogus
    corrupt_and_check(pool, f"block 0 touched: ref_count=0, hash={bogus!r}, queued=False", None)


def test_detects_a_wrong_free_queue_length(pool: BlockPool) -> None:
    pool._free._len += 1
    corrupt_and_check(pool, "free queue length 8 != 7 linked blocks", None)


def test_detects_a_broken_free_queue_back_link(pool: BlockPool) -> None:
    pool._blocks[3].prev_free = pool._blocks[5]
    corrupt_and_check(pool, "free queue back link broken at block 3", None)


def test_detects_a_free_queue_cycle(pool: BlockPool) -> None:
    pool._blocks[7].next_free = pool._blocks[1]
    pool._blocks[1].prev_free = pool._blocks[7]
    pool._free._head.next_free = pool._blocks[1]
    # the walk goes 1 .. 7, 1, ...: longer than the queue length
    with pytest.raises(IntegrityError, match="free queue"):
        pool.check_integrity()


# ----------------------------------------------------------- announced (scheduled) blocks
def test_an_announced_block_is_published_at_once_but_found_only_once_registered(
    pool: BlockPool,
) -> None:
    events = recorder(pool)
    chain = make_chain(toks(100, 2))
    pool.announce(chain, range(2))
    assert events == [stored(chain, 0), stored(chain, 1)]
    assert pool.num_announced_blocks == 2
    assert pool.lookup(chain) == []  # the KV is not written yet: no hit
    table = pool.allocate(2)
    assert table == [1, 2]
    assert register_all(pool, table, chain) == [1, 2]
    assert events == [stored(chain, 0), stored(chain, 1)]  # registering publishes nothing more
    assert pool.num_announced_blocks == 0
    assert pool.lookup(chain) == [1, 2]


def test_a_withdrawn_announcement_is_removed_once(pool: BlockPool) -> None:
    events = recorder(pool)
    chain = make_chain(toks(100, 3))
    pool.announce(chain, range(1, 3))
    pool.withdraw(chain, range(1, 3))
    assert events == [
        stored(chain, 1),
        stored(chain, 2),
        BlockRemoved(chain.hashes[1]),
        BlockRemoved(chain.hashes[2]),
    ]
    pool.withdraw(chain, range(3))  # not announced (any more): nothing
    assert len(events) == 4 and pool.num_announced_blocks == 0


def test_a_withdrawn_block_another_announcement_or_the_cache_holds_is_not_removed(
    pool: BlockPool,
) -> None:
    chain = make_chain(toks(100, 2))
    table = pool.allocate(1)
    assert table is not None
    assert register_all(pool, table, chain, 1) == [1]  # block 0 of the chain cached
    events = recorder(pool)
    pool.announce(chain, range(2))  # twice block 0's content (cached), once block 1's
    pool.announce(chain, range(1, 2))  # block 1 announced a second time
    pool.withdraw(chain, range(2))
    assert events == [stored(chain, 0), stored(chain, 1), stored(chain, 1)]
    assert pool.num_announced_blocks == 1
    pool.withdraw(chain, range(1, 2))
    assert events[-1] == BlockRemoved(chain.hashes[1])


def test_a_reset_forgets_announcements_so_a_later_register_publishes_again(
    pool: BlockPool,
) -> None:
    events = recorder(pool)
    chain = make_chain(toks(100, 1))
    pool.announce(chain, range(1))
    assert pool.reset() == 0
    assert pool.num_announced_blocks == 0
    table = pool.allocate(1)
    assert table is not None
    register_all(pool, table, chain)
    assert events == [stored(chain, 0), AllBlocksCleared(), stored(chain, 0)]


def test_announcing_with_caching_off_publishes_nothing() -> None:
    pool = BlockPool(8, BS, enable_caching=False)
    events = recorder(pool)
    pool.announce(make_chain(toks(100, 2)), range(2))
    assert events == [] and pool.num_announced_blocks == 0
