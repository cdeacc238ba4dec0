"""Our paged-attention op for fms (DESIGN §5).

K/V live in per-layer block tensors ``[num_blocks, block_size, kv_heads, head_dim]``. The store op
writes the new keys/values in place at the slots the scheduler chose (block 0 is the sink for
positions whose KV must not be stored); the compute op gathers each row's context through its
block table and attends with a mask built from the query positions, so causal masking is always
aligned to the end of the context. Nothing is copied but the context being attended over.

Selected per forward call with ``attn_name=ATTN_NAME`` and the keyword arguments built by
``paged_attention_kwargs``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from fms.modules.attention import register_attention_op

ATTN_NAME = "spyre_server_paged"


def paged_attention_kwargs(
    slot_mapping: torch.Tensor, block_tables: torch.Tensor, position_ids: torch.Tensor
) -> dict[str, Any]:
    """Keyword arguments for an fms forward with our op, built once per step (not per layer).

    ``slot_mapping``: ``[batch * num_queries]``, where each query position's K/V is stored;
    ``block_tables``: ``[batch, num_blocks]``, covering every row's context (short rows padded
    with block 0, which the mask hides); ``position_ids``: ``[batch, num_queries]``.
    The query at position p attends the keys at positions 0..p of its own row.
    """
    kv_len = int(position_ids.max()) + 1
    key_positions = torch.arange(kv_len, device=position_ids.device)
    mask = key_positions.view(1, 1, 1, kv_len) <= position_ids.unsqueeze(1).unsqueeze(-1)
    return {
        "attn_name": ATTN_NAME,
        "slot_mapping": slot_mapping,
        "block_tables": block_tables,
        "mask": mask,
    }


def _store(
    keys: torch.Tensor,
    values: torch.Tensor,
    key_cache: torch.Tensor | None,
    value_cache: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if key_cache is None or value_cache is None:
        raise ValueError(f"{ATTN_NAME} needs the per-layer block tensors as past_key_value_states")
    slots = kwargs["slot_mapping"]
    num_kv_heads, head_dim = keys.shape[-2:]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(
        0, slots, keys.reshape(-1, num_kv_heads, head_dim)
    )
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(
        0, slots, values.reshape(-1, num_kv_heads, head_dim)
    )
    return key_cache, value_cache, key_cache, value_cache


def _compute(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    nheads: int,
    kvheads: int,
    p_dropout: float,
    scale_factor: float | None,
    **kwargs: Any,
) -> torch.Tensor:
    block_tables: torch.Tensor = kwargs["block_tables"]
    mask: torch.Tensor = kwargs["mask"]
    batch, _, _, head_dim = query.shape
    kv_len = mask.shape[-1]
    keys = key_cache[block_tables].view(batch, -1, kvheads, head_dim)[:, :kv_len]
    values = value_cache[block_tables].view(batch, -1, kvheads, head_dim)[:, :kv_len]
    out = F.scaled_dot_product_attention(
        query.transpose(1, 2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=mask,
        dropout_p=p_dropout,
        scale=scale_factor,
        enable_gqa=nheads != kvheads,
    )
    return out.transpose(1, 2).contiguous()


register_attention_op(ATTN_NAME, _store, _compute)
