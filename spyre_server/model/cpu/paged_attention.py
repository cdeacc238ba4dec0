"""Our paged-attention op for fms.

K/V live in per-layer block tensors ``[num_blocks, block_size, kv_heads, head_dim]``. The store op
writes the new keys/values in place at the slots the scheduler chose (block 0 is the sink for
positions whose KV must not be stored). The compute op reads each row's context through its block
table, as planned once per step by ``plan_attention``:

- the server's plans are *row-invariant* (DESIGN §4: a prefix-cache hit, or caching off, must
  not change a token in any dtype): every row is an *own* row, whose keys are its table's
  blocks from a fixed start (block 0, or with a window the block of the first key its first
  query sees, rounded down to a multiple of ``KEY_GRID_BLOCKS``) up to its last query's block, padded with
  block 0 to the longest row and attended with a mask built from the query positions. A
  kernel then attends a row's keys in tiles on the same absolute grid, in the same order,
  whatever else the step holds (its first query, the other rows), so the row gets the same
  bits; the native kernels' tests check it bit for bit (test_batch_invariance.py);
- with ``share_blocks`` (not used by the server: it is not row-invariant), rows whose tables
  start with the same block form a group (the rows that share their first block with no other
  row form one more group), and a group's *shared* blocks, the leading blocks every row has in
  common that lie wholly before every query, are gathered once per layer for the whole group
  and merged with the own part through log-sum-exps: where those blocks end depends on the
  step, so a row's sums do too.

With a sliding window of ``W`` keys (Mistral's ``sliding_window``, HF transformers' semantics) the
query at position p attends the keys at positions ``p - W + 1 .. p`` (itself and the ``W - 1``
before it); without one, ``0 .. p``. A row's own blocks start at the block of the first key its
first query sees, rounded down to a multiple of ``KEY_GRID_BLOCKS`` (the keys before the window
masked), and with ``share_blocks`` the shared blocks are the common blocks that lie wholly inside
every query's window: blocks further outside every window of the row are not read at all (a
cached block among them is still shared by the scheduler, just not attended).

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
    ``positions``: ``[n, num_queries]`` the queries' positions; ``window``: the sliding window
    in keys (0: none); ``max_block_id``: the largest block id the group reads (0 for none), for
    a kernel to check against the cache.
    ``shared_span`` / ``own_span``: ``(first, end)`` when those block ids are the consecutive
    ``first..end-1`` (a request's blocks mostly are): the keys are then read in place through a
    view of the cache instead of being gathered into a copy.

    A row's own blocks are, in order, those before the shared blocks (with a window, from the
    block of the first key its first query sees, on the ``KEY_GRID_BLOCKS`` grid; without one
    there are none) and those after
    them, up to its last query's block.
    """

    rows: torch.Tensor | None
    shared_blocks: torch.Tensor
    own_blocks: torch.Tensor
    own_bias: torch.Tensor
    num_own_blocks: int
    positions: torch.Tensor
    max_block_id: int
    window: int = 0
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
    block_tables: Sequence[Sequence[int]],
    positions: Sequence[Sequence[int]],
    block_size: int,
    window: int | None = None,
    *,
    share_blocks: bool = False,
) -> AttentionPlan:
    """Plan a step whose row ``r`` has queries at ``positions[r]`` (ascending, same count in every
    row) over the context ``block_tables[r]`` (at least up to its last query's block). The query
    at position p attends the keys at positions 0..p of its own row, or with a ``window`` of W
    keys (None: none) those at positions p - W + 1 .. p.

    Without ``share_blocks`` (the server's plans): one row-invariant group of every row, in
    order (``rows`` None, no shared blocks; see the module docstring). With it: rows whose
    tables start with the same block form a group that reads its common blocks once; the rows
    that share their first block with no other row form one more group. A single group (rows
    that all start alike, or that share nothing) has ``rows`` None: every row, in order."""
    if window is not None and window < 1:
        raise ValueError(f"a sliding window of {window} keys sees nothing")
    if not share_blocks:
        return AttentionPlan(
            [_plan_group(None, block_tables, positions, block_size, window, share_blocks=False)]
        )
    first_blocks: dict[int, list[int]] = {}
    for row, (table, queries) in enumerate(zip(block_tables, positions, strict=True)):
        start = _window_start_block(queries[-1], block_size, window)
        shares = start < queries[0] // block_size  # a block wholly visible to every query
        key = table[0] if shares else -1 - row  # -1 - row: nothing to share
        first_blocks.setdefault(key, []).append(row)
    groups = [rows for rows in first_blocks.values() if len(rows) > 1]
    alone = [rows[0] for rows in first_blocks.values() if len(rows) == 1]
    if alone:
        groups.append(alone)
    if len(groups) == 1:  # every row, in order: no gathering of rows in the op
        return AttentionPlan(
            [_plan_group(None, block_tables, positions, block_size, window, share_blocks=True)]
        )
    return AttentionPlan(
        [
            _plan_group(
                rows,
                [block_tables[r] for r in rows],
                [positions[r] for r in rows],
                block_size,
                window,
                share_blocks=True,
            )
            for rows in groups
        ]
    )


def _window_start_block(position: int, block_size: int, window: int | None) -> int:
    """The first block wholly inside the window of the query at ``position`` (0 without one)."""
    if window is None:
        return 0
    return -(-max(0, position - window + 1) // block_size)


KEY_GRID_BLOCKS = 3
"""A windowed row's own keys start at a multiple of this many blocks (192 keys with blocks of
64): every native kernel's key tile (48 keys in attention.cpp, 64 in attention_dot_bf16.cpp)
divides it, so their tiles lie on one absolute grid. The kernels apply the same rule
(attention_common.h, ``kKeyGridBlocks``)."""


def _first_own_block(position: int, block_size: int, window: int | None) -> int:
    """The block of the first key the query at ``position`` sees (0 without a window), rounded
    down to a multiple of ``KEY_GRID_BLOCKS``."""
    if window is None:
        return 0
    block = max(0, position - window + 1) // block_size
    return block // KEY_GRID_BLOCKS * KEY_GRID_BLOCKS


def _plan_group(
    rows: list[int] | None,
    block_tables: Sequence[Sequence[int]],
    positions: Sequence[Sequence[int]],
    block_size: int,
    window: int | None,
    share_blocks: bool,
) -> RowGroup:
    # Shared: blocks wholly before every query and wholly inside every query's window (the
    # latest query's window starts last), the same block in every table.
    first_shared = _window_start_block(max(row[-1] for row in positions), block_size, window)
    end_shared = min(row[0] for row in positions) // block_size if share_blocks else 0
    num_shared = 0
    reference = block_tables[0]
    while first_shared + num_shared < end_shared and all(
        table[first_shared + num_shared] == reference[first_shared + num_shared]
        for table in block_tables
    ):
        num_shared += 1
    # Own: the blocks before the shared ones from the row's first visible block, then the
    # blocks after them up to its last query's block (with nothing shared: from the first
    # visible block on).
    own_ranges = []
    for row in positions:
        first = _first_own_block(row[0], block_size, window)
        last = -(-(row[-1] + 1) // block_size)
        if num_shared:
            own_ranges.append(((first, first_shared), (first_shared + num_shared, last)))
        else:
            own_ranges.append(((first, first), (first, last)))
    own_lengths = [(a1 - a0) + (b1 - b0) for (a0, a1), (b0, b1) in own_ranges]
    num_own_blocks = max(own_lengths)
    own = []
    key_positions = torch.full((len(positions), num_own_blocks * block_size), _PADDING)
    for r, (table, ranges, length) in enumerate(
        zip(block_tables, own_ranges, own_lengths, strict=True)
    ):
        keys = []
        for begin, end in ranges:
            own.extend(table[begin:end])
            keys.append(torch.arange(begin * block_size, end * block_size))
        own.extend([0] * (num_own_blocks - length))
        row_keys = torch.cat(keys)
        key_positions[r, : row_keys.numel()] = row_keys
    query_positions = torch.tensor(positions, dtype=torch.long)
    keys_seen = key_positions.unsqueeze(1)
    queries = query_positions.unsqueeze(-1)
    visible = keys_seen <= queries
    if window is not None:
        visible &= keys_seen > queries - window
    bias = torch.zeros(visible.shape).masked_fill_(~visible, -math.inf)
    shared = reference[first_shared : first_shared + num_shared]
    return RowGroup(
        rows=None if rows is None else torch.tensor(rows, dtype=torch.long),
        shared_blocks=torch.tensor(shared, dtype=torch.long),
        own_blocks=torch.tensor(own, dtype=torch.long),
        own_bias=bias,
        num_own_blocks=num_own_blocks,
        positions=query_positions,
        max_block_id=max([0, *shared, *own]),
        window=window or 0,
        shared_span=_consecutive(shared),
        own_span=_consecutive(own),
    )


_PADDING = torch.iinfo(torch.long).max
"""The position of a padding key in ``_plan_group``: after every query, never visible."""


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
