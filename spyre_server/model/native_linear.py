"""The cpu backend's float32 linear layers on our own kernel (``kernels/linear_f32.cpp``).

``NativeLinear`` packs its weight once into the kernel's panel layout (a copy: the token
embedding a tied LM head shares keeps its tensor) and computes ``x @ weight.T + bias`` with it.
It is for float32 inference on x86-64 with AVX2 and FMA; ``native_kernels.py`` builds and loads
the kernel and says why where it cannot. The results match ``F.linear`` to float32 rounding (the
sums run in another order).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from spyre_server.model.native_kernels import NativeKernels
from spyre_server.model.packed_linear import replace_linears

_PANEL_ALIGNMENT = 32
"""Bytes: the kernel reads the panels with aligned AVX loads."""


class NativeLinear(torch.nn.Module):
    panels: torch.Tensor
    _linear: Callable[[int, int, int, int, int, int], None]

    def __init__(self, linear: torch.nn.Linear, kernels: NativeKernels) -> None:
        super().__init__()
        weight = linear.weight.detach()
        if weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise ValueError(
                f"NativeLinear takes float32 CPU weights, not {weight.dtype} on {weight.device}"
            )
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = weight.contiguous()
        panels = torch.empty(kernels.packed_numel(self.out_features, self.in_features))
        assert panels.data_ptr() % _PANEL_ALIGNMENT == 0, "torch's CPU allocator aligns to 64"
        kernels.pack(weight.data_ptr(), panels.data_ptr(), self.out_features, self.in_features)
        self.register_buffer("panels", panels, persistent=False)
        self.bias = linear.bias
        self._linear = kernels.linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            raise TypeError(f"NativeLinear computes in float32; got {x.dtype} input")
        rows = x.reshape(-1, self.in_features).contiguous()
        out = torch.empty(rows.shape[0], self.out_features)
        if rows.shape[0]:
            self._linear(
                rows.data_ptr(),
                self.panels.data_ptr(),
                out.data_ptr(),
                rows.shape[0],
                self.in_features,
                self.out_features,
            )
        if self.bias is not None:
            out += self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, native"


def use_native_linears(model: torch.nn.Module, kernels: NativeKernels) -> int:
    """Replace every plain linear layer of ``model`` (in place) by a NativeLinear; returns how
    many."""
    return replace_linears(model, lambda linear: NativeLinear(linear, kernels))
