"""DESIGN §7 reference scenarios and further scheduler behaviours, checked step by step.

Block ids are deterministic: the pool's free queue starts as [1, 2, 3, ...] and allocations take
from its front; a released block goes to the back if it is cached, to the front if not, and a
block table is released tail first. The expectations below are derived by hand from these rules.
``r(a, b)`` is the slot range a..b-1: slots below 64 are block 0 (computed, not stored). Labels:
``"a:1"`` is prefill chunk 1 of request a, ``"D:a,b"`` one decode step of a and b.
The Driver checks the pool's integrity (every reference accounted for) after every step.
"""

from __future__ import annotations

import pytest

from scheduler import (
    FinishReason,
    ModelRunnerOutput,
    PrefillCompute,
    RequestOutput,
    RequestStatus,
    Scheduler,
    SchedulerStats,
)
from tests.scheduler.fake_runner import (
    Driver,
    FakeRunner,
    default_next_token,
    free_queue,
    hashed,
    make_scheduler,
    r,
    refs,
    toks,
)

LENGTH = FinishReason.LENGTH
STOP = FinishReason.STOP


def stats(d: Driver) -> SchedulerStats:
    return d.sched.make_stats()


def counters(d: Driver) -> tuple[int, int, int, int, int, int]:
    """(queries, hits, chunks computed, chunks skipped, decode steps, preemptions)."""
    s = d.sched.make_stats()
    return (
        s.prefix_cache_queries,
        s.prefix_cache_hits,
        s.num_prefill_chunks_computed,
        s.num_prefill_chunks_skipped,
        s.num_decode_steps,
        s.num_preemptions,
    )


def expected_tokens(prompt: list[int], n: int) -> list[int]:
    """What an undisturbed model generates: each token from the whole sequence before it."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(default_next_token(seq))
    return seq[len(prompt) :]


# =============================================================================== scenario 1
def test_scenario_01_identical_192_token_prompts_chunk_128() -> None:
    # L = 192, C = 128: 2 chunks, 1 block of left padding; chunk 0 = [0, 64), chunk 1 = [64, 192)
    d = Driver(make_scheduler(chunk_size=128, num_blocks=16))
    prompt = toks(192, 1000)
    d.add("a", prompt, 4)
    d.add("b", prompt, 4)
    sched = d.sched

    s = d.step()  # a admitted: blocks 1, 2, 3 (front of the free queue)
    assert s.label == "a:0"
    assert s.slots == r(64, 128)  # tokens 0..63 -> block 1
    assert s.block_tables == {"a": (1, 2, 3)}
    assert (s.step.window_offset, s.step.num_left_pad_tokens, s.step.tkv) == (64, 64, 128)
    assert hashed(sched, 1, 2, 3) == [True, False, False]  # block 1 fully computed

    s = d.step()
    assert s.label == "a:1"
    assert s.slots == r(128, 256)  # tokens 64..191 -> blocks 2, 3
    assert s.step.is_last_chunk and s.step.tkv == 256
    assert hashed(sched, 1, 2, 3) == [True, True, True]

    s = d.step()  # a's token at position 192 needs a 4th block
    assert s.label == "D:a"
    assert s.slots == (4 * 64 + 0,)
    assert s.block_tables == {"a": (1, 2, 3, 4)}

    s = d.step()  # b starts its prefill only now: shares all 3 blocks, skips chunk 0
    assert s.label == "b:1"
    assert s.block_tables == {"b": (1, 2, 3)}
    assert refs(sched, 1, 2, 3, 4) == [2, 2, 2, 1]
    assert s.slots == r(0, 64) + r(0, 64)  # tokens 64..191 are cached: written to block 0
    assert s.outputs[0].num_cached_tokens == 64
    assert free_queue(sched) == r(5, 16)

    s = d.step()
    assert s.label == "D:a,b"
    assert s.positions == (193, 192)
    assert s.step.tkv == 194  # the longest context: a's position 193 + 1
    assert s.slots == (4 * 64 + 1, 5 * 64 + 0)  # b grows into block 5
    assert s.block_tables == {"a": (1, 2, 3, 4), "b": (1, 2, 3, 5)}

    s = d.step()  # a's 4th token: a finishes, its unhashed block 4 goes to the front
    assert s.label == "D:a,b"
    assert d.finish == {"a": LENGTH}
    assert refs(sched, 1, 2, 3, 4, 5) == [1, 1, 1, 0, 1]
    assert free_queue(sched) == (4, *r(6, 16))

    assert d.run() == ["D:b"]
    assert d.finish == {"a": LENGTH, "b": LENGTH}
    assert free_queue(sched) == (5, 4, *r(6, 16), 3, 2, 1)
    assert d.tokens["a"] == d.tokens["b"] == expected_tokens(prompt, 4)
    assert d.cached == {"a": 0, "b": 64}
    assert counters(d) == (384, 64, 3, 1, 4, 0)


# =============================================================================== scenario 2
def test_scenario_02_identical_70_token_prompts_chunk_128() -> None:
    # L = 70, C = 128: 1 chunk, no padding; only 1 full block -> shared, never usable
    d = Driver(make_scheduler(chunk_size=128, num_blocks=16))
    prompt = toks(70, 1000)
    d.add("a", prompt, 3)
    d.add("b", prompt, 3)
    sched = d.sched

    s = d.step()
    assert s.label == "a:0"
    assert s.slots == r(64, 134)  # tokens 0..63 -> block 1, 64..69 -> block 2
    assert s.block_tables == {"a": (1, 2)}
    assert hashed(sched, 1, 2) == [True, False]

    s = d.step()
    assert (s.label, s.slots) == ("D:a", (2 * 64 + 6,))

    s = d.step()  # b hits block 1 (ref 2) but must compute its only chunk
    assert s.label == "b:0"
    assert s.block_tables == {"b": (1, 3)}
    assert refs(sched, 1, 2, 3) == [2, 1, 1]
    assert s.slots == r(0, 64) + r(192, 198)  # the shared block's recomputation -> block 0
    assert s.outputs[0].num_cached_tokens == 0

    s = d.step()  # a finishes (3 tokens)
    assert (s.label, s.slots) == ("D:a,b", (2 * 64 + 7, 3 * 64 + 6))
    assert free_queue(sched) == (2, *r(4, 16))

    assert d.run() == ["D:b"]
    assert free_queue(sched) == (3, 2, *r(4, 16), 1)
    assert d.tokens["a"] == d.tokens["b"] == expected_tokens(prompt, 3)
    assert d.cached == {"a": 0, "b": 0}
    assert counters(d) == (140, 0, 2, 0, 3, 0)


# =============================================================================== scenario 3
def test_scenario_03_hit_on_block_filled_by_prefill_and_decode() -> None:
    # C = 64: a's 100-token prompt fills block 2 with positions 64..99 by prefill and 100..127
    # by decode. b's prompt is a's prompt + a's 60 outputs (160 tokens).
    d = Driver(make_scheduler(chunk_size=64, num_blocks=16))
    prompt = toks(100, 1000)
    d.add("a", prompt, 60)
    labels = d.run()
    assert labels == ["a:0", "a:1"] + ["D:a"] * 59
    sched = d.sched
    # a ends with 160 tokens, 159 computed: blocks 1 (prefill) and 2 (mixed) cached, 3 partial
    assert free_queue(sched) == (3, *r(4, 16), 2, 1)
    assert d.trace[29].step.entries[0].position == 127  # the step that completed block 2

    b_prompt = prompt + d.tokens["a"]
    d.add("b", b_prompt, 1)
    assert sched.pool.lookup(sched.get_request("b").chain) == [1, 2]
    s = d.step()
    # L = 160, C = 64: 3 chunks; 2 hits, usable min(2, 3 - 1) = 2 -> only chunk 2 runs
    assert s.label == "b:2"
    assert s.block_tables == {"b": (1, 2, 3)}
    assert s.slots == r(192, 224)  # tokens 128..159 -> block 3
    assert s.outputs[0].num_cached_tokens == 128
    assert d.tokens["b"] == [default_next_token(b_prompt)]
    assert counters(d) == (260, 128, 3, 2, 59, 0)


# =============================================================================== scenario 4
def test_scenario_04_same_prompt_after_first_finished() -> None:
    d = Driver(make_scheduler(chunk_size=128, num_blocks=16))
    prompt = toks(192, 1000)
    d.add("a", prompt, 1)
    assert d.run() == ["a:0", "a:1"]
    sched = d.sched
    # released tail first, all cached -> to the back in order 3, 2, 1
    assert free_queue(sched) == (*r(4, 16), 3, 2, 1)
    assert refs(sched, 1, 2, 3) == [0, 0, 0]

    d.add("b", prompt, 2)
    s = d.step()  # hits on free-but-cached blocks: they leave the free queue
    assert s.label == "b:1"
    assert s.block_tables == {"b": (1, 2, 3)}
    assert refs(sched, 1, 2, 3) == [1, 1, 1]
    assert free_queue(sched) == r(4, 16)
    assert s.slots == r(0, 64) + r(0, 64)
    assert s.outputs[0].num_cached_tokens == 64

    s = d.step()
    assert (s.label, s.slots) == ("D:b", (4 * 64,))
    assert d.finish["b"] == LENGTH
    assert free_queue(sched) == (4, *r(5, 16), 3, 2, 1)
    assert d.tokens["b"] == expected_tokens(prompt, 2)
    assert d.tokens["a"] == d.tokens["b"][:1]
    assert counters(d) == (384, 64, 3, 1, 1, 0)


# =============================================================================== scenario 5
def test_scenario_05_eviction_with_too_few_blocks() -> None:
    # 4 usable blocks. a (192 tokens) caches 1, 2, 3; c (200 tokens) needs 4 and evicts them.
    d = Driver(make_scheduler(chunk_size=128, num_blocks=5))
    prompt = toks(192, 1000)
    d.add("a", prompt, 1)  # reserves ceil(193/64) = 4 blocks
    d.add("c", toks(200, 5000), 1)  # reserves ceil(201/64) = 4 blocks
    d.add("b", prompt, 1)
    sched = d.sched

    assert [d.step().label for _ in range(2)] == ["a:0", "a:1"]
    assert free_queue(sched) == (4, 3, 2, 1)
    assert sched.pool.num_cached_blocks == 3

    s = d.step()  # c takes the whole free queue, evicting a's blocks 3, 2, 1
    assert s.label == "c:0"
    assert s.block_tables == {"c": (4, 3, 2, 1)}
    assert s.slots == r(256, 320) + r(192, 256)  # tokens 0..127 -> blocks 4, 3
    s = d.step()
    assert s.label == "c:1"
    assert s.slots == r(128, 192) + r(64, 72)  # tokens 128..199 -> blocks 2, 1
    # c cached its 3 full blocks; 1 (partial) goes to the front
    assert free_queue(sched) == (1, 2, 3, 4)
    assert hashed(sched, 1, 2, 3, 4) == [False, True, True, True]

    assert sched.pool.lookup(sched.get_request("b").chain) == []
    s = d.step()  # no hit: b computes chunk 0
    assert s.label == "b:0"
    assert s.block_tables == {"b": (1, 2, 3)}
    assert s.slots == r(64, 128)
    assert d.run() == ["b:1"]
    assert d.cached == {"a": 0, "c": 0, "b": 0}
    assert d.tokens["b"] == d.tokens["a"]
    assert counters(d) == (584, 0, 6, 0, 0, 0)


def test_scenario_05_enough_blocks_keeps_the_hit() -> None:
    d = Driver(make_scheduler(chunk_size=128, num_blocks=9))
    prompt = toks(192, 1000)
    d.add("a", prompt, 1)
    d.add("c", toks(200, 5000), 1)
    d.add("b", prompt, 1)
    sched = d.sched

    assert [d.step().label for _ in range(2)] == ["a:0", "a:1"]
    assert free_queue(sched) == (4, 5, 6, 7, 8, 3, 2, 1)

    s = d.step()
    assert s.label == "c:0"
    assert s.block_tables == {"c": (4, 5, 6, 7)}
    assert s.slots == r(256, 384)
    s = d.step()
    assert s.label == "c:1"
    assert s.slots == r(384, 448) + r(448, 456)
    assert free_queue(sched) == (7, 8, 3, 2, 1, 6, 5, 4)

    assert sched.pool.lookup(sched.get_request("b").chain) == [1, 2, 3]
    s = d.step()
    assert s.label == "b:1"
    assert s.block_tables == {"b": (1, 2, 3)}
    assert s.slots == r(0, 64) + r(0, 64)
    assert free_queue(sched) == (7, 8, 6, 5, 4, 3, 2, 1)  # b finished: back again
    assert d.cached == {"a": 0, "c": 0, "b": 64}
    assert d.tokens["b"] == d.tokens["a"]
    assert counters(d) == (584, 64, 5, 1, 0, 0)


# =============================================================================== scenario 6
def test_scenario_06_prompts_a_a_b_a_share_a_block_three_ways() -> None:
    # C = 64, 100-token prompts: 2 chunks; a repeat hits block 1 (1 full block), usable 1.
    d = Driver(make_scheduler(chunk_size=64, num_blocks=32))
    prompt_a, prompt_b = toks(100, 1000), toks(100, 2000)
    for rid, prompt in (("r1", prompt_a), ("r2", prompt_a), ("r3", prompt_b), ("r4", prompt_a)):
        d.add(rid, prompt, 6)
    sched = d.sched

    expected = [
        # label, slots, block tables
        ("r1:0", r(64, 128), {"r1": (1, 2)}),
        ("r1:1", r(128, 164), {"r1": (1, 2)}),
        ("D:r1", (164,), {"r1": (1, 2)}),
        ("r2:1", r(192, 228), {"r2": (1, 3)}),
        ("D:r1,r2", (165, 228), {"r1": (1, 2), "r2": (1, 3)}),
        ("r3:0", r(256, 320), {"r3": (4, 5)}),
        ("D:r1,r2", (166, 229), {"r1": (1, 2), "r2": (1, 3)}),
        ("r3:1", r(320, 356), {"r3": (4, 5)}),
        ("D:r1,r2,r3", (167, 230, 356), {"r1": (1, 2), "r2": (1, 3), "r3": (4, 5)}),
        ("r4:1", r(384, 420), {"r4": (1, 6)}),
    ]
    for label, slots, tables in expected:
        s = d.step()
        assert (s.label, s.slots, s.block_tables) == (label, slots, tables)
    assert refs(sched, 1, 2, 3, 4, 5, 6) == [3, 1, 1, 1, 1, 1]

    s = d.step()  # r1 gets its 6th token and finishes
    assert (s.label, s.slots) == ("D:r1,r2,r3,r4", (168, 231, 357, 420))
    assert refs(sched, 1, 2) == [2, 0]
    s = d.step()
    assert (s.label, s.slots) == ("D:r2,r3,r4", (232, 358, 421))
    assert refs(sched, 1, 3) == [1, 0]
    assert d.run() == ["D:r3,r4", "D:r3,r4", "D:r4"]
    assert free_queue(sched) == (6, 5, 3, 2, *r(7, 32), 4, 1)
    assert d.tokens["r1"] == d.tokens["r2"] == d.tokens["r4"] == expected_tokens(prompt_a, 6)
    assert d.tokens["r3"] == expected_tokens(prompt_b, 6)
    assert d.cached == {"r1": 0, "r2": 64, "r3": 0, "r4": 64}
    assert counters(d) == (400, 128, 6, 2, 9, 0)


# =============================================================================== scenario 7
def test_scenario_07_384_token_prompt_twice_chunk_128() -> None:
    # L = 384, C = 128: 3 chunks, no padding. 6 hits, usable min(6 // 2, 2) * 2 = 4 blocks.
    d = Driver(make_scheduler(chunk_size=128, num_blocks=32))
    prompt = toks(384, 1000)
    d.add("a", prompt, 3)
    d.add("b", prompt, 3)
    sched = d.sched
    usable = 31

    def gauges() -> tuple[int, int, float]:
        s = stats(d)
        return s.num_running, s.num_waiting, s.kv_cache_usage

    s = d.step()
    assert (s.label, s.slots, s.block_tables) == ("a:0", r(64, 192), {"a": (1, 2, 3, 4, 5, 6)})
    assert counters(d) == (384, 0, 1, 0, 0, 0)
    assert gauges() == (1, 1, 6 / usable)
    s = d.step()
    assert (s.label, s.slots) == ("a:1", r(192, 320))
    assert counters(d) == (384, 0, 2, 0, 0, 0)  # the admission is counted once
    s = d.step()
    assert (s.label, s.slots) == ("a:2", r(320, 448))
    assert hashed(sched, 1, 2, 3, 4, 5, 6) == [True] * 6
    s = d.step()
    assert (s.label, s.slots, s.block_tables) == ("D:a", (448,), {"a": (1, 2, 3, 4, 5, 6, 7)})
    assert counters(d) == (384, 0, 3, 0, 1, 0)
    assert gauges() == (1, 1, 7 / usable)

    s = d.step()  # all 6 shared, chunks 0 and 1 skipped, the last recomputed into block 0
    assert s.label == "b:2"
    assert s.block_tables == {"b": (1, 2, 3, 4, 5, 6)}
    assert refs(sched, 1, 2, 3, 4, 5, 6, 7) == [2, 2, 2, 2, 2, 2, 1]
    assert s.slots == r(0, 64) + r(0, 64)
    assert s.outputs[0].num_cached_tokens == 256
    assert counters(d) == (768, 256, 4, 2, 1, 0)
    assert gauges() == (2, 0, 7 / usable)

    s = d.step()  # a finishes; b grows into block 8
    assert (s.label, s.slots) == ("D:a,b", (449, 512))
    assert counters(d) == (768, 256, 4, 2, 2, 0)
    assert gauges() == (1, 0, 7 / usable)
    assert d.run() == ["D:b"]
    assert gauges() == (0, 0, 0.0)
    assert free_queue(sched) == (8, 7, *r(9, 32), 6, 5, 4, 3, 2, 1)
    assert d.tokens["a"] == d.tokens["b"] == expected_tokens(prompt, 3)
    assert counters(d) == (768, 256, 4, 2, 3, 0)


# =============================================================================== scenario 8
def test_scenario_08_shared_254_tokens_three_hits_two_usable() -> None:
    d = Driver(make_scheduler(chunk_size=128, num_blocks=32))
    prompt_a = toks(384, 1000)
    prompt_b = prompt_a[:254] + toks(130, 9000)  # blocks 0..2 equal, block 3 differs at 254
    d.add("a", prompt_a, 3)
    d.add("b", prompt_b, 1)
    sched = d.sched
    assert [d.step().label for _ in range(4)] == ["a:0", "a:1", "a:2", "D:a"]

    s = d.step()  # 3 hits; usable min(3 // 2, 2) * 2 = 2: chunk 0 skipped
    assert s.label == "b:1"
    assert s.block_tables == {"b": (1, 2, 3, 8, 9, 10)}
    assert refs(sched, 1, 2, 3, 4) == [2, 2, 2, 1]
    # tokens 128..191 (block 3, a hit) -> block 0; tokens 192..255 -> block 8
    assert s.slots == r(0, 64) + r(512, 576)
    assert not s.step.is_last_chunk
    assert hashed(sched, 8, 9, 10) == [True, False, False]

    s = d.step()
    assert (s.label, s.slots) == ("D:a", (449,))
    assert d.finish == {"a": LENGTH}
    assert free_queue(sched) == (7, *r(11, 32), 6, 5, 4)

    s = d.step()
    assert s.label == "b:2"
    assert s.slots == r(576, 704)
    assert d.cached == {"a": 0, "b": 128}
    assert free_queue(sched) == (7, *r(11, 32), 6, 5, 4, 10, 9, 8, 3, 2, 1)
    assert d.tokens["b"] == expected_tokens(prompt_b, 1)
    assert counters(d) == (768, 128, 5, 1, 2, 0)


# =============================================================================== scenario 9
def test_scenario_09_shared_256_tokens_four_hits_all_usable() -> None:
    d = Driver(make_scheduler(chunk_size=128, num_blocks=32))
    prompt_a = toks(384, 1000)
    prompt_b = prompt_a[:256] + toks(128, 9000)
    d.add("a", prompt_a, 3)
    d.add("b", prompt_b, 1)
    sched = d.sched
    assert [d.step().label for _ in range(4)] == ["a:0", "a:1", "a:2", "D:a"]

    s = d.step()  # 4 hits, usable min(4 // 2, 2) * 2 = 4: only chunk 2 runs, nothing to block 0
    assert s.label == "b:2"
    assert s.block_tables == {"b": (1, 2, 3, 4, 8, 9)}
    assert refs(sched, 1, 2, 3, 4, 5) == [1, 1, 1, 1, 1]  # b finished at once (max_tokens 1)
    assert s.slots == r(512, 640)
    assert s.outputs[0].num_cached_tokens == 256
    assert free_queue(sched) == (*r(10, 32), 9, 8)

    assert d.run() == ["D:a"]
    assert free_queue(sched) == (7, *r(10, 32), 9, 8, 6, 5, 4, 3, 2, 1)
    assert d.tokens["b"] == expected_tokens(prompt_b, 1)
    assert counters(d) == (768, 256, 4, 2, 2, 0)


# ============================================================================== scenario 10
def test_scenario_10_chunk_192_hit_with_no_usable_block() -> None:
    # a: L = 64, C = 192: 1 chunk, 2 blocks of padding. b: L = 320: 2 chunks, 1 block of padding;
    # 1 hit, usable max(0, min((1 + 1) // 3, 1) * 3 - 1) = 0.
    d = Driver(make_scheduler(chunk_size=192, num_blocks=32))
    prompt_a = toks(64, 1000)
    prompt_b = prompt_a + toks(256, 7000)
    d.add("a", prompt_a, 3)
    d.add("b", prompt_b, 1)
    sched = d.sched

    s = d.step()
    assert (s.label, s.slots, s.block_tables) == ("a:0", r(64, 128), {"a": (1,)})
    assert (s.step.window_offset, s.step.num_left_pad_tokens, s.step.tkv) == (128, 128, 192)
    s = d.step()
    assert (s.label, s.slots, s.block_tables) == ("D:a", (128,), {"a": (1, 2)})

    s = d.step()  # chunk 0 recomputed: the cached block 1 written to block 0
    assert s.label == "b:0"
    assert s.block_tables == {"b": (1, 3, 4, 5, 6)}
    assert refs(sched, 1) == [2]
    assert s.slots == r(0, 64) + r(192, 256)
    assert (s.step.window_offset, s.step.num_left_pad_tokens) == (64, 64)
    assert s.step.token_ids == tuple(prompt_b[:128])

    s = d.step()
    assert (s.label, s.slots) == ("D:a", (129,))
    assert d.finish == {"a": LENGTH}
    s = d.step()
    assert (s.label, s.slots) == ("b:1", r(256, 448))
    assert d.cached == {"a": 0, "b": 0}
    assert free_queue(sched) == (2, *r(7, 32), 6, 5, 4, 3, 1)
    assert d.tokens["b"] == expected_tokens(prompt_b, 1)
    assert counters(d) == (384, 0, 3, 0, 2, 0)


# ============================================================================== scenario 11
@pytest.mark.parametrize(
    ("limit", "admitted_early"),
    [
        # r2 (192-token prompt, 64 cached, max_tokens 4) next to r1 (64 + 20): the widest tables,
        # in whole blocks, 192 + 4 - 1 -> 256 and 64 + 20 - 1 -> 128: full check 2 * 256 = 512;
        # uncached-only would be 2 * (128 + 4 - 1 -> 192) = 384
        (400, False),  # 384 <= 400 < 512: blocked only if the full prompt is used
        (511, False),
        (512, True),
    ],
)
def test_scenario_11_hit_making_first_chunk_last_still_obeys_tkv_limit(
    limit: int, admitted_early: bool
) -> None:
    d = Driver(make_scheduler(chunk_size=128, num_blocks=32, max_batch_tkv_limit=limit))
    prompt = toks(192, 1000)
    d.add("p", prompt, 1)  # caches blocks 1, 2, 3 and finishes at once
    d.add("r1", toks(64, 3000), 20)
    d.add("r2", prompt, 4)
    sched = d.sched
    assert [d.step().label for _ in range(4)] == ["p:0", "p:1", "r1:0", "D:r1"]
    assert counters(d)[:2] == (256, 0)

    if admitted_early:
        s = d.step()
        assert s.label == "r2:1"
        assert s.step.is_last_chunk
        assert s.block_tables == {"r2": (1, 2, 3)}
        assert d.run()[:2] == ["D:r1,r2", "D:r1,r2"]
    else:
        # r2 waits while r1 makes its other 18 decode steps; failed attempts are not counted
        assert [d.step().label for _ in range(18)] == ["D:r1"] * 18
        assert counters(d)[:2] == (256, 0)
        assert d.finish == {"p": LENGTH, "r1": LENGTH}
        assert stats(d).num_waiting == 1
        assert free_queue(sched) == (5, *r(6, 32), 3, 2, 1, 4)
        s = d.step()  # the first scheduled chunk of r2 is its last one
        assert s.label == "r2:1"
        assert s.step.is_last_chunk
        assert s.block_tables == {"r2": (1, 2, 3)}
        assert s.slots == r(0, 64) + r(0, 64)
        assert d.run() == ["D:r2"] * 3
    assert d.cached["r2"] == 64
    assert d.tokens["r2"] == expected_tokens(prompt, 4)
    assert d.tokens["r1"] == expected_tokens(toks(64, 3000), 20)
    assert counters(d)[:2] == (448, 64)


# ============================================================================== scenario 12
@pytest.mark.parametrize("in_flight", [False, True])
def test_scenario_12_abort_part_way_through_prefill(in_flight: bool) -> None:
    # L = 384, C = 128: 3 chunks on blocks 1..6. Chunk 0 completes (blocks 1, 2); then abort,
    # either between steps or while chunk 1 is being executed.
    d = Driver(make_scheduler(chunk_size=128, num_blocks=16))
    prompt = toks(384, 1000)
    d.add("a", prompt, 5)
    sched = d.sched
    assert d.step().label == "a:0"
    assert hashed(sched, 1, 2, 3, 4) == [True, True, False, False]

    if in_flight:
        step = sched.schedule()
        assert step is not None and step.chunk_index == 1
        result = d.runner.execute(step)
    out = sched.finish_request("a")
    assert out is not None
    assert (out.finish_reason, out.new_token_ids, out.num_cached_tokens) == (
        FinishReason.ABORT,
        (),
        0,
    )
    if in_flight:
        assert sched.update_from_output(step, result) == []
    sched.check_integrity()
    assert not sched.has_unfinished_requests
    assert sched.get_request("a") is None
    assert sched.finish_request("a") is None
    # unhashed blocks 6, 5, 4, 3 to the front (6 first), cached 2, 1 to the back
    assert free_queue(sched) == (3, 4, 5, 6, *r(7, 16), 2, 1)
    assert hashed(sched, 1, 2, 3, 4, 5, 6) == [True, True, False, False, False, False]
    assert sched.pool.num_cached_blocks == 2
    assert sched.schedule() is None

    d.add("b", prompt, 1)
    assert sched.pool.lookup(sched.get_request("b").chain) == [1, 2]
    s = d.step()  # 2 hits, usable min(2 // 2, 2) * 2 = 2: chunk 0 skipped
    assert s.label == "b:1"
    assert s.block_tables == {"b": (1, 2, 3, 4, 5, 6)}
    assert s.slots == r(192, 320)
    assert d.run() == ["b:2"]
    assert d.cached == {"b": 128}
    assert counters(d) == (768, 128, 4 if in_flight else 3, 1, 0, 0)


def test_abort_releases_shared_blocks_and_waiting_requests() -> None:
    d = Driver(make_scheduler(chunk_size=128, num_blocks=16))
    prompt = toks(384, 1000)
    d.add("a", prompt, 5)
    d.add("b", prompt, 5)
    d.add("c", toks(64, 3000), 5)
    sched = d.sched
    assert [d.step().label for _ in range(5)] == ["a:0", "a:1", "a:2", "D:a", "b:2"]
    assert refs(sched, 1, 2, 3, 4, 5, 6, 7) == [2, 2, 2, 2, 2, 2, 1]
    out = sched.finish_request("c")  # still waiting: never admitted, never counted
    assert out is not None and out.finish_reason is FinishReason.ABORT
    assert stats(d).num_waiting == 0
    sched.finish_request("a")  # decoding: its own block 7 freed, shared ones keep b
    sched.check_integrity()
    assert refs(sched, 1, 2, 3, 4, 5, 6, 7) == [1, 1, 1, 1, 1, 1, 0]
    assert free_queue(sched) == (7, *r(8, 16))
    assert d.run() == ["D:b"] * 4
    assert counters(d)[:2] == (768, 256)


# ================================================================== interleave / caching flags
@pytest.mark.parametrize(
    ("interleave", "labels", "tables"),
    [
        (
            True,
            ["r1:0", "D:r1", "r2:0", "D:r1", "r2:1", "D:r1", "r2:2", "D:r2"],
            {"r1": (1, 2), "r2": (3, 4, 5, 6, 7, 8, 2)},  # r1's unhashed block 2 comes first
        ),
        (
            False,  # every prefill first, then decode
            ["r1:0", "r2:0", "r2:1", "r2:2", "D:r1,r2", "D:r1", "D:r1"],
            {"r1": (1, 8), "r2": (2, 3, 4, 5, 6, 7, 9)},
        ),
    ],
)
def test_interleave(
    interleave: bool, labels: list[str], tables: dict[str, tuple[int, ...]]
) -> None:
    d = Driver(make_scheduler(chunk_size=128, num_blocks=32, interleave=interleave))
    d.add("r1", toks(64, 1000), 4)
    d.add("r2", toks(384, 2000), 2)
    assert d.run() == labels
    assert d.last_tables() == tables
    assert d.tokens == {
        "r1": expected_tokens(toks(64, 1000), 4),
        "r2": expected_tokens(toks(384, 2000), 2),
    }


def test_prefix_caching_disabled() -> None:
    d = Driver(make_scheduler(chunk_size=128, num_blocks=16, enable_prefix_caching=False))
    prompt = toks(192, 1000)
    d.add("a", prompt, 4)
    d.add("b", prompt, 4)
    sched = d.sched
    assert d.run() == ["a:0", "a:1", "D:a", "b:0", "D:a", "b:1", "D:a,b", "D:b", "D:b"]
    tables = d.last_tables()
    assert tables == {"a": (1, 2, 3, 4), "b": (5, 6, 7, 8)}
    assert [s.slots for s in d.trace if s.label.startswith("b:")] == [r(320, 384), r(384, 512)]
    assert sched.pool.num_cached_blocks == 0
    assert free_queue(sched) == (5, 6, 7, 8, 1, 2, 3, 4, *r(9, 16))
    assert d.cached == {"a": 0, "b": 0}
    assert d.tokens["a"] == d.tokens["b"] == expected_tokens(prompt, 4)
    assert counters(d)[1:4] == (0, 4, 0)


@pytest.mark.parametrize(
    ("cache_decode_blocks", "prompt_len", "max_tokens", "table", "cached"),
    [
        # 100 prompt tokens + 40: block 2 holds prefill 64..99 and decode 100..127
        (True, 100, 40, (1, 2, 3), [True, True, False]),
        (False, 100, 40, (1, 2, 3), [True, False, False]),
        # 128 prompt tokens + 70: blocks 1, 2 prefill only; block 3 (128..191) decode only
        (True, 128, 70, (1, 2, 3, 4), [True, True, True, False]),
        (False, 128, 70, (1, 2, 3, 4), [True, True, False, False]),
    ],
)
def test_cache_decode_blocks(
    cache_decode_blocks: bool,
    prompt_len: int,
    max_tokens: int,
    table: tuple[int, ...],
    cached: list[bool],
) -> None:
    d = Driver(
        make_scheduler(chunk_size=64, num_blocks=16, cache_decode_blocks=cache_decode_blocks)
    )
    prompt = toks(prompt_len, 1000)
    d.add("a", prompt, max_tokens)
    d.run()
    assert d.trace[-1].block_tables == {"a": table}
    assert hashed(d.sched, *table) == cached
    # a follow-up whose prompt is everything a saw hits exactly the cached blocks
    d.add("b", prompt + d.tokens["a"], 1)
    assert d.sched.pool.lookup(d.sched.get_request("b").chain) == list(table[: sum(cached)])


@pytest.mark.parametrize("first_needs_logits", [False, True])
def test_needs_prompt_logits_bypasses_lookup_but_registers(first_needs_logits: bool) -> None:
    d = Driver(make_scheduler(chunk_size=64, num_blocks=16))
    prompt = toks(128, 1000)
    d.add("a", prompt, 1, needs_prompt_logits=first_needs_logits)
    d.add("b", prompt, 1, needs_prompt_logits=True)
    d.add("c", prompt, 1)
    sched = d.sched

    assert [d.step().label for _ in range(2)] == ["a:0", "a:1"]
    assert hashed(sched, 1, 2) == [True, True]  # registered either way
    s = d.step()  # b does not look up: a fresh table, its first chunk computed and stored
    assert s.label == "b:0"
    assert s.block_tables == {"b": (3, 4)}
    assert s.slots == r(192, 256)
    s = d.step()
    assert (s.label, s.slots) == ("b:1", r(256, 320))
    # b's blocks duplicate a's: b holds a's cached blocks instead, and its copies go back
    # unhashed to the front (3 after chunk 0, then 4 after chunk 1); b is done (max_tokens 1)
    # and releases 1, 2 tail first
    assert hashed(sched, 3, 4) == [False, False]
    assert [sched.pool.ref_count(x) for x in (1, 2, 3, 4)] == [0, 0, 0, 0]
    assert free_queue(sched) == (4, 3, *r(5, 16), 2, 1)

    s = d.step()  # c finds a's blocks: 2 hits, usable min(2, 1) = 1
    assert s.label == "c:1"
    assert s.block_tables == {"c": (1, 2)}
    assert s.slots == r(0, 64)
    assert d.cached == {"a": 0, "b": 0, "c": 64}
    assert d.tokens["a"] == d.tokens["b"] == d.tokens["c"]
    # only requests that looked up count as queries: c, and a unless it bypassed too
    assert counters(d)[:4] == ((128 if first_needs_logits else 256), 64, 5, 1)


def test_needs_prompt_logits_registers_blocks_beyond_a_cached_prefix() -> None:
    # a caches P (blocks 1, 2). b (echo + logprobs) = P + Q recomputes all 4 blocks into 3..6:
    # 3, 4 duplicate a's 1, 2 (b swaps them for 1, 2), but 5, 6 hold content nobody cached. DESIGN §4:
    # b bypasses the lookup but "still registers its blocks for others", so c = P + Q must find
    # 4 blocks (usable min(4, 4 - 1) = 3 -> cached 192, only chunk 3 runs).
    d = Driver(make_scheduler(chunk_size=64, num_blocks=16))
    prompt_p, prompt_q = toks(128, 1000), toks(128, 5000)
    d.add("a", prompt_p, 1)
    d.add("b", prompt_p + prompt_q, 1, needs_prompt_logits=True)
    assert d.run() == ["a:0", "a:1", "b:0", "b:1", "b:2", "b:3"]
    assert d.last_tables() == {"a": (1, 2), "b": (1, 2, 5, 6)}
    assert hashed(d.sched, 3, 4) == [False, False]
    d.add("c", prompt_p + prompt_q, 1)
    assert d.sched.pool.lookup(d.sched.get_request("c").chain) == [1, 2, 5, 6]
    assert d.run() == ["c:3"]
    assert d.cached["c"] == 192


def test_max_num_seqs() -> None:
    d = Driver(make_scheduler(chunk_size=64, num_blocks=32, max_num_seqs=2))
    for i, rid in enumerate(("r1", "r2", "r3")):
        d.add(rid, toks(64, 1000 * (i + 1)), 4)
    waiting_running = []
    labels = []
    while (s := d.step()) is not None:
        labels.append(s.label)
        st = stats(d)
        waiting_running.append((st.num_waiting, st.num_running))
    assert labels == [
        "r1:0",
        "D:r1",
        "r2:0",
        "D:r1,r2",
        "D:r1,r2",  # r3 may not start: 2 running
        "r3:0",
        "D:r2,r3",
        "D:r3",
        "D:r3",
    ]
    assert waiting_running == [
        (2, 1),
        (2, 1),
        (1, 2),
        (1, 2),
        (1, 1),  # r1 finished in this step
        (0, 2),
        (0, 1),
        (0, 1),
        (0, 0),
    ]
    assert d.last_tables() == {
        "r1": (1, 2),
        "r2": (3, 4),
        "r3": (2, 5),  # r1's unhashed block 2 was at the front of the free queue
    }


# ========================================================================== finishing rules
@pytest.mark.parametrize("kind", ["stop", "eos"])
def test_stop_token_finishes_with_stop_and_frees_blocks(kind: str) -> None:
    def next_token(context: list[int]) -> int:
        return 7 if len(context) == 73 else 500 + len(context)

    d = Driver(make_scheduler(chunk_size=64, num_blocks=16), FakeRunner(next_token))
    stop = {"stop_token_ids": [7]} if kind == "stop" else {"eos_token_id": 7}
    d.add("a", toks(70, 1000), 10, **stop)
    assert d.run() == ["a:0", "a:1", "D:a", "D:a", "D:a"]
    assert d.tokens == {"a": [570, 571, 572, 7]}
    assert d.finish == {"a": STOP}
    assert [out.finish_reason for s in d.trace for out in s.outputs] == [None, None, None, STOP]
    assert not d.sched.has_unfinished_requests
    assert free_queue(d.sched) == (2, *r(3, 16), 1)


def test_length_finish() -> None:
    d = Driver(make_scheduler(chunk_size=64, num_blocks=16))
    d.add("a", toks(10, 1000), 3, stop_token_ids=[999_999])
    assert d.run() == ["a:0", "D:a", "D:a"]
    t1, t2, t3 = expected_tokens(toks(10, 1000), 3)
    outputs = [(out.new_token_ids, out.finish_reason) for s in d.trace for out in s.outputs]
    assert outputs == [((t1,), None), ((t2,), None), ((t3,), LENGTH)]
    assert free_queue(d.sched) == r(1, 16)


def run_reporting(
    sched: Scheduler,
    runner: FakeRunner,
    stop_strings: dict[str, str] | None = None,
    completed_grammars: frozenset[str] = frozenset(),
) -> list[RequestOutput]:
    """One step, reporting text stops for the sampled tokens as the engine would."""
    step = sched.schedule()
    assert step is not None
    sampled = runner.execute(step).sampled_token_ids
    report = ModelRunnerOutput(sampled, stop_strings or {}, completed_grammars)
    return sched.update_from_output(step, report)


def test_text_stops_reported_by_the_engine_finish_in_the_scheduler() -> None:
    """Rules, first first: stop token, EOS, stop string, completed grammar, max_tokens."""
    runner = FakeRunner(lambda context: 7 if context[0] == 3000 else 500 + len(context))
    sched = make_scheduler(chunk_size=64, num_blocks=32, interleave=False)
    sched.add_request("string", toks(10, 1000), 5)
    sched.add_request("grammar", toks(10, 2000), 5)
    sched.add_request("token", toks(10, 3000), 5, stop_token_ids=[7])  # samples 7 only
    sched.add_request("length", toks(10, 4000), 2)
    for _ in range(4):  # the four prefills, one token each
        assert [o.finish_reason for o in run_reporting(sched, runner)] in ([None], [STOP])
    assert sched.get_request("token") is None  # its first token was its stop token
    outputs = run_reporting(
        sched,
        runner,
        stop_strings={"string": "END", "token": "x", "length": "!"},
        completed_grammars=frozenset({"grammar", "length"}),
    )
    finished = {o.request_id: (o.finish_reason, o.stop_reason) for o in outputs}
    assert finished == {"string": (STOP, "END"), "grammar": (STOP, None), "length": (STOP, "!")}
    assert not sched.has_unfinished_requests
    sched.check_integrity()


def test_stop_token_beats_a_stop_string_in_the_same_token() -> None:
    sched = make_scheduler(chunk_size=64, num_blocks=16)
    sched.add_request("a", toks(10, 1000), 5, stop_token_ids=[7])
    outputs = run_reporting(sched, FakeRunner(lambda context: 7), stop_strings={"a": "s"})
    assert [(o.new_token_ids, o.finish_reason, o.stop_reason) for o in outputs] == [((7,), STOP, 7)]


def test_max_tokens_zero_scores_the_prompt_and_ends_without_a_token() -> None:
    d = Driver(make_scheduler(chunk_size=64, num_blocks=16))
    d.add("a", toks(130, 1000), 0)
    assert d.run() == ["a:0", "a:1", "a:2"]
    outputs = [(o.new_token_ids, o.finish_reason) for s in d.trace for o in s.outputs]
    assert outputs == [((), LENGTH)]
    assert d.tokens.get("a", []) == []
    assert hashed(d.sched, 1, 2, 3) == [True, True, False]  # its full blocks serve others
    assert free_queue(d.sched) == (3, *r(4, 16), 2, 1)
    assert counters(d) == (130, 0, 3, 0, 0, 0)


def test_max_tokens_one_finishes_in_prefill() -> None:
    d = Driver(make_scheduler(chunk_size=64, num_blocks=16))
    d.add("a", toks(64, 1000), 1)
    assert d.run() == ["a:0"]
    assert d.finish == {"a": LENGTH}
    assert counters(d) == (64, 0, 1, 0, 0, 0)


def test_block_cached_only_when_all_positions_computed() -> None:
    # 100-token prompt, C = 64: block 2 holds positions 64..127. The token at position 127 is
    # sampled by the decode step of position 126 (step 29) but its KV is written by step 30.
    d = Driver(make_scheduler(chunk_size=64, num_blocks=16))
    d.add("a", toks(100, 1000), 30)
    sched = d.sched
    for _ in range(29):
        s = d.step()
    assert s.positions == (126,)
    assert len(sched.get_request("a").all_token_ids) == 128  # block 2 holds 64 token ids ...
    assert hashed(sched, 1, 2) == [True, False]  # ... but only 63 of them have KV
    s = d.step()
    assert s.positions == (127,)
    assert hashed(sched, 1, 2) == [True, True]


def test_final_tokens_kv_is_never_cached() -> None:
    # Same, but a finishes with the token at position 127: its KV is never written.
    d = Driver(make_scheduler(chunk_size=64, num_blocks=16))
    d.add("a", toks(100, 1000), 28)
    assert len(d.run()) == 29
    assert d.finish == {"a": LENGTH}
    assert hashed(d.sched, 1, 2) == [True, False]
    assert free_queue(d.sched) == (2, *r(3, 16), 1)


def test_no_dummy_steps_for_cached_chunks() -> None:
    # L = 512, C = 128: 4 chunks, no padding. b shares 320 tokens (5 blocks): usable
    # min(5 // 2, 3) * 2 = 4 -> 2 chunks skipped, 2 run. c = a: 8 hits, usable min(4, 3) * 2 = 6.
    d = Driver(make_scheduler(chunk_size=128, num_blocks=32))
    prompt = toks(512, 1000)
    d.add("a", prompt, 1)
    d.add("b", prompt[:320] + toks(192, 8000), 1)
    d.add("c", prompt, 1)
    assert d.run() == ["a:0", "a:1", "a:2", "a:3", "b:2", "b:3", "c:3"]
    b2, b3, c3 = d.trace[4:]
    assert b2.block_tables == {"b": (1, 2, 3, 4, 5, 9, 10, 11)}
    assert b2.slots == r(0, 64) + r(576, 640)  # block 5 (tokens 256..319) is a hit
    assert b3.slots == r(640, 768)
    assert c3.block_tables == {"c": (1, 2, 3, 4, 5, 6, 7, 8)}
    assert c3.slots == r(0, 64) + r(0, 64)
    assert d.cached == {"a": 0, "b": 256, "c": 384}
    assert counters(d) == (1536, 640, 7, 5, 0, 0)
    assert free_queue(d.sched) == (*r(12, 32), 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1)


def test_equal_decode_blocks_first_registration_wins() -> None:
    # Two requests with the same 100-token prompt generate the same tokens (C = 64): r2 shares
    # block 1, and its own block 3 (positions 64..127) equals r1's block 2, registered first:
    # r2 holds block 2 instead, block 3 goes back (unhashed) and is r2's next decode block.
    d = Driver(make_scheduler(chunk_size=64, num_blocks=16))
    prompt = toks(100, 1000)
    d.add("r1", prompt, 40)
    d.add("r2", prompt, 40)
    d.run()
    assert d.tokens["r1"] == d.tokens["r2"]
    tables = d.last_tables()
    assert tables == {"r1": (1, 2, 4), "r2": (1, 2, 3)}
    assert hashed(d.sched, 1, 2, 3, 4, 5) == [True, True, False, False, False]


# =============================================================================== validation
@pytest.mark.parametrize(
    ("prompt", "max_tokens", "config", "message"),
    [
        # ceil((200 + 100) / 64) = 5 blocks > 4 usable
        (toks(200, 1000), 100, {"num_blocks": 5}, "KV blocks"),
        # 150 + 9 - 1 = 158 tokens in whole blocks = 192 > 191 (rows pad to the widest table)
        (toks(150, 1000), 9, {"max_batch_tkv_limit": 191}, "max_batch_tkv_limit"),
    ],
)
def test_add_request_rejects_what_the_scheduler_owns(
    prompt: list[int], max_tokens: int, config: dict[str, int], message: str
) -> None:
    sched = make_scheduler(**config)
    with pytest.raises(ValueError, match=message):
        sched.add_request("x", prompt, max_tokens)
    assert not sched.has_unfinished_requests
    assert sched.schedule() is None


def test_add_request_accepts_exact_limits() -> None:
    sched = make_scheduler(max_model_len=512, num_blocks=9)
    sched.add_request("len", toks(500, 1000), 12)  # 512 = max_model_len, 8 blocks = 8 usable
    sched2 = make_scheduler(max_batch_tkv_limit=192)
    sched2.add_request("tkv", toks(150, 1000), 9)  # 158 tokens in whole blocks = 192
    assert sched.has_unfinished_requests and sched2.has_unfinished_requests


def test_duplicate_request_id_rejected_until_finished() -> None:
    d = Driver(make_scheduler(chunk_size=64, num_blocks=16))
    d.add("a", toks(10, 1000), 1)
    with pytest.raises(ValueError, match="'a' is already in use"):
        d.add("a", toks(10, 2000), 1)
    assert d.run() == ["a:0"]
    d.add("a", toks(10, 2000), 1)  # finished ids may be reused
    assert d.sched.get_request("a").prompt_token_ids == toks(10, 2000)


def test_reset_prefix_cache_while_running() -> None:
    d = Driver(make_scheduler(chunk_size=128, num_blocks=16))
    prompt = toks(192, 1000)
    d.add("a", prompt, 3)
    sched = d.sched
    assert [d.step().label for _ in range(3)] == ["a:0", "a:1", "D:a"]
    assert sched.reset_prefix_cache() == 3  # a's blocks 1, 2, 3 (in use) are dropped
    assert sched.pool.num_cached_blocks == 0
    d.add("b", prompt, 1)
    s = d.step()  # nothing findable: b computes chunk 0
    assert (s.label, s.block_tables, s.slots) == ("b:0", {"b": (5, 6, 7)}, r(320, 384))
    assert hashed(sched, 1, 2, 3, 5) == [False, False, False, True]
    assert d.run() == ["D:a", "b:1"]
    # a's blocks came back unhashed (to the front), b's cached ones to the back
    assert free_queue(sched) == (1, 2, 3, 4, *r(8, 16), 7, 6, 5)
    assert d.cached == {"a": 0, "b": 0}
    assert counters(d) == (384, 0, 4, 0, 2, 0)


# ============================================================================== reservation
def test_admission_waits_for_blocks_reserved_by_running_requests() -> None:
    # 5 usable blocks. r1 and r2 each reserve ceil((64 + 70) / 64) = 3. Once r1 holds 2 blocks
    # it still has 1 reserved: 3 free - 1 reserved = 2 < 3, so r2 waits for r1 to finish
    # (admitting it would force a preemption when both grow into their third block).
    d = Driver(make_scheduler(chunk_size=64, num_blocks=6))
    d.add("r1", toks(64, 1000), 70)
    d.add("r2", toks(64, 2000), 70)
    assert d.run() == ["r1:0"] + ["D:r1"] * 69 + ["r2:0"] + ["D:r2"] * 69
    assert stats(d).num_preemptions == 0
    tables = d.last_tables()
    assert tables == {"r1": (1, 2, 3), "r2": (3, 4, 5)}  # r1 left [3, 4, 5, 2, 1] free


def test_hits_on_blocks_in_use_cost_no_reservation() -> None:
    # 5 usable blocks. r1 (128 tokens + 60) holds 1, 2, 3 after its first decode; 2 blocks are
    # free. r2 (same prompt) needs 3 blocks, 2 of them hits held by r1: it takes only 1.
    d = Driver(make_scheduler(chunk_size=64, num_blocks=6))
    prompt = toks(128, 1000)
    d.add("r1", prompt, 60)
    d.add("r2", prompt, 60)
    sched = d.sched
    assert [d.step().label for _ in range(3)] == ["r1:0", "r1:1", "D:r1"]
    assert free_queue(sched) == (4, 5)
    s = d.step()
    assert (s.label, s.block_tables, s.slots) == ("r2:1", {"r2": (1, 2)}, r(0, 64))
    s = d.step()
    assert (s.label, s.slots) == ("D:r1,r2", (3 * 64 + 1, 4 * 64))
    assert free_queue(sched) == (5,)
    d.run()
    assert stats(d).num_preemptions == 0
    assert d.tokens["r1"] == d.tokens["r2"] == expected_tokens(prompt, 60)


def reservation_with_free_cached_hits(num_blocks: int) -> Driver:
    """a (128 tokens) runs alone and leaves blocks 1, 2 cached in the free queue. Then b (64 tokens
    + 70) runs, and c = a's prompt + 64 tokens (+ 60) wants to start: it needs 4 blocks, 2 of them
    hits on a's blocks, which sit in the free queue. Sharing them takes them out of it, so they
    cost free blocks exactly like new ones: c needs 4 free blocks beyond b's reservation."""
    d = Driver(make_scheduler(chunk_size=64, num_blocks=num_blocks))
    sched = d.sched
    d.add("a", toks(128, 1000), 1)
    assert d.run() == ["a:0", "a:1"]
    assert free_queue(sched) == (*r(3, num_blocks), 2, 1)
    assert hashed(sched, 1, 2) == [True, True] and refs(sched, 1, 2) == [0, 0]
    d.add("b", toks(64, 5000), 70)  # reserves ceil(134 / 64) = 3 blocks
    d.add("c", toks(128, 1000) + toks(64, 9000), 60)  # reserves ceil(252 / 64) = 4 blocks
    assert sched.pool.lookup(sched.get_request("c").chain) == [1, 2]
    s = d.step()
    assert (s.label, s.block_tables) == ("b:0", {"b": (3,)})
    s = d.step()  # b's first decode takes block 4: b holds 2 blocks and 1 more is reserved
    assert (s.label, s.block_tables) == ("D:b", {"b": (3, 4)})
    return d


def test_hits_on_free_cached_blocks_cost_free_blocks_in_the_reservation() -> None:
    # 6 usable blocks. Free now: 5, 6, 2, 1 (4 blocks), 1 of them reserved for b: 3 are left.
    # c takes 4 (1 new + 2 free hits + 1 to grow into): it must wait for b to finish. Admitting
    # it (counting the hits as free of charge: 4 - 2 = 2 <= 3) would leave b without its third
    # block at position 128: a preemption, which the reservation exists to rule out.
    d = reservation_with_free_cached_hits(num_blocks=7)
    sched = d.sched
    s = d.step()  # c cannot start: b decodes alone
    assert s.label == "D:b"
    assert sched.get_request("c").status is RequestStatus.WAITING
    assert refs(sched, 1, 2) == [0, 0] and free_queue(sched) == (5, 6, 2, 1)
    labels = d.run()
    assert labels == ["D:b"] * 67 + ["c:2"] + ["D:c"] * 59
    # b grew into 5 at position 128; released tail first: 5 (partial) to the front, 4 and 3
    # (full, cached) to the back. c shares the hits 1, 2, takes 5 for chunk 2, 6 to decode into.
    assert d.last_tables() == {"a": (1, 2), "b": (3, 4, 5), "c": (1, 2, 5, 6)}
    assert d.cached == {"a": 0, "b": 0, "c": 128}  # chunks 0 and 1 skipped
    assert counters(d) == (128 + 64 + 192, 128, 4, 2, 69 + 59, 0)
    assert d.tokens["b"] == expected_tokens(toks(64, 5000), 70)
    assert d.tokens["c"] == expected_tokens(toks(128, 1000) + toks(64, 9000), 60)


def test_hits_on_free_cached_blocks_one_block_more_and_c_starts_at_once() -> None:
    # 7 usable blocks: free 5, 6, 7, 2, 1 minus b's 1 reserved = 4 = what c takes.
    d = reservation_with_free_cached_hits(num_blocks=8)
    sched = d.sched
    s = d.step()
    assert (s.label, s.block_tables) == ("c:2", {"c": (1, 2, 5)})
    assert s.slots == r(5 * 64, 6 * 64)  # only chunk 2 runs: tokens 128..191 -> block 5
    assert refs(sched, 1, 2) == [1, 1]
    assert free_queue(sched) == (6, 7)  # exactly c's fourth block and b's third
    labels = d.run()
    assert labels == ["D:b,c"] * 59 + ["D:b"] * 9  # c's 60 tokens; b's 70 = 1 + 1 + 59 + 9
    assert stats(d).num_preemptions == 0
    # c grows into 6 at position 192 (its first decode); when c finishes, its unhashed 6 goes
    # to the front, and b, reaching position 128 five steps later, grows into it
    assert d.last_tables() == {"a": (1, 2), "b": (3, 4, 6), "c": (1, 2, 5, 6)}
    assert d.cached == {"a": 0, "b": 0, "c": 128}


# =============================================================================== preemption
def preemption_workload(d: Driver) -> None:
    # C = 64. r1: 100 tokens (blocks 1, 2); r2 shares r1's first block (64 cached tokens).
    prompt = toks(100, 1000)
    d.add("r1", prompt, 40)  # reserves ceil(140 / 64) = 3 blocks
    d.add("r2", prompt[:64] + toks(36, 4000), 40)


def test_preemption_of_newest_decoding_request() -> None:
    d = Driver(make_scheduler(chunk_size=64, num_blocks=10))
    preemption_workload(d)
    sched = d.sched
    assert [d.step().label for _ in range(4)] == ["r1:0", "r1:1", "D:r1", "r2:1"]
    assert d.trace[3].block_tables == {"r2": (1, 3)}
    assert d.cached["r2"] == 64
    for _ in range(27):  # steps 5..31: r1 reaches position 127, r2 position 126
        assert d.step().label == "D:r1,r2"
    assert d.trace[-1].positions == (127, 126)
    assert free_queue(sched) == r(4, 10)

    stolen = sched.pool.allocate(6)  # the reservation now fails: simulate it
    assert stolen == [4, 5, 6, 7, 8, 9]
    d.extra_holders = {"stolen": stolen}
    s = d.step()  # r1 needs block 3 of its table: r2 (newest) is preempted for it
    assert s.label == "D:r1"
    assert s.block_tables == {"r1": (1, 2, 3)}
    assert s.slots == (3 * 64,)
    assert sched.get_request("r2").status is RequestStatus.WAITING
    assert sched.get_request("r2").block_table == []
    assert refs(sched, 1, 2, 3) == [1, 1, 1]
    assert stats(d).num_preemptions == 1
    assert (stats(d).num_running, stats(d).num_waiting) == (1, 1)
    assert len(d.tokens["r2"]) == 28

    s = d.step()  # r2 cannot be re-admitted: no free block
    assert (s.label, s.positions) == ("D:r1", (129,))
    sched.pool.free(stolen)
    d.extra_holders = {}
    assert free_queue(sched) == r(4, 10)

    s = d.step()  # re-admitted with 128 tokens: its first block hits again, 1 chunk skipped
    assert s.label == "r2:1"
    assert s.block_tables == {"r2": (1, 4)}
    assert s.slots == r(256, 320)
    assert refs(sched, 1) == [2]
    labels = d.run()
    assert labels == ["D:r1,r2"] * 9 + ["D:r2"] * 2
    assert d.finish == {"r1": LENGTH, "r2": LENGTH}
    assert d.cached == {"r1": 0, "r2": 64}
    # counted once: queries 100 + 100, hits 64 (not again at the re-admission)
    assert counters(d) == (200, 64, 4, 2, 41, 1)

    undisturbed = Driver(make_scheduler(chunk_size=64, num_blocks=10))
    preemption_workload(undisturbed)
    undisturbed.run()
    assert counters(undisturbed) == (200, 64, 3, 1, 40, 0)
    assert d.tokens == undisturbed.tokens
    assert d.tokens["r1"] == expected_tokens(toks(100, 1000), 40)


def test_preemption_prefers_the_request_in_prefill() -> None:
    # r1 (127 tokens) decodes into a third block while r3 is between its prefill chunks.
    d = Driver(make_scheduler(chunk_size=64, num_blocks=12))
    d.add("r1", toks(127, 1000), 10)
    d.add("r3", toks(192, 5000), 5)
    sched = d.sched
    assert [d.step().label for _ in range(4)] == ["r1:0", "r1:1", "D:r1", "r3:0"]
    assert d.trace[3].block_tables == {"r3": (3, 4, 5)}
    stolen = sched.pool.allocate(6)
    assert stolen == [6, 7, 8, 9, 10, 11]
    d.extra_holders = {"stolen": stolen}

    s = d.step()  # position 128 needs a block: r3 (newest, prefilling) is preempted
    assert s.label == "D:r1"
    assert s.block_tables == {"r1": (1, 2, 4)}
    assert sched.get_request("r3").status is RequestStatus.WAITING
    assert hashed(sched, 3, 4, 5) == [True, False, False]
    assert free_queue(sched) == (5, 3)
    assert stats(d).num_preemptions == 1

    assert d.step().label == "D:r1"  # 4 blocks needed, 2 free: r3 waits
    sched.pool.free(stolen)
    d.extra_holders = {}
    s = d.step()  # its own cached first block is hit: chunk 0 is not computed again
    assert s.label == "r3:1"
    assert s.block_tables == {"r3": (3, 6, 7)}
    assert s.slots == r(384, 448)
    d.run()
    assert d.cached == {"r1": 0, "r3": 0}
    assert d.tokens == {
        "r1": expected_tokens(toks(127, 1000), 10),
        "r3": expected_tokens(toks(192, 5000), 5),
    }
    assert counters(d)[:4] == (319, 0, 5, 1)


def test_preempted_request_can_run_alone_again() -> None:
    # add_request accepts r: 64 + 100 - 1 = 163 tokens in whole blocks = 192 <= 192, the limit.
    # Preempted after its first output, r's prefill becomes 65 tokens; the bound stays the one
    # of its prompt and max_tokens (a bound from the 65-token prefill plus the 99 tokens left
    # would be 128 + 99 = 227). Alone with every block free again, r must still run to completion.
    d = Driver(make_scheduler(chunk_size=64, num_blocks=8, max_batch_tkv_limit=192))
    d.add("r", toks(64, 2000), 100)
    sched = d.sched
    assert d.step().label == "r:0"
    stolen = sched.pool.allocate(6)
    assert stolen == [2, 3, 4, 5, 6, 7]
    d.extra_holders = {"stolen": stolen}
    assert d.step() is None  # r needs a second block: it preempts itself
    assert stats(d).num_preemptions == 1
    assert sched.get_request("r").status is RequestStatus.WAITING
    sched.pool.free(stolen)
    d.extra_holders = {}
    labels = d.run()  # 65 tokens, block 1 hit: chunk 0 skipped, chunk 1 computed
    assert sched.has_unfinished_requests == (labels == [])
    assert labels == ["r:1"] + ["D:r"] * 98, "r is never re-admitted (schedule() returns None)"
    assert d.finish == {"r": LENGTH}
    assert d.tokens["r"] == expected_tokens(toks(64, 2000), 100)


# ============================================ accounting for a runner of new positions only
@pytest.mark.parametrize(
    ("chunk_size", "len_a", "len_shared", "len_b", "whole_windows", "new_positions"),
    [
        # (scenario) whole windows: the usable grid part; new positions: min(hit, L - 1)
        (128, 192, 192, 192, 64, 191),  # §7.1: 3 blocks hit, 1 usable
        (128, 70, 70, 70, 0, 64),  # §7.2: 1 block hit, one chunk
        (128, 384, 384, 384, 256, 383),  # §7.7: 6 blocks hit, 4 usable
        (128, 384, 254, 384, 128, 192),  # §7.8: 3 blocks hit, 2 usable
        (128, 384, 256, 384, 256, 256),  # §7.9: 4 blocks hit and usable
        (192, 64, 64, 320, 0, 64),  # §7.10: 1 block hit, usable 0
        (128, 64, 64, 64, 0, 63),  # the whole prompt hit: its logits position still runs
    ],
)
def test_cached_tokens_follow_what_the_runner_computes(
    chunk_size: int,
    len_a: int,
    len_shared: int,
    len_b: int,
    whole_windows: int,
    new_positions: int,
) -> None:
    prompt_a = toks(len_a, 1000)
    prompt_b = prompt_a[:len_shared] + toks(len_b - len_shared, 9000)
    for compute, want in (
        (PrefillCompute.WHOLE_WINDOWS, whole_windows),
        (PrefillCompute.NEW_POSITIONS, new_positions),
    ):
        d = Driver(make_scheduler(chunk_size=chunk_size, num_blocks=32, prefill_compute=compute))
        d.add("a", prompt_a, 2)
        d.run()
        d.add("b", prompt_b, 2)
        d.run()
        assert d.cached == {"a": 0, "b": want}, compute
        queries, hits, *_ = counters(d)
        assert (queries, hits) == (len_a + len_b, want), compute
        assert d.tokens["b"] == expected_tokens(prompt_b, 2)
