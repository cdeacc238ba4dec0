"""A hash collision may cost a miss, never a wrong hit (DESIGN.md §4).

The tests replace ``kvcache.hashing.hash_block`` (``BlockHashChain.update`` looks the name up in
that module at call time) with functions that collide on purpose, and check that ``lookup`` only
returns blocks whose tokens, extra keys and parent (id + reuse generation) are exactly the request's.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import pytest
import xxhash

import kvcache
import kvcache.hashing
from kvcache import NO_EXTRA_KEYS, BlockHashChain, BlockPool, ExtraKeys, root_hash
from tests.kvcache.registration import hold_twin, register_all

BS = 4
ROOT = root_hash(0)
CONSTANT = b"\xab" * 16
HashFn = Callable[[bytes, bytes, ExtraKeys], bytes]


def make_chain(token_ids: Sequence[int], extra: ExtraKeys = NO_EXTRA_KEYS) -> BlockHashChain:
    chain = BlockHashChain(BS, ROOT, extra)
    chain.update(token_ids)
    return chain


def patch_hash(monkeypatch: pytest.MonkeyPatch, fn: HashFn) -> None:
    monkeypatch.setattr(kvcache.hashing, "hash_block", fn)
    monkeypatch.setattr(kvcache, "hash_block", fn)


def constant_hash(parent: bytes, token_bytes: bytes, extra: ExtraKeys) -> bytes:
    return CONSTANT


def position_only_hash(parent: bytes, token_bytes: bytes, extra: ExtraKeys) -> bytes:
    """Ignores the block's tokens and extra keys: every chain collides with every other."""
    return xxhash.xxh3_128_digest(parent)


def tokens_only_hash(parent: bytes, token_bytes: bytes, extra: ExtraKeys) -> bytes:
    """Ignores the parent and extra keys: equal blocks collide at every position."""
    return xxhash.xxh3_128_digest(token_bytes)


A0, A1, A2 = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
B0, B1 = [21, 22, 23, 24], [25, 26, 27, 28]


@pytest.fixture
def constant(monkeypatch: pytest.MonkeyPatch) -> None:
    patch_hash(monkeypatch, constant_hash)


# ------------------------------------------------------------------------ constant hash
@pytest.mark.usefixtures("constant")
def test_the_patch_reaches_the_chain() -> None:
    chain = make_chain(A0 + A1 + B0)
    assert chain.hashes == [CONSTANT] * 3


@pytest.mark.usefixtures("constant")
def test_different_tokens_never_hit() -> None:
    pool = BlockPool(8, BS)
    a = make_chain(A0 + A1)
    table = pool.allocate(2)
    assert table == [1, 2]
    # only one block can own the single hash value
    assert register_all(pool, table, a) == [1, None]
    assert pool.lookup(a) == [1]
    assert pool.lookup(make_chain(B0 + A1)) == []
    assert pool.lookup(make_chain([1, 2, 3, 5, *A1])) == []  # last token of block 0 differs
    assert pool.lookup(make_chain([0, 2, 3, 4])) == []  # first token differs
    pool.check_integrity({"a": table})


@pytest.mark.usefixtures("constant")
def test_different_extra_keys_never_hit() -> None:
    pool = BlockPool(8, BS)
    salted = make_chain(A0, ExtraKeys(cache_salt="alice"))
    table = pool.allocate(1)
    assert table == [1]
    assert pool.register(1, salted, 0, None) == 1
    assert pool.lookup(make_chain(A0, ExtraKeys(cache_salt="alice"))) == [1]
    for other in (
        NO_EXTRA_KEYS,
        ExtraKeys(cache_salt="bob"),
        ExtraKeys(cache_salt=""),
        ExtraKeys(model_name="alice"),
        ExtraKeys(adapter="alice"),
        ExtraKeys(cache_salt="alice", model_name="m"),
        ExtraKeys(cache_salt="alice", adapter="x"),
    ):
        assert pool.lookup(make_chain(A0, other)) == [], other


@pytest.mark.usefixtures("constant")
def test_a_block_is_never_hit_at_another_position() -> None:
    pool = BlockPool(8, BS)
    table = pool.allocate(1)
    assert table == [1]
    assert pool.register(1, make_chain(A0), 0, None) == 1
    # A0 again as block 1: same hash, same tokens, same extra keys, but its parent is block 1
    # itself, not "no parent": the KV of a block depends on its position and its prefix.
    assert pool.lookup(make_chain(A0 + A0 + A0)) == [1]


@pytest.mark.usefixtures("constant")
def test_a_colliding_different_block_stays_unhashed() -> None:
    pool = BlockPool(8, BS)
    events: list[kvcache.KVCacheEvent] = []
    pool.subscribe(events.append)
    a, b = make_chain(A0), make_chain(B0)
    ta, tb = pool.allocate(1), pool.allocate(1)
    assert ta == [1]
    assert tb == [2]
    assert pool.register(1, a, 0, None) == 1
    assert pool.register(2, b, 0, None) is None  # block 1 holds the hash and is in use
    assert pool.block_hash(1) == CONSTANT
    assert pool.block_hash(2) is None
    assert pool.num_cached_blocks == 1
    assert len(events) == 1
    assert pool.lookup(b) == []
    assert pool.lookup(a) == [1]
    pool.free(tb)
    assert pool.free_block_ids() == [2, 3, 4, 5, 6, 7]  # unhashed: front
    pool.check_integrity({"a": ta})


@pytest.mark.usefixtures("constant")
def test_after_eviction_the_collision_slot_can_be_taken_by_other_content() -> None:
    pool = BlockPool(2, BS)
    t = pool.allocate(1)
    assert t == [1]
    assert pool.register(1, make_chain(A0), 0, None) == 1
    pool.free(t)
    t = pool.allocate(1)  # evicts A0
    assert t == [1]
    assert pool.register(1, make_chain(B0), 0, None) == 1
    assert pool.lookup(make_chain(A0)) == []
    assert pool.lookup(make_chain(B0)) == [1]


def test_random_traffic_under_a_constant_hash_never_hits_wrongly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, fn in (
        ("constant", constant_hash),
        ("position-only", position_only_hash),
        ("tokens-only", tokens_only_hash),
    ):
        patch_hash(monkeypatch, fn)
        check_random_traffic(random.Random(name), num_requests=300)


def check_random_traffic(rng: random.Random, num_requests: int) -> None:
    """Requests over a tiny alphabet so that equal blocks are common; every hit, and every twin
    that register returns, is verified against the content each block was written with (its
    full token prefix and extra keys). Blocks are registered as the scheduler does: each one
    chained onto the id returned for the previous one. All of a request's blocks are registered
    at admission, so a returned twin cannot change before it is used as a parent."""
    pool = BlockPool(12, BS)
    events: list[kvcache.KVCacheEvent] = []
    pool.subscribe(events.append)
    content: dict[int, tuple[ExtraKeys, tuple[int, ...]] | None] = {}
    holders: dict[int, list[int]] = {}
    num_hits = num_twins = num_takeovers = 0
    for rid in range(num_requests):
        if holders and (rng.random() < 0.4 or pool.num_free_blocks < 4):
            victim = rng.choice(sorted(holders))
            pool.free(holders.pop(victim))
        extra = rng.choice([NO_EXTRA_KEYS, ExtraKeys(cache_salt="s")])
        seq = [rng.choice([0, 1]) for _ in range(rng.randrange(BS, 4 * BS))]
        chain = make_chain(seq, extra)
        # some requests bypass the lookup (echo with logprobs): they compute duplicates
        hits = pool.lookup(chain) if rng.random() < 0.8 else []
        for i, block_id in enumerate(hits):
            assert content[block_id] == (extra, tuple(seq[: (i + 1) * BS])), "wrong hit"
        num_hits += len(hits)
        num_new = -(-len(seq) // BS) - len(hits)
        if num_new + pool.num_free_among(hits) > pool.num_free_blocks:
            continue
        pool.share(hits)
        new = pool.allocate(num_new)
        assert new is not None
        for block_id in new:
            content[block_id] = None  # garbage until written
        table = hits + new
        parent = hits[-1] if hits else None
        for i in range(len(hits), chain.num_blocks):
            if i > 0 and parent is None:
                break  # the chain is broken: the later blocks cannot be reached
            prefix = (extra, tuple(seq[: (i + 1) * BS]))
            content[table[i]] = prefix
            del events[:]
            parent = pool.register(table[i], chain, i, parent)
            if parent is not None:
                assert content[parent] == prefix, "register returned a block with other content"
                assert pool.block_hash(parent) == chain.hashes[i]
                if parent != table[i]:
                    num_twins += 1
                    content[table[i]] = None  # our copy goes back to the pool
                    hold_twin(pool, table, i, parent)
            stored = kvcache.BlockStored(
                chain.hashes[i], chain.parent_of(i), tuple(seq[i * BS : (i + 1) * BS]), BS, extra
            )
            if events[:1] == [kvcache.BlockRemoved(chain.hashes[i])]:  # a takeover
                assert parent == table[i]
                assert events == [kvcache.BlockRemoved(chain.hashes[i]), stored]
                num_takeovers += 1
            else:
                assert events in ([], [stored])
        holders[rid] = table
        pool.check_integrity({str(k): v for k, v in holders.items()})
    # the traffic did exercise hits, twins and takeovers of free colliding blocks
    assert num_hits > 0
    assert num_twins > 0
    assert num_takeovers > 0


# ------------------------------------------------------------------- parent identity
def test_a_hit_needs_the_exact_parent(monkeypatch: pytest.MonkeyPatch) -> None:
    """Equal blocks at every position share a hash; a block only hits after its own parent."""
    patch_hash(monkeypatch, tokens_only_hash)
    pool = BlockPool(8, BS)
    a = make_chain(A0 + A1)
    ta = pool.allocate(2)
    assert ta == [1, 2]
    assert register_all(pool, ta, a) == [1, 2]
    # B0 + A1: block 1 has A1's hash, tokens and extra keys, but its KV was computed after A0
    b = make_chain(B0 + A1)
    assert b.hashes[1] == a.hashes[1]
    tb = pool.allocate(2)
    assert tb == [3, 4]
    assert register_all(pool, tb, b) == [3, None]  # A1 collides with block 2, in use
    assert pool.lookup(b) == [3]
    assert pool.lookup(make_chain(A1)) == []  # A1 at position 0: parent differs
    assert pool.lookup(a) == [1, 2]
    pool.check_integrity({"a": ta, "b": tb})


def test_a_recycled_parent_id_does_not_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """Generation check: block 1 is evicted and reused for other content under the same hash,
    while its former child (block 2) stays cached. The child must not hit after the new
    content, although id, hash, tokens and extra keys of everything involved match."""
    patch_hash(monkeypatch, position_only_hash)
    pool = BlockPool(3, BS)
    a = make_chain(A0 + A1)
    ta = pool.allocate(2)
    assert ta == [1, 2]
    assert register_all(pool, ta, a) == [1, 2]
    pool.share([2])  # a holder keeps the child alive
    pool.free(ta)
    assert pool.free_block_ids() == [1]

    tc = pool.allocate(1)  # evicts block 1 (A0) and reuses it
    assert tc == [1]
    c = make_chain(B0 + A1)
    assert c.hashes == a.hashes  # the fake hash ignores tokens: C collides with A everywhere
    assert pool.register(1, c, 0, None) == 1
    assert pool.block_hash(2) == a.hashes[1]  # the old child is still cached

    # block 2 holds A1 computed after A0; C's block 0 is B0 in the very same block id
    assert pool.lookup(c) == [1]
    assert pool.lookup(a) == []
    pool.check_integrity({"x": [2], "c": tc})


def test_a_recycled_parent_with_equal_content_still_does_not_count() -> None:
    """Without any patch: block 1 is evicted, reused and registered again with the SAME content.
    Its old child carries the previous generation, so it is not reachable any more."""
    pool = BlockPool(4, BS)
    a = make_chain(A0 + A1)
    ta = pool.allocate(2)
    assert ta == [1, 2]
    assert register_all(pool, ta, a) == [1, 2]
    pool.share([2])
    pool.free(ta)
    assert pool.free_block_ids() == [3, 1]
    assert pool.allocate(2) == [3, 1]  # evicts block 1
    assert pool.register(1, a, 0, None) == 1  # same hash, new generation
    assert pool.lookup(a) == [1]
    pool.check_integrity({"x": [2], "y": [3, 1]})


# ------------------------------------------------------------------------ cache salt
def test_different_cache_salts_never_share_a_block() -> None:
    pool = BlockPool(16, BS)
    seq = A0 + A1 + A2
    salts: list[str | None] = [None, "tenant-a", "tenant-b", ""]
    expected_tables = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]]
    tables = {}
    for salt, expected in zip(salts, expected_tables, strict=True):
        chain = make_chain(seq, ExtraKeys(cache_salt=salt))
        assert pool.lookup(chain) == []  # nothing from another salt is visible
        table = pool.allocate(3)
        assert table == expected
        assert register_all(pool, table, chain) == expected
        tables[salt] = table
    for salt in salts:
        assert pool.lookup(make_chain(seq, ExtraKeys(cache_salt=salt))) == tables[salt]
    all_ids = [b for t in tables.values() for b in t]
    assert len(set(all_ids)) == len(all_ids)
    assert pool.num_cached_blocks == 12
    pool.check_integrity({str(s): t for s, t in tables.items()})


# ------------------------------------------------------------------ takeover of free blocks
@pytest.mark.usefixtures("constant")
def test_a_free_colliding_block_is_taken_over() -> None:
    pool = BlockPool(8, BS)
    events: list[kvcache.KVCacheEvent] = []
    pool.subscribe(events.append)
    a, b = make_chain(A0), make_chain(B0)
    ta = pool.allocate(1)
    assert ta == [1]
    assert pool.register(1, a, 0, None) == 1
    pool.free(ta)
    assert pool.free_block_ids() == [2, 3, 4, 5, 6, 7, 1]
    tb = pool.allocate(1)
    assert tb == [2]
    del events[:]
    assert pool.register(2, b, 0, None) == 2  # block 1 is free: b takes the hash over
    assert events == [
        kvcache.BlockRemoved(CONSTANT),
        kvcache.BlockStored(
            block_hash=CONSTANT,
            parent_block_hash=ROOT,
            token_ids=tuple(B0),
            block_size=BS,
            extra_keys=NO_EXTRA_KEYS,
        ),
    ]
    assert pool.block_hash(1) is None
    assert pool.block_hash(2) == CONSTANT
    assert pool.free_block_ids() == [3, 4, 5, 6, 7, 1]  # 1 stays where it was, unhashed
    assert pool.num_cached_blocks == 1
    assert pool.lookup(a) == []
    assert pool.lookup(b) == [2]
    pool.check_integrity({"b": tb})
    # block 1 is an ordinary unhashed free block now: evicting it emits nothing
    del events[:]
    assert pool.allocate(6) == [3, 4, 5, 6, 7, 1]
    assert events == []
    pool.check_integrity({"b": tb, "x": [3, 4, 5, 6, 7, 1]})


def test_taking_over_a_free_parent_makes_its_children_unreachable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    patch_hash(monkeypatch, position_only_hash)
    pool = BlockPool(8, BS)
    events: list[kvcache.KVCacheEvent] = []
    pool.subscribe(events.append)
    a, b = make_chain(A0 + A1), make_chain(B0 + B1)
    assert b.hashes == a.hashes
    ta = pool.allocate(2)
    assert ta == [1, 2]
    assert register_all(pool, ta, a) == [1, 2]
    pool.free(ta)
    assert pool.free_block_ids() == [3, 4, 5, 6, 7, 2, 1]
    tb = pool.allocate(2)
    assert tb == [3, 4]
    del events[:]
    assert register_all(pool, tb, b) == [3, 4]
    assert events == [
        kvcache.BlockRemoved(a.hashes[0]),
        kvcache.BlockStored(a.hashes[0], ROOT, tuple(B0), BS, NO_EXTRA_KEYS),
        kvcache.BlockRemoved(a.hashes[1]),
        kvcache.BlockStored(a.hashes[1], a.hashes[0], tuple(B1), BS, NO_EXTRA_KEYS),
    ]
    assert [pool.block_hash(x) for x in (1, 2, 3, 4)] == [None, None, *b.hashes]
    assert pool.free_block_ids() == [5, 6, 7, 2, 1]
    assert pool.lookup(a) == []
    assert pool.lookup(b) == [3, 4]
    pool.check_integrity({"b": tb})


def test_a_colliding_block_in_use_is_never_displaced(monkeypatch: pytest.MonkeyPatch) -> None:
    patch_hash(monkeypatch, position_only_hash)
    pool = BlockPool(8, BS)
    events: list[kvcache.KVCacheEvent] = []
    pool.subscribe(events.append)
    a, b = make_chain(A0 + A1), make_chain(A0 + B1)  # same block 0, colliding block 1
    ta, tb = pool.allocate(2), pool.allocate(2)
    assert ta == [1, 2]
    assert tb == [3, 4]
    assert register_all(pool, ta, a) == [1, 2]
    del events[:]
    assert register_all(pool, tb, b) == [1, None]  # block 2 holds b's block 1 hash, in use
    assert events == []
    assert [pool.block_hash(x) for x in (1, 2, 3, 4)] == [*a.hashes, None, None]
    assert pool.lookup(b) == [1]
    assert pool.lookup(a) == [1, 2]
    pool.check_integrity({"a": ta, "b": tb})


# ------------------------------------------------------------ twins kept across steps
def test_a_twin_the_caller_holds_cannot_be_recycled_under_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # B computed the same block 0 as A; register hands B the twin (block 1), and B holds it
    # instead of its copy (as the scheduler does). A finishing cannot free the twin, so C's
    # colliding content never lands in the block B chains onto.
    patch_hash(monkeypatch, position_only_hash)
    pool = BlockPool(4, BS)
    a, c = make_chain(A0 + A1), make_chain(B0)
    ta = pool.allocate(1)
    assert ta == [1]
    assert pool.register(1, a, 0, None) == 1
    tb = pool.allocate(2)
    assert tb == [2, 3]
    twin = pool.register(2, a, 0, None)
    assert twin == 1
    pool.share([twin])  # B swaps its copy for the twin
    pool.free([2])
    tb[0] = twin
    pool.free(ta)  # A finishes: block 1 is still held by B
    assert pool.ref_count(1) == 1
    tc = pool.allocate(1)  # C gets the freed copy, not the twin
    assert tc == [2]
    assert pool.register(2, c, 0, None) is None  # B0 collides with the cached, held A0
    assert pool.register(3, a, 1, twin) == 3
    assert pool.lookup(make_chain(B0 + A1)) == []  # no wrong hit
    assert pool.lookup(make_chain(A0 + A1)) == [1, 3]
    pool.check_integrity({"b": tb, "c": tc})


def test_register_needs_a_parent_the_caller_holds() -> None:
    pool = BlockPool(4, BS)
    chain = make_chain(A0 + A1)
    table = pool.allocate(2)
    assert pool.register(table[0], chain, 0, None) == table[0]
    pool.free([table[0]])  # parent released: it may be recycled at any time
    with pytest.raises(ValueError, match=f"parent block {table[0]} is not held"):
        pool.register(table[1], chain, 1, table[0])
