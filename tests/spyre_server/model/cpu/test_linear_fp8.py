"""The FP8-weight path of our bfloat16 linear kernel (``kernels/linear_bf16.cpp``,
``NativeFp8Linear``).

Oracles:
- the kernel's contract in torch: the bfloat16 kernel's float32 pair sums over the FP8 values
  (``test_linear_bf16.pair_sums``, proven there), times the column's scale, plus the bias, one
  rounding to bfloat16: the same bits, on both code paths, for every row count, with per-channel
  and per-tensor scales, odd sizes and a bias;
- every one of the 256 float8_e4m3fn bytes (subnormals, both zeros, the largest) against torch's
  own conversion, through the kernel;
- HF transformers' dequantized weights (compressed-tensors: ``(w.float() * scale).bfloat16()``)
  in float64: within the bfloat16 kernel's bound plus HF's rounding of each weight;
- compressed-tensors' activation quantize-dequantize written out op for op in torch.
"""

from __future__ import annotations

import pytest
import torch

from spyre_server.model.cpu.kernels.library import NativeKernels
from spyre_server.model.cpu.ops.native_linear import NativeFp8Linear
from spyre_server.model.fp8 import FP8_MAX, InputScales, fake_quantize_fp8, per_token_fp8_scale
from tests.conftest import needs_native_kernels
from tests.spyre_server.model.cpu.test_linear_bf16 import (
    BF16_HALF_STEP,
    EPS32,
    pair_sums,
    path,  # noqa: F401  (fixture)
)

pytestmark = needs_native_kernels


def fp8_weight(
    out_features: int, in_features: int, per_channel: bool, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """A random weight quantized as llm-compressor stores it: float8_e4m3fn values and a
    float32 scale per output (amax / 448) or one for the tensor."""
    torch.manual_seed(seed)
    w = torch.randn(out_features, in_features) * in_features**-0.5
    amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax().reshape(1)
    scale = amax / FP8_MAX
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def dequantized(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """HF transformers' (compressed-tensors') dequantization of an FP8 checkpoint weight."""
    return (weight.float() * scale.float()).to(torch.bfloat16)


def without_zero_exponents(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` with its zeros and subnormals (exponent 0) replaced by +-2^-6: every pair then
    takes the kernel's fast conversion."""
    bits = weight.view(torch.uint8).clone()
    small = (bits & 0x78) == 0
    bits[small] = (bits[small] & 0x80) | 0x08
    return bits.view(torch.float8_e4m3fn)


def contract(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The kernel's arithmetic: the pair sums over the FP8 values, times the scale, plus the bias,
    rounded once to bfloat16."""
    acc = pair_sums(x, weight.to(torch.bfloat16)) * scale.float().reshape(1, -1)
    return (acc if bias is None else acc + bias.float()).bfloat16()


@pytest.mark.parametrize(
    ("out_features", "in_features", "per_channel", "with_bias"),
    [(192, 256, True, False), (130, 77, True, True), (64, 300, False, False), (7, 9, False, True)],
)
@pytest.mark.parametrize("rows", [1, 5, 8, 12, 14, 16, 17, 61, 100])
@pytest.mark.parametrize("zero_exponents", [True, False])
def test_the_kernel_computes_exactly_its_contract(
    path: NativeKernels,  # noqa: F811
    out_features: int,
    in_features: int,
    per_channel: bool,
    with_bias: bool,
    rows: int,
    zero_exponents: bool,
) -> None:
    """With and without zeros and subnormals among the weights (the kernel converts pairs that
    have none another way; padding past an odd size is zero). Up to 12 rows convert as they
    read, the column groups in passes of 4 (up to 6 rows) or 2 (8, 12); 14 and 16 rows (a decode
    call's too) convert each chunk of pairs into the thread's copy first and compute it in row
    blocks of 4-6; 61 and 100 rows take several row chunks per column block, the later ones
    reading the thread's converted copy of the block."""
    weight, scale = fp8_weight(out_features, in_features, per_channel)
    if zero_exponents:  # +0, -0, 3 * 2^-9, -5 * 2^-9 in every 5th row, every 3rd column
        some = weight.view(torch.uint8)[::5, ::3]
        codes = torch.tensor([0x00, 0x80, 0x03, 0x85], dtype=torch.uint8)
        some.copy_(codes.repeat(some.numel())[: some.numel()].reshape(some.shape))
    else:
        weight = without_zero_exponents(weight)
    bias = torch.randn(out_features, dtype=torch.bfloat16) if with_bias else None
    fp8 = NativeFp8Linear(weight, scale, path, bias=bias)
    x = torch.randn(rows, in_features, dtype=torch.bfloat16)
    assert torch.equal(fp8(x), contract(x, weight, scale, bias))


@pytest.mark.parametrize(("out_features", "in_features"), [(960, 576), (256, 2048)])
def test_the_kernel_is_within_bounds_of_hf_dequantized_weights(
    path: NativeKernels,  # noqa: F811
    out_features: int,
    in_features: int,
) -> None:
    """|ours - exact| and |HF - exact| are each within the bfloat16 kernel's bound (HF's weights
    are further off by their own 2^-9 relative rounding), against the exact float64 product
    with HF's dequantized weights."""
    weight, scale = fp8_weight(out_features, in_features, per_channel=True)
    x = torch.randn(9, in_features, dtype=torch.bfloat16)
    hf_weight = dequantized(weight, scale).double()
    exact = x.double() @ hf_weight.T
    magnitude = x.double().abs() @ hf_weight.abs().T
    # ours sums the unrounded w8 * scale: each weight within 2^-9 of HF's, so within that of exact
    allowed = BF16_HALF_STEP * exact.abs() + (in_features + 2) * EPS32 * magnitude
    allowed = allowed + 2.0**-9 * magnitude * (1 + BF16_HALF_STEP)
    ours = NativeFp8Linear(weight, scale, path)(x).double()
    assert ((ours - exact).abs() <= allowed).all()
    assert not torch.equal(ours, exact)


def test_every_fp8_value_converts_as_torch_converts_it(path: NativeKernels) -> None:  # noqa: F811
    """Column n's weight is the n-th byte (NaNs replaced by zero) at input 0, and 0 elsewhere:
    with x = e_0 the output is the weight times its scale (scales that keep every value exact)."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # NaN is refused (below)
    weight = torch.zeros(256, 2, dtype=torch.uint8)
    weight[:, 0] = codes
    weight = weight.view(torch.float8_e4m3fn)
    x = torch.zeros(1, 2, dtype=torch.bfloat16)
    x[0, 0] = 1.0
    for scale in (torch.tensor([1.0]), torch.tensor([0.375]), torch.full((256, 1), 2.0**-3)):
        got = NativeFp8Linear(weight, scale, path)(x)[0]
        expected = (weight[:, 0].float() * scale.reshape(-1).float()).bfloat16()
        assert torch.equal(got, expected), (got - expected).abs().max()


def test_a_nan_weight_or_a_bad_scale_is_refused_at_packing(path: NativeKernels) -> None:  # noqa: F811
    weight, scale = fp8_weight(64, 32, per_channel=True)
    bad = weight.view(torch.uint8).clone()
    bad[3, 5] = 0xFF
    with pytest.raises(ValueError, match="1 NaN"):
        NativeFp8Linear(bad.view(torch.float8_e4m3fn), scale, path)
    with pytest.raises(ValueError, match="1 or 64 scales"):
        NativeFp8Linear(weight, scale[:3], path)
    with pytest.raises(ValueError, match="not finite"):
        NativeFp8Linear(weight, torch.full_like(scale, float("inf")), path)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        NativeFp8Linear(weight.float(), scale, path)


def compressed_tensors_fake_quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """compressed-tensors 0.20's ``_quantize_dequantize`` for a float 8-bit, symmetric,
    per-tensor static scale, written out: divide, clamp to the FP8 range, cast to FP8 and back,
    then to the scale's dtype and times the scale."""
    scaled = x / scale
    info = torch.finfo(torch.float8_e4m3fn)
    rounded = torch.clamp(scaled, info.min, info.max).to(torch.float8_e4m3fn).to(scaled.dtype)
    return rounded.to(scale.dtype) * scale


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32])
def test_a_static_input_scale_rounds_the_input_to_fp8_steps_first(
    path: NativeKernels,  # noqa: F811
    scale_dtype: torch.dtype,
) -> None:
    weight, scale = fp8_weight(96, 128, per_channel=True)
    input_scale = torch.tensor([0.02], dtype=scale_dtype)
    x = torch.randn(3, 128, dtype=torch.bfloat16) * 4  # some values past 448 steps: clamped
    assert (x.abs() / 0.02 > FP8_MAX).any()
    fq = fake_quantize_fp8(x, input_scale)
    assert torch.equal(fq, compressed_tensors_fake_quantize(x, input_scale))
    layer = NativeFp8Linear(weight, scale, path, input_scale=input_scale)
    assert torch.equal(layer(x), contract(fq.bfloat16(), weight, scale, None))
    assert not torch.equal(layer(x), contract(x, weight, scale, None))


def test_the_module_takes_any_leading_shape(path: NativeKernels) -> None:  # noqa: F811
    weight, scale = fp8_weight(64, 48, per_channel=True)
    layer = NativeFp8Linear(weight, scale, path)
    x = torch.randn(2, 3, 48, dtype=torch.bfloat16)
    assert torch.equal(layer(x), layer(x.reshape(6, 48)).reshape(2, 3, 64))
    with pytest.raises(TypeError, match="bfloat16"):
        layer(x.float())


@pytest.mark.parametrize("input_scales", ["static", "dynamic", None])
def test_the_native_layer_of_a_checkpoint_layer_is_within_the_bound_of_hfs_formula(
    path: NativeKernels,  # noqa: F811
    input_scales: InputScales,
) -> None:
    """``NativeFp8Linear.of(Fp8Linear)`` (what the cpu backend serves) against the loaded
    layer's own forward (HF's formula): within the bfloat16 kernel's bound plus HF's rounding
    of each weight, with the input rounded to FP8 steps by both where the layer has a scale
    (static) or computes one per row (dynamic)."""
    from spyre_server.model.fp8 import Fp8Linear

    weight, scale = fp8_weight(320, 256, per_channel=True)
    layer = Fp8Linear(256, 320, torch.bfloat16, input_scales=input_scales)
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.weight_scale.copy_(scale.reshape(-1).bfloat16())
        if layer.input_scale is not None:
            layer.input_scale.fill_(0.01)
    x = torch.randn(7, 256, dtype=torch.bfloat16)
    native = NativeFp8Linear.of(layer, path)
    assert (native.input_scale is None) == (input_scales != "static")
    assert native.dynamic_inputs == (input_scales == "dynamic")
    if input_scales == "static":
        x_in = fake_quantize_fp8(x, layer.input_scale).bfloat16()
    elif input_scales == "dynamic":
        x_in = fake_quantize_fp8(x, per_token_fp8_scale(x))
        assert not torch.equal(x_in, x)
    else:
        x_in = x
    hf_weight = dequantized(weight, layer.weight_scale.float()[:, None]).double()
    exact = x_in.double() @ hf_weight.T
    magnitude = x_in.double().abs() @ hf_weight.abs().T
    allowed = BF16_HALF_STEP * exact.abs() + (256 + 2) * EPS32 * magnitude
    allowed = allowed + 2.0**-9 * magnitude * (1 + BF16_HALF_STEP)
    with torch.no_grad():
        reference = layer(x).double()
    assert ((native(x).double() - exact).abs() <= allowed).all()
    assert ((reference - exact).abs() <= allowed).all()


@pytest.mark.parametrize("scale", [0.01, 2.0**-7, 0.3359375, 1.0])
def test_the_native_input_rounding_gives_torchs_bits(path: NativeKernels, scale: float) -> None:  # noqa: F811
    """The kernel behind a bfloat16 input scale against ``fake_quantize_fp8`` (torch's ops): every
    bfloat16 bit pattern that is a number (zeros, subnormals, ties between FP8 steps, values
    past the FP8 range, infinities), and NaN staying NaN."""
    x = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    s = torch.tensor([scale], dtype=torch.bfloat16)
    out = torch.empty_like(x)
    path.fake_quantize_fp8_bf16(x.data_ptr(), float(s), out.data_ptr(), x.numel())
    expected = fake_quantize_fp8(x, s)
    number = ~x.isnan()
    assert torch.equal(out[number].view(torch.int16), expected[number].view(torch.int16))
    assert out[~number].isnan().all()
    # A length that is not a multiple of the kernel's 8 lanes: the last values one at a time.
    shuffled = x[number][
        torch.randperm(int(number.sum()), generator=torch.Generator().manual_seed(0))
    ]
    tail = shuffled[: 8 * 5 + 7].clone()
    out = torch.full_like(tail, 7.0)
    path.fake_quantize_fp8_bf16(tail.data_ptr(), float(s), out.data_ptr(), tail.numel())
    assert torch.equal(out.view(torch.int16), fake_quantize_fp8(tail, s).view(torch.int16))


def compressed_tensors_dynamic_fake_quantize(x: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' own dynamic per-token FP8 quantize-dequantize (the library HF
    transformers runs), on ``x`` as HF's layers see it: ``[batch, tokens, hidden]``."""
    ct = pytest.importorskip("compressed_tensors.quantization")
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp

    args = ct.QuantizationArgs(
        num_bits=8, type="float", symmetric=True, dynamic=True, strategy="token"
    )
    scale, zero_point = compute_dynamic_scales_and_zp(x, args, module=torch.nn.Identity())
    return fake_quantize(x, scale, zero_point, args)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_per_token_scales_are_compressed_tensors_own(dtype: torch.dtype) -> None:
    """``fake_quantize_fp8(x, per_token_fp8_scale(x))`` against compressed-tensors' functions:
    the same bits, with a zero token (epsilon scale) and tokens of very different sizes."""
    x = torch.randn(1, 6, 96, dtype=dtype) * torch.tensor([1e-3, 1, 30, 0, 1e4, 2.0**-20]).to(
        dtype
    ).reshape(1, 6, 1)
    ours = fake_quantize_fp8(x, per_token_fp8_scale(x))
    theirs = compressed_tensors_dynamic_fake_quantize(x)
    assert torch.equal(ours, theirs)
    assert not torch.equal(ours, x)
    assert torch.equal(ours[0, 3], torch.zeros(96, dtype=dtype))


def test_the_native_per_row_rounding_gives_torchs_bits(path: NativeKernels) -> None:  # noqa: F811
    """The kernel behind dynamic input scales against ``fake_quantize_fp8(x,
    per_token_fp8_scale(x))``: every bfloat16 bit pattern, in rows of 64 (each with its own
    largest magnitude: zeros, subnormals, infinities), a row of zeros, and rows holding a NaN
    (NaN throughout, as in torch)."""
    patterns = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = torch.cat([patterns, torch.zeros(64, dtype=torch.bfloat16)]).reshape(-1, 64)
    x = x[torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(0))].contiguous()
    out = torch.empty_like(x)
    path.fake_quantize_fp8_rows_bf16(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1])
    expected = fake_quantize_fp8(x, per_token_fp8_scale(x))
    number = ~expected.isnan()
    assert torch.equal(out[number].view(torch.int16), expected[number].view(torch.int16))
    assert out[~number].isnan().all()
    assert number.sum() > x.numel() // 2
