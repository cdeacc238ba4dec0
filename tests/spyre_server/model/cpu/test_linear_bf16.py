"""Our own bfloat16 linear kernel (``kernels/linear_bf16.cpp``, ``NativeBf16Linear``): its exact
arithmetic, its batch invariance, its two code paths and its choice.

Oracles:
- the kernel's contract computed in torch: each output is one float32 sum over the pairs of
  inputs in order, ``acc + x[2p + 1] * w[2p + 1]`` then ``acc + x[2p] * w[2p]`` (a product of two
  bfloat16 values is exact in float32, so each step rounds once, as an FMA), then the bias, then
  one rounding to bfloat16: the kernel's bits, exactly (inputs without denormals);
- ``F.linear`` in float64: within the stated bound, half a bfloat16 step (2^-8 relative) of the
  result plus the float32 accumulation error, (K + 2) * 2^-24 * (|x| @ |w|^T + |bias|), element by
  element;
- the same rows in calls of other sizes: the same bits (no tolerance).
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from spyre_server.model.cpu.errors import LinearKernelError
from spyre_server.model.cpu.kernels.library import (
    NativeKernels,
    avx512_bf16_unsupported_reason,
    default_kernel_dir,
    load_native_kernels,
)
from spyre_server.model.cpu.ops.native_elementwise import NativeRMSNorm
from spyre_server.model.cpu.ops.native_linear import NativeBf16Linear, NativeLinear
from spyre_server.model.cpu.prepare import cpu_inference_copy
from tests.conftest import needs_native_kernels
from tests.spyre_server.model.cpu.test_aten_decoder import BF16_LOGIT_TOL

pytestmark = needs_native_kernels
EPS32 = 2.0**-24
BF16_HALF_STEP = 2.0**-8
"""bfloat16 keeps 8 significant bits: rounding moves a value by at most 2^-8 of it."""


def kernels() -> NativeKernels:
    """The kernels with every bfloat16 layer on this file's arithmetic (``model.native_amx:
    false``; the AMX kernel's is test_linear_amx.py's)."""
    return load_native_kernels(default_kernel_dir(), amx=False)


@pytest.fixture(params=["avx512_bf16", "avx2"])
def path(request: pytest.FixtureRequest) -> NativeKernels:
    """The kernels with the bfloat16 linear on AVX512-BF16 (skipped where the CPU lacks it) or
    on AVX2 (``model.native_avx512: false``, and every CPU without AVX512-BF16)."""
    if request.param == "avx2":
        lib = load_native_kernels(default_kernel_dir(), avx512=False)
        assert not lib.linear_bf16_dot
        return lib
    if (reason := avx512_bf16_unsupported_reason()) is not None:
        pytest.skip(f"the AVX512-BF16 code cannot run: {reason}")
    lib = kernels()
    assert lib.linear_bf16_dot
    return lib


def bf16_linear(
    out_features: int, in_features: int, bias: bool = False, seed: int = 0
) -> torch.nn.Linear:
    torch.manual_seed(seed)
    linear = torch.nn.Linear(in_features, out_features, bias=bias, dtype=torch.bfloat16)
    with torch.no_grad():
        linear.weight.normal_(0.0, in_features**-0.5)
        if linear.bias is not None:
            linear.bias.normal_(0.0, 1.0)
    return linear


def pair_sums(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The kernel's float32 sums over pairs, odd element first, step by step (bfloat16 values:
    each product exact, each add rounded once)."""
    xf, wf = x.float(), weight.float()
    if xf.shape[-1] % 2:
        xf, wf = F.pad(xf, (0, 1)), F.pad(wf, (0, 1))
    acc = torch.zeros(xf.shape[0], wf.shape[0])
    for p in range(xf.shape[-1] // 2):
        for k in (2 * p + 1, 2 * p):
            acc = acc + xf[:, k : k + 1] * wf[:, k]
    return acc


def contract(x: torch.Tensor, linear: torch.nn.Linear) -> torch.Tensor:
    """The kernel's arithmetic, step by step in float32 (see the module docstring)."""
    acc = pair_sums(x, linear.weight.detach())
    if linear.bias is not None:
        acc = acc + linear.bias.detach().float()
    return acc.bfloat16()


def bound(
    x: torch.Tensor, linear: torch.nn.Linear, eps: float = EPS32
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the exact result in float64, how far the kernel may be from it): ``eps`` the float32
    accumulation's error per step, relative."""
    w = linear.weight.detach().double()
    b = None if linear.bias is None else linear.bias.detach().double()
    exact = F.linear(x.double(), w, b)
    magnitude = F.linear(x.double().abs(), w.abs(), None if b is None else b.abs())
    accumulated = (x.shape[-1] + 2) * eps * magnitude
    return exact, accumulated + BF16_HALF_STEP * (exact.abs() + accumulated)


def run(lib: NativeKernels, linear: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The kernel called directly, output written into a NaN canvas that must stay NaN past the
    outputs."""
    n, k = linear.weight.shape
    packed = torch.empty(lib.linear_bf16_packed_numel(n, k), dtype=torch.bfloat16)
    lib.linear_bf16_pack(linear.weight.detach().contiguous().data_ptr(), packed.data_ptr(), n, k)
    rows = x.shape[0]
    canvas = torch.full((rows * n + 64,), float("nan"), dtype=torch.bfloat16)
    bias = None if linear.bias is None else linear.bias.detach().contiguous().data_ptr()
    ran_dot = lib.linear_bf16(x.data_ptr(), packed.data_ptr(), bias, canvas.data_ptr(), rows, k, n)
    assert ran_dot == int(lib.linear_bf16_dot)
    assert canvas[rows * n :].isnan().all(), "written past the outputs"
    return canvas[: rows * n].view(rows, n)


@pytest.mark.parametrize(
    ("rows", "out_features", "in_features", "bias"),
    [
        (1, 1, 1, False),
        (3, 17, 7, True),  # an odd K: the last pair has one value
        (6, 64, 32, False),  # one full row block of the AVX512-BF16 path, one column block
        (7, 65, 33, True),  # a row left over; a second column block with one column
        (8, 70, 259, True),  # two row blocks of 4 (a decode call's), three chunks, an odd K
        (13, 130, 64, False),
        (16, 100, 130, True),  # a decode step's largest row chunk, several chunks of pairs
        (17, 64, 96, False),  # the first prefill-sized call
        (49, 200, 40, True),  # two row chunks, the second of one row
        (100, 70, 300, False),
    ],
)
def test_the_kernel_computes_exactly_its_contract(
    path: NativeKernels, rows: int, out_features: int, in_features: int, bias: bool
) -> None:
    """Every row block size, column blocks full and partial, odd K, the bias: the contract's
    bits, and within the stated bound of the exact result."""
    linear = bf16_linear(out_features, in_features, bias, seed=rows)
    x = torch.randn(rows, in_features).bfloat16()
    out = run(path, linear, x)
    assert torch.equal(out, contract(x, linear))
    exact, tolerance = bound(x, linear)
    assert ((out.double() - exact).abs() <= tolerance).all()


@pytest.mark.parametrize(("out_features", "in_features"), [(960, 576), (576, 1536), (256, 2048)])
def test_the_kernel_is_within_the_bound_of_f_linear(
    path: NativeKernels, out_features: int, in_features: int
) -> None:
    """SmolLM2's projections and a 2048-wide one: within the bound of the exact result, so within
    twice it of F.linear (which sums in another order)."""
    linear = bf16_linear(out_features, in_features, seed=in_features)
    x = torch.randn(40, in_features).bfloat16()
    out = run(path, linear, x).double()
    exact, tolerance = bound(x, linear)
    assert ((out - exact).abs() <= tolerance).all()
    with torch.inference_mode():
        theirs = F.linear(x, linear.weight).double()
    assert ((out - theirs).abs() <= 2 * tolerance).all()


@pytest.mark.parametrize(("out_features", "in_features"), [(960, 576), (576, 1536), (130, 77)])
def test_a_row_gets_the_same_bits_in_a_call_of_any_size(
    path: NativeKernels, out_features: int, in_features: int
) -> None:
    """Batch invariance: each row of a 300-row call, computed again in calls of 1 to 256 rows
    at every offset kind (a decode step's single row and row chunks, prefill row chunks and
    their remainders), and on one thread and two, gives the same bits."""
    linear = bf16_linear(out_features, in_features, seed=out_features)
    x = torch.randn(300, in_features).bfloat16()
    full = run(path, linear, x)
    threads = torch.get_num_threads()
    try:
        for num_threads in (1, 2):
            torch.set_num_threads(num_threads)
            for size in (1, 2, 5, 6, 7, 8, 12, 16, 17, 48, 49, 64, 256):
                for start in sorted({0, 1, 7, 300 - size}):
                    part = run(path, linear, x[start : start + size].contiguous())
                    assert torch.equal(part, full[start : start + size]), (num_threads, size)
    finally:
        torch.set_num_threads(threads)


def test_the_two_paths_give_the_same_bits() -> None:
    """On a CPU with AVX512-BF16: the AVX2 code computes the same FMAs in the same order, with
    denormals flushed as the dot-product instruction flushes them, so every output is the same
    bits, denormal inputs, infinities and NaN included."""
    if (reason := avx512_bf16_unsupported_reason()) is not None:
        pytest.skip(f"no second path to compare: {reason}")
    dot, avx2 = kernels(), load_native_kernels(default_kernel_dir(), avx512=False)
    assert dot.linear_bf16_dot and not avx2.linear_bf16_dot
    torch.manual_seed(3)
    linear = bf16_linear(150, 91, bias=True)
    x = torch.randn(37, 91)
    x[0] *= 2.0**-130  # denormal in bfloat16
    x[1, :40] *= 2.0**-120  # products below float32's normal range
    x[2, 5] = float("inf")
    x[3, 9] = float("nan")
    x = x.bfloat16()
    with torch.no_grad():
        linear.weight[7] *= 2.0**-60
    out = run(dot, linear, x)
    assert torch.equal(run(avx2, linear, x).view(torch.int16), out.view(torch.int16))
    assert out[3].isnan().all() and not out[4:].isnan().any()


@pytest.mark.parametrize("bias", [False, True])
def test_the_module_takes_any_leading_shape_and_strided_input(bias: bool) -> None:
    linear = bf16_linear(40, 96, bias)
    native = NativeBf16Linear(linear, kernels())
    x = torch.randn(2, 5, 96).bfloat16()
    strided = torch.randn(6, 192).bfloat16()[:, ::2]
    with torch.inference_mode():
        assert torch.equal(native(x), contract(x.reshape(10, 96), linear).view(2, 5, 40))
        assert torch.equal(native(strided), contract(strided, linear))
        assert native(torch.randn(1, 0, 96).bfloat16()).shape == (1, 0, 40)
    assert "native bfloat16" in repr(native)


@pytest.mark.parametrize("bias", [False, True])
def test_a_converted_module_still_computes_what_it_packed(bias: bool) -> None:
    """The kernel reads the packed weight and the bias through addresses taken once: a
    conversion that replaces the module's tensors (``.float()``) must leave it reading them, not
    freed memory."""
    linear = bf16_linear(40, 96, bias)
    native = NativeBf16Linear(linear, kernels())
    x = torch.randn(3, 96).bfloat16()
    want = contract(x, linear)
    native.float()
    assert native.packed.dtype == torch.float32
    torch.full((1 << 20,), 7.0)  # reuses freed memory, if any
    with torch.inference_mode():
        assert torch.equal(native(x), want)


def test_the_module_refuses_other_dtypes() -> None:
    with pytest.raises(ValueError, match=r"bfloat16 CPU weights, not torch\.float32"):
        NativeBf16Linear(torch.nn.Linear(8, 8), kernels())
    native = NativeBf16Linear(bf16_linear(8, 8), kernels())
    with pytest.raises(TypeError, match=r"computes in bfloat16; got torch\.float32"):
        native(torch.randn(2, 8))


def test_a_bfloat16_copy_runs_every_linear_on_it(tiny_llama_factory: Any) -> None:
    """``linear_kernel: auto`` on a bfloat16 model: every linear layer (the LM head too) on the
    kernel, the element-wise ops native, the logits within bfloat16's precision of the float32
    model's; a float32 copy keeps the float32 kernel."""
    model = tiny_llama_factory()
    bf16 = tiny_llama_factory().to(torch.bfloat16)
    copy = cpu_inference_copy(bf16, linear_kernel="auto", dtype=torch.bfloat16)
    linears = [m for m in copy.modules() if isinstance(m, NativeBf16Linear)]
    assert len(linears) == 1 + 4 * len(copy.base_model.layers)
    assert not any(type(m) in (torch.nn.Linear, NativeLinear) for m in copy.modules())
    assert any(isinstance(m, NativeRMSNorm) for m in copy.modules())
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ours, theirs = copy(ids), model(ids)
    ours, theirs = (x[0] if isinstance(x, tuple) else x for x in (ours, theirs))
    assert ours.dtype == torch.bfloat16
    assert (ours.float() - theirs).abs().max() <= BF16_LOGIT_TOL
    f32 = cpu_inference_copy(model, linear_kernel="auto", dtype=torch.float32)
    assert not any(isinstance(m, NativeBf16Linear) for m in f32.modules())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_linear_kernel_that_is_not_batch_invariant_says_so(
    tiny_llama_factory: Any, dtype: torch.dtype, caplog: pytest.LogCaptureFixture
) -> None:
    """oneDNN's and aten's linears can sum a row differently in steps of other sizes: the start
    says so (a cache hit may then change an answer's last bits); ours do not, and say nothing."""
    model = tiny_llama_factory().to(dtype)
    for kernel in ("native", "onednn", "aten"):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="spyre_server.model.cpu.prepare"):
            try:
                cpu_inference_copy(model, linear_kernel=kernel, dtype=dtype)  # type: ignore[arg-type]
            except LinearKernelError:  # oneDNN without bfloat16 units
                continue
        said = f"linear_kernel {kernel} is not batch-invariant" in caplog.text
        assert said == (kernel != "native"), kernel
