"""Decode-step attention over long contexts: how fast the paged-attention kernel reads the KV.

A decode step reads every layer's KV of every request once; at long contexts that is a real
share of the step (a 1B model at 8,192 tokens: 268 MB of KV against 2.15 GB of weights). This
times the kernel the server picks (``model.attention_kernel: auto``: ``amx``, ``avx512_bf16`` or
``native``) on decode steps of one query per request, the server's plan (every key a row's own),
at SmolLM2-135M's heads (3 KV heads of 64, 3 queries each) and a Llama-3.2-1B's (8 of 64, 4
each), with each layer's cache a distinct tensor and 1 GB read before each pass (so the KV comes
from memory, as between a step's layers); and a streaming read (``torch.sum``) as the bound.
Per workload: microseconds per layer, the KV's GB/s and its share of the bound. Batches: one
request, 2, 3 and 8 of the same context, and one long request beside short ones (128 tokens).

Run (about a minute; nothing else may run meanwhile)::

    .venv/bin/python bench/decode_attention.py [--threads 2] [--contexts 512 2048 8192]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from spyre_server.model.cpu.kernels.library import (
    amx_unsupported_reason,
    avx512_bf16_unsupported_reason,
    default_kernel_dir,
    load_native_kernels,
)
from spyre_server.model.cpu.ops.native_attention import NativePagedAttention
from spyre_server.model.cpu.paged_attention import plan_attention

BLOCK = 64
SHAPES = {"SmolLM2-135M": (3, 3, 64), "Llama-3.2-1B": (8, 4, 64)}
"""name: (KV heads, queries per KV head, head_dim)."""
SHORT = 128
"""Tokens of the short requests beside a long one."""
KV_BYTES_PER_PASS = 64_000_000
"""About this much KV per timed pass (more layers at short contexts), fewer than 16 layers."""
EVICT_BYTES = 1 << 30


def kernel() -> tuple[str, NativePagedAttention]:
    """What ``model.attention_kernel: auto`` runs in bfloat16 here."""
    lib = load_native_kernels(default_kernel_dir())
    if amx_unsupported_reason() is None:
        return "amx", NativePagedAttention(lib, bf16_dot="amx")
    if avx512_bf16_unsupported_reason() is None:
        return "avx512_bf16", NativePagedAttention(lib, bf16_dot="avx512_bf16")
    return "native", NativePagedAttention(lib)


def per_layer(
    attention: NativePagedAttention,
    shape: tuple[int, int, int],
    lengths: list[int],
    evict: torch.Tensor,
    reps: int,
) -> tuple[float, int]:
    """(seconds per layer, KV bytes per layer) of decode steps of requests of ``lengths`` tokens
    (each request's blocks its own), the median of ``reps`` passes from memory."""
    kvheads, group, head_dim = shape
    blocks = [-(-n // BLOCK) for n in lengths]
    kv_bytes = sum(lengths) * kvheads * head_dim * 2 * 2
    layers = max(2, min(16, KV_BYTES_PER_PASS // kv_bytes))
    cache_shape = (sum(blocks) + 1, BLOCK, kvheads, head_dim)
    caches = [
        (torch.randn(cache_shape).bfloat16(), torch.randn(cache_shape).bfloat16())
        for _ in range(layers)
    ]
    tables, first = [], 1
    for n in blocks:
        tables.append(list(range(first, first + n)))
        first += n
    plan = plan_attention(tables, [[n - 1] for n in lengths], BLOCK)
    query = torch.randn(len(lengths), 1, kvheads * group, head_dim).bfloat16()
    scale = head_dim**-0.5
    times = []
    for _ in range(reps + 1):  # the first pass warms up
        evict.sum()
        start = time.perf_counter()
        for key_cache, value_cache in caches:
            attention(query, key_cache, value_cache, plan, scale)
        times.append((time.perf_counter() - start) / layers)
    return statistics.median(times[1:]), kv_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    evict = torch.ones(EVICT_BYTES // 4)
    bound = statistics.median(evict.numel() * 4 / _seconds(evict.sum) / 1e9 for _ in range(5))
    name, attention = kernel()
    print(f"{args.threads} threads, attention kernel {name}; streaming read {bound:.1f} GB/s")
    print("\n| heads | requests (tokens) | us per layer | KV GB/s | of the bound |")
    print("|---|---|---|---|---|")
    with torch.inference_mode():
        for shape_name, shape in SHAPES.items():
            for context in args.contexts:
                batches = {f"{n} x {context}": [context] * n for n in (1, 2, 3, 8)}
                batches[f"{context} + 2 x {SHORT}"] = [context, SHORT, SHORT]
                for label, lengths in batches.items():
                    seconds, kv_bytes = per_layer(attention, shape, lengths, evict, args.reps)
                    rate = kv_bytes / seconds / 1e9
                    print(
                        f"| {shape_name} | {label} | {seconds * 1e6:.0f} | "
                        f"{rate:.1f} | {rate / bound:.0%} |"
                    )


def _seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
