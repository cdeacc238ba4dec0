"""Micro-benchmark of the kvcache hot paths against their latency targets.

Run: .venv/bin/python bench/bench_kvcache.py [--quick]

1. Hashing + longest-prefix lookup of a 32k-token prompt (block size 64, 512 full blocks): a new
   BlockHashChain is built from the token list and looked up, as at a request's admission.
   - miss: nothing of the prompt is cached (the lookup stops at block 0);
   - full hit: all 512 blocks are cached.
   Target: < 2 ms, i.e. >= 16M tokens/s.
2. allocate(1000) + free(those 1000) in a pool of 2048 blocks.
   - warm: every free block is unhashed (no eviction);
   - cold: every free block is cached, so the allocation evicts 1000 cached blocks (hash-map
     deletes).
   Target: < 1 ms.
   - cold + subscriber: the same with an event subscriber, so also 1000 BlockRemoved events.
     Informational (no target, not counted in the overall result): the 1 ms target is for the
     pool itself; the subscriber's cost is the subscriber's.

Each case runs many times (garbage collection off inside the timed region, as ``timeit`` does);
the table shows the median and the minimum. PASS/FAIL compares the median with the target.
"""

from __future__ import annotations

import argparse
import gc
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import xxhash

from kvcache import BlockHashChain, BlockPool, ExtraKeys, KVCacheEvent, root_hash

BLOCK_SIZE = 64
PROMPT_TOKENS = 32 * 1024
POOL_BLOCKS = 2048
ALLOC_BLOCKS = 1000
LOOKUP_TARGET_S = 2e-3
ALLOC_TARGET_S = 1e-3
ROOT = root_hash(0)
EXTRA = ExtraKeys(cache_salt="bench", model_name="SmolLM2-135M-Instruct")


@dataclass
class Result:
    name: str
    times: list[float]
    target: float | None
    tokens: int | None = None

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def best(self) -> float:
        return min(self.times)


def measure(
    fn: Callable[[], object], setup: Callable[[], object] | None, repeats: int
) -> list[float]:
    times = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        gc.collect()
        gc.disable()
        try:
            start = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - start
        finally:
            gc.enable()
        times.append(elapsed)
    return times


# ---------------------------------------------------------------------------- lookup cases
def hash_and_lookup(pool: BlockPool, token_ids: list[int]) -> list[int]:
    chain = BlockHashChain(BLOCK_SIZE, ROOT, EXTRA)
    chain.update(token_ids)
    return pool.lookup(chain)


def bench_lookup(repeats: int) -> list[Result]:
    rng = random.Random(0)
    token_ids = [rng.randrange(0, 49_152) for _ in range(PROMPT_TOKENS)]
    num_blocks = PROMPT_TOKENS // BLOCK_SIZE

    miss_pool = BlockPool(num_blocks + 1, BLOCK_SIZE)
    # fill the miss pool with other content so the hash map is not empty
    other = BlockHashChain(BLOCK_SIZE, ROOT, EXTRA)
    other.update([t + 1 for t in token_ids])
    register_chain(miss_pool, other)
    assert hash_and_lookup(miss_pool, token_ids) == []

    hit_pool = BlockPool(num_blocks + 1, BLOCK_SIZE)
    chain = BlockHashChain(BLOCK_SIZE, ROOT, EXTRA)
    chain.update(token_ids)
    register_chain(hit_pool, chain)
    assert len(hash_and_lookup(hit_pool, token_ids)) == num_blocks

    def hash_only() -> None:
        BlockHashChain(BLOCK_SIZE, ROOT, EXTRA).update(token_ids)

    return [
        Result(
            "hash+lookup 32k tokens, miss",
            measure(lambda: hash_and_lookup(miss_pool, token_ids), None, repeats),
            LOOKUP_TARGET_S,
            PROMPT_TOKENS,
        ),
        Result(
            "hash+lookup 32k tokens, full hit (512 blk)",
            measure(lambda: hash_and_lookup(hit_pool, token_ids), None, repeats),
            LOOKUP_TARGET_S,
            PROMPT_TOKENS,
        ),
        Result("  of which: hashing only", measure(hash_only, None, repeats), None, PROMPT_TOKENS),
        Result(
            "  of which: lookup only, full hit",
            measure(lambda: hit_pool.lookup(chain), None, repeats),
            None,
            PROMPT_TOKENS,
        ),
    ]


def register_chain(pool: BlockPool, chain: BlockHashChain) -> list[int]:
    table = pool.allocate(chain.num_blocks)
    assert table is not None
    parent: int | None = None
    for i, block_id in enumerate(table):
        # chained onto the id returned for the previous block, as the scheduler does
        parent = pool.register(block_id, chain, i, parent)
        assert parent == block_id
    pool.free(table)
    return table


# ------------------------------------------------------------------------ allocate cases
def alloc_free(pool: BlockPool) -> None:
    table = pool.allocate(ALLOC_BLOCKS)
    assert table is not None
    pool.free(table)


def bench_alloc(repeats: int) -> list[Result]:
    warm = BlockPool(POOL_BLOCKS, BLOCK_SIZE)
    alloc_free(warm)
    warm_times = measure(lambda: alloc_free(warm), None, repeats)
    assert warm.num_cached_blocks == 0
    warm.check_integrity({})

    # one long chain covering every usable block, registered again before each repetition
    rng = random.Random(1)
    chain = BlockHashChain(BLOCK_SIZE, ROOT, EXTRA)
    chain.update([rng.randrange(0, 49_152) for _ in range((POOL_BLOCKS - 1) * BLOCK_SIZE)])

    def cold_case(subscribe: bool) -> list[float]:
        pool = BlockPool(POOL_BLOCKS, BLOCK_SIZE)
        events: list[KVCacheEvent] = []
        if subscribe:
            pool.subscribe(events.append)

        def setup() -> None:
            pool.reset()
            register_chain(pool, chain)
            assert pool.num_cached_blocks == POOL_BLOCKS - 1
            events.clear()

        times = measure(lambda: alloc_free(pool), setup, repeats)
        assert pool.num_cached_blocks == POOL_BLOCKS - 1 - ALLOC_BLOCKS  # it did evict
        assert len(events) == (ALLOC_BLOCKS if subscribe else 0)
        pool.check_integrity({})
        return times

    # breakdown of the cold case: the allocation alone, then the free alone
    split = BlockPool(POOL_BLOCKS, BLOCK_SIZE)
    held: list[int] = []

    def setup_cold() -> None:
        if held:
            split.free(held)
            held.clear()
        split.reset()
        register_chain(split, chain)

    def allocate_only() -> None:
        table = split.allocate(ALLOC_BLOCKS)
        assert table is not None
        held[:] = table

    def setup_free() -> None:
        setup_cold()
        allocate_only()

    def free_only() -> None:
        split.free(held)
        held.clear()

    alloc_times = measure(allocate_only, setup_cold, repeats)
    free_times = measure(free_only, setup_free, repeats)
    split.check_integrity({})

    return [
        Result("alloc+free 1000 blk, warm (no eviction)", warm_times, ALLOC_TARGET_S),
        Result("alloc+free 1000 blk, cold (evicts 1000)", cold_case(False), ALLOC_TARGET_S),
        Result("  of which: allocate(1000), cold", alloc_times, None),
        Result("  of which: free(1000)", free_times, None),
        # informational: the target is for the pool itself, not for its subscribers
        Result("alloc+free 1000 blk, cold + subscriber", cold_case(True), None),
    ]


# ---------------------------------------------------------------------------------- report
def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:8.3f} ms"


def report(results: list[Result], repeats: dict[str, int]) -> bool:
    print(
        f"kvcache benchmark: Python {platform.python_version()} ({platform.machine()}), "
        f"xxhash {xxhash.VERSION}, {platform.processor() or platform.platform()}"
    )
    print(
        f"block size {BLOCK_SIZE}; lookup: {PROMPT_TOKENS} tokens, {repeats['lookup']} runs; "
        f"alloc: pool {POOL_BLOCKS} blocks, {ALLOC_BLOCKS} blocks, {repeats['alloc']} runs"
    )
    header = (
        f"{'case':44} {'median':>11} {'min':>11} {'tokens/s (median)':>18}  {'target':>10}  result"
    )
    print(header)
    print("-" * len(header))
    all_pass = True
    for r in results:
        rate = f"{r.tokens / r.median / 1e6:14.1f} M" if r.tokens else ""
        if r.target is None:
            target, verdict = "", ""
        else:
            target = f"< {r.target * 1e3:g} ms"
            ok = r.median < r.target
            all_pass &= ok
            verdict = "PASS" if ok else "FAIL"
        print(
            f"{r.name:44} {fmt_ms(r.median):>11} {fmt_ms(r.best):>11} {rate:>18}  {target:>10}  {verdict}"
        )
    print(f"(lookup target < 2 ms = >= {PROMPT_TOKENS / LOOKUP_TARGET_S / 1e6:.1f}M tokens/s)")
    print("(cold + subscriber: informational, includes 1000 BlockRemoved events; not counted)")
    print("overall:", "PASS" if all_pass else "FAIL")
    return all_pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = parser.parse_args()
    repeats = {"lookup": 50, "alloc": 30} if args.quick else {"lookup": 300, "alloc": 200}
    results = bench_lookup(repeats["lookup"]) + bench_alloc(repeats["alloc"])
    return 0 if report(results, repeats) else 1


if __name__ == "__main__":
    sys.exit(main())
