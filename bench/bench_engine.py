"""Engine benchmark (CPU): prefill and decode speed, our runner against a plain fms forward,
time to first token with a cold vs a warm prefix cache, and the step path the server picks (a
decoder) against fms's forward, per token.

Run: ``.venv/bin/python bench/bench_engine.py`` (SmolLM2-135M-Instruct, 10-30 minutes on 2
cores). Options: ``--threads N`` torch threads (default 2); ``--linear-kernel
native|onednn|aten`` (default auto, as the server); ``--no-native-avx512``; ``--sections
prefill,decode,ttft,decoder`` (the first three by default); ``--reps N`` timed rounds per point
(median reported, after one warm-up run); ``--bf16`` run bfloat16 too even where the CPU would
emulate it; ``--profile`` add a torch profile of one decode step at batch 32.

``--model granite,llama`` runs random-weight checkpoints built at start instead of SmolLM2
(``RANDOM_MODELS``: granite-3.x-2b's shapes and scalars, and a Llama of the same shapes), with
``--layers N`` of their 40 layers (default 8); they are built with the conformance suite's
builder (``tests/conformance/checkpoints.py``), so run from the repository root as
``.venv/bin/python -m bench.bench_engine``. The decoder-against-fms comparison on both, in
float32 and bfloat16, with a summary table of the ratios at the end::

    .venv/bin/python -m bench.bench_engine --model granite,llama --sections decoder

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
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from scheduler import (
    DecodeBatch,
    ModelRunnerOutput,
    PrefillChunk,
    ScheduledStep,
    Scheduler,
    SchedulerConfig,
)
from spyre_server.config import Config, load_config
from spyre_server.engine.factory import scheduler_config
from spyre_server.model.build import build_runner
from spyre_server.model.cpu.runner import CpuModelRunner
from spyre_server.model.loading import LoadedModel, cpu_flags, load_model
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
STEP_PROMPT_LEN = 512
STEP_CHUNK = 256
STEP_BATCHES = (1, 8)
STEP_DECODE_STEPS = 4

GRANITE_2B_SHAPES: dict[str, Any] = {
    "vocab_size": 49155,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 40,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0},
}
"""granite-3.x-2b-instruct's sizes (head_dim 64), tied embeddings, plain RoPE."""
LLAMA_1B_SHAPES: dict[str, Any] = GRANITE_2B_SHAPES | {
    "vocab_size": 49152,
    "num_hidden_layers": 16,
    "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
}
"""Llama-3.2-1B's sizes (hidden 2048, 16 layers, 32/8 heads of 64, intermediate 8192, tied
embeddings) with the default tokenizer's vocabulary and plain RoPE: 2.15 GB in bfloat16."""
RANDOM_MODELS: dict[str, tuple[str, str, dict[str, Any]]] = {
    # name: (transformers class, model_type, config fields)
    "granite": (
        "GraniteForCausalLM",
        "granite",
        GRANITE_2B_SHAPES
        | {
            "embedding_multiplier": 12.0,
            "residual_multiplier": 0.22,
            "attention_multiplier": 0.015625,
            "logits_scaling": 8.0,
        },
    ),
    "llama": ("LlamaForCausalLM", "llama", GRANITE_2B_SHAPES),
    "llama1b": ("LlamaForCausalLM", "llama", LLAMA_1B_SHAPES),
}
"""The random-weight models ``--model`` builds: granite-3.x-2b's shapes and scalars, a Llama of
the same shapes (the scalars are Granite's only ops a Llama lacks), and Llama-3.2-1B's shapes."""


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
    ids = logits.float().argmax(dim=-1).tolist()  # as the sampler: bfloat16's argmax is 5x slower
    if isinstance(step, PrefillChunk):
        return ModelRunnerOutput({step.request_id: ids[0]})
    return ModelRunnerOutput({e.request_id: t for e, t in zip(step.entries, ids, strict=True)})


@dataclass(frozen=True)
class StepRow:
    """One point of the ``decoder`` section: a step kind's time per token on the decoder and on
    fms's forward (medians over the rounds), and the median of the rounds' fms/decoder ratios."""

    model: str
    dtype: str
    decoder: str
    step: str
    decoder_ms: float
    fms_ms: float
    ratio: float


class Bench:
    """The server's runner for the configuration ``overrides`` give (``build_runner``: the same
    model copy, kernels and decoder), with a fresh scheduler per measurement."""

    def __init__(
        self, overrides: dict[str, Any], loaded: LoadedModel, *, fms_forward: bool, model: str
    ) -> None:
        self.overrides = {"cache.num_blocks": 160, "model.max_model_len": 4096, **overrides}
        self.dtype = loaded.dtype
        self.vocab = loaded.vocab_size
        self.model_name = model
        runner = build_runner(self._config(), loaded, self.scheduler_config(256))
        assert isinstance(runner, CpuModelRunner)
        self.decoder = runner.decoder
        """The step path the server picks (None: fms's forward)."""
        if fms_forward:
            runner.decoder = None  # fms's forward runs the steps
        self.runner = runner
        self.model = runner.model
        self.step_rows: list[StepRow] = []

    def _config(self, **overrides: Any) -> Config:
        return load_config(environ={}, overrides={**self.overrides, **overrides})

    def scheduler_config(
        self, chunk_size: int, *, caching: bool = True, max_num_seqs: int = 8
    ) -> SchedulerConfig:
        config = self._config(
            **{
                "scheduler.chunk_size": chunk_size,
                "scheduler.max_num_seqs": max_num_seqs,
                "cache.enable_prefix_caching": caching,
            }
        )
        assert config.cache.num_blocks is not None
        return scheduler_config(config, config.cache.num_blocks, CpuModelRunner.prefill_compute)

    def scheduler(
        self, chunk_size: int, *, caching: bool = True, max_num_seqs: int = 8
    ) -> Scheduler:
        config = self.scheduler_config(chunk_size, caching=caching, max_num_seqs=max_num_seqs)
        return Scheduler(config, hash_seed=0)

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
    def decode_step_times(
        self, batch: int, steps: int, prompt_len: int = DECODE_PROMPT_LEN
    ) -> list[float]:
        """``batch`` requests with the same ``prompt_len``-token prompt (they share its
        blocks, so only the first prefill computes it), then ``steps`` timed decode steps with
        every request in the batch (schedule + forward + greedy sampling + update)."""
        sched = self.scheduler(256, max_num_seqs=batch)
        prompt = tokens(prompt_len, seed=7, vocab=self.vocab)
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


def bench_decoder(bench: Bench, reps: int, label: str) -> Results:
    """Per token: a prefill of one STEP_PROMPT_LEN-token prompt in STEP_CHUNK-token chunks (no
    cache hit), and decode steps at each of STEP_BATCHES, on the decoder the server picks and on
    fms's forward over the same model copy and kernels, in rounds that time both back to back."""
    decoder = bench.decoder
    name = type(decoder).__name__
    print(
        f"\n== {label}: {name} against fms's forward, per token: a {STEP_PROMPT_LEN}-token "
        f"prefill in chunks of {STEP_CHUNK}, decode steps at batch "
        f"{', '.join(map(str, STEP_BATCHES))} =="
    )
    if decoder is None:
        print("no decoder covers this model (the log says why): nothing to compare")
        return []
    prompt = tokens(STEP_PROMPT_LEN, seed=3, vocab=bench.vocab)

    def measure(step_path: Any) -> dict[str, float]:
        bench.runner.decoder = step_path
        times = {"prefill chunk": bench.prefill(STEP_CHUNK, prompt) / len(prompt)}
        for batch in STEP_BATCHES:
            steps = bench.decode_step_times(batch, STEP_DECODE_STEPS)
            times[f"decode step, batch {batch}"] = statistics.median(steps) / batch
        return times

    before = bench.runner.decoder  # None with --fms-forward
    try:
        measure(decoder), measure(None)  # warm-up
        rounds = [(measure(decoder), measure(None)) for _ in range(reps)]
    finally:
        bench.runner.decoder = before
    widths = (24, 16, 16, 10)
    print(row("step", f"{name} (ms/tok)", "fms (ms/tok)", "fms / dec", widths=widths))
    for step in rounds[0][0]:
        ours = statistics.median(r[0][step] for r in rounds) * 1e3
        theirs = statistics.median(r[1][step] for r in rounds) * 1e3
        ratio = statistics.median(r[1][step] / r[0][step] for r in rounds)
        print(row(step, f"{ours:.3f}", f"{theirs:.3f}", f"{ratio:.2f}x", widths=widths))
        bench.step_rows.append(StepRow(bench.model_name, label, name, step, ours, theirs, ratio))
    return []


SECTIONS = {
    "prefill": bench_prefill,
    "decode": bench_decode,
    "ttft": bench_ttft,
    "decoder": bench_decoder,
}
DEFAULT_SECTIONS = ("prefill", "decode", "ttft")


def random_checkpoint(name: str, layers: int, directory: Path) -> Path:
    """``RANDOM_MODELS[name]`` with ``layers`` layers, random weights, saved into
    ``directory`` with the default model's tokenizer (the conformance suite's builder)."""
    try:
        from tests.conformance.checkpoints import Architecture, build_checkpoint
    except ModuleNotFoundError as exc:
        raise SystemExit(
            f"--model {name} builds its checkpoint with tests/conformance/checkpoints.py ({exc}): "
            "run from the repository root as .venv/bin/python -m bench.bench_engine"
        ) from exc

    architecture, model_type, fields = RANDOM_MODELS[name]
    spec = Architecture(
        name,
        architecture,
        model_type,
        fields | {"num_hidden_layers": layers},
        embedding_std=0.002 if "embedding_multiplier" in fields else 0.02,
    )
    return build_checkpoint(spec, directory / name, prepare_default_model(default_cache_dir()))


def print_step_summary(rows: list[StepRow]) -> None:
    """The ``decoder`` section's points as one markdown table."""
    print("\n== the decoders against fms's forward, ms per token (markdown) ==")
    print("| model | dtype | step path | step | decoder | fms forward | fms / decoder |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r.model} | {r.dtype} | {r.decoder} | {r.step} | {r.decoder_ms:.3f} | "
            f"{r.fms_ms:.3f} | {r.ratio:.2f}x |"
        )


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
        "--sections",
        default=",".join(DEFAULT_SECTIONS),
        help=f"comma-separated, of {','.join(SECTIONS)} (default {','.join(DEFAULT_SECTIONS)})",
    )
    parser.add_argument(
        "--model",
        default="smollm2",
        help="comma-separated: smollm2 (the default model) and/or the random-weight models "
        f"built at start ({', '.join(RANDOM_MODELS)}: granite-3.x-2b's shapes; run as "
        "python -m bench.bench_engine from the repository root)",
    )
    parser.add_argument(
        "--layers",
        type=int,
        default=8,
        help="layers of the random-weight models (the real model has 40; default 8)",
    )
    parser.add_argument(
        "--linear-kernel",
        choices=("auto", "native", "onednn", "aten"),
        default="auto",
        help="model.linear_kernel: auto (the server's default), our own float32 and bfloat16 "
        "kernels, oneDNN-packed weights or F.linear; the runner always gets the server's model copy "
        "(model/cpu/prepare.py)",
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
    models = args.model.split(",")
    for name in models:
        if name != "smollm2" and name not in RANDOM_MODELS:
            parser.error(f"--model {name}: not smollm2 or one of {', '.join(RANDOM_MODELS)}")
    flags = cpu_flags()
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
    step_rows: list[StepRow] = []
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as scratch:
        for name in models:
            if name == "smollm2":
                path = prepare_default_model(default_cache_dir())
                print(f"\n##### SmolLM2-135M-Instruct from {path}")
                model_label = "SmolLM2-135M"
            else:
                started = time.perf_counter()
                path = random_checkpoint(name, args.layers, Path(scratch))
                model_label = f"{name} (granite-3.x-2b shapes, {args.layers} of 40 layers)"
                print(
                    f"\n##### {model_label}: random weights, built in "
                    f"{time.perf_counter() - started:.0f} s"
                )
            for dtype, label in dtypes:
                loaded = load_model(path, dtype)
                kernels = {
                    "model.linear_kernel": args.linear_kernel,
                    "model.attention_kernel": args.attention_kernel,
                    "model.native_avx512": args.native_avx512,
                }
                bench = Bench(kernels, loaded, fms_forward=args.fms_forward, model=model_label)
                for section in args.sections.split(","):
                    results += SECTIONS[section](bench, args.reps, label)
                if args.profile:
                    profile_decode(bench, 32)
                step_rows += bench.step_rows
                del bench, loaded

    if step_rows:
        print_step_summary(step_rows)
    if results:
        print("\n== targets ==")
    for text, ok in results:
        print(f"{'PASS' if ok else 'FAIL'}  {text}")


if __name__ == "__main__":
    main()
