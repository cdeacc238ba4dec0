"""The kernels a SmolLM2 step spends its time in, next to this machine's limits.

Run: ``.venv/bin/python bench/bench_kernels.py [--threads 2] [--linear-kernel native|onednn]
[--attention-kernel native|flash]`` (about two minutes; nothing else may run meanwhile). Shapes
are SmolLM2-135M's (30 layers, hidden 576, 9 query / 3 KV heads of 64, MLP 1536, vocabulary
49152) in float32, as the cpu backend runs them; every weight and KV block is read from memory,
not from cache, as in a real step: each kernel runs over 30 distinct layers' tensors per timing.

Prints, per kernel: time per layer, and the rate it reaches in GB/s (bytes of weights or K/V
read) and GFLOP/s, next to the limits measured here first:
- memory: a streaming read (``sum`` of 400 MB);
- arithmetic: the FMA peak, independent FMA chains on every thread (``bench/fma_peak.cpp``,
  built here with ``$CXX`` or g++) as wide as the native kernels run (512 bits where they do,
  else AVX2). A 2048^3 matrix product's rate is printed beside it; it is the limit instead only
  where no compiler is found (said in the output).

The two workloads: a decode step of 8 rows over a 1,536-token shared prefix (+ 2
own blocks each), and a warm prefill of 64 new tokens over the same prefix. Then all of a step's
projections under each linear kernel (native, onednn; on AVX512F CPUs also native with its
512-bit prefill path off, "avx2") at 1, 8, 64 and 256 rows, with the ratios; and the same in
bfloat16 (native on AVX512-BF16 where the CPU has it, native on AVX2, onednn where it computes
bfloat16 here).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from spyre_server.model.cpu import paged_attention
from spyre_server.model.cpu.kernels.library import default_kernel_dir, load_native_kernels
from spyre_server.model.cpu.ops.native_attention import NativePagedAttention
from spyre_server.model.cpu.ops.native_linear import NativeBf16Linear, NativeLinear
from spyre_server.model.cpu.paged_attention import paged_attention_kwargs, plan_attention

LAYERS = 30
HIDDEN, MLP, VOCAB = 576, 1536, 49152
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
GROUP = HEADS // KV_HEADS
BLOCK = 64
PREFIX_BLOCKS = 24  # 1,536 tokens
DECODE_ROWS = 8
FMA_PEAK_SOURCE = Path(__file__).resolve().parent / "fma_peak.cpp"

_reorder = torch.ops.mkldnn._reorder_linear_weight
_linear = torch.ops.mkldnn._linear_pointwise


def seconds(fn: Callable[[], object], reps: int = 7) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def limits() -> tuple[float, float]:
    """(GB/s streaming read, GFLOP/s of a 2048^3 matrix product)."""
    big = torch.randn(100_000_000)
    read = big.numel() * 4 / seconds(big.sum) / 1e9
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    gemm = 2 * 2048**3 / seconds(lambda: a @ b) / 1e9
    return read, gemm


def fma_peak(threads: int, width512: bool, dpbf16: bool = False) -> float | None:
    """GFLOP/s of ``fma_peak.cpp`` on ``threads`` threads, 512 or 256 bits wide, float32 FMAs or
    (``dpbf16``) AVX512-BF16's vdpbf16ps; None without a C++ compiler."""
    compiler = shutil.which(os.environ.get("CXX") or "g++")
    if compiler is None:
        return None
    if dpbf16:
        isa = ["-mavx512f", "-mavx512bf16", "-DDPBF16"]
    else:
        isa = ["-mavx512f", "-DWIDTH512"] if width512 else ["-mavx2", "-mfma"]
    with tempfile.TemporaryDirectory() as tmp:
        binary = Path(tmp) / "fma_peak"
        subprocess.run(
            [compiler, "-O2", "-fopenmp", *isa, str(FMA_PEAK_SOURCE), "-o", str(binary)],
            check=True,
        )
        out = subprocess.run(
            [str(binary), str(threads)], check=True, capture_output=True, text=True
        ).stdout
    match = re.search(r"^peak ([0-9.]+) GFLOP/s", out, re.MULTILINE)
    if match is None:
        raise RuntimeError(f"fma_peak printed no peak:\n{out}")
    return float(match.group(1))


Kernel = tuple[str, float, float, float, int]
"""(name, seconds per call, bytes read per call, FLOPs per call, calls per step)"""


LinearFactory = Callable[[torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]
"""weight -> the projection by it, as a linear kernel packs and runs it."""


def onednn_linear(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    packed = _reorder(weight)
    return lambda x: _linear(x, packed, None, "none", [], "")


def native_linear(
    weight: torch.Tensor, *, avx512: bool = True
) -> Callable[[torch.Tensor], torch.Tensor]:
    layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    layer.weight.data = weight
    return NativeLinear(layer, load_native_kernels(default_kernel_dir(), avx512=avx512))


def native_avx2_linear(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """``native_linear`` with its 512-bit path off (``model.native_avx512: false``)."""
    return native_linear(weight, avx512=False)


LINEAR_KERNELS: dict[str, LinearFactory] = {"native": native_linear, "onednn": onednn_linear}


def native_bf16_linear(
    weight: torch.Tensor, *, avx512: bool = True
) -> Callable[[torch.Tensor], torch.Tensor]:
    layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=torch.bfloat16)
    layer.weight.data = weight
    return NativeBf16Linear(layer, load_native_kernels(default_kernel_dir(), avx512=avx512))


def linears(rows: int, factory: LinearFactory, dtype: torch.dtype = torch.float32) -> list[Kernel]:
    """The projections at ``rows`` rows in ``dtype``, packed and run by ``factory``'s kernel."""
    out = []
    size = dtype.itemsize

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape).to(dtype)

    x_hidden, x_mlp = randn(rows, HIDDEN), randn(rows, MLP)
    shapes = [
        ("qkv", 3 * 320, HIDDEN, x_hidden),  # 576 + 2 * 192 outputs
        ("o", HIDDEN, HIDDEN, x_hidden),
        ("gate+up", 2 * MLP, HIDDEN, x_hidden),
        ("down", HIDDEN, MLP, x_mlp),
    ]
    for name, n, k, x in shapes:
        layers = [factory(randn(n, k)) for _ in range(LAYERS)]
        t = seconds(lambda x=x, layers=layers: [layer(x) for layer in layers]) / LAYERS
        out.append((name, t, n * k * size, 2 * rows * n * k, LAYERS))
    head = factory(randn(VOCAB, HIDDEN))
    head_rows = rows if rows <= DECODE_ROWS else 1  # prefill: the last position only
    x = randn(head_rows, HIDDEN)
    t = seconds(lambda: head(x))
    out.append(("LM head", t, VOCAB * HIDDEN * size, 2 * head_rows * VOCAB * HIDDEN, 1))
    return out


def compare_linear_kernels(rows_list: tuple[int, ...]) -> None:
    """All of a step's projections under each kernel, in one run: ms per step and the ratio."""
    print("\n== the projections of a step (30 layers + LM head) per linear kernel, ms/step ==")
    names = list(LINEAR_KERNELS)
    # native's 512-bit path from 5 rows (AVX512F CPUs)
    avx512 = load_native_kernels(default_kernel_dir()).avx512
    if avx512:
        names.append("avx2")  # native with that path off
    print(f"{'rows':>5} " + " ".join(f"{n:>8}" for n in names) + "   native/onednn native/avx2")
    for rows in rows_list:
        per_kernel = {
            n: sum(calls * t for _, t, _, _, calls in linears(rows, f))
            for n, f in LINEAR_KERNELS.items()
        }
        if avx512:
            per_kernel["avx2"] = sum(c * t for _, t, _, _, c in linears(rows, native_avx2_linear))
        cells = " ".join(f"{per_kernel[n] * 1e3:8.1f}" for n in names)
        ratio = f"{per_kernel['native'] / per_kernel['avx2']:.2f}x" if avx512 else ""
        print(
            f"{rows:5d} {cells}   {per_kernel['native'] / per_kernel['onednn']:13.2f}x {ratio:>11}"
        )


def compare_bf16_linear_kernels(rows_list: tuple[int, ...]) -> None:
    """The same in bfloat16: native (AVX512-BF16 where the CPU has it), native on AVX2, onednn
    (where it computes bfloat16 here)."""
    print("\n== the same in bfloat16, ms/step ==")
    lib = load_native_kernels(default_kernel_dir())
    kernels: dict[str, LinearFactory] = {}
    if lib.linear_bf16_dot:
        kernels["native"] = native_bf16_linear
    kernels["avx2"] = lambda weight: native_bf16_linear(weight, avx512=False)
    try:
        onednn_linear(torch.randn(8, 8).bfloat16())(torch.randn(1, 8).bfloat16())
        kernels["onednn"] = onednn_linear
    except RuntimeError:
        print("(onednn cannot compute bfloat16 here)")
    names = list(kernels)
    print(f"{'rows':>5} " + " ".join(f"{n:>8}" for n in names) + "   ratios to the first")
    for rows in rows_list:
        per_kernel = {
            n: sum(c * t for _, t, _, _, c in linears(rows, f, torch.bfloat16))
            for n, f in kernels.items()
        }
        cells = " ".join(f"{per_kernel[n] * 1e3:8.1f}" for n in names)
        first = per_kernel[names[0]]
        ratios = " ".join(f"{n}/{names[0]} {per_kernel[n] / first:.2f}x" for n in names[1:])
        print(f"{rows:5d} {cells}   {ratios}")


def caches() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    shape = (160, BLOCK, KV_HEADS, HEAD_DIM)
    return [torch.randn(shape) for _ in range(LAYERS)], [torch.randn(shape) for _ in range(LAYERS)]


def attention(
    rows: int, keys: list[torch.Tensor], values: list[torch.Tensor], kernel: str
) -> list[Kernel]:
    """The paged-attention op's compute per layer for ``rows`` query rows (a decode step: 8
    sequences with 2 own blocks each; a warm prefill: ``rows`` queries in one own block), over
    a 1,536-token shared prefix in scattered blocks, as a server's recycled blocks are:
    ``kernel`` native (one call, the cache read in place) or flash (SDPA on gathered copies,
    merged in aten ops)."""
    shared = list(range(2, 2 * PREFIX_BLOCKS + 2, 2))  # every other block: never a span
    if rows == DECODE_ROWS:
        tables = [[*shared, 100 + 2 * r, 101 + 2 * r] for r in range(rows)]
        positions = [[len(table) * BLOCK - 10] for table in tables]
    else:
        tables = [[*shared, 100]]
        positions = [list(range(PREFIX_BLOCKS * BLOCK, PREFIX_BLOCKS * BLOCK + rows))]
    plan = plan_attention(tables, positions, BLOCK)
    query = torch.randn(len(tables), len(positions[0]), KV_HEADS * GROUP, HEAD_DIM)
    op_kwargs = paged_attention_kwargs(
        torch.zeros(1, dtype=torch.long),
        plan,
        NativePagedAttention(load_native_kernels(default_kernel_dir()))
        if kernel == "native"
        else None,
    )
    compute = paged_attention._compute

    def per_layer() -> float:
        def run() -> None:
            for i in range(LAYERS):
                compute(
                    query, keys[i], values[i], KV_HEADS * GROUP, KV_HEADS, 0.0, None, **op_kwargs
                )

        return seconds(run) / LAYERS

    num_keys = sum(len(t) for t in tables) * BLOCK - (len(tables) - 1) * len(shared) * BLOCK
    scores = sum(len(p) * (p[-1] + 1) for p in positions)  # (an upper bound for the causal part)
    return [
        (
            f"attention ({kernel})",
            per_layer(),
            num_keys * 2 * KV_HEADS * HEAD_DIM * 4,
            scores * GROUP * KV_HEADS * 4 * HEAD_DIM,
            LAYERS,
        )
    ]


def report(
    title: str, kernels: list[Kernel], read: float, peak: float, others: list[Kernel]
) -> None:
    """Per kernel: its time per step, its rates, and its time at the limits (the larger of
    bytes / read rate and FLOPs / arithmetic peak); then ``others`` (alternatives, not in the
    total)."""
    print(f"\n== {title} ==")
    print(
        f"{'kernel':26} {'ms/call':>8} {'calls':>5} {'ms/step':>8} {'GB/s':>6} {'GFLOP/s':>8}"
        f" {'limit ms/step':>13}"
    )
    total = floor = 0.0
    for row, (name, t, num_bytes, flops, calls) in enumerate([*kernels, *others]):
        limit = calls * max(num_bytes / (read * 1e9), flops / (peak * 1e9))
        if row < len(kernels):
            total += calls * t
            floor += limit
        elif row == len(kernels):
            print(
                f"{'total':26} {'':8} {'':5} {total * 1e3:8.1f} {'':6} {'':8} {floor * 1e3:13.1f}"
            )
        print(
            f"{name:26} {t * 1e3:8.3f} {calls:5d} {calls * t * 1e3:8.1f} "
            f"{num_bytes / t / 1e9:6.1f} {flops / t / 1e9:8.1f} {limit * 1e3:13.1f}"
        )
    if not others:
        print(f"{'total':26} {'':8} {'':5} {total * 1e3:8.1f} {'':6} {'':8} {floor * 1e3:13.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--linear-kernel",
        choices=tuple(LINEAR_KERNELS),
        default="native",
        help="the projections' kernel in the step tables (default: native, what "
        "model.linear_kernel auto runs in float32 here)",
    )
    parser.add_argument(
        "--attention-kernel",
        choices=("native", "flash"),
        default="native",
        help="the attention kernel in the step tables (default: native; the other one's time "
        "is listed after the total)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32")
    read, gemm = limits()
    width512 = load_native_kernels(default_kernel_dir()).avx512
    peak = fma_peak(args.threads, width512)
    if peak is None:
        print("no C++ compiler for fma_peak.cpp: the arithmetic limit below is the GEMM's rate")
    print(
        f"limits: streaming read {read:.1f} GB/s, FMA peak "
        + (
            f"{peak:.0f} GFLOP/s ({512 if width512 else 256} bits, as the native kernels run)"
            if peak is not None
            else "not measured"
        )
        + f"; a 2048^3 matrix product (torch) runs at {gemm:.0f} GFLOP/s"
    )
    keys, values = caches()
    with torch.inference_mode():
        for title, rows in (
            (f"decode step, {DECODE_ROWS} rows, 1,536 shared + 128 own tokens", DECODE_ROWS),
            ("warm prefill, 64 new tokens after 1,536 cached", 64),
        ):
            kernels = linears(rows, LINEAR_KERNELS[args.linear_kernel])
            step_kernels = kernels + attention(rows, keys, values, args.attention_kernel)
            other = "flash" if args.attention_kernel == "native" else "native"
            report(
                f"{title}, {args.linear_kernel} linears",
                step_kernels,
                read,
                gemm if peak is None else peak,
                others=attention(rows, keys, values, other),
            )
        compare_linear_kernels((1, 8, 64, 256))
        compare_bf16_linear_kernels((1, 8, 64, 256))
    print("\nF.linear (MKL) for comparison, 8 rows, gate+up over 30 layers:")
    weights = [torch.randn(2 * MLP, HIDDEN) for _ in range(LAYERS)]
    x = torch.randn(DECODE_ROWS, HIDDEN)
    t = seconds(lambda: [F.linear(x, w) for w in weights]) / LAYERS
    print(f"  {t * 1e3:.3f} ms/layer, {2 * MLP * HIDDEN * 4 / t / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
