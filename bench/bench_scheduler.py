"""Scheduler micro-benchmarks: decode step cost, 32k-token cached admission, prefill chunk cost.

Run: ``.venv/bin/python bench/bench_scheduler.py`` (``--profile`` adds a cProfile of the
256-request decode step). Only the scheduler is timed (``schedule()`` + ``update_from_output()``);
the fake runner's work (building the sampled-token dict) is excluded.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import platform
import pstats
import random
import statistics
import sys
import time
import timeit
from collections.abc import Iterator
from contextlib import contextmanager

from scheduler import (
    DecodeBatch,
    ModelRunnerOutput,
    PrefillChunk,
    ScheduledStep,
    Scheduler,
    SchedulerConfig,
)

BS = 64
DECODE_TARGET_US = 1000.0  # per step at 256 decoding requests
PROMPT_LEN = 256
DECODE_WARMUP = 32
DECODE_STEPS = 400
LONG_PROMPT = 32 * 1024


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def run_output(step: ScheduledStep, token: int = 1) -> ModelRunnerOutput:
    """What the runner would return; never samples a stop token (there is none)."""
    if isinstance(step, DecodeBatch):
        return ModelRunnerOutput({e.request_id: token for e in step.entries})
    return ModelRunnerOutput({step.request_id: token} if step.is_last_chunk else {})


@contextmanager
def no_gc() -> Iterator[None]:
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def prompt_tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(n)]


# --------------------------------------------------------------------------- decode
def decode_scheduler(num_requests: int) -> Scheduler:
    """``num_requests`` requests that all finished their prefill and decode from now on."""
    max_tokens = DECODE_WARMUP + DECODE_STEPS + 64
    max_model_len = PROMPT_LEN + max_tokens
    config = SchedulerConfig(
        block_size=BS,
        chunk_size=256,
        max_num_seqs=num_requests,
        max_model_len=max_model_len,
        num_blocks=num_requests * cdiv(max_model_len, BS) + 1,
        max_batch_tkv_limit=num_requests * max_model_len,
        interleave=False,  # all prefills first: every request has the same number of outputs
    )
    sched = Scheduler(config, hash_seed=0)
    for i in range(num_requests):
        sched.add_request(f"req-{i}", prompt_tokens(i, PROMPT_LEN), max_tokens)
    while True:
        step = sched.schedule()
        assert step is not None
        sched.update_from_output(step, run_output(step))
        if isinstance(step, DecodeBatch) and len(step.entries) == num_requests:
            return sched


def time_decode_steps(sched: Scheduler, num_steps: int) -> tuple[list[float], list[float]]:
    """Seconds of schedule() and of update_from_output() for each of ``num_steps`` decode steps."""
    sched_times, update_times = [], []
    perf = time.perf_counter
    with no_gc():
        for _ in range(num_steps):
            t0 = perf()
            step = sched.schedule()
            t1 = perf()
            assert isinstance(step, DecodeBatch)
            assert sched.make_stats().num_running == len(step.entries), "a request finished"
            result = run_output(step)
            t2 = perf()
            sched.update_from_output(step, result)
            t3 = perf()
            sched_times.append(t1 - t0)
            update_times.append(t3 - t2)
    return sched_times, update_times


def bench_decode(num_requests: int) -> list[float]:
    """µs per step: median, mean, p90, min of schedule() + update(); medians of each alone."""
    sched = decode_scheduler(num_requests)
    time_decode_steps(sched, DECODE_WARMUP)
    sched_times, update_times = time_decode_steps(sched, DECODE_STEPS)
    times = [a + b for a, b in zip(sched_times, update_times, strict=True)]
    stats = [
        statistics.median(times),
        statistics.fmean(times),
        statistics.quantiles(times, n=10)[-1],
        min(times),
        statistics.median(sched_times),
        statistics.median(update_times),
    ]
    return [x * 1e6 for x in stats]


def profile_decode(num_requests: int, top: int = 20) -> str:
    sched = decode_scheduler(num_requests)
    time_decode_steps(sched, DECODE_WARMUP)
    profiler = cProfile.Profile()
    with no_gc():
        profiler.enable()
        for _ in range(DECODE_STEPS):
            step = sched.schedule()
            assert step is not None
            sched.update_from_output(step, run_output(step))
        profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    return out.getvalue()


# --------------------------------------------------------------------------- admission
def long_prompt_scheduler(chunk_size: int, caching: bool) -> tuple[Scheduler, list[int]]:
    """A scheduler in which a finished request left a 32k-token prompt's blocks cached."""
    num_prompt_blocks = LONG_PROMPT // BS
    config = SchedulerConfig(
        block_size=BS,
        chunk_size=chunk_size,
        max_num_seqs=4,
        max_model_len=LONG_PROMPT + 64,
        num_blocks=2 * (num_prompt_blocks + 2) + 1,
        enable_prefix_caching=caching,
    )
    sched = Scheduler(config, hash_seed=0)
    prompt = prompt_tokens(123, LONG_PROMPT)
    sched.add_request("warm", prompt, 1)  # max_tokens 1: finishes at the end of its prefill
    while sched.has_unfinished_requests:
        step = sched.schedule()
        assert step is not None
        sched.update_from_output(step, run_output(step))
    return sched, prompt


def bench_admission(chunk_size: int, caching: bool, reps: int = 30) -> tuple[float, float, int]:
    """Median µs of the schedule() call that admits a 32k-token prompt (and of its
    add_request, which hashes the prompt), with an identical finished request's blocks cached."""
    sched, prompt = long_prompt_scheduler(chunk_size, caching)
    add_times, admit_times = [], []
    cached_tokens = 0
    perf = time.perf_counter
    for i in range(reps + 3):
        rid = f"rep-{i}"
        with no_gc():
            t0 = perf()
            sched.add_request(rid, prompt, 1)
            t1 = perf()
            step = sched.schedule()
            t2 = perf()
        assert isinstance(step, PrefillChunk)
        request = sched.get_request(rid)
        assert request is not None and request.num_cached_tokens is not None
        cached_tokens = request.num_cached_tokens
        if caching:
            assert step.is_last_chunk, "the full hit should leave only the last chunk"
        sched.finish_request(rid)  # its blocks go back to the free queue, still cached
        if i >= 3:
            add_times.append(t1 - t0)
            admit_times.append(t2 - t1)
    return statistics.median(admit_times) * 1e6, statistics.median(add_times) * 1e6, cached_tokens


def profile_admission(chunk_size: int = 256, reps: int = 30, top: int = 12) -> str:
    sched, prompt = long_prompt_scheduler(chunk_size, caching=True)
    profiler = cProfile.Profile()
    with no_gc():
        for i in range(reps):
            sched.add_request(f"rep-{i}", prompt, 1)
            profiler.enable()
            sched.schedule()
            profiler.disable()
            sched.finish_request(f"rep-{i}")
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


# --------------------------------------------------------------------------- prefill chunks
def bench_prefill_chunks(
    chunk_size: int, prompt_len: int = 8192, num_requests: int = 8
) -> tuple[float, float]:
    """Median µs per prefill chunk of schedule() and of update_from_output() (admission chunks
    excluded; caching on, no hits, so every full block is registered)."""
    config = SchedulerConfig(
        block_size=BS,
        chunk_size=chunk_size,
        max_num_seqs=num_requests,
        max_model_len=prompt_len + 64,
        num_blocks=num_requests * cdiv(prompt_len + 1, BS) + 1,
        interleave=False,
    )
    sched = Scheduler(config, hash_seed=0)
    for i in range(num_requests):
        sched.add_request(f"p-{i}", prompt_tokens(1000 + i, prompt_len), 1)
    sched_times, update_times = [], []
    perf = time.perf_counter
    with no_gc():
        while sched.has_unfinished_requests:
            t0 = perf()
            step = sched.schedule()
            t1 = perf()
            assert isinstance(step, PrefillChunk)
            result = run_output(step)
            t2 = perf()
            sched.update_from_output(step, result)
            t3 = perf()
            if step.chunk_index > 0:
                sched_times.append(t1 - t0)
                update_times.append(t3 - t2)
    return statistics.median(sched_times) * 1e6, statistics.median(update_times) * 1e6


# --------------------------------------------------------------------------- main
def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", action="store_true", help="cProfile the 256-request step")
    args = parser.parse_args(argv)

    print(
        f"Python {platform.python_version()} ({platform.python_implementation()}) on "
        f"{platform.machine()} / {platform.system()}"
    )
    calibration = min(timeit.repeat("sum(range(1000))", number=2000, repeat=5)) / 2000 * 1e6
    print(
        f"block size {BS}; time.perf_counter; gc disabled while timing; machine speed: "
        f"sum(range(1000)) takes {calibration:.1f} us\n"
    )

    print(
        f"Decode step: schedule() + update_from_output(), {PROMPT_LEN}-token prompts, "
        f"median of {DECODE_STEPS} steady-state steps after {DECODE_WARMUP} warm-up steps"
    )
    rows = []
    verdict = True
    for n in (8, 64, 256):
        median, mean, p90, best, sched_us, update_us = bench_decode(n)
        status = ""
        if n == 256:
            ok = median < DECODE_TARGET_US
            verdict &= ok
            status = f"{'PASS' if ok else 'FAIL'} (< {DECODE_TARGET_US:.0f} us)"
        rows.append(
            [
                str(n),
                f"{median:.1f}",
                f"{mean:.1f}",
                f"{p90:.1f}",
                f"{best:.1f}",
                f"{sched_us:.1f}",
                f"{update_us:.1f}",
                f"{median / n:.2f}",
                status,
            ]
        )
    print(
        table(
            [
                "requests",
                "median us",
                "mean us",
                "p90 us",
                "min us",
                "schedule() us",
                "update() us",
                "us/request",
                "target",
            ],
            rows,
        )
    )

    print(
        f"\nAdmission of a {LONG_PROMPT}-token prompt (schedule() call that admits it, "
        "lookup included; median of 30)"
    )
    rows = []
    for chunk_size in (256, 512):
        for caching in (True, False):
            admit, add, cached = bench_admission(chunk_size, caching)
            label = "full prefix hit" if caching else "caching off (no lookup)"
            rows.append([str(chunk_size), label, f"{admit:.1f}", str(cached), f"{add:.1f}"])
    print(table(["chunk", "case", "schedule() us", "cached tokens", "add_request() us"], rows))

    print(
        "\nPrefill chunk scheduling cost (8192-token prompts, no hits, caching on; "
        "admission chunks excluded)"
    )
    rows = []
    for chunk_size in (256, 512):
        sched_us, update_us = bench_prefill_chunks(chunk_size)
        rows.append(
            [str(chunk_size), f"{sched_us:.1f}", f"{update_us:.1f}", f"{sched_us + update_us:.1f}"]
        )
    print(table(["chunk", "schedule() us", "update() us", "total us/chunk"], rows))

    print(f"\nRESULT: {'PASS' if verdict else 'FAIL'} (decode step at 256 requests)")
    if args.profile:
        print("\ncProfile of 400 decode steps with 256 requests (sorted by tottime):")
        print(profile_decode(256))
        print(f"cProfile of 30 admissions of the cached {LONG_PROMPT}-token prompt, chunk 256:")
        print(profile_admission())
    return 0 if verdict else 1


if __name__ == "__main__":
    sys.exit(main())
