"""Random operation sequences against an independent model of the pool (hypothesis, stateful).

The model keeps the free queue order, ref counts, each block's reuse generation, what every cached
block was registered with (hash, tokens, extra keys, parent identity), the event stream, and the
KV content every block was written with. Blocks are registered as the scheduler does it: each one
chained onto the id register returned for the previous one (a twin when an equal block was cached
first, which the holder then holds instead of its copy), remembered across steps. The model
predicts every returned id exactly, including a twin and the takeover of a free block under the
same hash (reachable only through collisions: whoever holds a child holds its parent, so a parent
is never evicted before its child).
After every operation the pool must agree with the model exactly and pass
``check_integrity(holders)``; every lookup hit and every returned twin must hold exactly the
request's token prefix and extra keys; at the end, freeing everything must give back every block.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import hypothesis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcache import (
    NO_EXTRA_KEYS,
    AllBlocksCleared,
    BlockHashChain,
    BlockPool,
    BlockRemoved,
    BlockStored,
    ExtraKeys,
    KVCacheEvent,
    root_hash,
)

BS = 2
NUM_BLOCKS = 10
ROOT = root_hash(7)
ALPHABET = (0, 1)  # a tiny alphabet: equal blocks (hits and duplicate registrations) are common
EXTRAS = (NO_EXTRA_KEYS, ExtraKeys(cache_salt="s"))

Content = tuple[ExtraKeys, tuple[int, ...]]
Identity = tuple[int, int]  # (block id, reuse generation)
token_lists = st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=4 * BS + 1)


@dataclass
class Holder:
    chain: BlockHashChain
    token_ids: list[int]
    table: list[int]
    written: int  # leading blocks whose KV is written (hits count as written)
    tail: int | None  # what register returned for block ``written - 1`` (the last hit, if any)


@dataclass(frozen=True)
class Cached:
    """What the model knows about a registered block."""

    block_hash: bytes
    tokens: tuple[int, ...]  # this block's token ids
    extra: ExtraKeys
    parent: Identity | None


def event(name: str) -> None:
    """Count a situation for ``--hypothesis-show-statistics`` (a no-op outside hypothesis, when a
    plain test drives the machine through a fixed scenario)."""
    if currently_in_test_context():
        hypothesis.event(name)


def note(text: str) -> None:
    if currently_in_test_context():
        hypothesis.note(text)


def make_chain(token_ids: list[int], extra: ExtraKeys) -> BlockHashChain:
    chain = BlockHashChain(BS, ROOT, extra)
    chain.update(token_ids)
    return chain


def block_tokens(token_ids: list[int], index: int) -> tuple[int, ...]:
    return tuple(token_ids[index * BS : (index + 1) * BS])


def written_now(data: st.DataObject) -> Callable[[int], int]:
    """How many of the remaining blocks the admission step writes: usually all of them (the
    whole prefill runs before anything else happens, one prefill at a time), or some."""

    def draw(remaining: int) -> int:
        return data.draw(st.just(remaining) | st.integers(0, remaining), label="written now")

    return draw


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS, BS)
        self.events: list[KVCacheEvent] = []
        self.pool.subscribe(self.events.append)
        self.expected_events: list[KVCacheEvent] = []
        self.holders: dict[str, Holder] = {}
        self.next_owner = 0
        self.past_prompts: list[list[int]] = []
        # the model
        self.queue: list[int] = list(range(1, NUM_BLOCKS))
        self.refs = [0] * NUM_BLOCKS
        self.generation = [0] * NUM_BLOCKS
        self.cached: dict[int, Cached] = {}  # block id -> what it is registered with
        self.content: dict[int, Content | None] = {}  # block id -> the KV it holds

    # ------------------------------------------------------------------ helpers
    def block_of_hash(self) -> dict[bytes, int]:
        by_hash = {c.block_hash: b for b, c in self.cached.items()}
        assert len(by_hash) == len(self.cached), "the model registered a hash twice"
        return by_hash

    def identity(self, block_id: int) -> Identity:
        return (block_id, self.generation[block_id])

    def holds(
        self,
        block_id: int,
        token_ids: list[int],
        extra: ExtraKeys,
        index: int,
        parent: Identity | None,
    ) -> bool:
        """Whether cached ``block_id`` holds block ``index`` of these tokens after ``parent``."""
        cached = self.cached[block_id]
        return (
            cached.parent == parent
            and cached.tokens == block_tokens(token_ids, index)
            and cached.extra == extra
        )

    def drop_hash(self, block_id: int) -> bytes:
        self.generation[block_id] += 1
        return self.cached.pop(block_id).block_hash

    def reachable(self) -> set[int]:
        """Cached blocks some lookup can reach: a chain of parents back to a root block."""
        found: set[int] = set()
        by_identity = {self.identity(b): b for b in self.cached}
        for block_id in self.cached:
            path = []
            node: int | None = block_id
            while node is not None and node not in found:
                path.append(node)
                parent = self.cached[node].parent
                if parent is None:
                    found.update(path)
                    break
                node = by_identity.get(parent)
            else:
                if node is not None:
                    found.update(path)
        return found

    def stale_free_blocks(self) -> list[int]:
        """Free cached blocks that no lookup can reach (their parent was evicted first)."""
        reachable = self.reachable()
        return sorted(b for b in self.cached if self.refs[b] == 0 and b not in reachable)

    def expected_hits(
        self, chain: BlockHashChain, token_ids: list[int], max_blocks: int | None
    ) -> list[int]:
        by_hash = self.block_of_hash()
        limit = chain.num_blocks if max_blocks is None else min(max_blocks, chain.num_blocks)
        hits: list[int] = []
        parent: Identity | None = None
        for i in range(limit):
            block_id = by_hash.get(chain.hashes[i])
            if block_id is None or not self.holds(block_id, token_ids, chain.extra, i, parent):
                break
            hits.append(block_id)
            parent = self.identity(block_id)
        return hits

    def check_hits(self, chain: BlockHashChain, token_ids: list[int], hits: list[int]) -> None:
        for i, block_id in enumerate(hits):
            assert self.content.get(block_id) == (chain.extra, tuple(token_ids[: (i + 1) * BS])), (
                f"lookup hit block {block_id} at index {i} with other content"
            )

    def model_register(
        self, block_id: int, holder: Holder, index: int, parent_id: int | None
    ) -> int | None:
        """The id ``register`` must return, with its effect on the model (and its events)."""
        chain, token_ids = holder.chain, holder.token_ids
        block_hash = chain.hashes[index]
        parent: Identity | None = None
        if index > 0:
            assert parent_id is not None
            parent_entry = self.cached.get(parent_id)
            if parent_entry is None or parent_entry.block_hash != chain.hashes[index - 1]:
                event("register: parent not cached as the previous link")
                return None
            parent = self.identity(parent_id)
        if block_id in self.cached:
            if self.holds(block_id, token_ids, chain.extra, index, parent):
                event("register: already cached")
                return block_id
            event("register: already cached as something else")
            return None
        existing = self.block_of_hash().get(block_hash)
        if existing is not None:
            if self.holds(existing, token_ids, chain.extra, index, parent):
                event("register: twin returned")
                return existing
            # xxh3_128 does not collide here: a different block under this hash is stale
            assert existing not in self.reachable()
            if self.refs[existing] > 0:
                event("register: hash held by a stale block in use")
                return None
            event("register: a stale free block under the same hash taken over")
            self.expected_events.append(BlockRemoved(self.drop_hash(existing)))
        self.cached[block_id] = Cached(
            block_hash, block_tokens(token_ids, index), chain.extra, parent
        )
        self.expected_events.append(
            BlockStored(
                block_hash=block_hash,
                parent_block_hash=chain.parent_of(index),
                token_ids=block_tokens(token_ids, index),
                block_size=BS,
                extra_keys=chain.extra,
            )
        )
        event("register: registered")
        if index > 0 and parent_id != holder.table[index - 1]:
            event("register: registered onto a twin (another request's block)")
        return block_id

    def model_share(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            if self.refs[block_id] == 0:
                self.queue.remove(block_id)
            self.refs[block_id] += 1

    def model_allocate(self, n: int) -> list[int]:
        taken = self.queue[:n]
        del self.queue[:n]
        reachable = self.reachable()
        for block_id in taken:
            if block_id in self.cached:
                if block_id not in reachable:
                    event("eviction of a stale block")
                self.expected_events.append(BlockRemoved(self.drop_hash(block_id)))
                event("eviction")
            self.refs[block_id] = 1
            self.content[block_id] = None  # garbage until written
        return taken

    def model_free(self, table: list[int]) -> None:
        for block_id in reversed(table):
            self.refs[block_id] -= 1
            if self.refs[block_id] == 0:
                if block_id in self.cached:
                    self.queue.append(block_id)
                else:
                    self.queue.insert(0, block_id)

    def holders_tables(self) -> dict[str, list[int]]:
        return {owner: h.table for owner, h in self.holders.items()}

    def snapshot(self) -> tuple[object, ...]:
        pool = self.pool
        return (
            pool.free_block_ids(),
            [pool.ref_count(b) for b in range(NUM_BLOCKS)],
            [pool.block_hash(b) for b in range(NUM_BLOCKS)],
            pool.num_cached_blocks,
            len(self.events),
        )

    def offer(self, holder: Holder, index: int, parent_id: int | None) -> int | None:
        """Offer block ``index`` of the holder's table to the cache; check the returned id."""
        block_id = holder.table[index]
        expected = self.model_register(block_id, holder, index, parent_id)
        returned = self.pool.register(block_id, holder.chain, index, parent_id)
        assert returned == expected
        if returned is not None:
            prefix = (holder.chain.extra, tuple(holder.token_ids[: (index + 1) * BS]))
            assert self.content.get(returned) == prefix, "register returned other content"
            if returned != block_id:  # as the scheduler does: hold the twin instead of our copy
                event("twin held instead of the holder's copy")
                self.pool.share([returned])
                self.model_share([returned])
                self.pool.free([block_id])
                self.model_free([block_id])
                holder.table[index] = returned
        return returned

    # -------------------------------------------------------------------- rules
    @rule(
        data=st.data(),
        extra=st.sampled_from(EXTRAS),
        use_cache=st.sampled_from([True, True, False]),
        max_blocks=st.none() | st.integers(0, 5),
    )
    def admit(
        self, data: st.DataObject, extra: ExtraKeys, use_cache: bool, max_blocks: int | None
    ) -> None:
        """A new request; ``use_cache=False`` bypasses the lookup (echo with logprobs), so it
        computes blocks that may be cached already (it gets twins back)."""
        reuse = data.draw(st.booleans(), label="reuse a prompt")
        if reuse and self.past_prompts:
            base = data.draw(st.sampled_from(self.past_prompts), label="base prompt")
            cut = data.draw(st.integers(1, len(base)), label="cut")
            token_ids = base[:cut] + data.draw(
                st.lists(st.sampled_from(ALPHABET), max_size=2 * BS), label="suffix"
            )
        else:
            token_ids = data.draw(token_lists, label="tokens")
        self.admit_request(token_ids, extra, use_cache, max_blocks, written_now(data))

    @precondition(lambda self: bool(self.stale_free_blocks()))
    @rule(data=st.data(), use_cache=st.booleans())
    def admit_stale_content(self, data: st.DataObject, use_cache: bool) -> None:
        """A new request whose prompt is exactly the content a stale free block holds: it
        computes that block again and takes over its hash."""
        stale = data.draw(st.sampled_from(self.stale_free_blocks()), label="stale block")
        content = self.content[stale]
        assert content is not None
        extra, prefix = content
        suffix = data.draw(st.lists(st.sampled_from(ALPHABET), max_size=BS), label="suffix")
        self.admit_request([*prefix, *suffix], extra, use_cache, None, written_now(data))

    def admit_request(
        self,
        token_ids: list[int],
        extra: ExtraKeys,
        use_cache: bool,
        max_blocks: int | None,
        written_now: Callable[[int], int],
    ) -> str | None:
        """Lookup, share the hits, allocate the rest (or skip when the pool is too full), then
        write (and offer) ``written_now(remaining)`` of the new blocks. Returns the owner."""
        self.past_prompts.append(token_ids)
        chain = make_chain(token_ids, extra)
        before = self.snapshot()
        hits = self.pool.lookup(chain, max_blocks) if use_cache else []
        assert self.snapshot() == before, "lookup changed the pool"
        if use_cache:
            assert hits == self.expected_hits(chain, token_ids, max_blocks)
        self.check_hits(chain, token_ids, hits)
        if hits:
            event("admission with a hit")

        num_new = -(-len(token_ids) // BS) - len(hits)
        if num_new + self.pool.num_free_among(hits) > self.pool.num_free_blocks:
            note(f"admission skipped: {num_new} new blocks, {len(self.queue)} free")
            return None
        self.pool.share(hits)
        self.model_share(hits)
        new = self.pool.allocate(num_new)
        assert new == self.model_allocate(num_new)
        owner = f"r{self.next_owner}"
        self.next_owner += 1
        holder = Holder(
            chain, token_ids, hits + new, written=len(hits), tail=hits[-1] if hits else None
        )
        self.holders[owner] = holder
        self.write_blocks(holder, written_now(chain.num_blocks - holder.written))
        return owner

    @precondition(lambda self: any(h.written < h.chain.num_blocks for h in self.holders.values()))
    @rule(data=st.data())
    def write(self, data: st.DataObject) -> None:
        """A later step (prefill chunk or decode) wrote the KV of more of a holder's blocks."""
        owner = data.draw(
            st.sampled_from(
                sorted(o for o, h in self.holders.items() if h.written < h.chain.num_blocks)
            ),
            label="owner",
        )
        holder = self.holders[owner]
        count = data.draw(st.integers(1, holder.chain.num_blocks - holder.written), label="count")
        self.write_blocks(holder, count)

    def write_blocks(self, holder: Holder, count: int) -> None:
        """The holder's next ``count`` full blocks are written: offer them in order, each one
        chained onto the id returned for the previous one (kept across steps, as the scheduler
        keeps it). Once that is ``None`` the chain is broken and later blocks are not offered."""
        for i in range(holder.written, holder.written + count):
            self.content[holder.table[i]] = (
                holder.chain.extra,
                tuple(holder.token_ids[: (i + 1) * BS]),
            )
            if i > 0 and holder.tail is None:
                event("chain broken: block not offered")
                continue
            holder.tail = self.offer(holder, i, holder.tail)
        holder.written += count

    @precondition(lambda self: bool(self.holders))
    @rule(data=st.data())
    def offer_again(self, data: st.DataObject) -> None:
        """Offering a holder's written blocks again, from block 0 on, is safe: a cached block
        returns itself, a duplicate its twin, and an unhashed one may get registered now."""
        owner = data.draw(st.sampled_from(sorted(self.holders)), label="owner")
        holder = self.holders[owner]
        parent: int | None = None
        for i in range(holder.written):
            if i > 0 and parent is None:
                break
            parent = self.offer(holder, i, parent)

    @precondition(lambda self: bool(self.holders))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        self.free_owner(data.draw(st.sampled_from(sorted(self.holders)), label="owner"))

    def free_owner(self, owner: str) -> None:
        holder = self.holders.pop(owner)
        self.pool.free(holder.table)
        self.model_free(holder.table)

    @rule(data=st.data())
    def free_or_share_with_a_bad_id(self, data: st.DataObject) -> None:
        """A bad id anywhere in the list: ValueError and nothing changes (all or nothing)."""
        tables = [h.table for h in self.holders.values()] + [[]]
        table = data.draw(st.sampled_from(tables), label="table")
        bad_ids = [0, NUM_BLOCKS, -1]
        freeing = data.draw(st.booleans(), label="free (else share)")
        if freeing:
            bad_ids += self.queue  # a block without holders cannot be freed
        bad = data.draw(st.sampled_from(bad_ids), label="bad id")
        at = data.draw(st.integers(0, len(table)), label="position")
        ids = [*table[:at], bad, *table[at:]]
        before = self.snapshot()
        try:
            if freeing:
                self.pool.free(ids)
            else:
                self.pool.share(ids)
        except ValueError:
            pass
        else:
            raise AssertionError(f"{'free' if freeing else 'share'}({ids}) did not raise")
        assert self.snapshot() == before

    @rule()
    def reset(self) -> None:
        assert self.pool.reset() == len(self.cached)
        for block_id in list(self.cached):
            self.drop_hash(block_id)
        self.expected_events.append(AllBlocksCleared())
        for holder in self.holders.values():
            assert self.pool.lookup(holder.chain) == []

    @rule(token_ids=token_lists, extra=st.sampled_from(EXTRAS))
    def lookup(self, token_ids: list[int], extra: ExtraKeys) -> None:
        chain = make_chain(token_ids, extra)
        before = self.snapshot()
        hits = self.pool.lookup(chain)
        assert self.snapshot() == before, "lookup changed the pool"
        assert hits == self.expected_hits(chain, token_ids, None)
        self.check_hits(chain, token_ids, hits)

    @precondition(lambda self: bool(self.queue))
    @rule(data=st.data())
    def churn(self, data: st.DataObject) -> None:
        """A request that caches nothing takes blocks from the front and gives them back: the
        LRU end of the cache is evicted (parents can go before children of twins)."""
        self.churn_blocks(data.draw(st.integers(1, len(self.queue)), label="blocks"))

    def churn_blocks(self, n: int) -> None:
        taken = self.pool.allocate(n)
        assert taken == self.model_allocate(n)
        self.pool.free(taken)
        self.model_free(taken)

    @rule(extra_blocks=st.integers(1, 3))
    def allocate_too_many(self, extra_blocks: int) -> None:
        before = self.snapshot()
        assert self.pool.allocate(len(self.queue) + extra_blocks) is None
        assert self.snapshot() == before

    # --------------------------------------------------------------- invariants
    @invariant()
    def agrees_with_the_model(self) -> None:
        pool = self.pool
        pool.check_integrity(self.holders_tables())
        assert pool.free_block_ids() == self.queue
        assert [pool.ref_count(b) for b in range(NUM_BLOCKS)] == self.refs
        assert [pool.block_hash(b) for b in range(NUM_BLOCKS)] == [
            self.cached[b].block_hash if b in self.cached else None for b in range(NUM_BLOCKS)
        ]
        assert pool.num_cached_blocks == len(self.cached)
        assert pool.num_free_blocks == len(self.queue)
        assert pool.usage() == (NUM_BLOCKS - 1 - len(self.queue)) / (NUM_BLOCKS - 1)
        assert self.events == self.expected_events
        assert self.refs[0] == 0 and 0 not in self.queue
        # a cached block holds the KV it was registered with, and its parent (while that life
        # of the parent lasts) holds exactly the KV of the prefix before it
        by_identity = {self.identity(b): b for b in self.cached}
        for block_id, cached in self.cached.items():
            content = self.content[block_id]
            assert content is not None
            assert content[0] == cached.extra and content[1][-BS:] == cached.tokens
            if cached.parent is None:
                assert len(content[1]) == BS
            elif cached.parent in by_identity:
                assert self.content[by_identity[cached.parent]] == (content[0], content[1][:-BS])
        if len(self.reachable()) < len(self.cached):
            event("state with a stale cached block")

    def teardown(self) -> None:
        for owner in sorted(self.holders):
            self.pool.free(self.holders.pop(owner).table)
            self.pool.check_integrity(self.holders_tables())
        assert self.pool.num_free_blocks == self.pool.num_usable_blocks
        assert sorted(self.pool.free_block_ids()) == list(range(1, NUM_BLOCKS))
        assert all(self.pool.ref_count(b) == 0 for b in range(NUM_BLOCKS))
        self.pool.check_integrity({})


PoolMachine.TestCase.settings = settings(
    max_examples=80,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPoolMachine = PoolMachine.TestCase


# ------------------------------------------------------------------ fixed scenarios
def all_blocks(remaining: int) -> int:
    return remaining
