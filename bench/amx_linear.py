"""The bfloat16 linear kernel on AMX tiles against its AVX512-BF16 code, at a 1B model's shapes.

Llama-3.2-1B's projections (hidden 2048, 32/8 heads of 64, MLP 8192; 16 layers, each its own
weights, so a decode-sized call reads them from memory as a step does) and the LM head (the
default tokenizer's 49,152 rows; one row at prefill sizes, as a prefill step computes only the
last position), packed once per kernel, run at each row count in turn: ms per step of all of
them, GFLOP/s or GB/s, and the ratio. Needs a CPU with AMX (the AVX512-BF16 column runs
anywhere it can). Nothing else may run meanwhile.

Run: ``.venv/bin/python -m bench.amx_linear [--threads 2] [--rows 1 8 64 256 512]``
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import torch

from spyre_server.model.cpu.kernels.library import (
    amx_unsupported_reason,
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
    if (reason := amx_unsupported_reason()) is not None:
        raise SystemExit(f"the AMX linear kernel cannot run here: {reason}")
    torch.set_num_threads(args.threads)
    kernels = {
        "amx": load_native_kernels(default_kernel_dir()),
        "avx512_bf16": load_native_kernels(default_kernel_dir(), amx=False),
    }
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
    print(f"threads {args.threads}; {weight_bytes / 1e9:.2f} GB of weights per step")
    print(
        f"{'rows':>5} {'amx ms':>9} {'avx512_bf16 ms':>15} {'ratio':>7}   rate (amx, avx512_bf16)"
    )
    with torch.inference_mode():
        for rows in args.rows:
            xs = {k: torch.randn(rows, k).bfloat16() for _, k in SHAPES}
            last = torch.randn(rows if rows <= DECODE_ROWS else 1, HIDDEN).bfloat16()
            flops = 2 * rows * sum(n * k for n, k in SHAPES) * LAYERS
            flops += 2 * last.shape[0] * VOCAB * HIDDEN
            seconds = {
                name: best_seconds(functools.partial(run_step, *step, xs, last), args.reps)
                for name, step in layers.items()
            }
            amx, dot = seconds["amx"], seconds["avx512_bf16"]
            if rows <= DECODE_ROWS:
                rate = f"{weight_bytes / amx / 1e9:.1f}, {weight_bytes / dot / 1e9:.1f} GB/s"
            else:
                rate = f"{flops / amx / 1e9:.0f}, {flops / dot / 1e9:.0f} GFLOP/s"
            print(f"{rows:5d} {amx * 1e3:9.1f} {dot * 1e3:15.1f} {dot / amx:6.2f}x   {rate}")


if __name__ == "__main__":
    main()
