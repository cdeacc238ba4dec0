"""The attention plan (shared blocks read once per batch, own blocks per row) and the op's
results against independent oracles: a plain full forward of fms and attention computed naively
over each row's gathered context."""

from __future__ import annotations

import math

import pytest
import torch

from spyre_server.model.cpu import paged_attention
from spyre_server.model.cpu.paged_attention import AttentionPlan, RowGroup, plan_attention
from tests.spyre_server.model.test_model_correctness import (
    BS,
    LOGIT_TOL,
    Harness,
    full_forward_logits,
    max_abs,
    rand_tokens,
)

INF = math.inf


def visible(group: RowGroup) -> list[list[list[bool]]]:
    return (group.own_bias == 0).tolist()  # type: ignore[no-any-return]


def one_group(
    tables: list[list[int]], positions: list[list[int]], block_size: int = BS
) -> RowGroup:
    """The ``share_blocks`` plan of a step whose rows all start alike: one group of every row,
    in order."""
    plan = plan_attention(tables, positions, block_size, share_blocks=True)
    assert len(plan.groups) == 1 and plan.groups[0].rows is None
    return plan.groups[0]


# ================================================================================ the plan
def test_the_server_plan_reads_every_row_from_its_first_block_in_one_group() -> None:
    """Row-invariant (the default): rows sharing a prefix, a prefill chunk after its past and a
    loner all attend their whole tables as own blocks, in one group of every row, so no row's
    keys are split where another row or the step's first query says."""
    tables = [[5, 6, 7, 9], [5, 6, 7, 10, 11], [8]]
    plan = plan_attention(tables, [[200], [300], [10]], BS)
    (group,) = plan.groups
    assert group.rows is None and group.shared_blocks.tolist() == []
    assert group.own_blocks.tolist() == [5, 6, 7, 9, 0, 5, 6, 7, 10, 11, 8, 0, 0, 0, 0]
    (chunk,) = plan_attention([[11, 12, 13, 14, 15]], [list(range(256, 300))], BS).groups
    assert chunk.shared_blocks.tolist() == [] and chunk.own_blocks.tolist() == [11, 12, 13, 14, 15]
    assert torch.equal(chunk.own_bias[0] == 0, torch.arange(320) <= torch.arange(256, 300)[:, None])


def test_a_windowed_row_starts_on_the_key_grid() -> None:
    """With a window, a row-invariant plan starts a row's own keys at the block of its first
    visible key rounded down to KEY_GRID_BLOCKS (192 keys): the same absolute tile grid for
    every kernel, whichever query starts the step. Keys before the window stay masked."""
    table = list(range(1, 11))
    for first_query, first_block in [(400, 0), (500, 3), (700, 6), (830, 6)]:
        (group,) = plan_attention([table], [[first_query, first_query + 1]], BS, window=300).groups
        expected_first = (first_query - 299) // BS // 3 * 3
        assert expected_first == first_block
        assert group.own_blocks.tolist()[0] == table[first_block]
        keys = torch.arange(first_block * BS, group.num_own_blocks * BS + first_block * BS)
        seen = keys[group.own_bias[0, 0] == 0]
        assert seen.tolist() == list(range(first_query - 299, first_query + 1))


def test_decode_rows_with_a_common_prefix_share_it() -> None:
    tables = [[5, 6, 7, 9], [5, 6, 7, 10, 11], [5, 6, 7, 12]]
    positions = [[200], [300], [192]]
    plan = one_group(tables, positions)
    assert plan.shared_blocks.tolist() == [5, 6, 7]
    assert plan.num_own_blocks == 2
    assert plan.own_blocks.tolist() == [9, 0, 10, 11, 12, 0]
    assert plan.own_bias.shape == (3, 1, 128)
    keys = range(192, 320)  # key positions of the own part
    assert visible(plan) == [[[k <= p[0] for k in keys]] for p in positions]


def test_sharing_stops_at_the_first_differing_block() -> None:
    plan = one_group([[1, 2, 3, 4], [1, 8, 3, 4]], [[255], [255]])
    assert plan.shared_blocks.tolist() == [1]
    assert plan.own_blocks.tolist() == [2, 3, 4, 8, 3, 4]


def test_the_block_holding_a_query_is_never_shared() -> None:
    """Both rows decode into the same block (a prefix-cache hit being recomputed is written to
    block 0, but the table still names the cached block): a shared block is read without a
    mask, so it must lie wholly before every query."""
    plan = one_group([[1, 2, 3], [1, 2, 3]], [[130], [140]])
    assert plan.shared_blocks.tolist() == [1, 2]
    assert plan.own_blocks.tolist() == [3, 3]
    assert visible(plan) == [
        [[k <= 130 for k in range(128, 192)]],
        [[k <= 140 for k in range(128, 192)]],
    ]


def test_the_shortest_row_caps_the_shared_part() -> None:
    plan = one_group([[1, 2, 3, 4], [1, 2]], [[250], [70]])
    assert plan.shared_blocks.tolist() == [1]
    assert plan.own_blocks.tolist() == [2, 3, 4, 2, 0, 0]


def test_rows_that_share_nothing_form_one_unshared_group() -> None:
    group = one_group([[1, 2], [3, 4], [5]], [[100], [127], [10]])
    assert group.shared_blocks.tolist() == []
    assert group.own_blocks.tolist() == [1, 2, 3, 4, 5, 0]


def test_rows_are_grouped_by_their_first_block() -> None:
    """Two prompt families (blocks 1.. and 5..) and a loner: each family reads its own prefix
    once and pads only to its own longest row; the loner is a group of its own."""
    tables = [[1, 2, 3, 10], [5, 6, 11], [1, 2, 3, 12, 13], [9, 14, 15, 16, 17, 18], [5, 6, 19]]
    positions = [[200], [150], [300], [330], [140]]
    plan = plan_attention(tables, positions, BS, share_blocks=True)
    summary = [
        (
            g.rows.tolist() if g.rows is not None else None,
            g.shared_blocks.tolist(),
            g.own_blocks.tolist(),
        )
        for g in plan.groups
    ]
    assert summary == [
        ([0, 2], [1, 2, 3], [10, 0, 12, 13]),
        ([1, 4], [5, 6], [11, 19]),
        ([3], [9, 14, 15, 16, 17], [18]),  # alone: its whole past needs no mask
    ]


def test_a_row_with_no_full_block_before_its_query_shares_nothing() -> None:
    """Row 1 decodes at position 10: its first block holds its query, so even though it starts
    with the same block id as row 0 (a recomputed hit), it cannot read it unmasked."""
    plan = plan_attention([[1, 2, 3], [1], [1, 2, 4]], [[150], [10], [160]], BS, share_blocks=True)
    summary = [
        (g.rows.tolist() if g.rows is not None else None, g.shared_blocks.tolist())
        for g in plan.groups
    ]
    assert summary == [([0, 2], [1, 2]), ([1], [])]


def test_prefill_chunk_shares_its_whole_past_and_masks_its_own_blocks() -> None:
    """A chunk of queries at positions 256..383: the four blocks before it need no mask; its own
    two blocks are causal."""
    table = [11, 12, 13, 14, 15, 16, 17]
    plan = one_group([table], [list(range(256, 384))])
    assert plan.shared_blocks.tolist() == [11, 12, 13, 14]
    assert plan.own_blocks.tolist() == [15, 16]
    bias = plan.own_bias[0]
    assert bias.shape == (128, 128)
    assert torch.equal(bias == 0, torch.ones(128, 128, dtype=torch.bool).tril())
    assert bias[0, 1] == -INF


def test_prefill_starting_mid_table_after_skipped_hits() -> None:
    """Queries start at 192 (positions 128..191 were recomputed hits written to block 0, so the
    runner skipped them): blocks 0..2 are shared, the chunk's last block is own."""
    plan = one_group([[4, 5, 6, 7]], [list(range(192, 256))])
    assert plan.shared_blocks.tolist() == [4, 5, 6]
    assert plan.own_blocks.tolist() == [7]


def test_grouped_bias_repeats_each_query_for_its_heads() -> None:
    plan = one_group([[1, 2]], [[64, 65]])
    grouped = plan.grouped_bias(3, torch.float32)
    assert grouped.shape == (1, 1, 6, 64)
    for row in range(6):
        assert torch.equal(grouped[0, 0, row], plan.own_bias[0, row // 3])
    assert plan.grouped_bias(3, torch.float32) is grouped  # built once per step


def test_consecutive_blocks_are_read_in_place() -> None:
    """Consecutive block ids get a span (read through a view of the cache), also when they are
    several rows' own blocks back to back; any other order, or padding, gets none (gathered into
    a copy)."""
    plan = one_group([[4, 5, 6, 7]], [list(range(192, 230))])
    assert (plan.shared_span, plan.own_span) == ((4, 7), (7, 8))
    plan = one_group([[4, 6, 5, 7]], [list(range(192, 230))])
    assert (plan.shared_span, plan.own_span) == (None, (7, 8))
    plan = one_group([[5, 6, 7, 9], [5, 6, 7, 10, 11]], [[200], [300]])
    assert plan.shared_span == (5, 8)
    assert plan.own_blocks.tolist() == [9, 0, 10, 11] and plan.own_span is None
    plan = one_group([[1, 2]], [[10]])  # a query in the first block: nothing shared
    assert plan.shared_blocks.numel() == 0 and plan.shared_span is None
    assert plan.own_span == (1, 2)


# ================================================================= the op against oracles
def naive_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    tables: list[list[int]],
    positions: list[list[int]],
    window: int | None = None,
) -> torch.Tensor:
    """Per row and head: gather the row's whole context, softmax(q k^T / sqrt(d)) v over the
    keys at positions <= the query's (and > the query's - ``window``), in float64."""
    batch, num_queries, nheads, head_dim = query.shape
    kvheads = key_cache.shape[2]
    out = torch.empty(batch, num_queries, nheads, head_dim, dtype=torch.float64)
    for b in range(batch):
        keys = key_cache[tables[b]].reshape(-1, kvheads, head_dim).double()
        values = value_cache[tables[b]].reshape(-1, kvheads, head_dim).double()
        for i, p in enumerate(positions[b]):
            first = 0 if window is None else max(0, p - window + 1)
            for h in range(nheads):
                kv = h // (nheads // kvheads)
                scores = keys[first : p + 1, kv] @ query[b, i, h].double() / math.sqrt(head_dim)
                out[b, i, h] = torch.softmax(scores, dim=0) @ values[first : p + 1, kv]
    return out


@pytest.mark.parametrize(
    ("tables", "positions"),
    [
        ([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6]], [[250], [200], [130]]),  # shared + own
        ([[1, 2], [3, 4, 5], [6]], [[100], [150], [0]]),  # nothing shared
        (  # two families and a loner
            [[1, 2, 3, 4], [5, 6, 7], [1, 2, 8], [9, 10], [5, 6, 11]],
            [[250], [190], [140], [100], [150]],
        ),
        ([[7, 8, 9]], [list(range(130, 160))]),  # prefill: 2 shared blocks, causal own block
        ([[7, 8, 9]], [list(range(0, 40))]),  # prefill of the first block
        ([[9, 3, 7, 4]], [list(range(200, 230))]),  # prefill over scattered blocks (gathered)
        ([[3, 4, 5, 6], [3, 4, 8, 9]], [[230], [250]]),  # consecutive own blocks, two rows
    ],
)
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("share_blocks", [False, True], ids=["row-invariant", "shared"])
def test_op_equals_naive_attention(
    tables: list[list[int]],
    positions: list[list[int]],
    dtype: torch.dtype,
    tolerance: float,
    share_blocks: bool,
) -> None:
    """In float32 and in bfloat16 (``model.dtype: auto`` on AMX / AVX512-BF16 CPUs), where the
    result keeps the query's dtype: bfloat16's 8-bit mantissa sets that tolerance."""
    torch.manual_seed(0)
    nheads, kvheads, head_dim = 6, 2, 16
    key_cache = torch.randn(12, BS, kvheads, head_dim).to(dtype)
    value_cache = torch.randn(12, BS, kvheads, head_dim).to(dtype)
    query = torch.randn(len(tables), len(positions[0]), nheads, head_dim).to(dtype)
    plan = plan_attention(tables, positions, BS, share_blocks=share_blocks)
    got = paged_attention._compute(
        query, key_cache, value_cache, nheads, kvheads, 0.0, None, plan=plan
    )
    want = naive_attention(query, key_cache, value_cache, tables, positions)
    assert got.dtype == dtype
    assert got.shape == want.shape
    assert max_abs(got, want) < tolerance


def test_decode_batch_sharing_a_prompt_prefix_equals_full_forwards(
    tiny_llama: torch.nn.Module, one_thread: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ``share_blocks`` plan through the runner. Five requests in two families (prompts
    sharing 256 tokens, four blocks, within a family)
    with different lengths: every decode step's logits equal a full forward of that row's
    tokens, and the steps really read the common blocks through the shared path."""
    shared_counts: list[int] = []

    def spy(*args: object, **kwargs: object) -> AttentionPlan:
        plan = plan_attention(*args, **kwargs, share_blocks=True)  # type: ignore[arg-type,misc]
        shared_counts.append(min(g.shared_blocks.numel() for g in plan.groups))
        return plan

    monkeypatch.setattr("spyre_server.model.cpu.runner.plan_attention", spy)
    prefixes = [rand_tokens(256, seed=500), rand_tokens(256, seed=501)]
    h = Harness(tiny_llama, chunk_size=128, max_num_seqs=5)
    for i, suffix_len in enumerate((1, 30, 64, 100, 150)):
        h.add(f"r{i}", prefixes[i % 2] + rand_tokens(suffix_len, seed=600 + i), 12)
    h.run()
    assert max(h.decode_batch_sizes()) == 5
    assert max(shared_counts) >= 4
    worst = 0.0
    for trace in h.traces.values():
        for i, row in enumerate(trace.logits):
            diff = max_abs(row, full_forward_logits(tiny_llama, trace.prompt + trace.tokens[:i]))
            worst = max(worst, diff)
            assert diff <= LOGIT_TOL
    print(f"\nshared-prefix decode vs full forward: max |logit diff| {worst:.2e}")
