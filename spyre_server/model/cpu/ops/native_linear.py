"""The cpu backend's float32 and bfloat16 linear layers on our own kernels
(``kernels/linear_f32.cpp``, ``kernels/linear_bf16.cpp``).

``NativeLinear`` (float32) and ``NativeBf16Linear`` (bfloat16) pack their weight once into their
kernel's layout (a copy: the token embedding a tied LM head shares keeps its tensor) and compute
``x @ weight.T + bias`` with it. They are for inference on x86-64 with AVX2 and FMA;
``kernels/library.py`` builds and loads the kernels and says why where it cannot.

Both compute every output with the same arithmetic whatever the number of rows of a call
(batch invariance: a row's result is the same bits in any step, DESIGN §4):

- float32: matches ``F.linear`` to float32 rounding (the sums run in another order);
- bfloat16: float32 sums in a fixed order over pairs of inputs, rounded to bfloat16 once (with
  the bias added before the rounding), denormals flushed to zero, as the AVX512-BF16 dot
  product computes them; ``kernels/linear_bf16.cpp`` states the arithmetic exactly and its
  distance from ``F.linear``. Where the kernels run on AMX (``linear_bf16_on_amx``), a layer
  whose input size is a multiple of 32 sums on the tiles instead, for every call
  (``kernels/linear_amx.cpp``: other bits, the same row invariance, a bound twice as wide for
  the float32 sums). ``F.linear`` itself (oneDNN) computes a step of one row another way than a
  step of several, so it does not have this property.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from spyre_server.model.cpu.kernels.library import NativeKernels
from spyre_server.model.cpu.ops.huge_pages import huge_page_empty
from spyre_server.model.cpu.ops.packed_linear import replace_linears
from spyre_server.model.fp8 import Fp8Linear, fake_quantize_fp8

_PANEL_ALIGNMENT = 32
"""Bytes: the float32 kernel reads the panels with aligned AVX loads."""
_PACKED_ALIGNMENT = 64
"""Bytes: the bfloat16 kernel reads the packed weight with aligned 512-bit loads."""


NATIVE_DTYPES = (torch.float32, torch.bfloat16)
"""What the native linear kernels compute."""
AMX_K_MULTIPLE = 32
"""The AMX linear kernel's input sizes: multiples of this (whole tiles of pairs)."""


def _check_status(status: int, on_amx: bool, kernel: str) -> None:
    """Raise for a bfloat16 or FP8 linear kernel's failed call: no memory for its scratch
    (``status`` < 0), or the AMX kernel refusing (0) a call its layer was checked for."""
    if status < 0:
        raise MemoryError(f"{kernel} found no memory for its scratch")
    if status == 0 and on_amx:
        raise RuntimeError("the AMX linear kernel refused a call it was checked for")


class _Held:
    """A tensor a kernel reads through its address, and that address, taken once (None for no
    tensor: the kernels' null pointer). The module holds the tensor here as well as in its
    buffer, so the address stays valid whatever happens to its buffers (a conversion that
    replaces them leaves the kernel reading what it packed)."""

    __slots__ = ("address", "tensor")

    def __init__(self, tensor: torch.Tensor | None) -> None:
        self.tensor = tensor
        self.address = None if tensor is None else tensor.data_ptr()


def _rows(x: torch.Tensor, in_features: int) -> torch.Tensor:
    """``x`` as contiguous rows of ``in_features`` (a view where it already is)."""
    rows = x.reshape(-1, in_features)
    return rows if rows.is_contiguous() else rows.contiguous()


def _shaped(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``out``'s rows in ``x``'s leading shape."""
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[1])


class NativeLinear(torch.nn.Module):
    panels: torch.Tensor
    kernels: NativeKernels
    """The kernels it runs on (their ``avx512``: its width)."""
    _linear: Callable[[int, int, int, int, int, int], int]

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
        panels = huge_page_empty(
            kernels.packed_numel(self.out_features, self.in_features), torch.float32
        )
        assert panels.data_ptr() % _PANEL_ALIGNMENT == 0, "huge_page_empty aligns to 64 or more"
        kernels.pack(weight.data_ptr(), panels.data_ptr(), self.out_features, self.in_features)
        self.register_buffer("panels", panels, persistent=False)
        self._panels = _Held(panels)
        self.bias = linear.bias
        self.kernels = kernels
        self._linear = kernels.linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            raise TypeError(f"NativeLinear computes in float32; got {x.dtype} input")
        rows = _rows(x, self.in_features)
        num_rows = rows.shape[0]
        out = torch.empty(num_rows, self.out_features)
        if num_rows:
            self._linear(
                rows.data_ptr(),
                self._panels.address,
                out.data_ptr(),
                num_rows,
                self.in_features,
                self.out_features,
            )
        if self.bias is not None:
            out += self.bias
        return _shaped(out, x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, native"


class NativeBf16Linear(torch.nn.Module):
    """``F.linear`` in bfloat16 on ``kernels/linear_bf16.cpp``, the weight packed once; on
    ``kernels/linear_amx.cpp`` (``on_amx``) where the kernels run on AMX and the input size is a
    multiple of 32."""

    packed: torch.Tensor
    kernels: NativeKernels
    """The kernels it runs on (their ``linear_bf16_dot``: AVX512-BF16 or AVX2)."""
    on_amx: bool
    """Whether every call sums on AMX tiles."""
    _linear: Callable[[int, int, int | None, int, int, int, int], int]

    def __init__(self, linear: torch.nn.Linear, kernels: NativeKernels) -> None:
        super().__init__()
        weight = linear.weight.detach()
        if weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
            raise ValueError(
                f"NativeBf16Linear takes bfloat16 CPU weights, not {weight.dtype} on "
                f"{weight.device}"
            )
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = weight.contiguous()
        numel = kernels.linear_bf16_packed_numel(self.out_features, self.in_features)
        packed = huge_page_empty(numel, torch.bfloat16)
        assert packed.data_ptr() % _PACKED_ALIGNMENT == 0, "huge_page_empty aligns to 64 or more"
        self.on_amx = kernels.linear_bf16_on_amx and self.in_features % AMX_K_MULTIPLE == 0
        sizes = (weight.data_ptr(), packed.data_ptr(), self.out_features, self.in_features)
        if not self.on_amx:
            kernels.linear_bf16_pack(*sizes)
        elif kernels.linear_bf16_amx_pack(*sizes) == 0:
            raise RuntimeError("the AMX linear kernel refused to pack a weight it was checked for")
        self.register_buffer("packed", packed, persistent=False)
        self._packed = _Held(packed)
        self.bias = linear.bias
        # What the kernel reads: the bias as contiguous bfloat16 (the parameter itself, mostly).
        self._bias = _Held(
            None if linear.bias is None else linear.bias.detach().bfloat16().contiguous()
        )
        self.kernels = kernels
        self._linear = kernels.linear_bf16_amx if self.on_amx else kernels.linear_bf16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16:
            raise TypeError(f"NativeBf16Linear computes in bfloat16; got {x.dtype} input")
        rows = _rows(x, self.in_features)
        num_rows = rows.shape[0]
        out = torch.empty(num_rows, self.out_features, dtype=torch.bfloat16)
        if num_rows:
            status = self._linear(
                rows.data_ptr(),
                self._packed.address,
                self._bias.address,
                out.data_ptr(),
                num_rows,
                self.in_features,
                self.out_features,
            )
            if status <= 0:
                _check_status(status, self.on_amx, "the bfloat16 linear kernel")
        return _shaped(out, x)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias="
            f"{self.bias is not None}, native bfloat16{' on amx' if self.on_amx else ''}"
        )


class NativeFp8Linear(torch.nn.Module):
    """A compressed-tensors FP8 linear layer on ``kernels/linear_bf16.cpp`` (on
    ``kernels/linear_amx.cpp`` where ``NativeBf16Linear`` would be: ``on_amx``): the
    float8_e4m3fn weight stays FP8 in memory (packed once, one byte a value) with its float32
    scale per output (or one for all). The kernel sums the FP8 values (each exact in bfloat16)
    as ``NativeBf16Linear`` sums its weights, then multiplies the float32 sum by the column's scale
    before the bias: within ``NativeBf16Linear``'s bound of the exact product with the
    dequantized weights. With a static ``input_scale`` the input is first rounded to its FP8
    steps (``fake_quantize_fp8``), with ``dynamic_inputs`` each row to the steps of its own
    scale (``per_token_fp8_scale``), as HF transformers does."""

    packed: torch.Tensor
    packed_scale: torch.Tensor
    kernels: NativeKernels
    on_amx: bool
    """Whether every call sums on AMX tiles (``kernels/linear_amx.cpp``), as
    ``NativeBf16Linear.on_amx``."""
    _linear: Callable[[int, int, int, int | None, int, int, int, int], int]

    def __init__(
        self,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        kernels: NativeKernels,
        *,
        bias: torch.Tensor | None = None,
        input_scale: torch.Tensor | None = None,
        dynamic_inputs: bool = False,
    ) -> None:
        super().__init__()
        if dynamic_inputs and input_scale is not None:
            raise ValueError("an FP8 layer's input scales are static or dynamic, not both")
        if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
            raise ValueError(
                f"NativeFp8Linear takes a 2-D float8_e4m3fn weight, not {weight.dtype}"
            )
        self.out_features, self.in_features = weight.shape
        scale = weight_scale.detach().float().reshape(-1).contiguous()
        if scale.numel() not in (1, self.out_features):
            raise ValueError(
                f"an FP8 weight of {self.out_features} outputs takes 1 or {self.out_features} "
                f"scales, not {tuple(weight_scale.shape)}"
            )
        if not bool(torch.isfinite(scale).all()):
            raise ValueError("an FP8 weight scale is not finite")
        weight = weight.detach().contiguous()
        packed = huge_page_empty(
            kernels.linear_fp8_packed_numel(self.out_features, self.in_features), torch.uint8
        )
        packed_scale = torch.empty(-(-self.out_features // 64) * 64)
        assert packed.data_ptr() % _PACKED_ALIGNMENT == 0, "huge_page_empty aligns to 64 or more"
        self.on_amx = kernels.linear_bf16_on_amx and self.in_features % AMX_K_MULTIPLE == 0
        pack = kernels.linear_fp8_amx_pack if self.on_amx else kernels.linear_fp8_pack
        nan = pack(
            weight.data_ptr(),
            scale.data_ptr(),
            scale.numel(),
            packed.data_ptr(),
            packed_scale.data_ptr(),
            self.out_features,
            self.in_features,
        )
        if nan < 0:
            raise RuntimeError("the AMX linear kernel refused to pack a weight it was checked for")
        if nan:
            raise ValueError(f"an FP8 weight holds {nan} NaN values")
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("packed_scale", packed_scale, persistent=False)
        self._packed, self._packed_scale = _Held(packed), _Held(packed_scale)
        self.bias = None if bias is None else bias.detach().bfloat16().contiguous()
        self._bias = _Held(self.bias)
        self.input_scale = None if input_scale is None else input_scale.detach().reshape(1)
        self._scale_value = None if input_scale is None else float(input_scale)
        self.dynamic_inputs = dynamic_inputs
        self.kernels = kernels
        self._linear = kernels.linear_fp8_amx if self.on_amx else kernels.linear_fp8

    @classmethod
    def of(cls, layer: Fp8Linear, kernels: NativeKernels) -> NativeFp8Linear:
        """``layer`` (an FP8 checkpoint's) on the kernel; its weight and scales shared."""
        return cls(
            layer.weight,
            layer.weight_scale,
            kernels,
            input_scale=layer.input_scale,
            dynamic_inputs=layer.dynamic_inputs,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16:
            raise TypeError(f"NativeFp8Linear computes in bfloat16; got {x.dtype} input")
        rows = _rows(x, self.in_features)
        if self.input_scale is not None or self.dynamic_inputs:
            rows = self._fake_quantize(rows)
        num_rows = rows.shape[0]
        out = torch.empty(num_rows, self.out_features, dtype=torch.bfloat16)
        if num_rows:
            status = self._linear(
                rows.data_ptr(),
                self._packed.address,
                self._packed_scale.address,
                self._bias.address,
                out.data_ptr(),
                num_rows,
                self.in_features,
                self.out_features,
            )
            if status <= 0:
                _check_status(status, self.on_amx, "the FP8 linear kernel")
        return _shaped(out, x)

    def _fake_quantize(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` rounded to FP8 steps in bfloat16: of each row's own scale
        (``dynamic_inputs``, on the native kernel), or ``fake_quantize_fp8(rows, input_scale)``:
        on the native kernel for a bfloat16 scale (what a loaded checkpoint holds), else in
        torch."""
        if self.dynamic_inputs:
            out = torch.empty_like(rows)
            self.kernels.fake_quantize_fp8_rows_bf16(
                rows.data_ptr(), out.data_ptr(), rows.shape[0], self.in_features
            )
            return out
        assert self.input_scale is not None and self._scale_value is not None
        if self.input_scale.dtype != torch.bfloat16:
            return fake_quantize_fp8(rows, self.input_scale).bfloat16()
        out = torch.empty_like(rows)
        self.kernels.fake_quantize_fp8_bf16(
            rows.data_ptr(), self._scale_value, out.data_ptr(), rows.numel()
        )
        return out

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias="
            f"{self.bias is not None}, static input scale={self.input_scale is not None}, "
            f"dynamic input scales={self.dynamic_inputs}, "
            f"native fp8 weights{' on amx' if self.on_amx else ''}"
        )


def use_native_linears(model: torch.nn.Module, kernels: NativeKernels) -> int:
    """Replace every plain linear layer of ``model`` (in place) by a NativeLinear (float32
    weights) or a NativeBf16Linear (bfloat16 weights), and every ``Fp8Linear`` by a
    NativeFp8Linear; returns how many. Raises ValueError for a weight of another dtype."""

    def native(linear: torch.nn.Linear) -> torch.nn.Module:
        if linear.weight.dtype == torch.bfloat16:
            return NativeBf16Linear(linear, kernels)
        return NativeLinear(linear, kernels)

    replaced = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is Fp8Linear:
                setattr(module, name, NativeFp8Linear.of(child, kernels))
                replaced += 1
    return replaced + replace_linears(model, native)
