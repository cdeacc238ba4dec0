"""Engine benchmark on SmolLM2-135M-Instruct (CPU): prefill and decode speed, our runner against a
plain fms forward, and time to first token with a cold vs a warm prefix cache.

Run: ``.venv/bin/python bench/bench_engine.py`` (10-30 minutes on 2 cores).
Options: ``--threads N`` torch threads (default 2); ``--linear-kernel native|onednn|aten``
(default auto, as the server); ``--no-native-avx512``; ``--sections prefill,decode,ttft`` (all by
default); ``--reps N`` timed rounds per point (median reported, after one warm-up run);
``--bf16`` run bfloat16 too even where the CPU would emulate it; ``--profile`` add a torch profile
of one decode step at batch 32.

On a machine shared with other busy processes, torch's thread pool degrades badly: compare with
``--threads 1`` before trusting a 2-thread number.

Everything below the scheduler is what the server runs: ``Scheduler.schedule()`` ->
``ModelRunner.compute_logits()`` -> ``Scheduler.update_from_output()`` (greedy argmax), timed with
``time.perf_counter`` around the whole loop, so scheduler overhead is included.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from scheduler import (
    DecodeBatch,
    ModelRunnerOutput,
    PrefillChunk,
    ScheduledStep,
    Scheduler,
    SchedulerConfig,
)
from spyre_server.model.cpu_backend import CpuModelRunner, StepDecoder
from spyre_server.model.cpu_model import cpu_attention_kernel, cpu_decoder, cpu_inference_copy
from spyre_server.model.loading import cpu_flags, load_model
from spyre_server.model.paged_attention import PagedAttentionKernel
from spyre_server.model.runner import kv_cache_shape
from spyre_server.model.store import default_cache_dir, prepare_default_model

BS = 64
THREADS = 2
PREFILL_LEN = 1024
PREFILL_CHUNKS = (64, 128, 256, 512)
DECODE_BATCHES = (1, 8, 32)
DECODE_PROMPT_LEN = 512
DECODE_STEPS = 8
PREFIX_LEN = 1536
SUFFIX_LEN = 64
TTFT_CHUNK = 256
PLAIN_RATIO_TARGET = 1.15
WARM_RATIO_TARGET = 1.25
FAST_BF16_FLAGS = {"avx512_bf16", "amx_bf16"}


def tokens(n: int, seed: int, vocab: int) -> list[int]:
    """``n`` random token ids (no special ids at the low end of the vocabulary)."""
    rng = random.Random(seed)
    return [rng.randrange(min(1000, vocab // 2), vocab) for _ in range(n)]


def median_time(fn: Callable[[], float], reps: int) -> float:
    fn()  # warm-up
    return statistics.median(fn() for _ in range(reps))


def sampled(step: ScheduledStep, logits: torch.Tensor | None) -> ModelRunnerOutput:
    if logits is None:
        return ModelRunnerOutput({})
    ids = logits.argmax(dim=-1).tolist()
    if isinstance(step, PrefillChunk):
        return ModelRunnerOutput({step.request_id: ids[0]})
    return ModelRunnerOutput({e.request_id: t for e, t in zip(step.entries, ids, strict=True)})


class Bench:
    def __init__(
        self,
        model: torch.nn.Module,
        dtype: torch.dtype,
        vocab: int,
        attention: PagedAttentionKernel | None = None,
        decoder: StepDecoder | None = None,
    ) -> None:
        self.model = model
        self.dtype = dtype
        self.vocab = vocab
        self.num_blocks = 160
        self.runner = CpuModelRunner(
            model,
            num_blocks=self.num_blocks,
            block_size=BS,
            dtype=dtype,
            attention=attention,
            decoder=decoder,
        )

    def scheduler(
        self, chunk_size: int, *, caching: bool = True, max_num_seqs: int = 8
    ) -> Scheduler:
        return Scheduler(
            SchedulerConfig(
                chunk_size=chunk_size,
                num_blocks=self.num_blocks,
                max_model_len=4096,
                max_num_seqs=max_num_seqs,
                enable_prefix_caching=caching,
            ),
            hash_seed=0,
        )

    def time_to_first_token(
        self, sched: Scheduler, request_id: str, prompt: Sequence[int]
    ) -> float:
        """Add a request and run steps until it has its first token (it must be alone)."""
        start = time.perf_counter()
        sched.add_request(request_id, prompt, 1)
        while (step := sched.schedule()) is not None:
            sched.update_from_output(step, sampled(step, self.runner.compute_logits(step)))
        return time.perf_counter() - start

    # ------------------------------------------------------------------ prefill
    def prefill(self, chunk_size: int, prompt: Sequence[int]) -> float:
        return self.time_to_first_token(self.scheduler(chunk_size, caching=False), "p", prompt)

    @torch.inference_mode()
    def plain_forward(self, prompt: Sequence[int]) -> float:
        """fms's own forward over the whole prompt (default sdpa attention, no cache), only the
        last position through the LM head, as our runner does."""
        ids = torch.tensor([list(prompt)])
        start = time.perf_counter()
        self.model(ids, last_n_tokens=1)
        return time.perf_counter() - start

    # ------------------------------------------------------------------- decode
    def decode_step_times(self, batch: int, steps: int) -> list[float]:
        """``batch`` requests with the same DECODE_PROMPT_LEN-token prompt (they share its
        blocks, so only the first prefill computes it), then ``steps`` timed decode steps with
        every request in the batch (schedule + forward + greedy sampling + update)."""
        sched = self.scheduler(256, max_num_seqs=batch)
        prompt = tokens(DECODE_PROMPT_LEN, seed=7, vocab=self.vocab)
        for i in range(batch):  # interleaving admits one request per two steps
            sched.add_request(f"d{i}", prompt, 2 * batch + steps + 8)
        times = []
        while True:
            start = time.perf_counter()
            step = sched.schedule()
            if step is None:
                break
            sched.update_from_output(step, sampled(step, self.runner.compute_logits(step)))
            elapsed = time.perf_counter() - start
            if isinstance(step, DecodeBatch) and len(step.entries) == batch:
                times.append(elapsed)
                if len(times) == steps + 2:
                    break
        return times[2:]  # the first two full steps are warm-up


def row(*cells: object, widths: Sequence[int]) -> str:
    return "  ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True))


Results = list[tuple[str, bool]]


def bench_prefill(bench: Bench, reps: int, label: str) -> Results:
    prompt = tokens(PREFILL_LEN, seed=1, vocab=bench.vocab)
    print(f"\n== {label}: prefill of one {PREFILL_LEN}-token prompt (no cache hit) ==")
    # One warm-up of each, then rounds that time every variant back to back, so that a change
    # in machine load hits all columns alike; ratios are medians of per-round ratios.
    variants: dict[str, Callable[[], float]] = {"plain fms": lambda: bench.plain_forward(prompt)}
    for chunk in PREFILL_CHUNKS:
        variants[str(chunk)] = lambda chunk=chunk: bench.prefill(chunk, prompt)  # type: ignore[misc]
    for fn in variants.values():
        fn()
    rounds = [{name: fn() for name, fn in variants.items()} for _ in range(reps)]
    widths = (14, 10, 12, 16)
    print(row("chunk size", "time (s)", "tokens/s", "vs plain fms", widths=widths))
    results = []
    for name in variants:
        t = statistics.median(r[name] for r in rounds)
        ratio = statistics.median(r[name] / r["plain fms"] for r in rounds)
        print(row(name, f"{t:.3f}", f"{PREFILL_LEN / t:.0f}", f"{ratio:.2f}x", widths=widths))
        if name == "256":
            results.append(
                (
                    f"{label}: prefill at chunk 256 within {PLAIN_RATIO_TARGET}x of plain fms "
                    f"({ratio:.2f}x)",
                    ratio <= PLAIN_RATIO_TARGET,
                )
            )
    return results


def bench_decode(bench: Bench, reps: int, label: str) -> Results:
    print(
        f"\n== {label}: decode, batch of requests sharing one {DECODE_PROMPT_LEN}-token prompt, "
        f"median of {DECODE_STEPS} full-batch steps =="
    )
    widths = (8, 14, 12)
    print(row("batch", "step (ms)", "tokens/s", widths=widths))
    for batch in DECODE_BATCHES:
        step = statistics.median(bench.decode_step_times(batch, DECODE_STEPS))
        print(row(batch, f"{step * 1e3:.1f}", f"{batch / step:.1f}", widths=widths))
    return []


def bench_ttft(bench: Bench, reps: int, label: str) -> Results:
    total = PREFIX_LEN + SUFFIX_LEN
    print(
        f"\n== {label}: TTFT, {PREFIX_LEN}-token shared prefix + {SUFFIX_LEN}-token suffix, "
        f"chunk {TTFT_CHUNK} =="
    )
    vocab = bench.vocab
    prefix = tokens(PREFIX_LEN, seed=2, vocab=vocab)
    suffixes = iter(range(100, 10_000))

    def cold(length: int) -> float:
        sched = bench.scheduler(TTFT_CHUNK)  # an empty cache
        full = prefix + tokens(SUFFIX_LEN, seed=next(suffixes), vocab=vocab)
        return bench.time_to_first_token(sched, "c", full[:length])

    warm_sched = bench.scheduler(TTFT_CHUNK)
    bench.time_to_first_token(warm_sched, "seed", prefix + tokens(SUFFIX_LEN, 99, vocab))
    counter = iter(range(10_000))

    def warm() -> float:
        """The shared prefix is cached; the suffix is new every time."""
        suffix = tokens(SUFFIX_LEN, seed=next(suffixes), vocab=vocab)
        return bench.time_to_first_token(warm_sched, f"w{next(counter)}", prefix + suffix)

    # Warm-up, then rounds of back-to-back measurements (see bench_prefill).
    cold(total), cold(total - TTFT_CHUNK), warm()
    rounds = [(cold(total), cold(total - TTFT_CHUNK), warm()) for _ in range(reps)]
    cold_full = statistics.median(r[0] for r in rounds)
    cold_part = statistics.median(r[1] for r in rounds)
    chunk_cost = statistics.median(r[0] - r[1] for r in rounds)
    warm_t = statistics.median(r[2] for r in rounds)
    ratio = statistics.median(r[2] / (r[0] - r[1]) for r in rounds)
    stats = warm_sched.make_stats()
    widths = (48, 10)
    print(row(f"cold TTFT, {total} tokens (s)", f"{cold_full:.3f}", widths=widths))
    print(row(f"cold TTFT, {total - TTFT_CHUNK} tokens (s)", f"{cold_part:.3f}", widths=widths))
    print(row("cold cost of the last chunk = difference (s)", f"{chunk_cost:.3f}", widths=widths))
    print(
        row(f"warm TTFT, {total} tokens, {PREFIX_LEN} cached (s)", f"{warm_t:.3f}", widths=widths)
    )
    print(row("warm TTFT / cold cost of the last chunk", f"{ratio:.2f}x", widths=widths))
    print(row("cold / warm TTFT", f"{cold_full / warm_t:.1f}x", widths=widths))
    print(
        f"(warm scheduler: {stats.prefix_cache_hits} of {stats.prefix_cache_queries} prompt "
        f"tokens hit, {stats.num_prefill_chunks_computed} chunks computed, "
        f"{stats.num_prefill_chunks_skipped} skipped)"
    )
    return [
        (
            f"{label}: warm TTFT <= {WARM_RATIO_TARGET}x the cold cost of the non-skipped chunk "
            f"({ratio:.2f}x)",
            ratio <= WARM_RATIO_TARGET,
        )
    ]


SECTIONS = {"prefill": bench_prefill, "decode": bench_decode, "ttft": bench_ttft}


def profile_decode(bench: Bench, batch: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    sched = bench.scheduler(256, max_num_seqs=batch)
    prompt = tokens(DECODE_PROMPT_LEN, seed=7, vocab=bench.vocab)
    for i in range(batch):
        sched.add_request(f"d{i}", prompt, 2 * batch + 16)
    steps = 0
    while (step := sched.schedule()) is not None:
        full = isinstance(step, DecodeBatch) and len(step.entries) == batch
        if full and steps == 2:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                bench.runner.compute_logits(step)
            print(f"\n== torch profile of one decode step, batch {batch} ==")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
            return
        steps += full
        sched.update_from_output(step, sampled(step, bench.runner.compute_logits(step)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--bf16", action="store_true", help="run bfloat16 even if emulated")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--threads", type=int, default=THREADS, help="torch threads (default 2)")
    parser.add_argument(
        "--sections", default=",".join(SECTIONS), help="comma-separated: prefill,decode,ttft"
    )
    parser.add_argument(
        "--linear-kernel",
        choices=("auto", "native", "onednn", "aten"),
        default="auto",
        help="model.linear_kernel: auto (the server's default), our own float32 kernel, "
        "oneDNN-packed weights or F.linear; the runner always gets the server's model copy "
        "(cpu_model.py)",
    )
    parser.add_argument(
        "--no-native-avx512",
        dest="native_avx512",
        action="store_false",
        help="model.native_avx512: false (the native kernels' AVX2 code on AVX512F CPUs)",
    )
    parser.add_argument(
        "--attention-kernel",
        choices=("auto", "native", "amx", "avx512_bf16", "mixed", "flash"),
        default="auto",
        help="model.attention_kernel: auto (the server's default: ours; in bfloat16 our "
        "dot-product kernel on AMX where the CPU has AMX, else on AVX512-BF16, else ours), ours, "
        "ours on AMX or on AVX512-BF16 (bfloat16), mixed (ours for decode steps, flash for "
        "prefill chunks), or SDPA's flash kernel",
    )
    parser.add_argument(
        "--fms-forward",
        action="store_true",
        help="run the steps through fms's forward even where a decoder (native or aten) covers "
        "the model (the server uses the decoder there)",
    )
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    path = prepare_default_model(default_cache_dir())
    flags = cpu_flags()
    print(f"SmolLM2-135M-Instruct from {path}")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, reps {args.reps} "
        f"(median), linear kernel {args.linear_kernel}, attention kernel {args.attention_kernel}"
        f"{', fms forward' if args.fms_forward else ''}"
    )
    load = os.getloadavg()[0]
    print(f"load average at start: {load:.2f} on {os.cpu_count()} CPUs")
    if load > 0.5:
        print("WARNING: other processes are using the CPU: timings will be noisy")
    fast_bf16 = sorted(flags & FAST_BF16_FLAGS)
    print(f"CPU bf16 flags: {', '.join(fast_bf16) or 'none (no avx512_bf16 / amx_bf16)'}")

    results: list[tuple[str, bool]] = []
    dtypes = [(torch.float32, "float32")]
    if fast_bf16:
        dtypes.append((torch.bfloat16, "bfloat16"))
    elif args.bf16:
        dtypes.append((torch.bfloat16, "bfloat16 (EMULATED: no avx512_bf16/amx_bf16)"))
    else:
        print(
            "bfloat16 skipped: this CPU has neither avx512_bf16 nor amx_bf16, so bf16 matrix "
            "products would be emulated (slower than float32); --bf16 runs it anyway"
        )
    if args.attention_kernel in ("amx", "avx512_bf16"):
        print(f"float32 skipped: attention kernel {args.attention_kernel} computes bfloat16 only")
        dtypes = [(dtype, label) for dtype, label in dtypes if dtype == torch.bfloat16]
    for dtype, label in dtypes:
        loaded = load_model(path, dtype)
        model = cpu_inference_copy(
            loaded.model,
            linear_kernel=args.linear_kernel,
            dtype=dtype,
            native_avx512=args.native_avx512,
        )
        attention = cpu_attention_kernel(
            args.attention_kernel,
            dtype=dtype,
            head_dim=kv_cache_shape(model).head_dim,
            native_avx512=args.native_avx512,
        )
        decoder = None if args.fms_forward else cpu_decoder(model, attention)
        bench = Bench(model, dtype, loaded.vocab_size, attention, decoder)
        for section in args.sections.split(","):
            results += SECTIONS[section](bench, args.reps, label)
        if args.profile:
            profile_decode(bench, 32)
        del bench, loaded, model

    print("\n== targets ==")
    for text, ok in results:
        print(f"{'PASS' if ok else 'FAIL'}  {text}")


if __name__ == "__main__":
    main()
