"""The cpu backend's float32 and bfloat16 RMS norms, GLU activations and rotary embeddings on our
own kernels (``kernels/elementwise_f32.cpp``, ``kernels/elementwise_bf16.cpp``).

A step runs about two of each per layer; through aten each is several ops (torch's CPU
``rms_norm`` alone is seven, and in bfloat16 fms adds an upcast, a downcast and the weight's
product), and every op has a fixed cost whatever its size. Here each is one call. The results
match fms's to float32 rounding (the norm's sum of squares and the SiLU's exp run in another
order and precision; in bfloat16 the kernels round where fms's ops round, so a value differs at
most where that float32 rounding moves it across a bfloat16 rounding boundary); anything the
kernels do not cover (another dtype, a norm with a mean or a shift or a low-precision pow,
another activation, dropout while training) goes through the fast or fms code it replaces.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from fms.modules.feedforward import GatedLinearUnit

from spyre_server.model.cpu.kernels.library import NativeKernels
from spyre_server.model.cpu.ops.fast_norm import FastRMSNorm
from spyre_server.model.cpu.ops.fast_rope import FastRotaryEmbedding


class NativeRMSNorm(FastRMSNorm):
    native_kernels: NativeKernels

    def _upcast_norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or self.weight.dtype != torch.bfloat16:
            return super()._upcast_norm(x)
        return self._native_norm(x, self.native_kernels.rms_norm_bf16)

    def _float32_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self._native_norm(x, self.native_kernels.rms_norm)

    def _native_norm(self, x: torch.Tensor, kernel: Callable[..., None]) -> torch.Tensor:
        width = x.shape[-1]
        rows = x.reshape(-1, width)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = torch.empty(rows.shape, dtype=x.dtype)
        kernel(
            rows.data_ptr(),
            rows.stride(0),
            self.weight.data_ptr(),
            out.data_ptr(),
            rows.shape[0],
            width,
            self.eps,
        )
        return out.view(x.shape)


class NativeGatedLinearUnit(GatedLinearUnit):
    native_kernels: NativeKernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = self.native_kernels
        kernel = {torch.float32: k.silu_mul, torch.bfloat16: k.silu_mul_bf16}.get(x.dtype)
        if (
            kernel is None
            or not self.fused
            or not isinstance(self.a, torch.nn.SiLU)
            or (self.p_dropout and self.training)
        ):
            return super().forward(x)
        gate_up = self.wg1_fused(x)
        rows = gate_up.reshape(-1, 2 * self.hidden_dim).contiguous()
        hidden = torch.empty(rows.shape[0], self.hidden_dim, dtype=x.dtype)
        kernel(rows.data_ptr(), hidden.data_ptr(), rows.shape[0], self.hidden_dim)
        return self.w2(hidden.view(*x.shape[:-1], self.hidden_dim))


class NativeRotaryEmbedding(FastRotaryEmbedding):
    native_kernels: NativeKernels

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """``x`` ``[batch, seq, heads, head_dim]`` (each head's floats contiguous, as the views
        of fms's fused QKV output are) rotated into a new contiguous tensor."""
        batch, seq, heads, head_dim = x.shape
        k = self.native_kernels
        kernel = {torch.float32: k.rope, torch.bfloat16: k.rope_bf16}.get(x.dtype)
        if kernel is None or head_dim % 8:
            return super()._rotate(x, cos, signed_sin)
        if x.stride(3) != 1 or x.stride(2) != head_dim or x.stride(0) != seq * x.stride(1):
            x = x.contiguous()
        out = torch.empty(x.shape, dtype=x.dtype)
        kernel(
            x.data_ptr(),
            x.stride(1),
            cos.data_ptr(),
            signed_sin.data_ptr(),
            out.data_ptr(),
            batch * seq,
            heads,
            head_dim,
        )
        return out


def use_native_elementwise(model: torch.nn.Module, kernels: NativeKernels) -> int:
    """Switch the RMS norms, gated linear units and rotary embeddings of ``model`` (in place,
    after ``use_fast_rms_norm`` and ``use_fast_rope``) to the native kernels; returns how many
    objects were switched."""
    switched = 0
    for module in model.modules():
        targets: list[Any] = [module]
        targets += [v for v in vars(module).values() if type(v) is FastRotaryEmbedding]
        for target in targets:
            native = _NATIVE.get(type(target))
            if native is not None:
                target.__class__ = native
                target.native_kernels = kernels
                switched += 1
    return switched


_NATIVE: dict[type, type] = {
    FastRMSNorm: NativeRMSNorm,
    GatedLinearUnit: NativeGatedLinearUnit,
    FastRotaryEmbedding: NativeRotaryEmbedding,
}
