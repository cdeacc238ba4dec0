"""Our paged-attention kernels (``model.attention_kernel: native``, ``amx``, ``avx512_bf16``).

Oracles: softmax attention in float64 over each query's causal context (the kernel alone and the
paged-attention op), and a plain full forward of fms (the steps of a model run through it).
Tolerances: float32 attention over at most a few hundred keys agrees with float64 to ~1e-6;
2e-5 leaves room for the polynomial exp (relative error ~1e-7) summed over the keys. In bfloat16
the kernel computes in float32 on the (exact) widened inputs and rounds its output once: the
float64 oracle over the same bfloat16 inputs, within half a bfloat16 step (2**-8 relative) on
top. The bfloat16 dot-product kernels (AMX, AVX512-BF16) also round each probability to bfloat16
before the product with the values (as SDPA's flash kernel does): at most 2**-9 of each term
p * v, so 2**-9 * max |v| more.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import math
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from fms.models import get_model

from spyre_server.model.cpu import paged_attention
from spyre_server.model.cpu import prepare as cpu_model
from spyre_server.model.cpu.errors import AttentionKernelError
from spyre_server.model.cpu.kernels import library as native_kernels
from spyre_server.model.cpu.kernels.library import (
    amx_unsupported_reason,
    avx512_bf16_unsupported_reason,
    default_kernel_dir,
    load_native_kernels,
)
from spyre_server.model.cpu.ops.native_attention import NativePagedAttention
from spyre_server.model.cpu.paged_attention import RowGroup, plan_attention
from spyre_server.model.cpu.prepare import cpu_attention_kernel, resolve_attention_kernel
from spyre_server.model.loading import ModelLoadError
from tests.conftest import needs_amx, needs_avx512_bf16, needs_native_kernels
from tests.spyre_server.model.cpu.test_paged_attention import naive_attention
from tests.spyre_server.model.test_model_correctness import (
    BS,
    LOGIT_TOL,
    Harness,
    full_forward_logits,
    max_abs,
    rand_tokens,
)

pytestmark = needs_native_kernels
TOL = 2e-5
DOTS = [pytest.param("amx", marks=needs_amx), pytest.param("avx512_bf16", marks=needs_avx512_bf16)]
"""The bfloat16 dot-product kernels, each where this CPU runs it."""


def kernels() -> native_kernels.NativeKernels:
    return load_native_kernels(default_kernel_dir())


def run_kernel(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    group: RowGroup,
    threads: int,
    bf16_dot: str | None = None,
    lib: native_kernels.NativeKernels | None = None,
) -> torch.Tensor:
    """The kernel called directly (float32 or bfloat16, as the query; ``bf16_dot``: the
    bfloat16 dot-product one on that unit; of ``lib``, default ``kernels()``), with ``threads``
    key ranges and tasks' scratch areas, scratch and output NaN before."""
    lib = lib or kernels()
    kernel = lib.paged_attention if query.dtype == torch.float32 else lib.paged_attention_bf16
    scratch_numel = lib.paged_attention_scratch_numel
    if bf16_dot is not None:
        kernel = {"amx": lib.paged_attention_amx, "avx512_bf16": lib.paged_attention_avx512_bf16}[
            bf16_dot
        ]
        scratch_numel = lib.paged_attention_dot_bf16_scratch_numel
    batch, num_queries, nheads, head_dim = query.shape
    _, block_size, kvheads, _ = key_cache.shape
    rows = batch * num_queries * (nheads // kvheads)
    scratch = torch.full((scratch_numel(head_dim, kvheads, rows, threads),), math.nan)
    out = torch.full_like(query, math.nan)
    status = kernel(
        head_dim, query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), block_size,
        kvheads, nheads // kvheads, batch, num_queries, group.shared_blocks.data_ptr(),
        group.shared_blocks.numel(), group.own_blocks.data_ptr(), group.num_own_blocks,
        group.positions.data_ptr(), group.window, 1 / math.sqrt(head_dim), threads,
        scratch.data_ptr(), out.data_ptr(),
    )  # fmt: skip
    assert status == 0
    return out


def scattered_tables(num_blocks: int, shared: int, own: list[int], seed: int) -> list[list[int]]:
    """Block tables with ``shared`` common blocks then each row's ``own[r]`` blocks, every id
    drawn at random from 1..num_blocks-1 (so hardly ever consecutive)."""
    ids = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(seed)) + 1
    assert shared + sum(own) <= num_blocks - 1
    common = ids[:shared].tolist()
    tables, used = [], shared
    for n in own:
        tables.append(common + ids[used : used + n].tolist())
        used += n
    return tables


Case = tuple[int, int, list[int], int, int | None]
CASES: list[Case] = [
    # (block_size, shared blocks, own blocks per row, queries per row, first query's offset
    #  into the own blocks): decode rows, prefill chunks, tails of every kind.
    (64, 3, [1, 2, 3, 1, 2, 1, 3, 2], 1, None),  # decode, 8 rows, ragged own lengths
    (64, 0, [1, 3], 1, None),  # decode over nothing shared
    (16, 5, [4], 50, 3),  # prefill: 48-key tiles straddle 16-token blocks
    (16, 0, [13], 193, 0),  # prefill from position 0, 193 queries: row-block tails
    (64, 2, [2], 64, 64),  # a warm prefill: one block of own queries after the shared ones
    (64, 1, [4], 256, 0),  # a full 256-token chunk after one shared block
    (16, 7, [3, 2], 7, 9),  # two sequences of 7 queries each
]


def attention_case(
    dtype: torch.dtype, head_dim: int, kvheads: int, group: int, case: Case
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[list[int]], list[list[int]]]:
    """``(query, key_cache, value_cache, tables, positions)`` of ``case``, one of CASES:
    scattered block ids, a decode row's query somewhere in its last block, a chunk's at
    ``offset`` into the own blocks."""
    block_size, shared, own, num_queries, offset = case
    torch.manual_seed(head_dim + kvheads + num_queries)
    tables = scattered_tables(64, shared, own, seed=num_queries)
    positions = []
    for table in tables:
        if offset is None:  # decode: somewhere in the row's last block
            last = len(table) * block_size - 1 - int(torch.randint(block_size, ()))
            positions.append([last])
        else:
            first = shared * block_size + offset
            positions.append(list(range(first, first + num_queries)))
            assert positions[-1][-1] < len(table) * block_size
    key_cache = torch.randn(64, block_size, kvheads, head_dim).to(dtype)
    value_cache = torch.randn(64, block_size, kvheads, head_dim).to(dtype)
    query = torch.randn(len(tables), len(positions[0]), kvheads * group, head_dim).to(dtype)
    return query, key_cache, value_cache, tables, positions


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
# 11 KV heads: more than a task of the own blocks covers (attention_common.h's kOwnHeads), in
# uneven parts.
@pytest.mark.parametrize(("kvheads", "group"), [(1, 1), (3, 3), (2, 1), (11, 1)])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("share_blocks", [False, True], ids=["row-invariant", "shared"])
def test_kernel_matches_float64_attention(
    dtype: torch.dtype, head_dim: int, kvheads: int, group: int, case: Case, share_blocks: bool
) -> None:
    """Against softmax attention in float64 over each query's whole causal context, read in
    place through scattered block ids; with ``share_blocks``, the shared keys split over 1, 2
    and 5 ranges (5 leave some empty)."""
    query, key_cache, value_cache, tables, positions = attention_case(
        dtype, head_dim, kvheads, group, case
    )
    block_size, shared = case[0], case[1]
    plan = plan_attention(tables, positions, block_size, share_blocks=share_blocks)
    assert len(plan.groups) == 1
    if len(tables) > 1:
        assert plan.groups[0].shared_blocks.numel() == (shared if share_blocks else 0)
    want = naive_attention(
        query.double(), key_cache.double(), value_cache.double(), tables, positions
    )
    rounding = 0.0 if dtype == torch.float32 else 2.0**-8  # the output's one rounding
    for threads in (1, 2, 5):
        got = run_kernel(query, key_cache, value_cache, plan.groups[0], threads)
        assert got.dtype == dtype
        error = (got.double() - want).abs() - rounding * want.abs()
        assert float(error.max()) < TOL, threads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("kvheads", "group"), [(3, 3), (2, 1)])
@pytest.mark.parametrize("case", CASES)
def test_the_512_bit_code_gives_the_avx2_bits(
    dtype: torch.dtype,
    head_dim: int,
    kvheads: int,
    group: int,
    case: Case,
    both_widths: tuple[Any, Any],
) -> None:
    """On a CPU with AVX512F: the same outputs bit for bit with the 512-bit products and softmax
    on and off (float32 and bfloat16 caches; partial tiles, causal tails, 1 and 2 key ranges),
    so the float64 test above holds for the AVX2 code wherever it holds here."""
    query, key_cache, value_cache, tables, positions = attention_case(
        dtype, head_dim, kvheads, group, case
    )
    plan = plan_attention(tables, positions, case[0])
    outputs = []
    for enable, lib in enumerate(both_widths):
        assert lib.avx512 == enable
        outputs.append(
            [run_kernel(query, key_cache, value_cache, plan.groups[0], t, lib=lib) for t in (1, 2)]
        )
    for avx2, wide in zip(*outputs, strict=True):
        assert not avx2.isnan().any()
        assert torch.equal(avx2, wide)


@pytest.mark.parametrize("bf16_dot", DOTS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("kvheads", "group"), [(1, 1), (3, 3), (2, 1), (11, 1)])
@pytest.mark.parametrize("case", CASES)
def test_dot_kernels_match_float64_attention(
    bf16_dot: str, head_dim: int, kvheads: int, group: int, case: Case
) -> None:
    """The bfloat16 dot-product kernels on the same cases (64-key tiles across 16- and 64-token
    blocks, 16-row tiles past the rows' end), against float64 attention over the same bfloat16
    values."""
    query, key_cache, value_cache, tables, positions = attention_case(
        torch.bfloat16, head_dim, kvheads, group, case
    )
    plan = plan_attention(tables, positions, case[0])
    want = naive_attention(
        query.double(), key_cache.double(), value_cache.double(), tables, positions
    )
    probabilities = 2.0**-9 * float(value_cache.double().abs().max())
    for threads in (1, 2, 5):
        got = run_kernel(query, key_cache, value_cache, plan.groups[0], threads, bf16_dot)
        assert got.dtype == torch.bfloat16
        error = (got.double() - want).abs() - 2.0**-8 * want.abs() - probabilities
        assert float(error.max()) < TOL, threads


@pytest.mark.parametrize("bf16_dot", DOTS)
def test_dot_kernel_rows_never_see_later_keys(bf16_dot: str) -> None:
    """A 100-query chunk whose last position's key and value are changed to large values: every
    other row's output is the same bits (the masked keys share the rows' tiles), the last one's
    moves."""
    block_size, kvheads, head_dim = 16, 3, 64
    tables = [[5, 9, 2, 7, 11, 3, 8, 1]]
    positions = [list(range(20, 120))]
    plan = plan_attention(tables, positions, block_size)
    torch.manual_seed(7)
    key_cache = torch.randn(12, block_size, kvheads, head_dim).bfloat16()
    value_cache = torch.randn(12, block_size, kvheads, head_dim).bfloat16()
    query = torch.randn(1, 100, kvheads * 3, head_dim).bfloat16()
    before = run_kernel(query, key_cache, value_cache, plan.groups[0], 2, bf16_dot)
    last_block, last_offset = tables[0][119 // block_size], 119 % block_size
    key_cache[last_block, last_offset] = 300.0
    value_cache[last_block, last_offset] = -1000.0
    after = run_kernel(query, key_cache, value_cache, plan.groups[0], 2, bf16_dot)
    assert torch.equal(after[:, :99], before[:, :99])
    assert not torch.equal(after[:, 99], before[:, 99])


def test_the_kernel_refuses_other_head_dims() -> None:
    lib = kernels()
    assert lib.paged_attention_scratch_numel(48, 1, 1, 1) == -1
    assert lib.paged_attention_dot_bf16_scratch_numel(48, 1, 1, 1) == -1
    null = 0
    args = (null, null, null, 16, 1, 1, 1, 1, null, 0, null, 1, null, 0, 1.0, 1, null, null)
    assert lib.paged_attention(48, *args) == 1
    assert lib.paged_attention_amx(48, *args) == 1  # before any AMX instruction
    assert lib.paged_attention_avx512_bf16(48, *args) == 1


def test_the_wrapper_checks_its_input() -> None:
    attend = NativePagedAttention(kernels())
    cache = torch.randn(6, BS, 2, 64)
    plan = plan_attention([[1, 2, 3]], [[150]], BS)
    query = torch.randn(1, 1, 4, 64)
    want = naive_attention(query, cache, cache, [[1, 2, 3]], [[150]])
    assert max_abs(attend(query, cache, cache, plan, 0.125), want) < TOL
    with pytest.raises(ValueError, match="float32 or bfloat16 with head_dim 64 or 128"):
        attend(query.double(), cache, cache, plan, 0.125)
    with pytest.raises(ValueError, match="contiguous float32 block tensors"):
        attend(query, cache.transpose(0, 1), cache, plan, 0.125)
    with pytest.raises(ValueError, match="contiguous bfloat16 block tensors"):
        attend(query.bfloat16(), cache, cache, plan, 0.125)  # caches of another dtype
    with pytest.raises(ValueError, match="reads block 7 of a cache of 6"):
        attend(query, cache, cache, plan_attention([[1, 7]], [[100]], BS), 0.125)
    with pytest.raises(ValueError, match="cannot attend"):
        attend(torch.randn(2, 1, 4, 64), cache, cache, plan, 0.125)


@pytest.mark.parametrize(
    ("tables", "positions"),
    [
        ([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6]], [[250], [200], [130]]),  # shared + own
        (  # two families and a loner: three groups, gathered and scattered back
            [[1, 2, 3, 4], [5, 6, 7], [1, 2, 8], [9, 10], [5, 6, 11]],
            [[250], [190], [140], [100], [150]],
        ),
        ([[7, 8, 9]], [list(range(130, 160))]),  # prefill: 2 shared blocks, causal own block
        ([[9, 3, 7, 4]], [list(range(200, 230))]),  # prefill over scattered blocks
        ([[1, 2]], [[100]]),  # one row: its whole past is shared
        ([[1, 2], [3, 4, 5], [6]], [[100], [150], [0]]),  # nothing shared
    ],
)
def test_the_op_with_our_kernel_equals_naive_attention(
    tables: list[list[int]], positions: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The paged-attention op's whole compute on our kernel: one call per row group, and
    SDPA's flash kernel never called."""
    torch.manual_seed(0)
    nheads, kvheads, head_dim = 6, 2, 64
    key_cache = torch.randn(12, BS, kvheads, head_dim)
    value_cache = torch.randn(12, BS, kvheads, head_dim)
    query = torch.randn(len(tables), len(positions[0]), nheads, head_dim)
    native = NativePagedAttention(kernels())
    calls = []
    group_call = native._group

    def counted(*args: Any) -> torch.Tensor:
        calls.append(1)
        return group_call(*args)

    monkeypatch.setattr(native, "_group", counted)
    monkeypatch.setattr(paged_attention, "_flash_attention", None)  # a call would fail
    plan = plan_attention(tables, positions, BS)
    got = paged_attention._compute(
        query, key_cache, value_cache, nheads, kvheads, 0.0, None, plan=plan,
        attention_kernel=native,
    )  # fmt: skip
    want = naive_attention(query, key_cache, value_cache, tables, positions)
    assert max_abs(got, want) < TOL
    assert len(calls) == len(plan.groups)


def test_decode_and_prefill_with_our_kernel_equal_full_forwards(one_thread: None) -> None:
    """A model with head_dim 64 (the suite's tiny llama has 48): five requests in two families
    sharing 256-token prompts; every step's logits equal a full forward of the row's tokens, and
    the server's plans are row-invariant (no shared blocks: DESIGN §4)."""
    torch.manual_seed(3)
    model = get_model("llama", "micro", data_type=torch.float32, nheads=4, kvheads=2, emb_dim=256)
    model.eval()
    prefixes = [rand_tokens(256, seed=700), rand_tokens(256, seed=701)]
    native = NativePagedAttention(kernels())
    num_shared_read = []
    group_call = native._group

    def counted(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                group: RowGroup, scale: float, out: torch.Tensor) -> None:  # fmt: skip
        num_shared_read.append(group.shared_blocks.numel())
        group_call(query, key_cache, value_cache, group, scale, out)

    native._group = counted  # type: ignore[method-assign]
    h = Harness(model, chunk_size=128, max_num_seqs=5, attention=native)
    for i, suffix_len in enumerate((1, 30, 64, 100, 150)):
        h.add(f"r{i}", prefixes[i % 2] + rand_tokens(suffix_len, seed=800 + i), 12)
    with torch.inference_mode():
        h.run()
        assert max(h.decode_batch_sizes()) == 5
        assert num_shared_read and max(num_shared_read) == 0
        for trace in h.traces.values():
            for i, row in enumerate(trace.logits):
                want = full_forward_logits(model, trace.prompt + trace.tokens[:i])
                assert max_abs(row, want) <= LOGIT_TOL


def test_auto_picks_native_where_it_computes(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_attention_kernel("auto", torch.float32, 64) == "native"
    assert resolve_attention_kernel("auto", torch.float32, 128) == "native"
    assert resolve_attention_kernel("auto", torch.float32, 48) == "flash"
    assert resolve_attention_kernel("native", torch.bfloat16, 64) == "native"
    assert resolve_attention_kernel("mixed", torch.float32, 64) == "mixed"
    assert resolve_attention_kernel("flash", torch.float32, 64) == "flash"
    with pytest.raises(AttentionKernelError, match=r"attention_kernel 'native'.*head_dim 48"):
        resolve_attention_kernel("native", torch.float32, 48)
    with pytest.raises(AttentionKernelError, match=r"attention_kernel 'mixed'.*float16"):
        resolve_attention_kernel("mixed", torch.float16, 64)
    for dot in ("amx", "avx512_bf16"):
        with pytest.raises(AttentionKernelError, match=rf"'{dot}'.*float32 with head_dim"):
            resolve_attention_kernel(dot, torch.float32, 64)  # type: ignore[arg-type]
    # bfloat16: amx where the CPU has it, else avx512_bf16, else native; each refuses with the
    # reason where it cannot run.
    monkeypatch.setattr(native_kernels, "amx_unsupported_reason", lambda: None)
    monkeypatch.setattr(native_kernels, "avx512_bf16_unsupported_reason", lambda: None)
    assert resolve_attention_kernel("auto", torch.bfloat16, 64) == "amx"
    assert resolve_attention_kernel("amx", torch.bfloat16, 128) == "amx"
    assert resolve_attention_kernel("avx512_bf16", torch.bfloat16, 128) == "avx512_bf16"
    monkeypatch.setattr(native_kernels, "amx_unsupported_reason", lambda: "this CPU lacks amx_bf16")
    assert resolve_attention_kernel("auto", torch.bfloat16, 64) == "avx512_bf16"
    with pytest.raises(
        AttentionKernelError, match=r"'amx' cannot run here: this CPU lacks amx_bf16"
    ):
        resolve_attention_kernel("amx", torch.bfloat16, 64)
    monkeypatch.setattr(
        native_kernels, "avx512_bf16_unsupported_reason", lambda: "this CPU lacks avx512_bf16"
    )
    assert resolve_attention_kernel("auto", torch.bfloat16, 64) == "native"
    with pytest.raises(AttentionKernelError, match=r"'avx512_bf16' cannot run here: .*avx512_bf16"):
        resolve_attention_kernel("avx512_bf16", torch.bfloat16, 64)
    monkeypatch.setattr(cpu_model, "unsupported_cpu_reason", lambda: "this CPU lacks avx2")
    assert resolve_attention_kernel("auto", torch.float32, 64) == "flash"
    assert resolve_attention_kernel("auto", torch.bfloat16, 64) == "flash"


def test_the_runner_gets_our_kernel_or_none() -> None:
    native = cpu_attention_kernel("auto", dtype=torch.float32, head_dim=64)
    assert isinstance(native, NativePagedAttention) and native.prefill
    assert native.bf16_dot is None
    auto = cpu_attention_kernel("auto", dtype=torch.bfloat16, head_dim=64)
    assert isinstance(auto, NativePagedAttention)
    if amx_unsupported_reason() is None:
        assert auto.prefill and auto.bf16_dot == "amx"
    elif avx512_bf16_unsupported_reason() is None:
        assert auto.prefill and auto.bf16_dot == "avx512_bf16"
    else:
        assert auto.prefill and auto.bf16_dot is None
    mixed = cpu_attention_kernel("mixed", dtype=torch.bfloat16, head_dim=64)
    assert isinstance(mixed, NativePagedAttention) and not mixed.prefill
    assert mixed.bf16_dot is None
    native = cpu_attention_kernel("native", dtype=torch.bfloat16, head_dim=64)
    assert isinstance(native, NativePagedAttention) and native.prefill
    assert native.bf16_dot is None
    assert cpu_attention_kernel("auto", dtype=torch.float32, head_dim=48) is None
    assert cpu_attention_kernel("flash", dtype=torch.float32, head_dim=64) is None


@pytest.mark.parametrize(
    ("bf16_dot", "check", "missing"),
    [
        ("amx", "amx_unsupported_reason", "amx_tile"),
        ("avx512_bf16", "avx512_bf16_unsupported_reason", "avx512_bf16"),
    ],
)
def test_the_dot_wrappers_refuse_what_they_cannot_run(
    bf16_dot: Any, check: str, missing: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(native_kernels, check, lambda: f"this CPU lacks {missing}")
    with pytest.raises(
        ValueError, match=rf"{bf16_dot} attention kernel cannot run here: .*{missing}"
    ):
        NativePagedAttention(kernels(), bf16_dot=bf16_dot)
    monkeypatch.setattr(native_kernels, check, lambda: None)
    cache = torch.randn(6, BS, 2, 64)
    with pytest.raises(
        ValueError, match=rf"{bf16_dot} attention kernel takes bfloat16, not torch\.float32"
    ):
        NativePagedAttention(kernels(), bf16_dot=bf16_dot)(
            torch.randn(1, 1, 4, 64), cache, cache, plan_attention([[1]], [[5]], BS), 0.125
        )


def test_without_amx_intrinsics_the_library_builds_stubs_that_refuse(tmp_path: Path) -> None:
    """The dot-product file compiled as a compiler without AMX intrinsics does
    (``SPYRE_NO_DOT_BF16``): the entry points exist, say they are stubs, and refuse every call
    without touching memory."""
    library = tmp_path / "stub.so"
    source = native_kernels.KERNELS / "attention_dot_bf16.cpp"
    flags = [*native_kernels.FLAGS, "-DSPYRE_NO_DOT_BF16"]
    subprocess.run(["g++", *flags, str(source), "-o", str(library)], check=True)
    lib = ctypes.CDLL(str(library))
    lib.spyre_paged_attention_dot_bf16_scratch_numel.restype = ctypes.c_int64
    assert lib.spyre_dot_bf16_compiled() == 0
    numel_args = map(ctypes.c_int64, (64, 3, 24, 2))
    assert lib.spyre_paged_attention_dot_bf16_scratch_numel(*numel_args) == -1
    null = ctypes.c_void_p(0)
    args = [ctypes.c_int64(64), null, null, null, *map(ctypes.c_int64, (16, 1, 1, 1, 1))]
    args += [null, ctypes.c_int64(0), null, ctypes.c_int64(1), null, ctypes.c_int64(0)]
    args += [ctypes.c_float(1.0)]
    args += [ctypes.c_int64(1), null, null]
    assert lib.spyre_paged_attention_amx(*args) == 2
    assert lib.spyre_paged_attention_avx512_bf16(*args) == 2
    version = subprocess.run(["g++", "-dumpversion"], capture_output=True, text=True, check=True)
    if int(version.stdout.split(".")[0]) >= 11:  # the kernels built for the tests have it
        assert kernels().dot_bf16_compiled


@pytest.mark.parametrize(("bf16_dot", "auto_prefill"), [("amx", False), ("avx512_bf16", True)])
def test_auto_falls_back_where_the_kernels_lack_the_dot_kernels(
    bf16_dot: Any,
    auto_prefill: bool,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """On a CPU with the unit whose kernels were built without AMX intrinsics: auto runs mixed
    in place of amx (flash's products run on the tiles) and native in place of avx512_bf16 (and
    logs why), an explicit request stops the start with the reason, the wrapper refuses."""
    stubbed = dataclasses.replace(kernels(), dot_bf16_compiled=False)
    monkeypatch.setattr(
        native_kernels, "amx_unsupported_reason", lambda: None if bf16_dot == "amx" else "no AMX"
    )
    monkeypatch.setattr(native_kernels, "avx512_bf16_unsupported_reason", lambda: None)
    monkeypatch.setattr(cpu_model, "_native_kernels", lambda settings: stubbed)
    with caplog.at_level(logging.WARNING, logger="spyre_server.model.cpu.prepare"):
        auto = cpu_attention_kernel("auto", dtype=torch.bfloat16, head_dim=64)
    assert isinstance(auto, NativePagedAttention) and auto.prefill == auto_prefill
    assert auto.bf16_dot is None
    assert f"attention_kernel not {bf16_dot}: the native kernels were compiled without" in (
        caplog.text
    )
    with pytest.raises(AttentionKernelError, match=rf"'{bf16_dot}' cannot run here: .*g\+\+ 11"):
        cpu_attention_kernel(bf16_dot, dtype=torch.bfloat16, head_dim=64)
    with pytest.raises(ValueError, match=r"compiled without AMX intrinsics"):
        NativePagedAttention(stubbed, bf16_dot=bf16_dot)


@pytest.mark.parametrize("bf16_dot", DOTS)
def test_the_dot_wrappers_run_every_row_group(bf16_dot: Any) -> None:
    """Through the wrapper: a ``share_blocks`` decode batch of three row groups (two families
    and a lone row) and a prefill chunk, against float64 attention over the same bfloat16
    values."""
    torch.manual_seed(5)
    nheads, kvheads, head_dim = 6, 2, 64
    key_cache = torch.randn(12, BS, kvheads, head_dim).bfloat16()
    value_cache = torch.randn(12, BS, kvheads, head_dim).bfloat16()
    attend = NativePagedAttention(kernels(), bf16_dot=bf16_dot)
    probabilities = 2.0**-9 * float(value_cache.double().abs().max())
    for tables, positions, num_groups in (
        (
            [[1, 2, 3, 4], [1, 2, 3, 5], [6, 7, 8], [6, 7, 9], [10, 11]],
            [[250], [200], [130], [140], [70]],
            3,
        ),
        ([[7, 8, 9]], [list(range(130, 160))], 1),
    ):
        plan = plan_attention(tables, positions, BS, share_blocks=True)
        assert len(plan.groups) == num_groups
        query = torch.randn(len(tables), len(positions[0]), nheads, head_dim).bfloat16()
        got = attend(query, key_cache, value_cache, plan, 0.125)
        want = naive_attention(
            query.double(), key_cache.double(), value_cache.double(), tables, positions
        )
        assert got.dtype == torch.bfloat16
        error = (got.double() - want).abs() - 2.0**-8 * want.abs() - probabilities
        assert float(error.max()) < TOL


def test_native_attention_on_a_head_dim_it_cannot_compute_fails_at_start(
    make_engine: object,
) -> None:
    """The micro model has head_dim 48: a start-up error (a ModelLoadError, as the CLI reports
    them)."""
    with pytest.raises(AttentionKernelError, match=r"attention_kernel 'native'.*head_dim 48") as e:
        make_engine(model__attention_kernel="native")  # type: ignore[operator]
    assert isinstance(e.value, ModelLoadError)


def test_without_prefill_chunks_go_to_flash_and_decode_steps_to_ours(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``model.attention_kernel: mixed`` in bfloat16: a prefill chunk's queries through SDPA's
    flash kernel (our kernel never called), a decode batch's through ours (flash never called),
    both equal to attention in float64 over the same bfloat16 values."""
    torch.manual_seed(4)
    nheads, kvheads, head_dim = 6, 2, 64
    key_cache = torch.randn(12, BS, kvheads, head_dim).bfloat16()
    value_cache = torch.randn(12, BS, kvheads, head_dim).bfloat16()
    mixed = NativePagedAttention(kernels(), prefill=False)
    ours, flash = [], []
    group_call, flash_call = mixed._group, paged_attention._flash_attention

    def counted_group(*args: Any) -> None:
        ours.append(1)
        group_call(*args)

    def counted_flash(*args: Any, **kwargs: Any) -> Any:
        flash.append(1)
        return flash_call(*args, **kwargs)

    monkeypatch.setattr(mixed, "_group", counted_group)
    monkeypatch.setattr(paged_attention, "_flash_attention", counted_flash)
    for tables, positions, by_ours in (
        ([[7, 8, 9]], [list(range(130, 160))], False),  # a prefill chunk of 30 queries
        ([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6]], [[250], [200], [130]], True),  # decode
    ):
        ours.clear()
        flash.clear()
        query = torch.randn(len(tables), len(positions[0]), nheads, head_dim).bfloat16()
        got = mixed(query, key_cache, value_cache, plan_attention(tables, positions, BS), 0.125)
        want = naive_attention(
            query.double(), key_cache.double(), value_cache.double(), tables, positions
        )
        assert got.dtype == torch.bfloat16
        # ours rounds once; flash rounds inside too (test_paged_attention's bfloat16 tolerance)
        tolerance = 2.0**-8 * float(want.abs().max()) + TOL if by_ours else 2e-2
        assert max_abs(got, want) < tolerance
        assert (bool(ours), bool(flash)) == (by_ours, not by_ours)


@needs_native_kernels
@pytest.mark.parametrize(
    ("linear", "attention", "caching", "warned"),
    [
        ("native", "native", True, None),
        ("onednn", "native", True, "linear_kernel onednn"),
        ("native", "flash", True, "attention_kernel flash"),
        ("aten", "mixed", True, "linear_kernel aten and attention_kernel mixed"),
        ("aten", "flash", False, None),
    ],
)
def test_a_kernel_that_is_not_row_invariant_is_named_at_start(
    caplog: pytest.LogCaptureFixture,
    linear: cpu_model.LinearKernel,
    attention: cpu_model.AttentionKernel,
    caching: bool,
    warned: str | None,
) -> None:
    """With prefix caching on, a kernel whose row sums depend on the step's shape is named in a
    warning at start (a cache hit could change a token); never with caching off."""
    with caplog.at_level(logging.WARNING, logger=cpu_model.__name__):
        cpu_model.warn_unless_row_invariant(
            linear, attention, dtype=torch.float32, head_dim=64, prefix_caching=caching
        )
    messages = [r.getMessage() for r in caplog.records]
    if warned is None:
        assert messages == []
    else:
        assert len(messages) == 1 and warned in messages[0] and "float32" in messages[0]
