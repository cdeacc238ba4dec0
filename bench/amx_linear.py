"""The bfloat16 linear kernel on AMX tiles against its AVX512-BF16 code (or that code alone, next
to its arithmetic peak, where there is no AMX), at a 1B model's shapes.

Llama-3.2-1B's projections (hidden 2048, 32/8 heads of 64, MLP 8192; 16 layers, each its own
weights, so a decode-sized call reads them from memory as a step does) and the LM head (the
default tokenizer's 49,152 rows; one row at prefill sizes, as a prefill step computes only the
last position), packed once per kernel, run at each row count in turn: ms per step of all of
them, GFLOP/s or GB/s, and the ratio. Beside them, the arithmetic limit of the AVX512-BF16
code: vdpbf16ps chains on every thread (``bench/fma_peak.cpp -DDPBF16``). On a CPU without AMX
only the AVX512-BF16 column runs (against that limit); without AVX512-BF16 it refuses. Nothing
else may run meanwhile.

Run: ``.venv/bin/python -m bench.amx_linear [--threads 2] [--rows 1 8 64 256 512]``
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import torch

from bench.bench_kernels import fma_peak
from spyre_server.model.cpu.kernels.library import (
    amx_unsupported_reason,
    avx512_bf16_unsupported_reason,
    default_kernel_dir,
    load_native_kernels,
)
from spyre_server.model.cpu.ops.native_linear import NativeBf16Linear

LAYERS, HIDDEN, MLP, VOCAB = 16, 2048, 8192, 49152
SHAPES = [(3072, HIDDEN), (HIDDEN, HIDDEN), (2 * MLP, HIDDEN), (HIDDEN, MLP)]
"""(N, K) of one layer's projections: fused QKV, dense, fused gate/up, down."""
DECODE_ROWS = 16


def best_seconds(fn: Callable[[], object], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def run_step(
    projections: list[NativeBf16Linear],
    lm_head: NativeBf16Linear,
    xs: dict[int, torch.Tensor],
    last: torch.Tensor,
) -> None:
    """One step's projections in order, each on the input of its size, then the LM head."""
    for m in projections:
        m(xs[m.in_features])
    lm_head(last)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256, 512])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if (no_dot := avx512_bf16_unsupported_reason()) is not None:
        raise SystemExit(f"the AVX512-BF16 linear code cannot run here: {no_dot}")
    kernels = {"avx512_bf16": load_native_kernels(default_kernel_dir(), amx=False)}
    if (no_amx := amx_unsupported_reason()) is None:
        kernels = {"amx": load_native_kernels(default_kernel_dir()), **kernels}
    else:
        print(f"the AMX column is left out: {no_amx}")
    weights = [torch.randn(n, k).bfloat16() for _ in range(LAYERS) for n, k in SHAPES]
    head = torch.randn(VOCAB, HIDDEN).bfloat16()
    layers: dict[str, tuple[list[NativeBf16Linear], NativeBf16Linear]] = {}
    for name, lib in kernels.items():
        built = []
        for w in [*weights, head]:
            linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=torch.bfloat16)
            linear.weight.data = w
            built.append(NativeBf16Linear(linear, lib))
        assert all(m.on_amx == (name == "amx") for m in built)
        layers[name] = (built[:-1], built[-1])
    del weights, head
    weight_bytes = sum(2 * n * k for n, k in SHAPES) * LAYERS + 2 * VOCAB * HIDDEN
    peak = fma_peak(args.threads, width512=True, dpbf16=True)
    print(
        f"threads {args.threads}; {weight_bytes / 1e9:.2f} GB of weights per step; vdpbf16ps peak "
        + (f"{peak:.0f} GFLOP/s" if peak is not None else "not measured (no C++ compiler)")
    )
    names = list(layers)
    print(f"{'rows':>5} " + " ".join(f"{name + ' ms':>15}" for name in names), end="")
    print(f" {'ratio':>7}   rate ({', '.join(names)})" if len(names) == 2 else "   rate")
    with torch.inference_mode():
        for rows in args.rows:
            xs = {k: torch.randn(rows, k).bfloat16() for _, k in SHAPES}
            last = torch.randn(rows if rows <= DECODE_ROWS else 1, HIDDEN).bfloat16()
            flops = 2 * rows * sum(n * k for n, k in SHAPES) * LAYERS
            flops += 2 * last.shape[0] * VOCAB * HIDDEN
            seconds = [
                best_seconds(functools.partial(run_step, *step, xs, last), args.reps)
                for step in layers.values()
            ]
            if rows <= DECODE_ROWS:
                rate = ", ".join(f"{weight_bytes / t / 1e9:.1f}" for t in seconds) + " GB/s"
            else:
                rate = ", ".join(f"{flops / t / 1e9:.0f}" for t in seconds) + " GFLOP/s"
                if peak is not None:
                    shares = ", ".join(f"{flops / t / 1e9 / peak:.0%}" for t in seconds)
                    rate += f" ({shares} of the peak)"
            line = f"{rows:5d} " + " ".join(f"{t * 1e3:15.1f}" for t in seconds)
            if len(seconds) == 2:
                line += f" {seconds[1] / seconds[0]:6.2f}x"
            print(f"{line}   {rate}")


if __name__ == "__main__":
    main()
