"""The cpu backend's matrix products: linear layers whose weights are packed once for oneDNN.

``F.linear`` hands every call to MKL's sgemm, which packs the weight into its own blocked layout
again at every call; at the few rows of a decode step that repacking, not the arithmetic, is
most of the time. Packing the weights once into oneDNN's layout (what inductor's CPU freezing
does) removes it (``bench/bench_kernels.py`` measures both).

``pack_linears`` swaps a model's ``nn.Linear`` modules in place for ``PackedLinear`` (on the cpu
backend's own copy of the model, see ``prepare.py``). The packed weight is an opaque oneDNN
tensor, so a packed model is for inference on the CPU only. A tied LM head is packed as a copy:
the token embedding keeps its tensor.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from fms.modules.head import LinearClassificationHead

from spyre_server.model.cpu.errors import LinearKernelError

_PACKABLE = (torch.nn.Linear, LinearClassificationHead)
"""Types whose forward is exactly ``F.linear(x, weight, bias)``; subclasses that do more (tensor
parallel, quantized) are left as they are."""


_reorder = torch.ops.mkldnn._reorder_linear_weight
_linear = torch.ops.mkldnn._linear_pointwise


class PackedLinear(torch.nn.Module):
    """``F.linear`` through oneDNN with the weight packed at construction."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        self.register_buffer("packed_weight", _reorder(weight), persistent=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, onednn"


def check_onednn(dtype: torch.dtype) -> None:
    """Raise LinearKernelError unless oneDNN can pack and run a linear of ``dtype`` here."""
    if not torch.backends.mkldnn.is_available():
        raise LinearKernelError(
            "model.linear_kernel 'onednn' needs a torch build with oneDNN (mkldnn), which this "
            "one lacks; set model.linear_kernel: aten"
        )
    try:
        probe = torch.nn.Linear(8, 8, bias=False, dtype=dtype)
        with torch.inference_mode():
            PackedLinear(probe)(torch.ones(1, 8, dtype=dtype))
    except RuntimeError as exc:
        raise LinearKernelError(
            f"oneDNN cannot run a {dtype} linear on this machine ({exc}); set "
            "model.linear_kernel: aten"
        ) from exc


def replace_linears(
    model: torch.nn.Module, replacement: Callable[[torch.nn.Linear], torch.nn.Module]
) -> int:
    """Replace every plain linear layer of ``model`` (in place) by ``replacement(layer)``;
    returns how many. Layers replaced before are not plain any more, so they are left alone."""
    replaced = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) in _PACKABLE:
                assert isinstance(child, torch.nn.Linear)
                setattr(module, name, replacement(child))
                replaced += 1
    return replaced


def pack_linears(model: torch.nn.Module) -> int:
    """Replace every plain linear layer of ``model`` (in place) by a PackedLinear; returns how
    many."""
    return replace_linears(model, PackedLinear)
