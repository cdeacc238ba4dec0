"""Sliding-window attention on the cpu backend's paths (HF transformers' ``sliding_window``: the
query at position p attends the keys at positions p - W + 1 .. p).

Oracles: softmax attention in float64 over each query's window (the plan, SDPA's flash path, our
kernels at both widths and the bfloat16 dot-product kernels), and a plain full forward of fms
with the window as an explicit mask (the steps of a model: chunked prefill, decode, prefix-cache
hits, every decoder). Tolerances are test_native_attention's and test_model_correctness's.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from fms.models import get_model

from spyre_server.model.cpu import paged_attention
from spyre_server.model.cpu.kernels.library import unsupported_cpu_reason
from spyre_server.model.cpu.paged_attention import KEY_GRID_BLOCKS, RowGroup, plan_attention
from tests.conftest import needs_native_kernels
from tests.spyre_server.model.cpu.test_native_attention import (
    CASES,
    DOTS,
    TOL,
    Case,
    attention_case,
    kernels,
    run_kernel,
)
from tests.spyre_server.model.cpu.test_paged_attention import naive_attention
from tests.spyre_server.model.test_model_correctness import (
    BS,
    LOGIT_TOL,
    Harness,
    max_abs,
    rand_tokens,
)

NATIVE = unsupported_cpu_reason() is None
"""Whether our kernels run here (x86-64 with AVX2 and FMA)."""


def visible(group: RowGroup) -> list[list[list[bool]]]:
    return (group.own_bias == 0).tolist()  # type: ignore[no-any-return]


def dense_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    tables: list[list[int]],
    positions: list[list[int]],
    window: int | None,
) -> torch.Tensor:
    """The dense masked reference, in float64: per row, every query head against the row's
    whole gathered context, softmax(q k^T / sqrt(d)) v with the keys outside the query's window
    (and after it) masked out."""
    batch, num_queries, nheads, head_dim = query.shape
    group = nheads // key_cache.shape[2]
    out = torch.empty(batch, num_queries, nheads, head_dim, dtype=torch.float64)
    for b in range(batch):
        keys = key_cache[tables[b]].flatten(0, 1).double().repeat_interleave(group, dim=1)
        values = value_cache[tables[b]].flatten(0, 1).double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", query[b].double(), keys) / math.sqrt(head_dim)
        q = torch.tensor(positions[b]).unsqueeze(1)
        k = torch.arange(keys.shape[0]).unsqueeze(0)
        seen = (k <= q) & (k > q - window) if window is not None else k <= q
        weights = torch.softmax(scores.masked_fill(~seen, -math.inf), dim=-1)
        out[b] = torch.einsum("hqk,khd->qhd", weights, values)
    return out


def test_the_dense_reference_is_the_naive_one() -> None:
    torch.manual_seed(2)
    tables, positions = [[3, 1, 2], [4, 5]], [list(range(100, 140)), list(range(60, 100))]
    cache = torch.randn(6, BS, 2, 8)
    query = torch.randn(2, 40, 6, 8)
    for window in (None, 1, 30, 80):
        want = naive_attention(query, cache, cache, tables, positions, window)
        assert (
            max_abs(dense_attention(query, cache, cache, tables, positions, window), want) < 1e-12
        )


def sees(p: int, window: int | None, keys: list[int]) -> list[bool]:
    return [k <= p and (window is None or k > p - window) for k in keys]


# ================================================================================ the plan
def test_a_decode_row_reads_only_the_blocks_its_window_touches() -> None:
    """Position 300, window 100: keys 201..300, in blocks 3 and 4; blocks 0-2 are not read."""
    plan = plan_attention([[11, 12, 13, 14, 15]], [[300]], BS, window=100)
    (group,) = plan.groups
    assert group.shared_blocks.tolist() == []
    assert group.own_blocks.tolist() == [14, 15]
    assert group.window == 100
    assert visible(group) == [[sees(300, 100, list(range(192, 320)))]]
    assert group.max_block_id == 15


def test_blocks_wholly_inside_the_window_are_shared_and_the_cut_block_is_own() -> None:
    """``share_blocks``: position 400, window 250: keys 151..400. Blocks 3-5 (192..383) lie
    wholly inside it and before the query: shared, unmasked. Block 2 (128..191) is cut by the
    window's start and block 6 holds the query: both own, masked; the own keys start on the
    key grid (block 0), the keys before the window masked."""
    plan = plan_attention([[1, 2, 3, 4, 5, 6, 7]], [[400]], BS, window=250, share_blocks=True)
    (group,) = plan.groups
    assert group.shared_blocks.tolist() == [4, 5, 6]
    assert group.own_blocks.tolist() == [1, 2, 3, 7]
    own_keys = [*range(0, 192), *range(384, 448)]
    assert visible(group) == [[sees(400, 250, own_keys)]]
    assert group.shared_span == (4, 7) and group.own_span is None


def test_a_decode_batch_shares_what_every_window_holds() -> None:
    """``share_blocks``: three rows of one prompt family: the latest window (position 420,
    window 200: from 221) starts in block 3, so blocks 4 and 5 are shared (every row's queries
    lie after them); each row's own blocks start on the key grid at or before its own first
    visible block."""
    tables = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 8], [1, 2, 3, 4, 5, 6, 9, 10]]
    positions = [[390], [400], [420]]
    (group,) = plan_attention(tables, positions, BS, window=200, share_blocks=True).groups
    assert group.shared_blocks.tolist() == [5, 6]
    # own: row 0 sees from 191 (block 2: grid block 0), rows 1 and 2 from 201 and 221 (block 3)
    assert group.own_blocks.tolist() == [1, 2, 3, 4, 7, 4, 8, 0, 0, 0, 4, 9, 0, 0, 0]
    assert group.num_own_blocks == 5
    keys = [[*range(0, 256), *range(384, 448)], [*range(192, 256), *range(384, 448)]]
    keys.append(keys[1])
    for row, p in enumerate((390, 400, 420)):
        assert visible(group)[row][0][: len(keys[row])] == sees(p, 200, keys[row])
        assert not any(visible(group)[row][0][len(keys[row]) :])  # padding


def test_a_prefill_chunk_with_a_window_reads_from_its_first_query_s_window() -> None:
    """Queries at 256..383, window 100: the first sees from 157 (block 2, on the key grid from
    block 0), the last from 284; every key is the row's own, masked outside each window."""
    (group,) = plan_attention([[5, 6, 7, 8, 9, 10]], [list(range(256, 384))], BS, 100).groups
    assert group.shared_blocks.tolist() == []
    assert group.own_blocks.tolist() == [5, 6, 7, 8, 9, 10]
    bias = group.own_bias[0]
    assert bias.shape == (128, 384)
    for i, p in enumerate(range(256, 384)):
        assert (bias[i] == 0).tolist() == sees(p, 100, list(range(0, 384)))


def test_a_windowed_row_reads_from_the_key_grid_in_any_step() -> None:
    """A query at position 700 with a window of 300 (keys 401..700, from block 6): alone, in a
    chunk from position 640 (whose first query sees from block 5) and in a chunk from 420 (from
    block 1) its own keys start at a multiple of KEY_GRID_BLOCKS, so a kernel's tiles lie on
    one absolute grid (the tiles before its window are wholly masked for it)."""
    table = list(range(1, 13))
    starts = []
    for first in (700, 640, 420):
        (group,) = plan_attention([table], [list(range(first, 701))], BS, window=300).groups
        starts.append(group.own_blocks.tolist()[0] - 1)
    assert starts == [6, 3, 0]
    assert all(s % KEY_GRID_BLOCKS == 0 for s in starts)


def test_a_window_longer_than_the_context_plans_as_no_window() -> None:
    tables = [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6]]
    positions = [[250], [200], [130]]
    plain, windowed = (plan_attention(tables, positions, BS, w).groups[0] for w in (None, 251))
    for name in ("shared_blocks", "own_blocks", "own_bias", "positions"):
        assert torch.equal(getattr(plain, name), getattr(windowed, name)), name
    assert (plain.window, windowed.window) == (0, 251)


def test_rows_whose_windows_share_no_block_are_not_grouped_for_it() -> None:
    """Rows of one family whose common prefix is wholly outside their windows: nothing to
    share, so each row is planned alone (one unshared group)."""
    plan = plan_attention([[1, 2, 3, 4], [1, 2, 3, 5]], [[250], [240]], BS, window=20)
    (group,) = plan.groups
    assert group.shared_blocks.tolist() == []
    assert group.own_blocks.tolist() == [4, 5]


def test_a_window_of_no_keys_is_refused() -> None:
    with pytest.raises(ValueError, match="window of 0 keys"):
        plan_attention([[1]], [[3]], BS, window=0)


# ================================================================= SDPA's flash path
FLASH_CASES = [
    ([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6]], [[250], [200], [130]]),  # a family, decode
    ([[1, 2], [3, 4, 5], [6]], [[100], [150], [0]]),  # nothing shared
    (  # two families and a loner
        [[1, 2, 3, 4], [5, 6, 7], [1, 2, 8], [9, 10], [5, 6, 11]],
        [[250], [190], [140], [100], [150]],
    ),
    ([[7, 8, 9, 10, 11]], [list(range(260, 300))]),  # prefill late in a long context
    ([[7, 8, 9]], [list(range(0, 40))]),  # prefill of the first block
    ([[9, 3, 7, 4, 2, 1]], [list(range(320, 350))]),  # scattered blocks (gathered)
    ([[1, 2, 3, 4, 5, 6, 7]], [[400]]),  # a lone row: shared middle, own both sides
]


@pytest.mark.parametrize(("tables", "positions"), FLASH_CASES)
@pytest.mark.parametrize("window", [1, 50, 64, 65, 130, 250, 1000])
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_the_flash_path_equals_windowed_attention(
    tables: list[list[int]],
    positions: list[list[int]],
    window: int,
    dtype: torch.dtype,
    tolerance: float,
) -> None:
    torch.manual_seed(0)
    nheads, kvheads, head_dim = 6, 2, 16
    key_cache = torch.randn(12, BS, kvheads, head_dim).to(dtype)
    value_cache = torch.randn(12, BS, kvheads, head_dim).to(dtype)
    query = torch.randn(len(tables), len(positions[0]), nheads, head_dim).to(dtype)
    plan = plan_attention(tables, positions, BS, window)
    got = paged_attention._compute(
        query, key_cache, value_cache, nheads, kvheads, 0.0, None, plan=plan
    )
    want = dense_attention(query, key_cache, value_cache, tables, positions, window)
    assert got.dtype == dtype
    assert max_abs(got, want) < tolerance


def poison_outside_windows(
    cache: torch.Tensor, tables: list[list[int]], positions: list[list[int]], window: int
) -> torch.Tensor:
    """``cache`` with NaN in every block before the key grid's start of every query's window
    (and that is not block 0, the padding block): a path that read one would return NaN."""
    touched = {0}
    for table, queries in zip(tables, positions, strict=True):
        for p in queries:
            first = max(0, p - window + 1) // BS // KEY_GRID_BLOCKS * KEY_GRID_BLOCKS
            touched.update(table[first : p // BS + 1])
    poisoned = cache.clone()
    for block in range(cache.shape[0]):
        if block not in touched:
            poisoned[block] = math.nan
    return poisoned


@pytest.mark.parametrize(("tables", "positions"), FLASH_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_outside_every_window_are_never_read(
    tables: list[list[int]], positions: list[list[int]], dtype: torch.dtype
) -> None:
    """The prefix cache keeps (and shares) blocks that have slid out of every window: every
    attention path skips those before the window's key grid start (NaN there changes
    nothing)."""
    torch.manual_seed(1)
    nheads, kvheads, head_dim, window = 4, 2, 64, 70
    key_cache = torch.randn(12, BS, kvheads, head_dim).to(dtype)
    value_cache = torch.randn(12, BS, kvheads, head_dim).to(dtype)
    query = torch.randn(len(tables), len(positions[0]), nheads, head_dim).to(dtype)
    want = dense_attention(query, key_cache, value_cache, tables, positions, window)
    keys = poison_outside_windows(key_cache, tables, positions, window)
    values = poison_outside_windows(value_cache, tables, positions, window)
    plan = plan_attention(tables, positions, BS, window)
    attentions: list[Any] = [None]
    if NATIVE:
        from spyre_server.model.cpu.kernels.library import bf16_dot_unsupported_reason
        from spyre_server.model.cpu.ops.native_attention import NativePagedAttention

        attentions.append(NativePagedAttention(kernels()))
        for unit in ("amx", "avx512_bf16"):
            if dtype == torch.bfloat16 and bf16_dot_unsupported_reason(unit) is None:  # type: ignore[arg-type]
                attentions.append(NativePagedAttention(kernels(), bf16_dot=unit))  # type: ignore[arg-type]
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for attention in attentions:
        got = paged_attention.attend(query, keys, values, plan, None, attention)
        assert not got.isnan().any()
        assert max_abs(got, want) < tolerance


# ======================================================================= our kernels
WINDOWS = [1, 45, 130]
"""One key; under a 48-key tile; cutting 16- and 64-token blocks and spanning several."""


def window_case(
    dtype: torch.dtype, head_dim: int, kvheads: int, group: int, case: Case, window: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[list[int]], list[list[int]], Any]:
    """``attention_case`` and its plan with ``window``."""
    query, key_cache, value_cache, tables, positions = attention_case(
        dtype, head_dim, kvheads, group, case
    )
    plan = plan_attention(tables, positions, case[0], window)
    return query, key_cache, value_cache, tables, positions, plan


def run_plan(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: Any,
    threads: int,
    bf16_dot: str | None = None,
    lib: Any = None,
) -> torch.Tensor:
    """``run_kernel`` on every row group of ``plan`` (with a window, rows of one prompt family
    can fall into several), the rows put back in order."""
    out = torch.full_like(query, math.nan)
    for group in plan.groups:
        rows = torch.arange(query.shape[0]) if group.rows is None else group.rows
        attended = run_kernel(
            query[rows].contiguous(), key_cache, value_cache, group, threads, bf16_dot, lib
        )
        out[rows] = attended
    return out


@needs_native_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("head_dim", "kvheads", "group"), [(64, 1, 1), (128, 3, 3)])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_float64_windowed_attention(
    dtype: torch.dtype, head_dim: int, kvheads: int, group: int, window: int, case: Case
) -> None:
    """test_native_attention's cases (decode rows, prefill chunks, 16- and 64-token blocks)
    with a window, the keys split over 1, 2 and 5 ranges."""
    query, key_cache, value_cache, tables, positions, plan = window_case(
        dtype, head_dim, kvheads, group, case, window
    )
    want = dense_attention(query, key_cache, value_cache, tables, positions, window)
    rounding = 0.0 if dtype == torch.float32 else 2.0**-8  # the output's one rounding
    for threads in (1, 2, 5):
        got = run_plan(query, key_cache, value_cache, plan, threads)
        error = (got.double() - want).abs() - rounding * want.abs()
        assert float(error.max()) < TOL, threads


@needs_native_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("case", CASES)
def test_the_512_bit_code_gives_the_avx2_bits_with_a_window(
    dtype: torch.dtype, window: int, case: Case, both_widths: tuple[Any, Any]
) -> None:
    query, key_cache, value_cache, _, _, plan = window_case(dtype, 64, 3, 3, case, window)
    outputs = []
    for enable, lib in enumerate(both_widths):
        assert lib.avx512 == enable
        outputs.append([run_plan(query, key_cache, value_cache, plan, t, lib=lib) for t in (1, 2)])
    for avx2, wide in zip(*outputs, strict=True):
        assert not avx2.isnan().any()
        assert torch.equal(avx2, wide)


@pytest.mark.parametrize("bf16_dot", DOTS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("case", CASES)
def test_dot_kernels_match_float64_windowed_attention(
    bf16_dot: str, head_dim: int, window: int, case: Case
) -> None:
    query, key_cache, value_cache, tables, positions, plan = window_case(
        torch.bfloat16, head_dim, 3, 3, case, window
    )
    want = dense_attention(query, key_cache, value_cache, tables, positions, window)
    probabilities = 2.0**-9 * float(value_cache.double().abs().max())
    for threads in (1, 2, 5):
        got = run_plan(query, key_cache, value_cache, plan, threads, bf16_dot)
        error = (got.double() - want).abs() - 2.0**-8 * want.abs() - probabilities
        assert float(error.max()) < TOL, threads


@needs_native_kernels
@pytest.mark.parametrize("window", [3, 64, 200])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_op_with_our_kernels_equals_windowed_attention(window: int, dtype: torch.dtype) -> None:
    """Through the wrapper, every row group of a decode batch (two families and a loner) and a
    prefill chunk late in its context, on each kernel this CPU runs."""
    from spyre_server.model.cpu.kernels.library import bf16_dot_unsupported_reason
    from spyre_server.model.cpu.ops.native_attention import NativePagedAttention

    torch.manual_seed(5)
    nheads, kvheads, head_dim = 6, 2, 64
    key_cache = torch.randn(16, BS, kvheads, head_dim).to(dtype)
    value_cache = torch.randn(16, BS, kvheads, head_dim).to(dtype)
    ops = [NativePagedAttention(kernels())]
    if dtype == torch.bfloat16:
        for unit in ("amx", "avx512_bf16"):
            if bf16_dot_unsupported_reason(unit) is None:  # type: ignore[arg-type]
                ops.append(NativePagedAttention(kernels(), bf16_dot=unit))  # type: ignore[arg-type]
    for tables, positions in (
        (
            [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [7, 8, 9], [7, 8, 10], [11, 12, 13, 14]],
            [[300], [290], [170], [140], [240]],
        ),
        ([[1, 2, 3, 4, 5, 6, 7]], [list(range(380, 420))]),
    ):
        plan = plan_attention(tables, positions, BS, window)
        query = torch.randn(len(tables), len(positions[0]), nheads, head_dim).to(dtype)
        want = dense_attention(query, key_cache, value_cache, tables, positions, window)
        slack = 0.0 if dtype == torch.float32 else 2.0**-8 * float(want.abs().max())
        slack += 0.0 if dtype == torch.float32 else 2.0**-9 * float(value_cache.abs().max())
        for op in ops:
            assert max_abs(op(query, key_cache, value_cache, plan, 0.125), want) < TOL + slack


# ===================================================================== the model's steps
WINDOW = 100


@pytest.fixture(scope="module")
def llama64() -> torch.nn.Module:
    """fms's micro llama with head_dim 64 (our kernels' size): 4 query heads over 2 KV heads."""
    torch.manual_seed(3)
    model = get_model("llama", "micro", data_type=torch.float32, nheads=4, kvheads=2, emb_dim=256)
    model.eval()
    return model


@torch.inference_mode()
def windowed_full_forward(model: torch.nn.Module, token_ids: list[int], window: int) -> Any:
    """The oracle: one plain forward over the whole sequence with the window as its mask."""
    key = (id(model), tuple(token_ids), window)
    if key not in _ORACLE:
        n = len(token_ids)
        q = torch.arange(n).unsqueeze(1)
        k = torch.arange(n).unsqueeze(0)
        mask = ((k <= q) & (k > q - window)).unsqueeze(0)
        _ORACLE[key] = model(torch.tensor([token_ids]), mask=mask)[0, -1].float()
    return _ORACLE[key]


_ORACLE: dict[tuple[int, tuple[int, ...], int], Any] = {}
"""The oracle's answers in this module (the same tokens are checked on every path)."""


def step_paths(model: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """Harness arguments for every way the cpu runner can compute a float32 step of ``model``:
    fms's forward through our op with SDPA's flash kernel or ours, and each decoder that
    covers the model with the attention it takes."""
    from spyre_server.model.cpu import prepare

    paths: dict[str, dict[str, Any]] = {"fms-flash": {}}
    if not NATIVE:
        return paths
    native = prepare.cpu_attention_kernel("native", dtype=torch.float32, head_dim=64)
    paths["fms-native"] = {"attention": native}
    copy = prepare.cpu_inference_copy(model, linear_kernel="native", dtype=torch.float32)
    decoder = prepare.cpu_decoder(copy, native)
    if decoder is not None:
        paths[type(decoder).__name__] = {"attention": native, "decoder": decoder, "model": copy}
    aten_copy = prepare.cpu_inference_copy(model, linear_kernel="aten", dtype=torch.float32)
    aten = prepare.cpu_decoder(aten_copy, None)
    if aten is not None:
        paths[f"{type(aten).__name__}-flash"] = {"decoder": aten, "model": aten_copy}
    return paths


def test_chunked_prefill_and_decode_with_a_window_equal_full_forwards(
    llama64: torch.nn.Module, one_thread: None
) -> None:
    """Prompts of 150 to 450 tokens (up to four 128-token chunks) in two families sharing 256
    tokens, decoded together, with a 100-key window: every sampled token's logits equal a full
    forward of the row's tokens under the window mask, on every path; and the window matters
    (the full causal forward differs)."""
    prefixes = [rand_tokens(256, seed=900), rand_tokens(256, seed=901)]
    prompts = [rand_tokens(150, seed=902)] + [
        prefixes[i % 2] + rand_tokens(n, seed=910 + i) for i, n in enumerate((1, 64, 130, 194))
    ]
    for name, kwargs in step_paths(llama64).items():
        model = kwargs.pop("model", llama64)
        h = Harness(model, chunk_size=128, max_num_seqs=5, sliding_window=WINDOW, **kwargs)
        for i, prompt in enumerate(prompts):
            h.add(f"r{i}", prompt, 12)
        with torch.inference_mode():
            h.run()
        assert max(h.decode_batch_sizes()) >= 4
        worst = 0.0
        for trace in h.traces.values():
            for i, row in enumerate(trace.logits):
                tokens = trace.prompt + trace.tokens[:i]
                diff = max_abs(row, windowed_full_forward(llama64, tokens, WINDOW))
                worst = max(worst, diff)
                assert diff <= LOGIT_TOL, name
        print(f"\n{name}: windowed steps vs full forward: max |logit diff| {worst:.2e}")
    long = prompts[-1]
    assert (
        max_abs(
            windowed_full_forward(llama64, long, WINDOW),
            windowed_full_forward(llama64, long, 10**6),
        )
        > 1e-2
    )


def test_a_prefix_cache_hit_with_a_window_gives_the_first_run_s_answers(
    llama64: torch.nn.Module, one_thread: None
) -> None:
    """The same prompts again (their blocks cached, most of them outside the last chunk's
    window), and a run with caching off: the same greedy tokens, the logits within rounding."""
    prompts = [rand_tokens(n, seed=950 + n) for n in (70, 257, 450)]
    prompts.append(prompts[-1][:300] + rand_tokens(90, seed=960))
    for name, kwargs in step_paths(llama64).items():
        model = kwargs.pop("model", llama64)
        runs = []
        for caching in (True, False):
            h = Harness(
                model,
                chunk_size=128,
                max_num_seqs=4,
                sliding_window=WINDOW,
                enable_prefix_caching=caching,
                **kwargs,
            )
            for repeat in range(2 if caching else 1):
                for i, prompt in enumerate(prompts):
                    h.add(f"r{i}-{repeat}", prompt, 8)
                with torch.inference_mode():
                    h.run()
            runs.append(h.traces)
        cached, off = runs
        assert any(t.num_cached_tokens for t in cached.values())
        for i in range(len(prompts)):
            first, rerun, uncached = cached[f"r{i}-0"], cached[f"r{i}-1"], off[f"r{i}-0"]
            assert rerun.num_cached_tokens or len(prompts[i]) <= 128, name  # one chunk: no skip
            assert first.tokens == rerun.tokens == uncached.tokens, name
            for a, b, c in zip(first.logits, rerun.logits, uncached.logits, strict=True):
                assert max_abs(a, b) <= LOGIT_TOL and max_abs(a, c) <= LOGIT_TOL, name
