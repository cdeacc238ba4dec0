"""The wire format, decoded with vLLM's own struct definitions, and which pool events leave the
replica (a real BlockPool, real hash chains)."""

from __future__ import annotations

import msgpack
import pytest

from kvcache import BlockHashChain, BlockPool, ExtraKeys, root_hash
from spyre_server.kv_events import wire
from spyre_server.kv_events.collector import EventCollector
from tests.spyre_server.kv_events import vllm_kv_events as vllm

BS = 4
ROOT = root_hash(7)


def test_external_hash_is_the_low_64_bits_of_the_digest() -> None:
    digest = bytes(range(16))
    assert wire.external_hash(digest) == int.from_bytes(bytes(range(8, 16)), "big")
    assert wire.external_hash(b"\xff" * 16) == 2**64 - 1


def test_a_batch_decodes_with_vllms_structs_field_by_field() -> None:
    parent, child = bytes(range(16)), bytes(range(16, 32))
    events = [
        wire.block_stored(parent, None, (1, 2, 3, 4), BS),
        wire.block_stored(child, parent, (5, 6, 7, 8), BS),
        wire.block_removed(child),
        wire.all_blocks_cleared(),
    ]
    batch = vllm.decode(wire.encode_batch(events, ts=12.5))
    assert batch.ts == 12.5
    assert batch.data_parallel_rank == 0
    assert batch.events == [
        vllm.BlockStored(
            block_hashes=[wire.external_hash(parent)],
            parent_block_hash=None,
            token_ids=[1, 2, 3, 4],
            block_size=BS,
            lora_id=None,
            medium="GPU",
            lora_name=None,
        ),
        vllm.BlockStored(
            block_hashes=[wire.external_hash(child)],
            parent_block_hash=wire.external_hash(parent),
            token_ids=[5, 6, 7, 8],
            block_size=BS,
            lora_id=None,
            medium="GPU",
            lora_name=None,
        ),
        vllm.BlockRemoved(block_hashes=[wire.external_hash(child)], medium="GPU"),
        vllm.AllBlocksCleared(),
    ]


def test_the_raw_layout_is_a_positional_batch_of_tagged_maps() -> None:
    """What routers written in other languages rely on: array at the top, maps with "type"
    first and every field without a default present (null when unset)."""
    raw = msgpack.unpackb(
        wire.encode_batch([wire.block_stored(b"\x01" * 16, None, (9,) * BS, BS)], ts=1.0)
    )
    assert isinstance(raw, list) and len(raw) == 3
    (event,) = raw[1]
    assert list(event) == [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ]
    assert event["type"] == "BlockStored"


def _register(pool: BlockPool, chain: BlockHashChain, tokens: list[int]) -> list[int]:
    """Allocate and register every full block of ``tokens`` in ``chain``; returns the table."""
    chain.update(tokens)
    table = pool.allocate(chain.num_blocks)
    assert table is not None
    parent = None
    for index, block_id in enumerate(table):
        held = pool.register(block_id, chain, index, parent)
        assert held == block_id
        parent = block_id
    return table


class _Queue:
    """A publisher queue stand-in that holds at most ``capacity`` events."""

    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = capacity
        self.events: list[wire.WireEvent] = []

    def offer(self, event: wire.WireEvent) -> bool:
        if self.capacity is not None and len(self.events) >= self.capacity:
            return False
        self.events.append(event)
        return True


def _collect(pool: BlockPool, capacity: int | None = None) -> tuple[_Queue, EventCollector]:
    queue = _Queue(capacity)
    collector = EventCollector(ROOT, queue.offer)
    pool.subscribe(collector)
    return queue, collector


def _kinds(queue: _Queue) -> list[str]:
    return [e["type"] for e in queue.events]


def test_stored_blocks_chain_from_a_null_parent_and_evictions_follow() -> None:
    pool = BlockPool(num_blocks=3, block_size=BS)
    queue, _ = _collect(pool)
    chain = BlockHashChain(BS, ROOT)
    table = _register(pool, chain, [1, 2, 3, 4, 5, 6, 7, 8, 9])  # 2 full blocks, 1 partial
    h0, h1 = (wire.external_hash(h) for h in chain.hashes)
    events = queue.events
    assert [(e["type"], e["block_hashes"], e.get("parent_block_hash")) for e in events] == [
        ("BlockStored", [h0], None),
        ("BlockStored", [h1], h0),
    ]
    assert events[0]["token_ids"] == [1, 2, 3, 4] and events[1]["token_ids"] == [5, 6, 7, 8]
    pool.free(table)
    assert pool.allocate(2) is not None  # takes (evicts) both cached blocks, tail first
    assert [(e["type"], e["block_hashes"]) for e in events[2:]] == [
        ("BlockRemoved", [h1]),
        ("BlockRemoved", [h0]),
    ]


@pytest.mark.parametrize("salt", ["user-salt", "tenant-hmac:"])
def test_salted_blocks_are_never_published_nor_their_removal(salt: str) -> None:
    pool = BlockPool(num_blocks=3, block_size=BS)
    queue, _ = _collect(pool)
    table = _register(pool, BlockHashChain(BS, ROOT, ExtraKeys(cache_salt=salt)), [1] * 8)
    pool.free(table)
    assert pool.allocate(2) is not None  # evicts both salted blocks
    assert queue.events == []


def test_model_name_extra_key_is_published() -> None:
    pool = BlockPool(num_blocks=2, block_size=BS)
    queue, _ = _collect(pool)
    _register(pool, BlockHashChain(BS, ROOT, ExtraKeys(model_name="m")), [3] * BS)
    assert _kinds(queue) == ["BlockStored"]


def test_reset_sends_all_blocks_cleared_and_forgets_what_was_published() -> None:
    pool = BlockPool(num_blocks=3, block_size=BS)
    queue, _ = _collect(pool)
    table = _register(pool, BlockHashChain(BS, ROOT), [1] * 8)
    assert pool.reset() == 2
    pool.free(table)  # unhashed now: nothing is evicted later
    assert pool.allocate(2) is not None
    assert _kinds(queue) == ["BlockStored", "BlockStored", "AllBlocksCleared"]


def test_a_full_queue_drops_events_and_the_next_one_is_preceded_by_a_clear() -> None:
    pool = BlockPool(num_blocks=4, block_size=BS)
    queue, collector = _collect(pool, capacity=1)
    first = _register(pool, BlockHashChain(BS, ROOT), [1] * 8)  # the second event does not fit
    assert _kinds(queue) == ["BlockStored"] and collector.num_dropped == 1
    queue.events.clear()  # the publisher caught up
    queue.capacity = None
    pool.free(first)
    second = BlockHashChain(BS, ROOT)
    _register(pool, second, [2] * BS)
    assert _kinds(queue) == ["AllBlocksCleared", "BlockStored"]
    assert queue.events[1]["block_hashes"] == [wire.external_hash(second.hashes[0])]
