"""A 1B-class single-request decode step against this machine's memory-bandwidth bound.

At 1B+ parameters a decode step of one request reads every weight once, so its speed is bytes
per second. This builds a random-weight checkpoint at start (``--model llama1b``: Llama-3.2-1B's
shapes with the default tokenizer's vocabulary, 2.15 GB in bfloat16; ``granite``: granite-3.x-2b's
shapes, ``--layers`` of its 40), loads it as the server does (``build_runner``: the same model copy,
kernels and decoder) and alternates, in one process:

- the streaming bound: a ``torch.sum`` over a float32 array as large as the step's weights, on the
  same threads (bytes / time);
- single-request decode steps after a ``--context``-token prompt (schedule + forward + greedy
  sampling), their weights' bytes / step time against that bound;
- the same step's projections alone, called in the step's order on one row each (so every weight
  is read from memory as in the step), per kind: GB/s of each, and the step's median minus
  theirs: roughly what it spends outside them (attention, norms, RoPE, the embedding, sampling,
  Python), within the two measurements' noise.

With ``--fp8`` (bfloat16 only), the checkpoint is also quantized as llm-compressor's FP8 scheme
writes it (``realistic_checkpoint.quantize_fp8``) and served beside the bfloat16 one: its
decode steps and projections timed in the same rounds, against the bfloat16 ones and the bound.

Run from the repository root (it builds the checkpoint with the conformance suite's builder)::

    .venv/bin/python -m bench.decode_bandwidth [--model llama1b] [--dtype bfloat16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from bench.bench_engine import RANDOM_MODELS, Bench, random_checkpoint
from bench.realistic_checkpoint import quantize_fp8
from spyre_server.model.loading import cpu_flags, load_model

PROJECTION_KINDS = {"qkv_fused": "qkv", "dense": "dense", "wg1_fused": "gate_up", "w2": "down"}
"""fms's projection module names in a decoder layer, as the step's kinds."""


def streaming_gbps(data: torch.Tensor, reps: int = 5) -> list[float]:
    """GB/s of ``torch.sum`` over ``data`` (touched before), each of ``reps`` reads."""
    rates = []
    for _ in range(reps):
        start = time.perf_counter()
        data.sum()
        rates.append(data.numel() * data.element_size() / (time.perf_counter() - start) / 1e9)
    return rates


def projections(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, int]]:
    """The step's projections in the order it calls them: (kind, module, bytes of its weight as
    the kernel reads it), the LM head last."""
    found = []
    for name, module in model.named_modules():
        kind = PROJECTION_KINDS.get(name.rsplit(".", 1)[-1])
        if name.endswith("head") and hasattr(module, "in_features"):
            kind = "lm_head"
        if kind is None or not hasattr(module, "in_features"):
            continue
        # What each linear kernel reads: ours (bf16, f32), oneDNN's, aten's.
        weight = next(
            getattr(module, name)
            for name in ("packed", "panels", "packed_weight", "weight")
            if getattr(module, name, None) is not None
        )
        found.append((kind, module, weight.numel() * weight.element_size()))
    assert found and found[-1][0] == "lm_head", [k for k, _, _ in found[-3:]]
    return found


@torch.inference_mode()
def projection_seconds(
    found: list[tuple[str, torch.nn.Module, int]], dtype: torch.dtype
) -> dict[str, float]:
    """Seconds per kind of one pass over every projection on one row, in the step's order."""
    rows = {m.in_features: torch.randn(1, m.in_features).to(dtype) for _, m, _ in found}
    seconds: dict[str, float] = defaultdict(float)
    for kind, module, _ in found:
        x = rows[module.in_features]
        start = time.perf_counter()
        module(x)
        seconds[kind] += time.perf_counter() - start
    return seconds


def fp8_bench(path: Path, overrides: dict[str, Any], model: str) -> Bench:
    """The checkpoint at ``path`` quantized to FP8 (``realistic_checkpoint.quantize_fp8``),
    loaded and served as the server does."""
    fp8 = quantize_fp8(path, path.with_name(path.name + "-fp8"))
    return Bench(overrides, load_model(fp8, torch.bfloat16), fms_forward=False, model=model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(RANDOM_MODELS), default="llama1b")
    parser.add_argument("--layers", type=int, default=None, help="default: the model's own")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--context", type=int, default=512, help="prompt tokens before decoding")
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--linear-kernel", default="auto")
    parser.add_argument(
        "--no-amx", action="store_true", help="model.native_amx false (AVX512-BF16 linears)"
    )
    parser.add_argument("--fp8", action="store_true", help="also serve an FP8 quantization")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    layers = args.layers or RANDOM_MODELS[args.model][2]["num_hidden_layers"]
    overrides: dict[str, Any] = {
        "model.dtype": args.dtype,
        "model.num_threads": args.threads,
        "model.linear_kernel": args.linear_kernel,
        "model.native_amx": not args.no_amx,
    }
    print(f"cpu: {', '.join(sorted(cpu_flags() & {'avx2', 'avx512f', 'avx512_bf16', 'amx_bf16'}))}")
    with tempfile.TemporaryDirectory() as scratch:
        path = random_checkpoint(args.model, layers, Path(scratch))
        loaded = load_model(path, getattr(torch, args.dtype))
        bench = Bench(overrides, loaded, fms_forward=False, model=args.model)
        fp8 = fp8_bench(path, overrides, args.model) if args.fp8 else None
    found = projections(bench.model)
    fp8_found = projections(fp8.model) if fp8 is not None else []
    weight_bytes = sum(b for _, _, b in found)
    by_kind: dict[str, int] = defaultdict(int)
    for kind, _, nbytes in found:
        by_kind[kind] += nbytes
    print(
        f"{args.model}, {layers} layers, {args.dtype}, decoder {type(bench.decoder).__name__}: "
        f"{weight_bytes / 1e9:.3f} GB of projection weights per decode step"
    )
    data = torch.ones(weight_bytes // 4, dtype=torch.float32)  # as many bytes as the weights
    stream: list[float] = []
    steps: list[float] = []
    kinds: dict[str, list[float]] = defaultdict(list)
    fp8_kinds: dict[str, list[float]] = defaultdict(list)
    fp8_steps: list[float] = []
    for _ in range(args.rounds):
        stream += streaming_gbps(data)
        steps += bench.decode_step_times(1, args.steps, args.context)
        if fp8 is not None:
            fp8_steps += fp8.decode_step_times(1, args.steps, args.context)
        for _ in range(3):
            for kind, seconds in projection_seconds(found, getattr(torch, args.dtype)).items():
                kinds[kind].append(seconds)
            for kind, seconds in projection_seconds(fp8_found, torch.bfloat16).items():
                fp8_kinds[kind].append(seconds)
    bound = statistics.median(stream)
    step = statistics.median(steps)
    print(
        f"\nstreaming read (torch.sum, {args.threads} threads): median {bound:.1f} GB/s "
        f"(min {min(stream):.1f}, max {max(stream):.1f})"
    )
    print(
        f"decode step, 1 request, {args.context}-token context: median {step * 1e3:.1f} ms "
        f"(min {min(steps) * 1e3:.1f}) = {1 / step:.1f} tok/s; "
        f"{weight_bytes / step / 1e9:.1f} GB/s = {weight_bytes / step / 1e9 / bound:.0%} of the "
        f"bound (bound: {bound * 1e9 / weight_bytes:.1f} tok/s)"
    )
    print("\n| kind | GB | ms per step | GB/s | of the bound |\n|---|---|---|---|---|")
    total = 0.0
    for kind, values in kinds.items():
        seconds = statistics.median(values)
        total += seconds
        rate = by_kind[kind] / seconds / 1e9
        print(
            f"| {kind} | {by_kind[kind] / 1e9:.3f} | {seconds * 1e3:.1f} | {rate:.1f} | "
            f"{rate / bound:.0%} |"
        )
    print(
        f"| all projections | {weight_bytes / 1e9:.3f} | {total * 1e3:.1f} | "
        f"{weight_bytes / total / 1e9:.1f} | {weight_bytes / total / 1e9 / bound:.0%} |"
    )
    # Two medians of separate measurements: within their noise (a few ms) this can go negative.
    print(f"| step minus the projections alone | | {(step - total) * 1e3:.1f} | | |")
    if fp8_steps:
        print_fp8(kinds, fp8_kinds, fp8_found, bound, step, statistics.median(fp8_steps))


def print_fp8(
    kinds: dict[str, list[float]],
    fp8_kinds: dict[str, list[float]],
    fp8_found: list[tuple[str, torch.nn.Module, int]],
    bound: float,
    step: float,
    fp8_step: float,
) -> None:
    fp8_bytes: dict[str, int] = defaultdict(int)
    for kind, _, nbytes in fp8_found:
        fp8_bytes[kind] += nbytes
    total_bytes = sum(fp8_bytes.values())
    print(
        f"\nFP8 decode step, 1 request: median {fp8_step * 1e3:.1f} ms = {1 / fp8_step:.1f} "
        f"tok/s = **{fp8_step / step:.2f}x the bfloat16 step**; {total_bytes / 1e9:.3f} GB of "
        f"weights read at {total_bytes / fp8_step / 1e9:.1f} GB/s = "
        f"{total_bytes / fp8_step / 1e9 / bound:.0%} of the bound"
    )
    print(
        "\n| kind | FP8 GB | bf16 ms | FP8 ms | FP8 / bf16 | FP8 GB/s | of the bound |"
        "\n|---|---|---|---|---|---|---|"
    )
    bf16_total = fp8_total = 0.0
    for kind, values in fp8_kinds.items():
        bf16, fp8 = statistics.median(kinds[kind]), statistics.median(values)
        bf16_total, fp8_total = bf16_total + bf16, fp8_total + fp8
        rate = fp8_bytes[kind] / fp8 / 1e9
        print(
            f"| {kind} | {fp8_bytes[kind] / 1e9:.3f} | {bf16 * 1e3:.1f} | {fp8 * 1e3:.1f} | "
            f"{fp8 / bf16:.2f} | {rate:.1f} | {rate / bound:.0%} |"
        )
    print(
        f"| all projections | {total_bytes / 1e9:.3f} | {bf16_total * 1e3:.1f} | "
        f"{fp8_total * 1e3:.1f} | {fp8_total / bf16_total:.2f} | | |"
    )


if __name__ == "__main__":
    main()
