"""The paged-attention op's compute on our own kernel (``kernels/attention.cpp``).

``NativePagedAttention`` computes each row group of the step's plan in one call per layer: its
shared blocks (read once for every row, the keys split into one range per thread over every KV
head, where flash splits by heads and query blocks only) and each row's own blocks (causal,
and within the plan's sliding window where it has one), read in place from the cache through
the block ids, merged through their log-sum-exps and written in fms's layout. The flash path
gathers blocks that are not consecutive into copies and merges in aten ops. float32 or
bfloat16 (computed in float32, the output rounded once), head_dim 64 or 128, x86-64 with AVX2
and FMA.

With ``bf16_dot`` (bfloat16 only, ``kernels/attention_dot_bf16.cpp``) the same plan runs with
both products as bfloat16 dot products accumulated in float32, on the AMX tile unit (``amx``)
or in AVX512-BF16 vector instructions (``avx512_bf16``): the softmax is float32, and its
probabilities are rounded to bfloat16 for the product with the values, as SDPA's flash kernel
does in bfloat16.
"""

from __future__ import annotations

import torch

from spyre_server.model.cpu.kernels.library import (
    DOT_BF16_NOT_COMPILED,
    Bf16Dot,
    NativeKernels,
    bf16_dot_unsupported_reason,
)
from spyre_server.model.cpu.paged_attention import AttentionPlan, RowGroup, flash_attention

SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)


def check_caches(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
) -> None:
    """Raises ValueError unless the caches are what the kernels read and write through raw
    pointers: contiguous ``dtype`` block tensors of one shape, ``head_dim`` values per head."""
    for cache in (key_cache, value_cache):
        if cache.dtype != dtype or not cache.is_contiguous():
            raise ValueError(f"the KV caches must be contiguous {_name(dtype)} block tensors")
        if cache.shape[-1] != head_dim or cache.shape != key_cache.shape:
            raise ValueError(
                f"cache shapes {tuple(key_cache.shape)} and {tuple(value_cache.shape)} do "
                f"not fit queries with head_dim {head_dim}"
            )


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class NativePagedAttention:
    def __init__(
        self, kernels: NativeKernels, *, prefill: bool = True, bf16_dot: Bf16Dot | None = None
    ) -> None:
        """``prefill`` False: queries of more than one position (prefill chunks) go to SDPA's
        flash kernel instead (``model.attention_kernel: mixed``: on AMX, flash multiplies
        bfloat16 on the tiles and this kernel in float32). ``bf16_dot``:
        the bfloat16 dot-product kernel (bfloat16 only) on that unit, None: float32 compute;
        raises ValueError where it cannot run here."""
        self._dot_kernel = None
        if bf16_dot is not None:
            reason = bf16_dot_unsupported_reason(bf16_dot)
            if reason is None and not kernels.dot_bf16_compiled:
                reason = DOT_BF16_NOT_COMPILED
            if reason is not None:
                raise ValueError(f"the {bf16_dot} attention kernel cannot run here: {reason}")
            self._dot_kernel = (
                kernels.paged_attention_amx
                if bf16_dot == "amx"
                else kernels.paged_attention_avx512_bf16
            )
        self.kernels = kernels
        """The kernels it runs (their ``avx512``: its width)."""
        self.prefill = prefill
        self.bf16_dot = bf16_dot
        self._scratch = torch.empty(0)
        """Grown to the largest call so far and kept: one call per layer and step."""

    def __call__(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        plan: AttentionPlan,
        scale: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``query`` ``[batch, num_queries, nheads, head_dim]``; the caches ``[num_blocks,
        block_size, kvheads, head_dim]``, of ``query``'s dtype -> the attention output,
        ``query``'s shape and dtype: written into ``out`` when given (contiguous), else a new
        tensor."""
        head_dim = query.shape[-1]
        if query.dtype not in SUPPORTED_DTYPES or head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(
                f"NativePagedAttention takes float32 or bfloat16 with head_dim 64 or 128, not "
                f"{query.dtype} with {head_dim}"
            )
        check_caches(key_cache, value_cache, head_dim, query.dtype)
        if self.bf16_dot is not None and query.dtype != torch.bfloat16:
            raise ValueError(
                f"the {self.bf16_dot} attention kernel takes bfloat16, not {query.dtype}"
            )
        if not self.prefill and query.shape[1] > 1:
            attended = flash_attention(query, key_cache, value_cache, plan, scale)
            return attended if out is None else out.copy_(attended)
        query = query.contiguous()
        if out is None:
            out = torch.empty_like(query)
        elif out.shape != query.shape or out.dtype != query.dtype or not out.is_contiguous():
            raise ValueError(f"out must be contiguous {_name(query.dtype)} {tuple(query.shape)}")
        if len(plan.groups) == 1 and plan.groups[0].rows is None:
            self._group(query, key_cache, value_cache, plan.groups[0], scale, out)
            return out
        for group in plan.groups:
            assert group.rows is not None
            rows = query.index_select(0, group.rows)
            attended = torch.empty_like(rows)
            self._group(rows, key_cache, value_cache, group, scale, attended)
            out.index_copy_(0, group.rows, attended)
        return out

    def _group(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        group: RowGroup,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        batch, num_queries, nheads, head_dim = query.shape
        _, block_size, kvheads, _ = key_cache.shape
        if group.max_block_id >= key_cache.shape[0]:
            raise ValueError(
                f"the plan reads block {group.max_block_id} of a cache of {key_cache.shape[0]}"
            )
        if nheads % kvheads or group.positions.shape != (batch, num_queries):
            raise ValueError(
                f"{nheads} query heads over {kvheads} KV heads with a plan for "
                f"{tuple(group.positions.shape)} queries cannot attend {tuple(query.shape)}"
            )
        threads = max(1, torch.get_num_threads())
        rows = batch * num_queries * (nheads // kvheads)
        lib = self.kernels
        if self._dot_kernel is not None:
            kernel, scratch_numel = self._dot_kernel, lib.paged_attention_dot_bf16_scratch_numel
        elif query.dtype == torch.float32:
            kernel, scratch_numel = lib.paged_attention, lib.paged_attention_scratch_numel
        else:
            kernel, scratch_numel = lib.paged_attention_bf16, lib.paged_attention_scratch_numel
        numel = scratch_numel(head_dim, kvheads, rows, threads)
        if self._scratch.numel() < numel:
            self._scratch = torch.empty(numel)
        status = kernel(
            head_dim,
            query.data_ptr(),
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            block_size,
            kvheads,
            nheads // kvheads,
            batch,
            num_queries,
            group.shared_blocks.data_ptr(),
            group.shared_blocks.numel(),
            group.own_blocks.data_ptr(),
            group.num_own_blocks,
            group.positions.data_ptr(),
            group.window,
            scale,
            threads,
            self._scratch.data_ptr(),
            out.data_ptr(),
        )
        assert status == 0, f"the attention kernel refused head_dim {head_dim}"
