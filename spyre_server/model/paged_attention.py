"""Our paged-attention op for fms (DESIGN §5).

K/V live in per-layer block tensors ``[num_blocks, block_size, kv_heads, head_dim]``. The store op
writes the new keys/values in place at the slots the scheduler chose (block 0 is the sink for
positions whose KV must not be stored). The compute op reads each row's context through its block
table, as planned once per step by ``plan_attention``:

- rows whose tables start with the same block form a group (the rows that share their first
  block with no other row form one more group);
- *shared* blocks: the leading blocks that every row of a group has in common and that lie
  wholly before every query. They are gathered once per layer for the whole group (not once per
  row) and need no mask. Decode batches of requests with a common prompt prefix (system
  prompts, the same document) mostly attend over shared blocks;
- *own* blocks: the rest of each row's table, padded with block 0 to the longest row of the
  group, attended with a mask built from the query positions, so causal masking is always
  aligned to the end of the context.

Attention is computed with grouped queries (the query heads of one KV head are folded into the
query rows), so K/V are never repeated per query head. Nothing is copied but the context being
attended over. A ``PagedAttentionKernel`` (``NativePagedAttention``, with
``model.attention_kernel: native``) takes over the whole compute from the same plan, reading
every block in place.

Selected per forward call with ``attn_name=ATTN_NAME`` and the keyword arguments built by
``paged_attention_kwargs``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from fms.modules.attention import register_attention_op

ATTN_NAME = "spyre_server_paged"


@dataclass(slots=True)
class RowGroup:
    """Rows of a step whose context is read together (see ``plan_attention``).

    ``rows``: ``[n]`` the group's row indices in the batch (``None``: every row, in order);
    ``shared_blocks``: ``[num_shared_blocks]`` block ids every query of the group attends fully;
    ``own_blocks``: ``[n * num_own_blocks]`` the rest of each row's table, row-major, padded with
    block 0; ``own_bias``: ``[n, num_queries, num_own_blocks * block_size]``, 0 where a query may
    attend the own key and -inf elsewhere (later positions, padding).
    ``positions``: ``[n, num_queries]`` the queries' positions; ``max_block_id``: the largest
    block id the group reads (0 for none), for a kernel to check against the cache.
    ``shared_span`` / ``own_span``: ``(first, end)`` when those block ids are the consecutive
    ``first..end-1`` (a request's blocks mostly are): the keys are then read in place through a
    view of the cache instead of being gathered into a copy.
    """

    rows: torch.Tensor | None
    shared_blocks: torch.Tensor
    own_blocks: torch.Tensor
    own_bias: torch.Tensor
    num_own_blocks: int
    positions: torch.Tensor
    max_block_id: int
    shared_span: tuple[int, int] | None = None
    own_span: tuple[int, int] | None = None
    _grouped_bias: dict[tuple[int, torch.dtype], torch.Tensor] = field(default_factory=dict)

    def grouped_bias(self, group: int, dtype: torch.dtype) -> torch.Tensor:
        """``own_bias`` with each query repeated for the ``group`` query heads that share one KV
        head: ``[n, 1, num_queries * group, own_len]`` (rows ordered query-major)."""
        key = (group, dtype)
        if key not in self._grouped_bias:
            batch, num_queries, own_len = self.own_bias.shape
            self._grouped_bias[key] = (
                self.own_bias.to(dtype)
                .unsqueeze(2)
                .expand(batch, num_queries, group, own_len)
                .reshape(batch, 1, num_queries * group, own_len)
            )
        return self._grouped_bias[key]


@dataclass(slots=True)
class AttentionPlan:
    """How one step's queries read the KV cache; built once per step, used by every layer."""

    groups: list[RowGroup]


def plan_attention(
    block_tables: Sequence[Sequence[int]], positions: Sequence[Sequence[int]], block_size: int
) -> AttentionPlan:
    """Plan a step whose row ``r`` has queries at ``positions[r]`` (ascending, same count in every
    row) over the context ``block_tables[r]`` (at least up to its last query's block). The query
    at position p attends the keys at positions 0..p of its own row.

    Rows whose tables start with the same block form a group that reads its common prefix once;
    the rows that share their first block with no other row form one more group. A single group
    (rows that all start alike, or that share nothing) has ``rows`` None: every row, in order."""
    first_blocks: dict[int, list[int]] = {}
    for row, (table, queries) in enumerate(zip(block_tables, positions, strict=True)):
        key = table[0] if queries[0] >= block_size else -1 - row  # -1 - row: nothing to share
        first_blocks.setdefault(key, []).append(row)
    groups = [rows for rows in first_blocks.values() if len(rows) > 1]
    alone = [rows[0] for rows in first_blocks.values() if len(rows) == 1]
    if alone:
        groups.append(alone)
    if len(groups) == 1:  # every row, in order: no gathering of rows in the op
        return AttentionPlan([_plan_group(None, block_tables, positions, block_size)])
    return AttentionPlan(
        [
            _plan_group(
                rows, [block_tables[r] for r in rows], [positions[r] for r in rows], block_size
            )
            for rows in groups
        ]
    )


def _plan_group(
    rows: list[int] | None,
    block_tables: Sequence[Sequence[int]],
    positions: Sequence[Sequence[int]],
    block_size: int,
) -> RowGroup:
    first_query_blocks = min(row[0] for row in positions) // block_size
    num_shared = 0
    reference = block_tables[0]
    while num_shared < first_query_blocks and all(
        table[num_shared] == reference[num_shared] for table in block_tables
    ):
        num_shared += 1
    own_lengths = [-(-(row[-1] + 1) // block_size) - num_shared for row in positions]
    num_own_blocks = max(own_lengths)
    own = []
    for table, length in zip(block_tables, own_lengths, strict=True):
        own.extend(table[num_shared : num_shared + length])
        own.extend([0] * (num_own_blocks - length))
    key_positions = torch.arange(
        num_shared * block_size, (num_shared + num_own_blocks) * block_size
    )
    query_positions = torch.tensor(positions, dtype=torch.long)
    visible = key_positions.view(1, 1, -1) <= query_positions.unsqueeze(-1)
    bias = torch.zeros(visible.shape).masked_fill_(~visible, -math.inf)
    shared = reference[:num_shared]
    return RowGroup(
        rows=None if rows is None else torch.tensor(rows, dtype=torch.long),
        shared_blocks=torch.tensor(shared, dtype=torch.long),
        own_blocks=torch.tensor(own, dtype=torch.long),
        own_bias=bias,
        num_own_blocks=num_own_blocks,
        positions=query_positions,
        max_block_id=max([0, *shared, *own]),
        shared_span=_consecutive(shared),
        own_span=_consecutive(own),
    )


def _consecutive(block_ids: Sequence[int]) -> tuple[int, int] | None:
    """``(first, end)`` if ``block_ids`` is ``first, first + 1, ..., end - 1`` (not empty)."""
    if not block_ids:
        return None
    first = block_ids[0]
    if any(b != first + i for i, b in enumerate(block_ids)):
        return None
    return first, first + len(block_ids)


PagedAttentionKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, AttentionPlan, float], torch.Tensor
]
"""``(query [batch, num_queries, nheads, head_dim], key_cache, value_cache, plan, scale) ->
the attention output in the query's shape``: the whole compute op on one kernel, as
``NativePagedAttention`` computes it."""


def paged_attention_kwargs(
    slot_mapping: torch.Tensor, plan: AttentionPlan, kernel: PagedAttentionKernel | None = None
) -> dict[str, Any]:
    """Keyword arguments for an fms forward with our op, built once per step (not per layer).

    ``slot_mapping``: ``[batch * num_queries]``, where each query position's K/V is stored.
    ``kernel``: computes the attention (None: SDPA's flash kernel, on gathered blocks).
    """
    return {
        "attn_name": ATTN_NAME,
        "slot_mapping": slot_mapping,
        "plan": plan,
        "attention_kernel": kernel,
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
    """``query``: ``[batch, num_queries, nheads, head_dim]`` -> the same shape."""
    return attend(
        query, key_cache, value_cache, kwargs["plan"], scale_factor, kwargs.get("attention_kernel")
    )


def attend(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: AttentionPlan,
    scale_factor: float | None,
    kernel: PagedAttentionKernel | None,
) -> torch.Tensor:
    """The op's compute: ``query`` ``[batch, num_queries, nheads, head_dim]`` over the caches as
    ``plan`` says, with ``kernel`` (None: SDPA's flash kernel) -> the same shape.
    ``scale_factor`` as fms's attention holds it (None: ``1 / sqrt(head_dim)``)."""
    if kernel is None:
        return flash_attention(query, key_cache, value_cache, plan, scale_factor)
    head_dim = query.shape[-1]
    scale = scale_factor if scale_factor is not None else 1 / math.sqrt(head_dim)
    return kernel(query, key_cache, value_cache, plan, scale)


def flash_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: AttentionPlan,
    scale_factor: float | None,
) -> torch.Tensor:
    """The op's compute with SDPA's flash kernel: ``query`` ``[batch, num_queries, nheads,
    head_dim]`` over the caches as ``plan`` says -> the same shape (``scale_factor`` None:
    ``1 / sqrt(head_dim)``)."""
    batch, num_queries, nheads, head_dim = query.shape
    kvheads = key_cache.shape[2]
    group = nheads // kvheads
    # [batch, kvheads, num_queries * group, head_dim]: the query heads of one KV head as rows.
    q = query.view(batch, num_queries, kvheads, group, head_dim).transpose(1, 2)
    q = q.reshape(batch, kvheads, num_queries * group, head_dim)
    if len(plan.groups) == 1 and plan.groups[0].rows is None:
        out = _attend(q, key_cache, value_cache, plan.groups[0], group, scale_factor)
    else:
        out = torch.empty_like(q)
        for row_group in plan.groups:
            rows = row_group.rows
            assert rows is not None
            q_rows = q.index_select(0, rows)
            attended = _attend(q_rows, key_cache, value_cache, row_group, group, scale_factor)
            out.index_copy_(0, rows, attended)
    # [batch, kvheads, num_queries, group, head_dim] -> [batch, num_queries, nheads, head_dim]
    out = out.view(batch, kvheads, num_queries, group, head_dim).transpose(1, 2)
    return out.reshape(batch, num_queries, nheads, head_dim)


def store_and_attend(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    plan: AttentionPlan,
    scale_factor: float | None,
    kernel: PagedAttentionKernel | None = None,
) -> torch.Tensor:
    """What fms's attention calls of the op in one layer: store ``keys`` and ``values``
    (``[batch, num_queries, kvheads, head_dim]``) at ``slot_mapping``, then attend ``queries``
    (``[batch, num_queries, nheads, head_dim]``) over the caches as ``plan`` says, with
    ``kernel`` (None: SDPA's flash kernel)."""
    _store(keys, values, key_cache, value_cache, slot_mapping=slot_mapping)
    return attend(queries, key_cache, value_cache, plan, scale_factor, kernel)


def _attend(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    rows: RowGroup,
    group: int,
    scale: float | None,
) -> torch.Tensor:
    """Attention of one row group: ``q`` ``[n, kvheads, num_rows, head_dim]`` -> the same."""
    batch, kvheads, num_rows, head_dim = q.shape
    block_size = key_cache.shape[1]
    own_len = rows.num_own_blocks * block_size
    own_keys = _blocks(key_cache, rows.own_blocks, rows.own_span)
    own_keys = own_keys.view(batch, own_len, kvheads, head_dim)
    own_values = _blocks(value_cache, rows.own_blocks, rows.own_span)
    own_values = own_values.view(batch, own_len, kvheads, head_dim)
    out, lse = _flash_attention(
        q,
        own_keys.transpose(1, 2),
        own_values.transpose(1, 2),
        attn_mask=rows.grouped_bias(group, q.dtype),
        scale=scale,
    )
    if rows.shared_blocks.numel() == 0:
        return out
    # Every row of the group against the shared keys at once, then the two softmax parts merged
    # exactly through their log-sum-exps: the own part's share of the whole softmax is
    # e^lse / (e^lse + e^shared_lse) = sigmoid(lse - shared_lse). In float32 (the log-sum-exps
    # are float32 whatever the query's dtype), returned in the query's dtype.
    shared_len = rows.shared_blocks.numel() * block_size
    shared_keys = _blocks(key_cache, rows.shared_blocks, rows.shared_span)
    shared_values = _blocks(value_cache, rows.shared_blocks, rows.shared_span)
    shared_q = q.transpose(0, 1).reshape(1, kvheads, batch * num_rows, head_dim)
    shared_out, shared_lse = _flash_attention(
        shared_q,
        shared_keys.view(1, shared_len, kvheads, head_dim).transpose(1, 2),
        shared_values.view(1, shared_len, kvheads, head_dim).transpose(1, 2),
        scale=scale,
    )
    shared_out = shared_out.view(kvheads, batch, num_rows, head_dim).transpose(0, 1)
    shared_lse = shared_lse.view(kvheads, batch, num_rows).transpose(0, 1)
    own_share = torch.sigmoid(lse - shared_lse).unsqueeze(-1)
    return torch.lerp(shared_out.float(), out.float(), own_share).type_as(q)


def _blocks(
    cache: torch.Tensor, block_ids: torch.Tensor, span: tuple[int, int] | None
) -> torch.Tensor:
    """The cache's blocks ``block_ids`` in order: a view when they are the span, else a copy."""
    if span is not None:
        return cache[span[0] : span[1]]
    return cache.index_select(0, block_ids)


_flash_attention = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
"""SDPA's CPU kernel, called directly because it also returns the log-sum-exp of every query
row (needed to merge the shared and own parts): ``(q, k, v, *, attn_mask, scale) -> (out, lse)``
with ``q`` ``[batch, heads, rows, head_dim]``, ``lse`` ``[batch, heads, rows]``."""


register_attention_op(ATTN_NAME, _store, _compute)
