"""vLLM's KV-event structs, copied for decoding what we publish.

Source: vllm-project/vllm, ``vllm/distributed/kv_events.py`` (classes ``EventBatch``,
``KVCacheEvent``, ``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``, ``KVEventBatch``), in the
layout vllm-router 0.1.17 and llm-d decode: the batch is ``array_like`` (``[ts, events, rank]``),
each event a ``tag=True`` map (``{"type": "BlockStored", ...}``), ``omit_defaults``. Field names,
order, types and defaults as in that file; ``ExternalBlockHash`` is ``int`` here (vLLM's
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` default). The ``__hash__`` methods vLLM adds for its
multi-worker aggregator are left out (they play no part in decoding).
"""

from __future__ import annotations

from typing import Any

import msgspec


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events"""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def decode(payload: bytes) -> KVEventBatch:
    """Decode one payload as vLLM's subscribers do; raises on anything vLLM would reject."""
    return DECODER.decode(payload)
