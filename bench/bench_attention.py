"""The paged-attention kernels side by side in bfloat16 (or float32), at bench_kernels.py's
shapes, in one run.

Run: ``.venv/bin/python bench/bench_attention.py [--threads 2] [--dtype float32]
[--no-native-avx512]`` (about a minute;
nothing else may run meanwhile). SmolLM2-135M's attention (9 query / 3 KV heads of 64) over a paged
cache
of 64-token blocks, every layer's cache a distinct tensor (each timing runs the 30 layers after
a 1 GB read, so the K/V come from memory as in a real step, also where the L3 would hold them
all), the shared prefix in scattered blocks as a server's recycled blocks are. Per workload and kernel: ms per layer, GFLOP/s (the two products; the
causal part counted in full), and each kernel's time over the first kernel's. Kernels (the values
of ``model.attention_kernel``): ``amx`` (where the CPU has AMX), ``avx512_bf16`` (where it has
AVX512-BF16), ``native`` (float32 compute) and ``flash`` (SDPA's flash kernel on gathered copies);
``mixed`` is native's decode and flash's prefill rows. In float32 (``--dtype float32``) only
``native`` and ``flash`` run.

Workloads: a decode step of 8 rows over a 1,536-token shared prefix (+ 2 own blocks each), a
warm prefill of 64 new tokens after it, and 256-token chunks of a cold prefill at 1,024 and
1,792 tokens of context. Limits printed first: a streaming read, and a 2048^3 matrix product in
the dtype (oneDNN, on AMX where the CPU has it).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from bench_kernels import BLOCK, GROUP, HEAD_DIM, KV_HEADS, LAYERS, PREFIX_BLOCKS, seconds

from spyre_server.model.cpu.kernels.library import (
    amx_unsupported_reason,
    avx512_bf16_unsupported_reason,
    default_kernel_dir,
    load_native_kernels,
)
from spyre_server.model.cpu.ops.native_attention import NativePagedAttention
from spyre_server.model.cpu.paged_attention import AttentionPlan, attend, plan_attention

NUM_BLOCKS = 200


def limits(dtype: torch.dtype) -> tuple[float, float]:
    """(GB/s streaming read, GFLOP/s of a 2048^3 matrix product in ``dtype``)."""
    big = torch.randn(100_000_000)
    read = big.numel() * 4 / seconds(big.sum) / 1e9
    a = torch.randn(2048, 2048).to(dtype)
    return read, 2 * 2048**3 / seconds(lambda: a @ a) / 1e9


def workloads() -> list[tuple[str, list[list[int]], list[list[int]]]]:
    """(name, block tables, query positions)."""
    shared = list(range(2, 2 * PREFIX_BLOCKS + 2, 2))  # every other block: never a span
    prefix = PREFIX_BLOCKS * BLOCK
    cold = list(range(3, 3 + 2 * 28, 2))  # a lone request's blocks, scattered
    return [
        (
            "decode, 8 rows over 1,536 shared tokens",
            [[*shared, 100 + 2 * r, 101 + 2 * r] for r in range(8)],
            [[prefix + BLOCK + 50] for _ in range(8)],
        ),
        (
            "warm prefill, 64 tokens after 1,536",
            [[*shared, 100]],
            [list(range(prefix, prefix + 64))],
        ),
        ("prefill chunk, 256 tokens at 768-1,024", [cold[:16]], [list(range(768, 1024))]),
        ("prefill chunk, 256 tokens at 1,536-1,792", [cold[:28]], [list(range(1536, 1792))]),
    ]


EVICT_BYTES = 1 << 30
"""Read before each timed pass: more than the caches hold (some CPUs' L3 holds every layer's
KV here), as a step's weights stream through them between two layers' attention."""


def per_layer(
    query: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    plan: AttentionPlan,
    kernel: NativePagedAttention | None,
    evict: torch.Tensor,
    reps: int = 7,
) -> float:
    """Seconds per layer of the op's compute with ``kernel`` (None: flash) over every layer, its
    K and V from memory (``evict`` read before each pass): the median of ``reps`` passes."""
    times = []
    for _ in range(reps + 1):  # the first pass warms up
        evict.sum()
        start = time.perf_counter()
        for i in range(LAYERS):
            attend(query, keys[i], values[i], plan, None, kernel)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) / LAYERS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument(
        "--no-native-avx512",
        dest="native_avx512",
        action="store_false",
        help="model.native_avx512: false (our kernel's AVX2 code on AVX512F CPUs)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    read, gemm = limits(dtype)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}")
    print(
        f"limits: streaming read {read:.1f} GB/s, {args.dtype} 2048^3 matrix product "
        f"{gemm:.0f} GFLOP/s"
    )
    lib = load_native_kernels(default_kernel_dir(), avx512=args.native_avx512)
    print(f"native: {512 if lib.avx512 else 256} bits wide")
    kernels: dict[str, NativePagedAttention | None] = {}
    for dot, unsupported in (
        ("amx", amx_unsupported_reason),
        ("avx512_bf16", avx512_bf16_unsupported_reason),
    ):
        if dtype == torch.float32:
            break  # the dot-product kernels compute bfloat16 only
        if (reason := unsupported()) is None:
            kernels[dot] = NativePagedAttention(lib, bf16_dot=dot)
        else:
            print(f"{dot}: not run ({reason})")
    kernels["native"] = NativePagedAttention(lib)
    kernels["flash"] = None
    first = next(iter(kernels))
    shape = (NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM)
    evict = torch.ones(EVICT_BYTES // 4)
    keys = [torch.randn(shape).to(dtype) for _ in range(LAYERS)]
    values = [torch.randn(shape).to(dtype) for _ in range(LAYERS)]
    print(f"\n{'workload':42} {'kernel':11} {'ms/layer':>8} {'GFLOP/s':>8} {'/ ' + first:>13}")
    with torch.inference_mode():
        for name, tables, positions in workloads():
            plan = plan_attention(tables, positions, BLOCK)
            query = torch.randn(len(tables), len(positions[0]), KV_HEADS * GROUP, HEAD_DIM)
            query = query.to(dtype)
            flops = sum(len(p) * (p[-1] + 1) for p in positions) * GROUP * KV_HEADS * 4 * HEAD_DIM
            times = {
                kernel_name: per_layer(query, keys, values, plan, kernel, evict)
                for kernel_name, kernel in kernels.items()
            }
            base = times[first]
            for kernel_name, t in times.items():
                ratio = f"{t / base:5.2f}x"
                print(
                    f"{name:42} {kernel_name:11} {t * 1e3:8.3f} {flops / t / 1e9:8.0f} {ratio:>13}"
                )
                name = ""


if __name__ == "__main__":
    main()
