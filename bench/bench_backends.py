"""The two backends side by side on SmolLM2-135M-Instruct, float32, in one run: the ``cpu``
backend against the ``spyre`` backend's programs compiled for a CPU (``eager``, optionally
``inductor``). The spyre backend on a CPU is a fidelity path (fms's reference
``spyre_paged_attn`` copies the whole KV cache at every layer), so this shows what it costs, not
a target.

Run: ``.venv/bin/python bench/bench_backends.py [--threads 1] [--inductor] [--num-blocks 64]``
(a few minutes on 2 cores). Measured through the engine (schedule -> runner -> update), greedy.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

import torch

from spyre_server.config import load_config
from spyre_server.engine.factory import build_engine
from spyre_server.entrypoints.llm import LLM
from spyre_server.model.loading import load_model
from spyre_server.model.store import default_cache_dir, prepare_default_model
from spyre_server.sample.sampler import SamplingParams

PROMPT_LEN = 512
CHUNK = 256
DECODE_BATCH = 4
DECODE_TOKENS = 16


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 49152) for _ in range(n)]


def timed(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[Any]]:
    start = time.perf_counter()
    out = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0))
    return time.perf_counter() - start, out


def run(loaded: Any, backend: str, compile_backend: str, num_blocks: int) -> dict[str, float]:
    config = load_config(
        environ={},
        overrides={
            "model.backend": backend,
            "model.compile_backend": compile_backend,
            "model.dtype": "float32",
            "cache.num_blocks": num_blocks,
            "scheduler.chunk_size": CHUNK,
            "scheduler.max_num_seqs": DECODE_BATCH,
        },
    )
    start = time.perf_counter()
    llm = LLM(build_engine(config, loaded))
    warmup = time.perf_counter() - start
    prefix = tokens(PROMPT_LEN, 1)
    cold, _ = timed(llm, [prefix], 1)  # 2 chunks, first token
    warm, out = timed(llm, [prefix[:-64] + tokens(64, 2)], 1)  # chunk 0 from the cache
    assert out[0].num_cached_tokens > 0
    # Two fresh batches of the same lengths: one stops after its prefills, one decodes on.
    lengths = [200 + 50 * i for i in range(DECODE_BATCH)]
    prefills, _ = timed(llm, [tokens(n, 10 + i) for i, n in enumerate(lengths)], 1)
    prompts = [tokens(n, 20 + i) for i, n in enumerate(lengths)]
    with_decode, _ = timed(llm, prompts, DECODE_TOKENS + 1)
    per_decode = max(0.0, with_decode - prefills) / DECODE_TOKENS
    return {
        "warm-up s": warmup,
        "cold TTFT s": cold,
        "warm TTFT s": warm,
        "decode step s": per_decode,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--inductor", action="store_true", help="also the inductor backend")
    parser.add_argument("--num-blocks", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(prepare_default_model(default_cache_dir()), torch.float32)
    rows = {"cpu": run(loaded, "cpu", "eager", args.num_blocks)}
    rows["spyre/eager"] = run(loaded, "spyre", "eager", args.num_blocks)
    if args.inductor:
        rows["spyre/inductor"] = run(loaded, "spyre", "inductor", args.num_blocks)
    print(
        f"\nSmolLM2-135M float32, {args.threads} thread(s), {args.num_blocks} KV blocks, "
        f"chunk {CHUNK}, prompt {PROMPT_LEN}, decode batch {DECODE_BATCH}"
    )
    keys = list(rows["cpu"])
    print(f"{'backend':<16}" + "".join(f"{k:>16}" for k in keys) + f"{'decode x cpu':>14}")
    for name, row in rows.items():
        ratio = row["decode step s"] / rows["cpu"]["decode step s"]
        print(f"{name:<16}" + "".join(f"{row[k]:>16.3f}" for k in keys) + f"{ratio:>13.1f}x")


if __name__ == "__main__":
    main()
