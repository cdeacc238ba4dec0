"""Our bfloat16 linear kernel on AMX tiles (``kernels/linear_amx.cpp``, ``NativeBf16Linear`` and
``NativeFp8Linear`` with ``on_amx``): which layers take it, and what it computes.

Intel does not fix the order or rounding of TDPBF16PS's internal float32 sums, so there is no
step-by-step contract to compare bits with. Oracles instead:
- sums that are exact in float32 (small integers): every order gives the exact value, so the
  kernel's bits equal ``F.linear`` in float64's, rounded once (this pins how the packed weight is
  read: any misplaced pair or column changes a sum);
- ``F.linear`` in float64: within the bound of ``test_linear_bf16.bound`` with a whole float32
  unit (2^-23) a step instead of half, element by element;
- the same rows in calls of other sizes and thread counts: the same bits (no tolerance);
- denormal inputs count as zero, as the kernel's contract says;
- FP8 weights: the bfloat16 kernel on their (exact) bfloat16 values, bit for bit.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from spyre_server.model.cpu.kernels.library import (
    NativeKernels,
    default_kernel_dir,
    load_native_kernels,
)
from spyre_server.model.cpu.ops.native_linear import (
    AMX_K_MULTIPLE,
    NativeBf16Linear,
    NativeFp8Linear,
)
from spyre_server.model.cpu.prepare import cpu_inference_copy
from tests.conftest import needs_amx, needs_native_kernels
from tests.spyre_server.model.cpu.test_aten_decoder import BF16_LOGIT_TOL
from tests.spyre_server.model.cpu.test_linear_bf16 import bf16_linear, bound, contract

pytestmark = [needs_native_kernels, needs_amx]
EPS32_UNIT = 2.0**-23
"""The float32 bound's error per step here: a whole unit (TDPBF16PS's rounding is not stated)."""


def kernels() -> NativeKernels:
    lib = load_native_kernels(default_kernel_dir())
    assert lib.linear_bf16_on_amx, "an AMX process's default kernels take AMX"
    return lib


def amx_linear(linear: torch.nn.Linear) -> NativeBf16Linear:
    native = NativeBf16Linear(linear, kernels())
    assert native.on_amx
    return native


SHAPES = [
    (64, 32, False),  # one tile of pairs, one column block
    (100, 64, True),  # a partial second column block
    (130, 96, True),
    (70, 320, True),
    (200, 1088, False),  # 544 pairs: a prefill task's sums in several chunks, the last short
    (1000, 256, True),  # 16 blocks (the last partial): panels of 4, several a thread
]


@pytest.mark.parametrize(("out_features", "in_features", "bias"), SHAPES)
def test_integer_sums_are_exact(out_features: int, in_features: int, bias: bool) -> None:
    """Small integers: every partial sum is exact in float32 (|sum| < 2^24), whatever order the
    tiles add in, so each output is the exact sum rounded once to bfloat16: decode-sized and
    prefill-sized calls (one and two row tiles, partial tiles)."""
    torch.manual_seed(in_features)
    linear = bf16_linear(out_features, in_features, bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randint(-8, 9, linear.weight.shape))
        if linear.bias is not None:
            linear.bias.copy_(torch.randint(-100, 101, linear.bias.shape))
    native = amx_linear(linear)
    for rows in (1, 7, 16, 17, 40, 129):
        x = torch.randint(-8, 9, (rows, in_features)).bfloat16()
        exact = F.linear(
            x.double(),
            linear.weight.double(),
            None if linear.bias is None else linear.bias.double(),
        )
        with torch.inference_mode():
            assert torch.equal(native(x), exact.bfloat16()), rows


@pytest.mark.parametrize(("out_features", "in_features", "bias"), SHAPES)
def test_each_result_is_within_the_bound(out_features: int, in_features: int, bias: bool) -> None:
    linear = bf16_linear(out_features, in_features, bias, seed=out_features)
    x = torch.randn(300, in_features).bfloat16()
    with torch.inference_mode():
        out = amx_linear(linear)(x)
    exact, allowed = bound(x, linear, EPS32_UNIT)
    assert ((out.double() - exact).abs() <= allowed).all()


@pytest.mark.parametrize(("out_features", "in_features", "bias"), SHAPES)
def test_a_row_has_the_same_bits_in_a_call_of_any_size(
    out_features: int, in_features: int, bias: bool
) -> None:
    """Every row computed in calls of other sizes (decode-sized, one and two row tiles, several
    tasks) and on one thread or two gives the bits of one 300-row call."""
    linear = bf16_linear(out_features, in_features, bias, seed=in_features)
    native = amx_linear(linear)
    x = torch.randn(300, in_features).bfloat16()
    threads = torch.get_num_threads()
    with torch.inference_mode():
        full = native(x).view(torch.int16)
        try:
            for num_threads in (1, 2):
                torch.set_num_threads(num_threads)
                for rows in (1, 5, 16, 17, 31, 32, 33, 100, 129, 130, 300):
                    for start in sorted({0, 3, 300 - rows}):
                        part = native(x[start : start + rows].contiguous()).view(torch.int16)
                        assert torch.equal(part, full[start : start + rows]), (rows, start)
        finally:
            torch.set_num_threads(threads)


def test_a_call_of_more_rows_than_a_task_takes_is_exact_and_row_invariant() -> None:
    """1,100 rows: more than a task's row chunk (512), so three chunks of rows per panel, the
    last a partial row tile; integer sums stay exact and each row has the bits it has alone."""
    torch.manual_seed(5)
    linear = bf16_linear(600, 128, True)
    with torch.no_grad():
        linear.weight.copy_(torch.randint(-8, 9, linear.weight.shape))
        linear.bias.copy_(torch.randint(-100, 101, linear.bias.shape))
    native = amx_linear(linear)
    x = torch.randint(-8, 9, (1100, 128)).bfloat16()
    exact = F.linear(x.double(), linear.weight.double(), linear.bias.double())
    with torch.inference_mode():
        full = native(x)
        assert torch.equal(full, exact.bfloat16())
        y = torch.randn(1100, 128).bfloat16()
        full = native(y).view(torch.int16)
        for start, rows in ((0, 1), (511, 2), (1024, 76), (1099, 1)):
            part = native(y[start : start + rows].contiguous()).view(torch.int16)
            assert torch.equal(part, full[start : start + rows]), (start, rows)


def test_denormal_inputs_count_as_zero_and_nan_stays_in_its_row() -> None:
    linear = bf16_linear(80, 64, bias=True, seed=5)
    native = amx_linear(linear)
    x = torch.randn(20, 64)
    x[0] = 2.0**-130  # every input denormal in bfloat16
    x[1, 9] = float("nan")
    x = x.bfloat16()
    assert x[0].float().abs().max() < 2.0**-126 and (x[0] != 0).all()
    with torch.inference_mode():
        out = native(x)
    assert torch.equal(out[0], linear.bias.detach())  # bf16(0 + bias)
    assert out[1].isnan().all() and not out[2:].isnan().any()


def test_the_kernel_refuses_an_input_size_that_is_not_whole_tiles() -> None:
    """K not a multiple of 32: the packing and the kernel return 0 and write nothing; K 32
    writes exactly the outputs."""
    lib = kernels()
    for k, ran in ((48, 0), (32, 2)):
        linear = bf16_linear(70, k, seed=k)
        numel = lib.linear_bf16_packed_numel(70, k)
        packed = torch.full((numel,), float("nan"), dtype=torch.bfloat16)
        weight = linear.weight.detach().data_ptr()
        assert lib.linear_bf16_amx_pack(weight, packed.data_ptr(), 70, k) == ran // 2
        assert packed.isnan().all() == (ran == 0)
        x = torch.randn(3, k).bfloat16()
        canvas = torch.full((3 * 70 + 64,), float("nan"), dtype=torch.bfloat16)
        status = lib.linear_bf16_amx(
            x.data_ptr(), packed.data_ptr(), None, canvas.data_ptr(), 3, k, 70
        )
        assert status == ran
        assert canvas[3 * 70 :].isnan().all()
        assert canvas[: 3 * 70].isnan().all() == (ran == 0)


def test_a_layer_takes_amx_only_for_whole_tiles_and_when_asked() -> None:
    """Input size a multiple of 32 on AMX (every call); other sizes, and every layer of kernels
    loaded with ``amx=False`` (``model.native_amx: false``), keep linear_bf16.cpp's exact
    arithmetic."""
    assert AMX_K_MULTIPLE == 32
    whole, odd = bf16_linear(40, 96, True, seed=1), bf16_linear(40, 90, True, seed=2)
    assert NativeBf16Linear(whole, kernels()).on_amx
    assert "on amx" in repr(NativeBf16Linear(whole, kernels()))
    off = load_native_kernels(default_kernel_dir(), amx=False)
    assert not off.linear_bf16_on_amx and off.linear_bf16_dot
    x = torch.randn(9, 96).bfloat16()
    with torch.inference_mode():
        for linear, lib in ((odd, kernels()), (whole, off)):
            native = NativeBf16Linear(linear, lib)
            assert not native.on_amx and "on amx" not in repr(native)
            rows = x[:, : linear.in_features].contiguous()
            assert torch.equal(native(rows), contract(rows, linear))


def test_a_bfloat16_copy_runs_its_whole_tile_layers_on_amx(tiny_llama_factory: Any) -> None:
    """``linear_kernel: auto`` in an AMX process: the layers whose input size is a multiple of 32
    take AMX, and the logits stay within bfloat16's precision of the float32 model's."""
    model = tiny_llama_factory()
    copy = cpu_inference_copy(
        tiny_llama_factory().to(torch.bfloat16), linear_kernel="auto", dtype=torch.bfloat16
    )
    linears = [m for m in copy.modules() if isinstance(m, NativeBf16Linear)]
    assert linears and all(m.on_amx == (m.in_features % 32 == 0) for m in linears)
    assert any(m.on_amx for m in linears)
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ours, theirs = copy(ids), model(ids)
    ours, theirs = (x[0] if isinstance(x, tuple) else x for x in (ours, theirs))
    assert (ours.float() - theirs).abs().max() <= BF16_LOGIT_TOL


# ============================================================================ FP8 weights


def amx_fp8(weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> Any:
    native = NativeFp8Linear(weight, scale, kernels(), bias=bias)
    assert native.on_amx and "on amx" in repr(native)
    return native


def every_finite_fp8(
    out_features: int, in_features: int, seed: int, zero_exponents: bool = True
) -> torch.Tensor:
    """A float8_e4m3fn weight holding each of the 254 finite bytes (both zeros and every
    subnormal among them), shuffled; without ``zero_exponents``, each of the 224 with a nonzero
    exponent."""
    finite = [b for b in range(256) if b & 0x7F != 0x7F and (zero_exponents or b & 0x78)]
    codes = torch.tensor(finite, dtype=torch.uint8)
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, len(codes), (out_features, in_features), generator=generator)
    return codes[picks].view(torch.float8_e4m3fn)


@pytest.mark.parametrize(
    ("out_features", "in_features"), [(64, 32), (130, 96), (200, 1088), (1000, 256)]
)
@pytest.mark.parametrize("zero_exponents", [True, False])
def test_fp8_weights_give_the_bits_of_their_bfloat16_values(
    out_features: int, in_features: int, zero_exponents: bool
) -> None:
    """Every float8_e4m3fn value is a bfloat16 value: with a scale of 1 the FP8 kernel's output
    is the bfloat16 AMX kernel's on the converted weight, bit for bit, at decode and prefill
    sizes: each of the 254 finite bytes in the weight (steps with and without exponent-0
    values, converted two ways), or each of the 224 with a nonzero exponent (every step
    converted the short way)."""
    weight = every_finite_fp8(out_features, in_features, in_features, zero_exponents)
    weight[:, :32] = torch.ones(out_features, 32).to(torch.float8_e4m3fn)  # a step without zeros
    fp8 = amx_fp8(weight, torch.ones(1))
    linear = bf16_linear(out_features, in_features)
    with torch.no_grad():
        linear.weight.copy_(weight.to(torch.bfloat16))
    bf16 = amx_linear(linear)
    x = (torch.randn(140, in_features) * 2.0**-8).bfloat16()  # sums well inside float32's range
    with torch.inference_mode():
        for rows in (1, 9, 16, 17, 140):
            want = bf16(x[:rows]).view(torch.int16)
            assert torch.equal(fp8(x[:rows]).view(torch.int16), want), rows


def test_fp8_scales_and_bias_are_exact_on_integer_sums() -> None:
    """Integer weights and inputs, power-of-two column scales: every step exact, so each output
    is the exact product with the dequantized weights plus the bias, rounded once."""
    torch.manual_seed(11)
    weight = torch.randint(-8, 9, (100, 64)).float()
    scale = 2.0 ** torch.randint(-4, 5, (100, 1)).float()
    bias = torch.randint(-50, 51, (100,)).bfloat16()
    native = amx_fp8(weight.to(torch.float8_e4m3fn), scale, bias)
    for rows in (1, 33):
        x = torch.randint(-8, 9, (rows, 64)).bfloat16()
        exact = F.linear(x.double(), (weight * scale).double(), bias.double())
        with torch.inference_mode():
            assert torch.equal(native(x), exact.bfloat16()), rows


def test_fp8_rows_have_the_same_bits_in_a_call_of_any_size() -> None:
    weight, scale = torch.randn(150, 320).to(torch.float8_e4m3fn), torch.rand(150) + 0.5
    native = amx_fp8(weight, scale)
    x = torch.randn(200, 320).bfloat16()
    with torch.inference_mode():
        full = native(x).view(torch.int16)
        for rows in (1, 5, 16, 17, 33, 130):
            for start in (0, 200 - rows):
                part = native(x[start : start + rows].contiguous()).view(torch.int16)
                assert torch.equal(part, full[start : start + rows]), (rows, start)


def test_fp8_packing_refuses_an_input_size_that_is_not_whole_tiles() -> None:
    lib = kernels()
    weight = torch.ones(70, 48).to(torch.float8_e4m3fn)
    packed = torch.zeros(lib.linear_fp8_packed_numel(70, 48), dtype=torch.uint8)
    scale, packed_scale = torch.ones(1), torch.zeros(128)
    args = (scale.data_ptr(), 1, packed.data_ptr(), packed_scale.data_ptr(), 70, 48)
    assert lib.linear_fp8_amx_pack(weight.view(torch.uint8).data_ptr(), *args) == -1
    assert not packed.any() and not packed_scale.any()
    assert not NativeFp8Linear(weight, scale, lib).on_amx  # the layer keeps linear_bf16.cpp
