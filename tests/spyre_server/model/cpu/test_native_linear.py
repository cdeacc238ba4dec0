"""Our own float32 linear kernel (``model.linear_kernel: native``), its build and its choice.

Oracle: ``F.linear`` in float64. The kernel sums each output in k order in float32, so its error
is bounded by K float32 roundings of the products' magnitudes: |err| <= K * 2^-24 * (|x| @ |w|^T)
(plus the bias' one rounding), checked element by element.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from spyre_server.model.cpu import prepare as cpu_model
from spyre_server.model.cpu.errors import KernelUnavailableError, LinearKernelError
from spyre_server.model.cpu.kernels import library as native_kernels
from spyre_server.model.cpu.kernels.library import (
    NativeKernelError,
    build,
    default_kernel_dir,
    load_native_kernels,
)
from spyre_server.model.cpu.ops.native_linear import NativeLinear
from spyre_server.model.cpu.prepare import resolve_linear_kernel
from spyre_server.model.loading import ModelLoadError
from tests.conftest import needs_native_kernels

pytestmark = needs_native_kernels
EPS32 = 2.0**-24


def assert_within_float32_bound(
    out: torch.Tensor, x: torch.Tensor, linear: torch.nn.Linear
) -> None:
    w = linear.weight.double()
    b = None if linear.bias is None else linear.bias.double()
    exact = F.linear(x.double(), w, b)
    magnitude = F.linear(x.double().abs(), w.abs())
    bound = (x.shape[-1] + 1) * EPS32 * magnitude
    if b is not None:
        bound += EPS32 * (exact.abs() + b.abs())
    assert out.dtype == torch.float32 and out.shape == exact.shape
    excess = (out.double() - exact).abs() - bound
    assert excess.max() <= 0, f"worst excess over the float32 bound: {excess.max():.3g}"


@pytest.mark.parametrize(
    ("out_features", "in_features"),
    [(1, 1), (7, 3), (8, 16), (23, 5), (24, 64), (25, 33), (49, 96), (960, 576)],
)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 64, 257])
def test_native_linear_matches_f_linear(rows: int, out_features: int, in_features: int) -> None:
    """Every row-block (4, 3, 2, 1 rows), panel-block (3, 2, 1 panels) and partial last panel."""
    torch.manual_seed(rows * 1000 + out_features)
    linear = torch.nn.Linear(in_features, out_features, bias=False)
    native = NativeLinear(linear, load_native_kernels(default_kernel_dir()))
    x = torch.randn(rows, in_features)
    with torch.inference_mode():
        assert_within_float32_bound(native(x), x, linear)


@pytest.mark.parametrize("bias", [False, True])
def test_native_linear_takes_any_leading_shape_and_strided_input(bias: bool) -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 40, bias=bias)
    native = NativeLinear(linear, load_native_kernels(default_kernel_dir()))
    x = torch.randn(2, 5, 96)
    strided = torch.randn(6, 192)[:, ::2]
    empty = torch.randn(1, 0, 96)
    with torch.inference_mode():
        assert_within_float32_bound(native(x), x, linear)
        assert_within_float32_bound(native(strided), strided, linear)
        assert native(empty).shape == (1, 0, 40)


def test_the_kernel_writes_exactly_its_outputs() -> None:
    """A partial last panel is padded with zero columns inside the kernel; the padding must not
    reach the memory after each output row."""
    kernels = load_native_kernels(default_kernel_dir())
    rows, out_features, in_features = 5, 13, 7
    weight = torch.randn(out_features, in_features)
    panels = torch.empty(kernels.packed_numel(out_features, in_features))
    assert panels.numel() == 16 * in_features  # two panels of 8 columns
    kernels.pack(weight.data_ptr(), panels.data_ptr(), out_features, in_features)
    x = torch.randn(rows, in_features)
    canvas = torch.full((rows * out_features + 64,), float("nan"))
    kernels.linear(
        x.data_ptr(), panels.data_ptr(), canvas.data_ptr(), rows, in_features, out_features
    )
    out = canvas[: rows * out_features].view(rows, out_features)
    assert torch.allclose(out, x @ weight.T, rtol=1e-5, atol=1e-6)
    assert canvas[rows * out_features :].isnan().all()


@pytest.mark.parametrize(
    ("rows", "out_features", "in_features"),
    [
        (1, 7, 33),
        (3, 24, 33),
        (5, 25, 33),
        (8, 576, 33),
        (17, 49, 33),
        (13, 30, 200),
        (15, 49, 129),
    ],
)
def test_linear_add_is_the_linear_then_an_add_bit_for_bit(
    rows: int, out_features: int, in_features: int
) -> None:
    """The residual epilogue (the native decoder's x += dense(attention)): every row block, a
    partial last panel, the packed rows from 16 on, a decode step's rows over several chunks of
    k (the add only after the last); and nothing written past the outputs."""
    torch.manual_seed(rows + out_features)
    kernels = load_native_kernels(default_kernel_dir())
    weight = torch.randn(out_features, in_features)
    panels = torch.empty(kernels.packed_numel(out_features, in_features))
    kernels.pack(weight.data_ptr(), panels.data_ptr(), out_features, in_features)
    x = torch.randn(rows, in_features)
    residual = torch.randn(rows, out_features)
    product = torch.empty(rows, out_features)
    kernels.linear(
        x.data_ptr(), panels.data_ptr(), product.data_ptr(), rows, in_features, out_features
    )
    canvas = torch.full((rows * out_features + 64,), float("nan"))
    canvas[: rows * out_features] = residual.flatten()
    kernels.linear_add(
        x.data_ptr(), panels.data_ptr(), canvas.data_ptr(), rows, in_features, out_features
    )
    assert torch.equal(canvas[: rows * out_features].view(rows, out_features), product + residual)
    assert canvas[rows * out_features :].isnan().all()


def test_a_row_gets_the_same_bits_in_any_batch() -> None:
    """Batch invariance: each output is one k-ordered sum whatever the other rows are, so a
    request's logits do not depend on which requests share its decode step."""
    torch.manual_seed(1)
    linear = torch.nn.Linear(576, 960, bias=False)
    native = NativeLinear(linear, load_native_kernels(default_kernel_dir()))
    x = torch.randn(70, 576)  # 5-15 rows go over k in chunks, 1-4 in one pass, 16 on packed
    with torch.inference_mode():
        batch = native(x)
        for i in (0, 4, 8, 12, 14, 40, 69):
            assert torch.equal(native(x[i : i + 1])[0], batch[i])
            assert torch.equal(native(x[i : i + 3])[0], batch[i])
            assert torch.equal(native(x[i : i + 11])[0], batch[i])
        assert torch.equal(native(x[:15]), batch[:15])


@pytest.mark.parametrize(
    ("rows", "out_features", "in_features"),
    [
        (16, 48, 33),  # 6 panels: 3 pairs, two 8-row blocks
        (21, 56, 40),  # 7 panels: a lone seventh panel on AVX2; a 4-row block, 1 row left
        (67, 100, 64),  # 13 panels, the last partial: 6 + 6 + 1
        (30, 86, 17),  # 11 panels, the last partial: a pair, then a pair and a partial one
        (256, 576, 96),  # a prefill chunk's shape
        (8, 48, 200),  # a decode step's rows, over 4 chunks of k
        (13, 56, 129),  # a block of 8 and one of 5 rows; a lone panel on AVX2
        (5, 86, 64),  # 5 rows, one chunk; a partial last panel
        (15, 576, 70),  # 8 + 7 rows; a chunk of 6 k after one of 64
        (4, 48, 33),  # 4 rows stay on AVX2
    ],
)
def test_the_512_bit_path_gives_the_avx2_bits(
    rows: int, out_features: int, in_features: int, both_widths: tuple[Any, Any]
) -> None:
    """On a CPU with AVX512F: the same outputs bit for bit with the 512-bit path on and off
    (packed prefill rows, a decode step's rows over chunks of k), plain and with the residual
    add, nothing written past the outputs; each call says which path it ran."""
    torch.manual_seed(rows + out_features)
    weight = torch.randn(out_features, in_features)
    panels = torch.empty(both_widths[0].packed_numel(out_features, in_features))
    both_widths[0].pack(weight.data_ptr(), panels.data_ptr(), out_features, in_features)
    x = torch.randn(rows, in_features)
    residual = torch.randn(rows, out_features)
    outputs = []
    for kernels in both_widths:
        for add in (False, True):
            canvas = torch.full((rows * out_features + 64,), float("nan"))
            if add:
                canvas[: rows * out_features] = residual.flatten()
            linear = kernels.linear_add if add else kernels.linear
            ran512 = linear(
                x.data_ptr(), panels.data_ptr(), canvas.data_ptr(), rows, in_features, out_features
            )
            assert ran512 == int(kernels.avx512 and rows > 4)
            assert canvas[rows * out_features :].isnan().all()
            outputs.append(canvas[: rows * out_features].view(rows, out_features))
    assert torch.equal(outputs[0], outputs[2]) and torch.equal(outputs[1], outputs[3])
    assert torch.allclose(outputs[0], x @ weight.T, rtol=1e-4, atol=1e-4)
    assert torch.equal(outputs[1], outputs[0] + residual)


def test_the_kernel_runs_on_torchs_openmp_runtime() -> None:
    """One libgomp in the process: a second OpenMP runtime would add a second thread pool that
    competes with torch's for the cores."""
    load_native_kernels(default_kernel_dir())
    maps = Path("/proc/self/maps").read_text().splitlines()
    runtimes = {line.split()[-1] for line in maps if "libgomp" in line}
    torch_lib = Path(torch.__file__).parent / "lib"
    assert len(runtimes) == 1
    assert Path(runtimes.pop()).parent == torch_lib


def test_build_caches_by_source_and_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = build(tmp_path)
    assert first.parent == tmp_path and first.name == native_kernels.library_name()
    mtime = first.stat().st_mtime_ns
    assert build(tmp_path) == first and first.stat().st_mtime_ns == mtime  # not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no scratch left behind
    lib = ctypes.CDLL(str(first))
    assert lib.spyre_linear_f32_packed_numel(ctypes.c_int64(9), ctypes.c_int64(2)) == 32

    monkeypatch.setattr(native_kernels, "FLAGS", (*native_kernels.FLAGS, "-DSPYRE_TEST_FLAG"))
    assert native_kernels.library_name() != first.name  # other flags: another library
    monkeypatch.undo()
    header = tmp_path / "edited" / native_kernels.HEADERS[0].name
    header.parent.mkdir()
    header.write_bytes(native_kernels.HEADERS[0].read_bytes() + b"// edited\n")
    monkeypatch.setattr(native_kernels, "HEADERS", (header,))
    assert native_kernels.library_name() != first.name  # an edited header: another library


def test_every_header_the_kernels_include_is_hashed() -> None:
    """The library's name hashes HEADERS: a header a source includes but HEADERS missed would
    let an edit to it reuse the stale library."""
    hashed = {h.name for h in native_kernels.HEADERS}
    included = set()
    for source in (*native_kernels.SOURCES, *native_kernels.HEADERS):
        for line in source.read_text().splitlines():
            if line.startswith('#include "'):
                included.add(line.split('"')[1])
    assert "fp8_bf16.h" in included and included <= hashed


def test_the_default_kernel_dir_is_beside_the_model_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert native_kernels.default_kernel_dir() == tmp_path / "spyre-server" / "kernels"


def test_the_engine_builds_into_model_kernel_dir(tmp_path: Path, make_engine: Any) -> None:
    engine = make_engine(model__linear_kernel="native", model__kernel_dir=str(tmp_path))
    assert any(isinstance(m, NativeLinear) for m in engine.runner.model.modules())
    assert [p.name for p in tmp_path.iterdir()] == [native_kernels.library_name()]


def test_a_missing_compiler_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CXX", "no-such-compiler")
    with pytest.raises(NativeKernelError, match=r"'no-such-compiler' is not on PATH.*onednn"):
        build(tmp_path)


def test_kernels_that_cannot_be_built_stop_the_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the kernel choice the library's error is a start-up error (a ModelLoadError, as
    the CLI reports them), its message kept."""
    monkeypatch.setenv("CXX", "no-such-compiler")
    settings = native_kernels.NativeKernelSettings(kernel_dir=tmp_path)
    with pytest.raises(KernelUnavailableError, match=r"'no-such-compiler' is not on PATH") as e:
        cpu_model.cpu_inference_copy(
            torch.nn.Linear(8, 8),
            linear_kernel="native",
            dtype=torch.float32,
            kernel_settings=settings,
        )
    assert isinstance(e.value, ModelLoadError)


def test_a_failed_compile_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native_kernels, "FLAGS", (*native_kernels.FLAGS, "-Werror=no-such-flag"))
    with pytest.raises(
        NativeKernelError,
        match=r"compiling the native kernels \(linear_f32\.cpp, linear_bf16\.cpp, linear_amx\.cpp, attention\.cpp, "
        r"elementwise_f32\.cpp, elementwise_bf16\.cpp, attention_dot_bf16\.cpp, rank_sync\.cpp\).*failed.*onednn",
    ):
        build(tmp_path)
    assert not any(tmp_path.iterdir())


def test_an_unwritable_kernel_dir_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")  # a directory below a file cannot be made, even by root
    with pytest.raises(NativeKernelError, match=r"cannot write the native kernels.*kernel_dir"):
        build(tmp_path / "a-file" / "kernels")


def test_auto_picks_native_for_float32_and_bfloat16_and_onednn_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert resolve_linear_kernel("auto", torch.float32) == "native"
    assert resolve_linear_kernel("auto", torch.bfloat16) == "native"
    assert resolve_linear_kernel("auto", torch.float16) == "onednn"
    for kernel in ("native", "onednn", "aten"):
        assert resolve_linear_kernel(kernel, torch.float32) == kernel  # type: ignore[arg-type]
        assert resolve_linear_kernel(kernel, torch.bfloat16) == kernel  # type: ignore[arg-type]
    with pytest.raises(
        LinearKernelError, match=r"'native' computes float32 and bfloat16.*torch.float16"
    ):
        resolve_linear_kernel("native", torch.float16)
    monkeypatch.setattr(cpu_model, "unsupported_cpu_reason", lambda: "this CPU lacks avx2")
    assert resolve_linear_kernel("auto", torch.float32) == "onednn"
    assert resolve_linear_kernel("auto", torch.bfloat16) == "onednn"


def test_a_cpu_without_avx2_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native_kernels, "unsupported_cpu_reason", lambda: "this CPU lacks avx2")
    load_native_kernels.cache_clear()
    try:
        with pytest.raises(
            NativeKernelError, match=r"cannot run here: this CPU lacks avx2.*onednn"
        ):
            load_native_kernels(default_kernel_dir())
    finally:
        load_native_kernels.cache_clear()


def test_kernel_objects_of_one_library_each_run_their_own_width(
    both_widths: tuple[Any, Any],
) -> None:
    """Two NativeKernels of one library in one process, on AVX2 and 512 bits wide: called in
    turn, each runs its own code, whatever the other ran last."""
    avx2, avx512 = both_widths
    assert avx2.path == avx512.path
    weight, x = torch.randn(48, 64), torch.randn(8, 64)
    panels = torch.empty(avx2.packed_numel(48, 64))
    avx2.pack(weight.data_ptr(), panels.data_ptr(), 48, 64)
    out = torch.zeros(8, 48)
    for kernels in (avx512, avx2, avx2, avx512, avx2):
        args = (x.data_ptr(), panels.data_ptr(), out.data_ptr(), 8, 64, 48)
        assert kernels.linear(*args) == int(kernels.avx512)
        assert kernels.linear_add(*args) == int(kernels.avx512)


def engine_linears(engine: Any) -> list[NativeLinear]:
    linears = [m for m in engine.runner.model.modules() if isinstance(m, NativeLinear)]
    assert linears
    return linears


def ran_512_bits_wide(linear: NativeLinear) -> int:
    """Runs 8 rows through ``linear``'s kernel: 1 where they ran 512 bits wide, else 0."""
    x = torch.randn(8, linear.in_features)
    out = torch.empty(8, linear.out_features)
    rows = (x.data_ptr(), linear.panels.data_ptr(), out.data_ptr(), 8)
    return linear.kernels.linear(*rows, linear.in_features, linear.out_features)


def test_model_native_avx512_sets_each_engines_width(make_engine: Any) -> None:
    """``model.native_avx512: false`` keeps an engine's native kernels on AVX2; true (the
    default) runs them 512 bits wide exactly where the CPU has AVX512F. Two engines in one
    process each keep their own, whichever was built last; the attention kernel takes the
    setting too."""
    has_avx512f = native_kernels.cpu_flags() >= {"avx512f"}
    narrow = make_engine(model__linear_kernel="native", model__native_avx512=False)
    assert {ran_512_bits_wide(m) for m in engine_linears(narrow)} == {0}
    wide = make_engine(model__linear_kernel="native")
    assert {ran_512_bits_wide(m) for m in engine_linears(wide)} == {int(has_avx512f)}
    assert {ran_512_bits_wide(m) for m in engine_linears(narrow)} == {0}
    # The attention kernel takes it too (the micro model's head_dim 48 has none).
    attention = cpu_model.cpu_attention_kernel(
        "native",
        dtype=torch.float32,
        head_dim=64,
        kernel_settings=native_kernels.NativeKernelSettings(avx512=False),
    )
    assert attention is not None and not attention.kernels.avx512
