"""KV events ahead of the KV (issue 34): a prompt's full blocks past its cached prefix are
published (``BlockStored``) when the scheduler queues the request, so a router can send the
prefix here while the KV is still to be written; they become hits only once written; what is
abandoned before it is written is withdrawn (``BlockRemoved``). Event lists are exact."""

from __future__ import annotations

from typing import Any

from kvcache import BlockRemoved, BlockStored, KVCacheEvent
from scheduler import Scheduler
from tests.scheduler.fake_runner import Driver, hashed, make_scheduler, toks


def recorded(sched: Scheduler) -> list[KVCacheEvent]:
    events: list[KVCacheEvent] = []
    sched.pool.subscribe(events.append)
    return events


def stored_hashes(events: list[KVCacheEvent]) -> list[object]:
    return [e.block_hash for e in events if isinstance(e, BlockStored)]


def test_a_prompt_s_blocks_are_published_when_queued_and_hit_once_written() -> None:
    # L = 300, C = 128: 3 chunks (84 tokens of left padding), 4 full blocks on blocks 1..4.
    d = Driver(make_scheduler(chunk_size=128, num_blocks=16))
    events = recorded(d.sched)
    d.add("a", toks(300, 1000), 2)
    chain = d.sched.get_request("a").chain  # type: ignore[union-attr]
    assert stored_hashes(events) == chain.hashes[:4]  # queued: nothing scheduled yet
    step = d.sched.schedule()
    assert step is not None and step.chunk_index == 0
    assert len(events) == 4
    assert d.sched.pool.lookup(chain) == []  # not written: no hit yet
    d.sched.update_from_output(step, d.runner.execute(step))
    d.run()
    assert stored_hashes(events) == chain.hashes[:4] and len(events) == 4  # nothing more
    assert hashed(d.sched, 1, 2, 3, 4) == [True] * 4
    assert d.sched.pool.num_announced_blocks == 0


def test_a_request_queued_behind_the_prefill_hits_every_block_that_prefill_wrote() -> None:
    """b arrives (routed here by a's events) while a's prefill runs: it is admitted after a's
    last chunk and hits all four blocks; nothing is computed twice."""
    d = Driver(make_scheduler(chunk_size=128, num_blocks=32))
    prefix = toks(256, 1000)
    d.add("a", prefix + toks(44, 5000), 2)
    assert d.step().label == "a:0"  # type: ignore[union-attr]
    d.add("b", prefix + toks(44, 7000), 2)
    d.run()
    b_chunks = [label for label in d.labels() if label.startswith("b:")]
    tables = d.last_tables()
    assert tables["b"][:4] == tables["a"][:4]  # the four blocks a wrote, shared
    assert b_chunks == ["b:2"]  # the chunks wholly inside them skipped (the grid's rule)
    assert d.cached["b"] == 192


def test_an_abort_withdraws_the_published_blocks_it_did_not_write() -> None:
    # L = 384, C = 128: 6 full blocks; chunk 0 writes blocks 0 and 1 of the chain.
    d = Driver(make_scheduler(chunk_size=128, num_blocks=16))
    events = recorded(d.sched)
    d.add("a", toks(384, 1000), 2)
    chain = d.sched.get_request("a").chain  # type: ignore[union-attr]
    assert d.step().label == "a:0"  # type: ignore[union-attr]
    d.sched.finish_request("a")
    assert stored_hashes(events) == chain.hashes[:6]
    assert events[6:] == [BlockRemoved(h) for h in chain.hashes[2:6]]
    assert d.sched.pool.num_announced_blocks == 0
    assert hashed(d.sched, 1, 2, 3) == [True, True, False]


def test_a_bypassed_lookup_publishes_when_written() -> None:
    """A request that needs its prompt's logits computes every block (no lookup), so nothing is
    announced for it: its blocks are published as they are registered."""
    d = Driver(make_scheduler(chunk_size=128, num_blocks=16))
    events = recorded(d.sched)
    d.add("a", toks(128, 1000), 1, needs_prompt_logits=True)
    step = d.sched.schedule()
    assert step is not None and events == []
    d.sched.update_from_output(step, d.runner.execute(step))
    assert len(stored_hashes(events)) == 2


def test_a_queued_request_publishes_only_past_its_cached_prefix_and_withdraws_on_abort() -> None:
    d = Driver(make_scheduler(chunk_size=128, num_blocks=32))
    prefix = toks(128, 1000)
    d.add("a", prefix, 1)
    d.run()
    events = recorded(d.sched)
    d.add("b", prefix + toks(128, 3000), 1)  # blocks 0, 1 cached; 2, 3 to compute
    chain = d.sched.get_request("b").chain  # type: ignore[union-attr]
    assert events == [BlockStored(**stored_fields(d.sched, chain, i)) for i in (2, 3)]
    d.sched.finish_request("b")  # aborted while queued
    assert events[2:] == [BlockRemoved(chain.hashes[2]), BlockRemoved(chain.hashes[3])]
    d.check()


def test_after_a_reset_a_queued_request_is_published_again_at_admission() -> None:
    d = Driver(make_scheduler(chunk_size=128, num_blocks=16))
    d.add("a", toks(128, 1000), 1)
    events = recorded(d.sched)
    d.sched.reset_prefix_cache()  # routers forget the announcement
    d.check()
    chain = d.sched.get_request("a").chain  # type: ignore[union-attr]
    d.step()
    assert stored_hashes(events) == chain.hashes[:2]
    d.run()
    assert stored_hashes(events) == chain.hashes[:2]  # registering publishes nothing more


def stored_fields(sched: Scheduler, chain: object, index: int) -> dict[str, object]:
    from kvcache.hashing import decode_token_ids

    c: Any = chain
    return {
        "block_hash": c.hashes[index],
        "parent_block_hash": c.parent_of(index),
        "token_ids": decode_token_ids(c.token_bytes[index]),
        "block_size": sched.config.block_size,
        "extra_keys": c.extra,
    }
