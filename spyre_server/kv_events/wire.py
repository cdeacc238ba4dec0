"""vLLM's KV-event wire format (``vllm/distributed/kv_events.py``, vLLM 0.33).

A message is three ZMQ frames: topic, an 8-byte big-endian sequence number, and a msgpack
payload. The payload is an ``EventBatch`` (msgspec ``array_like``): ``[ts, events, dp_rank]``.
Each event is a msgspec struct with ``tag=True`` and without ``array_like``: a map whose first key
``"type"`` names the class, followed by the fields in declaration order. Fields without a default
(``lora_id``, ``medium``, ``lora_name``) are always present, ``null`` when unset; fields with a
default (``extra_keys``, ``group_idx``, ...) are omitted (``omit_defaults=True``).
"""

from __future__ import annotations

import time
from typing import Any

import msgpack

from kvcache import BlockHash

WireEvent = dict[str, Any]

MEDIUM = "GPU"
"""vLLM's name for the primary KV tier; routers discount the other tiers (CPU, disk)."""

END_OF_REPLAY_SEQUENCE = (-1).to_bytes(8, "big", signed=True)
_LOW_64_BITS = (1 << 64) - 1


def external_hash(block_hash: BlockHash) -> int:
    """The low 64 bits of our 16-byte xxh3_128 digest (big-endian), as an unsigned integer."""
    return int.from_bytes(block_hash, "big") & _LOW_64_BITS


def block_stored(
    block_hash: BlockHash,
    parent_block_hash: BlockHash | None,
    token_ids: tuple[int, ...],
    block_size: int,
) -> WireEvent:
    return {
        "type": "BlockStored",
        "block_hashes": [external_hash(block_hash)],
        "parent_block_hash": None
        if parent_block_hash is None
        else external_hash(parent_block_hash),
        "token_ids": list(token_ids),
        "block_size": block_size,
        "lora_id": None,
        "medium": MEDIUM,
        "lora_name": None,
    }


def block_removed(block_hash: BlockHash) -> WireEvent:
    return {"type": "BlockRemoved", "block_hashes": [external_hash(block_hash)], "medium": MEDIUM}


def all_blocks_cleared() -> WireEvent:
    return {"type": "AllBlocksCleared"}


def encode_batch(events: list[WireEvent], ts: float | None = None) -> bytes:
    """One ``EventBatch`` payload; data-parallel rank 0 (one engine per replica)."""
    return msgpack.packb([time.time() if ts is None else float(ts), events, 0], use_bin_type=True)


def sequence_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")
