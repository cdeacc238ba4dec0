"""Issue 6, targets 2 and 3, against a running spyre-server (over HTTP, with the bench tool's
client): what a shared 1536-token prefix buys.

- ``ttft``: one request at a time. cold(1600) and cold(1344) after a cache reset, and a warm
  request (1536 cached + 64 new); the warm TTFT must be at most 1.25x cold(1600) - cold(1344),
  the cost of the one chunk the warm request computes, as measured inside a cold run of the same
  prompt (same tokens, same context length). Medians of ``--reps`` rounds.
- ``burst``: eight concurrent requests sharing the prefix (64 new tokens each, 16 out): wall time
  from a cold cache (target < 6 s: the prefix is computed once) and with the prefix cached
  (target < 4 s).

Start the server first (2 threads, default chunk 256), then:

    .venv/bin/spyre-server serve --port 8000 &
    .venv/bin/python bench/shared_prefix.py --base-url http://127.0.0.1:8000

It resets the server's prefix cache (``POST /reset_prefix_cache``) before every cold run.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
from pathlib import Path

import httpx

from spyre_server.benchmark.client import fetch_model_ids
from spyre_server.benchmark.runner import RunOutcome, RunSettings, run_benchmark
from spyre_server.benchmark.tokenizer import load_tokenizer, ordinary_token_ids
from spyre_server.benchmark.workloads import Conversation

PREFIX_LEN = 1536
SUFFIX_LEN = 64
CHUNK = 256
BURST = 8
BURST_OUTPUT_LEN = 16
WARM_RATIO_TARGET = 1.25
BURST_COLD_TARGET_S = 6.0
BURST_WARM_TARGET_S = 4.0


class Client:
    def __init__(self, base_url: str, vocab: list[int], seed: int) -> None:
        self.base_url = base_url
        self.model = fetch_model_ids(base_url, None, 30)[0]
        self.vocab = vocab
        self.rng = random.Random(seed)

    def tokens(self, n: int) -> tuple[int, ...]:
        return tuple(self.rng.choice(self.vocab) for _ in range(n))

    def reset_cache(self) -> None:
        httpx.post(f"{self.base_url}/reset_prefix_cache", timeout=30).raise_for_status()

    def run(self, prompts: list[tuple[int, ...]], output_len: int) -> RunOutcome:
        settings = RunSettings(self.base_url, self.model, show_progress=False)
        conversations = [Conversation(0, (p,), output_len) for p in prompts]
        outcome = asyncio.run(run_benchmark(settings, conversations, lambda text: []))
        failed = [r.completion.error for r in outcome.results if not r.completion.ok]
        if failed:
            raise SystemExit(f"{len(failed)} request(s) failed: {failed[0]}")
        return outcome

    def ttft(self, prompt: tuple[int, ...]) -> tuple[float, int]:
        """(TTFT in s, cached tokens) of one request sent alone."""
        completion = self.run([prompt], 1).results[0].completion
        assert completion.ttft_s is not None
        return completion.ttft_s, completion.num_cached_tokens or 0


def bench_ttft(client: Client, reps: int) -> bool:
    print(f"== TTFT, one request at a time: {PREFIX_LEN}-token prefix + {SUFFIX_LEN} new tokens ==")
    rounds = []
    for _ in range(reps + 1):  # the first round is a warm-up
        prompt = client.tokens(PREFIX_LEN + SUFFIX_LEN)
        client.reset_cache()
        cold_full, _ = client.ttft(prompt)
        client.reset_cache()
        cold_part, _ = client.ttft(prompt[: PREFIX_LEN + SUFFIX_LEN - CHUNK])
        client.reset_cache()
        client.run([prompt[:PREFIX_LEN] + client.tokens(SUFFIX_LEN)], 1)  # caches the prefix
        warm, cached = client.ttft(prompt)
        rounds.append((cold_full, cold_part, warm, cached))
    rounds = rounds[1:]
    cold_full = statistics.median(r[0] for r in rounds)
    cold_part = statistics.median(r[1] for r in rounds)
    warm = statistics.median(r[2] for r in rounds)
    ratio = statistics.median(r[2] / (r[0] - r[1]) for r in rounds)
    total = PREFIX_LEN + SUFFIX_LEN
    print(f"cold TTFT, {total} tokens                  {cold_full:7.3f} s")
    print(f"cold TTFT, {total - CHUNK} tokens                  {cold_part:7.3f} s")
    print(f"cold cost of the last chunk (difference)  {cold_full - cold_part:7.3f} s")
    print(f"warm TTFT, {PREFIX_LEN} cached (cached_tokens {rounds[0][3]})  {warm:7.3f} s")
    ok = ratio <= WARM_RATIO_TARGET
    print(
        f"warm / cold chunk cost                    {ratio:7.2f}x "
        f"(target <= {WARM_RATIO_TARGET}x: {'PASS' if ok else 'FAIL'}); cold / warm "
        f"{cold_full / warm:.1f}x"
    )
    return ok


def bench_burst(client: Client) -> bool:
    print(
        f"\n== {BURST} concurrent requests sharing a {PREFIX_LEN}-token prefix, {SUFFIX_LEN} new "
        f"tokens each, {BURST_OUTPUT_LEN} out =="
    )
    prefix = client.tokens(PREFIX_LEN)
    ok = True
    for label, target in (
        ("cold cache", BURST_COLD_TARGET_S),
        ("prefix cached", BURST_WARM_TARGET_S),
    ):
        if label == "cold cache":
            client.reset_cache()
        outcome = client.run(
            [prefix + client.tokens(SUFFIX_LEN) for _ in range(BURST)], BURST_OUTPUT_LEN
        )
        ttfts = sorted(r.completion.ttft_s or 0.0 for r in outcome.results)
        cached = sum(r.completion.num_cached_tokens or 0 for r in outcome.results)
        tokens = sum(r.completion.num_output_tokens for r in outcome.results)
        passed = outcome.duration_s < target and tokens == BURST * BURST_OUTPUT_LEN
        ok &= passed
        print(
            f"{label:<14} {len(outcome.results)}/{BURST} complete, {tokens} tokens out, wall "
            f"{outcome.duration_s:6.2f} s (target < {target:.0f} s: {'PASS' if passed else 'FAIL'}), "
            f"TTFT min/median/max {ttfts[0]:.2f}/{statistics.median(ttfts):.2f}/{ttfts[-1]:.2f} s, "
            f"cached_tokens {cached}"
        )
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--tokenizer", type=Path, default=None)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sections", default="ttft,burst")
    args = parser.parse_args()
    vocab = ordinary_token_ids(load_tokenizer(args.tokenizer))
    client = Client(args.base_url.rstrip("/"), vocab, args.seed)
    sections = args.sections.split(",")
    results = []
    if "ttft" in sections:
        results.append(bench_ttft(client, args.reps))
    if "burst" in sections:
        results.append(bench_burst(client))
    sys.exit(0 if all(results) else 1)


if __name__ == "__main__":
    main()
