"""Attention over the shared blocks on our own kernel (``kernels/attention_f32.cpp``).

The paged-attention op reads a row group's shared blocks (keys wholly before every query, no
mask) in one call per layer; ``NativeSharedAttention`` computes it in place of SDPA's flash
kernel, with the same contract: ``(out, lse)``. It splits the keys into one range per thread
over every KV head, where flash splits by heads and query blocks (3 tasks for 2 threads at a
SmolLM2 decode step). float32, head_dim 64 or 128, x86-64 with AVX2 and FMA.
"""

from __future__ import annotations

import torch

from spyre_server.model.native_kernels import NativeKernels

SUPPORTED_HEAD_DIMS = (64, 128)


class NativeSharedAttention:
    def __init__(self, kernels: NativeKernels) -> None:
        self._kernels = kernels

    def __call__(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``q`` ``[1, kvheads, rows, head_dim]``; ``keys``/``values`` ``[num_keys, kvheads,
        head_dim]`` with contiguous last two dimensions (the cache's blocks, in place) ->
        ``(out [1, kvheads, rows, head_dim], lse [1, kvheads, rows])`` float32."""
        _, kvheads, rows, head_dim = q.shape
        num_keys = keys.shape[0]
        if q.dtype != torch.float32 or head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(
                f"NativeSharedAttention takes float32 with head_dim 64 or 128, not "
                f"{q.dtype} with {head_dim}"
            )
        for kv in (keys, values):
            if kv.shape != (num_keys, kvheads, head_dim) or kv.stride()[1:] != (head_dim, 1):
                raise ValueError(
                    f"keys and values must be [{num_keys}, {kvheads}, {head_dim}] "
                    "with contiguous heads"
                )
        if keys.stride(0) != values.stride(0):
            raise ValueError("keys and values must have the same token stride")
        q = q.contiguous()
        splits = max(1, torch.get_num_threads())
        scratch = torch.empty(
            self._kernels.attention_scratch_numel(head_dim, kvheads, rows, splits)
        )
        out = torch.empty(1, kvheads, rows, head_dim)
        lse = torch.empty(1, kvheads, rows)
        status = self._kernels.attention(
            head_dim,
            q.data_ptr(),
            keys.data_ptr(),
            values.data_ptr(),
            kvheads,
            rows,
            num_keys,
            keys.stride(0),
            scale,
            splits,
            scratch.data_ptr(),
            out.data_ptr(),
            lse.data_ptr(),
        )
        assert status == 0, f"the attention kernel refused head_dim {head_dim}"
        return out, lse
