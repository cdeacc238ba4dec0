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

import torch
from bench_attention import EVICT_BYTES
from bench_kernels import seconds

from spyre_server.model.cpu.ops.native_attention import NativePagedAttention
from spyre_server.model.cpu.paged_attention import plan_attention
from spyre_server.model.cpu.prepare import cpu_attention_kernel

BLOCK = 64
SHAPES = {"SmolLM2-135M": (3, 3, 64), "Llama-3.2-1B": (8, 4, 64)}
"""name: (KV heads, queries per KV head, head_dim)."""
SHORT = 128
"""Tokens of the short requests beside a long one."""
KV_BYTES_PER_PASS = 64_000_000
"""About this much KV per timed pass (more layers at short contexts), fewer than 16 layers."""


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
    bound = evict.numel() * 4 / seconds(evict.sum, reps=5) / 1e9
    # What the server builds for model.attention_kernel: auto (both models' head_dim is 64).
    attention = cpu_attention_kernel("auto", dtype=torch.bfloat16, head_dim=64)
    if attention is None:
        raise SystemExit("attention_kernel auto is SDPA's flash here: not our kernel")
    name = attention.bf16_dot or "native"  # a decode step runs ours under mixed too
    print(f"{args.threads} threads, attention kernel {name}; streaming read {bound:.1f} GB/s")
    print("\n| heads | requests (tokens) | us per layer | KV GB/s | of the bound |")
    print("|---|---|---|---|---|")
    with torch.inference_mode():
        for shape_name, shape in SHAPES.items():
            for context in args.contexts:
                batches = {f"{n} x {context}": [context] * n for n in (1, 2, 3, 8)}
                batches[f"{context} + 2 x {SHORT}"] = [context, SHORT, SHORT]
                for label, lengths in batches.items():
                    layer_s, kv_bytes = per_layer(attention, shape, lengths, evict, args.reps)
                    rate = kv_bytes / layer_s / 1e9
                    print(
                        f"| {shape_name} | {label} | {layer_s * 1e6:.0f} | "
                        f"{rate:.1f} | {rate / bound:.0%} |"
                    )


if __name__ == "__main__":
    main()
