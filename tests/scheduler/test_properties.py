"""Random workloads against the Spyre scheduler, checked after every step (DESIGN §3, §4).

A deterministic fake runner keeps a shadow KV store: the "KV" of position t is a chain value over
the request's tokens[0..t], written into the slot the scheduler assigns. Every step reads the whole
context back through the block table the scheduler hands out and derives the sampled token from
what it read, so a wrong cache hit, a block registered before its KV was written, or a write into a
shared / cached block changes the outputs (and is also reported directly, with the position).

Independently of the scheduler the test models: the chunk grid and the usable-hit rule, FCFS
admission with the max_num_seqs and volumetric limits, the interleave rule, and (while no block has
been evicted) the exact content of the prefix cache, so the number of hit blocks is checked too.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, currently_in_test_context, example, given, settings
from hypothesis import event as _hypothesis_event
from hypothesis import strategies as st

from kvcache import BlockRemoved, KVCacheEvent
from scheduler import (
    DecodeBatch,
    FinishReason,
    ModelRunnerOutput,
    PrefillChunk,
    RequestOutput,
    Scheduler,
    SchedulerConfig,
)

BS = 64
VOCAB = 48
"""Sampled tokens are in [0, VOCAB): small, so random stop tokens fire now and then."""
MAX_PROMPT = 700
MAX_NEW = 48
MAX_MODEL_LEN = 1024
KV_ROOT = 0x5EED


def event(name: str) -> None:
    """Coverage statistics (``--hypothesis-show-statistics``); a no-op outside hypothesis."""
    if currently_in_test_context():
        _hypothesis_event(name)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --------------------------------------------------------------------------- the fake model
def mix(h: int, token: int) -> int:
    """KV of the next position from the previous one (hash of int tuples is deterministic)."""
    return hash((h, token))


def next_token(h: int) -> int:
    return h % VOCAB


def kv_chain(tokens: list[int]) -> list[int]:
    out = []
    h = KV_ROOT
    for token in tokens:
        h = mix(h, token)
        out.append(h)
    return out


def pure_generate(
    prompt: tuple[int, ...], max_tokens: int, stops: frozenset[int]
) -> tuple[int, ...]:
    """What any correct schedule must produce: the fake model run without any scheduler."""
    h = kv_chain(list(prompt))[-1]
    out: list[int] = []
    while True:
        token = next_token(h)
        out.append(token)
        if token in stops or len(out) == max_tokens:
            return tuple(out)
        h = mix(h, token)


def _rand_tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


_BASE0 = _rand_tokens(1, MAX_PROMPT)
BASES = (
    _BASE0,
    _BASE0[:130] + _rand_tokens(2, MAX_PROMPT - 130),  # shares 2 full blocks + 2 tokens with 0
    _rand_tokens(3, MAX_PROMPT),
)
BOUNDARY_LENS = sorted({max(0, 64 * k + d) for k in range(12) for d in (-1, 0, 1)})


# --------------------------------------------------------------------------- scenarios
@dataclass(frozen=True)
class Spec:
    rid: str
    prompt: tuple[int, ...]
    max_tokens: int
    stop_token_ids: tuple[int, ...] = ()
    eos_token_id: int | None = None
    cache_salt: str | None = None
    arrival: int = 0
    abort_at: int | None = None
    abort_in_flight: bool = False
    needs_prompt_logits: bool = False
    """echo + logprobs: bypasses the lookup, still registers its blocks."""

    @property
    def stops(self) -> frozenset[int]:
        extra = () if self.eos_token_id is None else (self.eos_token_id,)
        return frozenset(self.stop_token_ids + extra)

    @property
    def blocks_needed(self) -> int:
        return cdiv(len(self.prompt) + self.max_tokens, BS)

    @property
    def max_decode_tkv(self) -> int:
        """The widest block table of its decode steps (prompt + max_tokens - 1 tokens) in whole
        blocks: rows of a decode batch are left-padded to the widest table."""
        return cdiv(len(self.prompt) + self.max_tokens - 1, BS) * BS


@dataclass(frozen=True)
class Scenario:
    config: SchedulerConfig
    specs: tuple[Spec, ...]
    resets: tuple[tuple[int, bool], ...] = ()
    """(step, in flight): ``reset_prefix_cache()`` between steps or while a step runs."""


def make_config(
    specs: tuple[Spec, ...],
    *,
    chunk_size: int = 128,
    max_num_seqs: int = 4,
    interleave: bool = True,
    caching: bool = True,
    cache_decode_blocks: bool = True,
    pool: str = "large",
    pool_extra: int = 0,
    tkv: str = "loose",
    tkv_factor: float = 1.0,
) -> SchedulerConfig:
    if pool == "large":  # room for every request at once: nothing is ever evicted
        num_blocks = sum(s.blocks_needed for s in specs) + 1
    else:  # just enough for the largest request
        num_blocks = max(s.blocks_needed for s in specs) + 1 + pool_extra
    limit = None
    if tkv == "tight":
        single = max(s.max_decode_tkv for s in specs)
        limit = max(single, int(single * tkv_factor))
    return SchedulerConfig(
        block_size=BS,
        chunk_size=chunk_size,
        max_num_seqs=max_num_seqs,
        max_model_len=MAX_MODEL_LEN,
        num_blocks=num_blocks,
        max_batch_tkv_limit=limit,
        interleave=interleave,
        enable_prefix_caching=caching,
        cache_decode_blocks=cache_decode_blocks,
    )


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    num_requests = draw(st.integers(1, 10))
    specs: list[Spec] = []
    for index in range(num_requests):
        kind = draw(st.sampled_from(["base", "copy", "extend"])) if specs else "base"
        if kind == "base":
            base = BASES[draw(st.integers(0, len(BASES) - 1))]
            length = draw(st.one_of(st.sampled_from(BOUNDARY_LENS), st.integers(0, MAX_PROMPT)))
            prompt = list(base[:length])
        else:
            earlier = specs[draw(st.integers(0, len(specs) - 1))]
            prompt = list(earlier.prompt)
            if kind == "extend":  # continue with what the earlier request generated (§7.3)
                generated = pure_generate(earlier.prompt, earlier.max_tokens, earlier.stops)
                prompt += generated[: draw(st.integers(0, len(generated)))]
        if kind != "copy" or draw(st.booleans()):
            tail_len = draw(st.one_of(st.integers(0, 3), st.integers(0, 160)))
            prompt += _rand_tokens(draw(st.integers(0, 2**16)) + 1000, tail_len)
        prompt = prompt[:MAX_PROMPT] or [7]
        stops = draw(st.lists(st.integers(0, VOCAB - 1), max_size=2, unique=True))
        use_eos = bool(stops) and draw(st.booleans())
        arrival = draw(st.integers(0, 30))
        abort_delta = draw(st.one_of(st.none(), st.integers(0, 6), st.integers(0, 40)))
        specs.append(
            Spec(
                rid=f"r{index}",
                prompt=tuple(prompt),
                max_tokens=draw(st.integers(1, MAX_NEW)),
                stop_token_ids=tuple(stops[1:] if use_eos else stops),
                eos_token_id=stops[0] if use_eos else None,
                cache_salt=draw(st.sampled_from([None, None, None, "tenant-a"])),
                arrival=arrival,
                abort_at=None if abort_delta is None else arrival + abort_delta,
                abort_in_flight=draw(st.booleans()),
                needs_prompt_logits=draw(st.sampled_from([False] * 7 + [True])),
            )
        )
    frozen = tuple(specs)
    config = make_config(
        frozen,
        chunk_size=draw(st.sampled_from([64, 128, 192, 256])),
        max_num_seqs=draw(st.integers(1, 8)),
        interleave=draw(st.booleans()),
        caching=draw(st.sampled_from([True, True, True, False])),
        cache_decode_blocks=draw(st.booleans()),
        pool=draw(st.sampled_from(["large", "small"])),
        pool_extra=draw(st.integers(0, 2)),
        tkv=draw(st.sampled_from(["loose", "tight"])),
        tkv_factor=draw(st.sampled_from([1.0, 1.5, 2.0, 3.0])),
    )
    resets = draw(st.lists(st.tuples(st.integers(0, 40), st.booleans()), max_size=2))
    return Scenario(config, frozen, tuple(resets) if draw(st.integers(0, 2)) == 0 else ())


# --------------------------------------------------------------------------- the harness
@dataclass
class RState:
    """The test's own view of one request."""

    spec: Spec
    tokens: list[int]
    hs: list[int]
    """Expected KV of every position so far."""
    status: str = "pending"  # pending, waiting, prefilling, decoding, finished, aborted
    computed: int = 0
    hit_blocks: int = 0
    cached_tokens: int | None = None
    outputs: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    canon: list[bool] = field(default_factory=list)
    """Model of the cache: is this request's block i cached (its own copy or an equal twin)
    and reachable, so that its next block can be registered after it."""
    registered: int = 0

    def key(self, index: int) -> tuple[str | None, tuple[int, ...]]:
        return (self.spec.cache_salt, tuple(self.tokens[: (index + 1) * BS]))

    def append(self, token: int) -> None:
        self.tokens.append(token)
        self.hs.append(mix(self.hs[-1], token))
        self.outputs.append(token)


class Run:
    def __init__(self, scenario: Scenario) -> None:
        self.cfg = cfg = scenario.config
        self.specs = scenario.specs
        self.resets = scenario.resets
        self.sched = Scheduler(cfg, hash_seed=0)
        self.evicted = False
        self.sched.pool.subscribe(self._on_event)
        self.kv: list[int | None] = [None] * (cfg.num_blocks * BS)
        self.states = {
            s.rid: RState(s, list(s.prompt), kv_chain(list(s.prompt))) for s in self.specs
        }
        self.waiting: list[str] = []
        """Added and not yet admitted, in arrival order (FCFS)."""
        self.prefilling: str | None = None
        self.decoding: list[str] = []
        self.model_cache: set[tuple[str | None, tuple[int, ...]]] = set()
        self.prev_kind: str | None = None
        self.num_prefill_steps = 0
        self.num_decode_steps = 0
        self.num_chunks_skipped = 0
        self.admitted: list[str] = []
        self.max_ref_count = 0

    def _on_event(self, ev: KVCacheEvent) -> None:
        if isinstance(ev, BlockRemoved):
            self.evicted = True  # the cache model no longer predicts hits exactly

    # ---------------------------------------------------------------- driving
    def drive(self) -> dict[str, RState]:
        sched = self.sched
        arrivals = sorted(self.specs, key=lambda s: s.arrival)
        bound = 50 + max(s.arrival for s in self.specs)
        bound += sum(2 * (cdiv(len(s.prompt), BS) + s.max_tokens) for s in self.specs)
        step_no = 0
        while True:
            assert step_no <= bound, f"livelock: still running after {bound} steps"
            while arrivals and arrivals[0].arrival <= step_no:
                self._add(arrivals.pop(0))
            for spec in self.specs:
                if spec.abort_at == step_no and not spec.abort_in_flight:
                    self._abort(spec.rid)
            if (step_no, False) in self.resets:
                self._reset()
            evicted_before = self.evicted
            step = sched.schedule()
            if step is None:
                assert not sched.has_unfinished_requests, (
                    "schedule() returned None although requests are unfinished "
                    f"(waiting={self.waiting}, prefilling={self.prefilling}, "
                    f"decoding={self.decoding})"
                )
                self.prev_kind = None
                if not arrivals:
                    break
            else:
                if isinstance(step, PrefillChunk):
                    sampled = self._prefill(step, exact_cache=not evicted_before)
                else:
                    assert isinstance(step, DecodeBatch), f"unexpected step {step!r}"
                    sampled = self._decode(step)
                for spec in self.specs:
                    if spec.abort_at == step_no and spec.abort_in_flight:
                        self._abort(spec.rid)
                if (step_no, True) in self.resets:
                    self._reset()
                outputs = sched.update_from_output(step, ModelRunnerOutput(sampled))
                self._apply(step, outputs)
            sched.check_integrity()
            self._check_gauges()
            pool = sched.pool
            self.max_ref_count = max(
                self.max_ref_count, *(pool.ref_count(b) for b in range(pool.num_blocks))
            )
            step_no += 1
        self._check_end()
        return self.states

    def _add(self, spec: Spec) -> None:
        self.sched.add_request(
            spec.rid,
            spec.prompt,
            spec.max_tokens,
            stop_token_ids=spec.stop_token_ids,
            eos_token_id=spec.eos_token_id,
            cache_salt=spec.cache_salt,
            needs_prompt_logits=spec.needs_prompt_logits,
        )
        self.states[spec.rid].status = "waiting"
        self.waiting.append(spec.rid)

    def _abort(self, rid: str) -> None:
        state = self.states[rid]
        out = self.sched.finish_request(rid)
        if state.status in ("finished", "aborted", "pending"):
            assert out is None, f"finish_request({rid}) on a finished request returned {out}"
            return
        event(f"abort while {state.status}")
        expected = RequestOutput(rid, (), FinishReason.ABORT, state.cached_tokens or 0)
        assert out == expected
        if state.status == "waiting":
            self.waiting.remove(rid)
        elif state.status == "prefilling":
            self.prefilling = None
        else:
            self.decoding.remove(rid)
        state.status = "aborted"
        state.finish_reason = FinishReason.ABORT
        assert self.sched.get_request(rid) is None

    def _reset(self) -> None:
        """DESIGN §4: afterwards nothing is findable; blocks in use stay valid, unhashed."""
        dropped = self.sched.reset_prefix_cache()
        event("prefix cache reset")
        if not self.evicted:
            assert dropped == len(self.model_cache)
        self.model_cache.clear()
        for state in self.states.values():
            state.canon = [False] * len(state.canon)
        assert self.sched.pool.num_cached_blocks == 0

    # ---------------------------------------------------------------- steps
    def _admit(self, step: PrefillChunk, exact_cache: bool) -> RState:
        cfg = self.cfg
        rid = step.request_id
        assert self.prefilling is None, f"{rid} admitted while {self.prefilling} prefills"
        assert self.waiting and self.waiting[0] == rid, f"{rid} admitted out of order"
        assert len(self.decoding) < cfg.max_num_seqs, "admitted beyond max_num_seqs"
        batch = [self.states[r].spec for r in self.decoding] + [self.states[rid].spec]
        volume = len(batch) * max(s.max_decode_tkv for s in batch)
        assert volume <= cfg.batch_tkv_limit, (
            f"admitting {rid} makes a future decode batch of {len(batch)} x tkv "
            f"{volume // len(batch)} > {cfg.batch_tkv_limit}"
        )
        state = self.states[rid]
        request = self.sched.get_request(rid)
        assert request is not None
        L = len(state.spec.prompt)
        hit = request.num_hit_blocks
        assert 0 <= hit <= L // BS
        if not cfg.enable_prefix_caching or state.spec.needs_prompt_logits:
            assert hit == 0
        elif exact_cache:
            expected = 0
            while expected < L // BS and state.key(expected) in self.model_cache:
                expected += 1
            assert hit == expected, f"{rid}: {hit} hit blocks, the cache holds {expected}"
        # DESIGN §4 usable-hit rule, written out independently of scheduler.grid.
        C = cfg.chunk_size
        chunks = cdiv(L, C)
        pad = chunks * C - cdiv(L, BS) * BS
        whole = min((pad // BS + hit) // (C // BS), chunks - 1)
        usable = max(0, whole * (C // BS) - pad // BS)
        event("hit: none" if hit == 0 else ("hit: usable" if usable else "hit: shared only"))
        if usable and usable < hit:
            event("hit: boundary chunk recomputed")
        self.waiting.pop(0)
        self.prefilling = rid
        self.admitted.append(rid)
        state.status = "prefilling"
        state.hit_blocks = hit
        state.computed = usable * BS
        state.cached_tokens = usable * BS
        state.canon = [True] * hit
        state.registered = hit
        self.num_chunks_skipped += (usable * BS + pad) // C
        return state

    def _prefill(self, step: PrefillChunk, exact_cache: bool) -> dict[str, int]:
        cfg = self.cfg
        rid = step.request_id
        if self.cfg.interleave and self.prev_kind == "prefill":
            assert not self.decoding, f"two prefill steps in a row while {self.decoding} decode"
        self.prev_kind = "prefill"
        self.num_prefill_steps += 1
        state = self.states[rid]
        if state.status == "waiting":
            state = self._admit(step, exact_cache)
        assert state.status == "prefilling" and self.prefilling == rid, (
            f"prefill chunk for {rid} in state {state.status} (prefilling: {self.prefilling})"
        )
        # The chunk grid (DESIGN §3).
        C = cfg.chunk_size
        prompt = state.spec.prompt
        L = len(prompt)
        chunks = cdiv(L, C)
        pad = chunks * C - cdiv(L, BS) * BS
        start = state.computed
        assert start == 0 or (start + pad) % C == 0, f"chunk starts off the grid at {start}"
        index = (start + pad) // C
        end = min(L, (index + 1) * C - pad)
        assert step.positions == tuple(range(start, end)), (
            f"{rid}: positions {step.positions[0]}..{step.positions[-1]}, expected {start}..{end - 1}"
        )
        assert step.token_ids == prompt[start:end]
        assert (step.chunk_index, step.num_chunks, step.num_left_pad_tokens) == (index, chunks, pad)
        assert step.window_offset == start - (index * C - pad)
        assert step.is_last_chunk == (end == L)
        assert step.tkv == (index + 1) * C
        table = step.block_table
        request = self.sched.get_request(rid)
        assert request is not None and table == tuple(request.block_table)
        assert len(table) >= cdiv(end, BS) and 0 not in table and len(set(table)) == len(table)
        shared_end = state.hit_blocks * BS
        assert step.is_last_chunk or end > shared_end, (
            f"{rid}: chunk {index} is fully cached ({state.hit_blocks} hit blocks) but was scheduled"
        )
        for t, slot in zip(step.positions, step.slot_mapping, strict=True):
            if t < shared_end:
                assert slot == t % BS, f"{rid}: shared position {t} not written to block 0"
            else:
                assert slot == table[t // BS] * BS + t % BS, f"{rid}: position {t} slot {slot}"
        if shared_end > start:
            event("prefill: chunk writes cached positions to block 0")

        # Execute: attend over the context through the block table, write the chunk's KV.
        self._read_context(rid, table, start, state.hs)
        h = KV_ROOT if start == 0 else self.kv[table[(start - 1) // BS] * BS + (start - 1) % BS]
        assert h is not None
        checked_blocks: set[int] = set()
        for t, token, slot in zip(step.positions, step.token_ids, step.slot_mapping, strict=True):
            h = mix(h, token)
            block = table[t // BS]
            real = block * BS + t % BS
            if slot < BS:  # cached already: attention reads the stored copy
                assert self.kv[real] == h, f"{rid}: shared position {t} holds wrong KV"
            else:
                if block not in checked_blocks:
                    self._check_writable(rid, block)
                    checked_blocks.add(block)
                self.kv[slot] = h
        if not step.is_last_chunk:
            return {}
        return {rid: next_token(h)}

    def _decode(self, step: DecodeBatch) -> dict[str, int]:
        cfg = self.cfg
        if cfg.interleave and self.prev_kind == "decode":
            assert self.prefilling is None, (
                f"two decode steps in a row while {self.prefilling} is part-way through its prefill"
            )
        self.prev_kind = "decode"
        self.num_decode_steps += 1
        ids = [e.request_id for e in step.entries]
        assert sorted(ids) == sorted(self.decoding), f"decode batch {ids}, decoding {self.decoding}"
        assert 0 < len(ids) <= cfg.max_num_seqs
        assert step.tkv == max(e.position for e in step.entries) + 1
        widest = max(len(e.block_table) for e in step.entries)
        padded_tkv = max((widest - len(e.block_table)) * BS + e.position + 1 for e in step.entries)
        assert len(ids) * padded_tkv <= cfg.batch_tkv_limit, (
            f"decode batch {len(ids)} x padded tkv {padded_tkv} > {cfg.batch_tkv_limit}"
        )
        sampled = {}
        for entry in step.entries:
            rid = entry.request_id
            state = self.states[rid]
            p = len(state.tokens) - 1
            assert (entry.position, entry.token_id) == (p, state.tokens[-1])
            table = entry.block_table
            assert 0 not in table and len(set(table)) == len(table) and len(table) > p // BS
            assert entry.slot == table[p // BS] * BS + p % BS
            self._read_context(rid, table, p, state.hs)
            h = self.kv[table[(p - 1) // BS] * BS + (p - 1) % BS]
            assert h is not None
            h = mix(h, entry.token_id)
            self._check_writable(rid, table[p // BS])
            self.kv[entry.slot] = h
            sampled[rid] = next_token(h)
        return sampled

    def _check_writable(self, rid: str, block: int) -> None:
        pool = self.sched.pool
        assert pool.ref_count(block) == 1, f"{rid} writes into block {block} shared by others"
        assert pool.block_hash(block) is None, f"{rid} writes into cached block {block}"

    def _read_context(self, rid: str, table: tuple[int, ...], n: int, hs: list[int]) -> None:
        """Attention over positions [0, n): everything must be there, correct."""
        kv = self.kv
        for b in range(cdiv(n, BS)):
            lo, hi = b * BS, min(n, b * BS + BS)
            base = table[b] * BS
            if kv[base : base + hi - lo] != hs[lo:hi]:
                bad = next(t for t in range(lo, hi) if kv[base + t - lo] != hs[t])
                raise AssertionError(
                    f"{rid}: context position {bad} in block {table[b]} holds wrong or no KV"
                )

    # ---------------------------------------------------------------- results
    def _apply(self, step: PrefillChunk | DecodeBatch, outputs: list[RequestOutput]) -> None:
        if isinstance(step, PrefillChunk):
            live = [step.request_id] if self.prefilling == step.request_id else []
            new_computed = {step.request_id: step.positions[-1] + 1}
            produces = step.is_last_chunk
        else:
            live = [e.request_id for e in step.entries if e.request_id in self.decoding]
            new_computed = {e.request_id: e.position + 1 for e in step.entries}
            produces = True
        expected_ids = live if produces else []
        assert [o.request_id for o in outputs] == expected_ids, (
            f"outputs for {[o.request_id for o in outputs]}, expected {expected_ids}"
        )
        for rid in live:
            state = self.states[rid]
            state.computed = new_computed[rid]
            self._model_register(state)
        for out in outputs:
            state = self.states[out.request_id]
            assert len(out.new_token_ids) == 1
            token = out.new_token_ids[0]
            state.append(token)
            reason = None
            if token in state.spec.stops:
                reason = FinishReason.STOP
            elif len(state.outputs) >= state.spec.max_tokens:
                reason = FinishReason.LENGTH
            assert out.finish_reason == reason, f"{out.request_id}: {out} expected {reason}"
            assert out.num_cached_tokens == state.cached_tokens
            if state.status == "prefilling":
                self.prefilling = None
                self.decoding.append(out.request_id)
                state.status = "decoding"
            if reason is not None:
                self.decoding.remove(out.request_id)
                state.status = "finished"
                state.finish_reason = reason
                assert self.sched.get_request(out.request_id) is None

    def _model_register(self, state: RState) -> None:
        if not self.cfg.enable_prefix_caching:
            return
        limit = state.computed // BS
        if not self.cfg.cache_decode_blocks:
            limit = min(limit, len(state.spec.prompt) // BS)
        for index in range(state.registered, limit):
            key = state.key(index)
            if index > 0 and not state.canon[index - 1]:
                state.canon.append(False)  # the chain is broken: nothing after it is reachable
            elif key in self.model_cache:
                state.canon.append(True)  # an equal twin is registered: chain onto it
            else:
                self.model_cache.add(key)
                state.canon.append(True)
        state.registered = max(state.registered, limit)

    def _check_gauges(self) -> None:
        stats = self.sched.make_stats()
        running = len(self.decoding) + (self.prefilling is not None)
        assert (stats.num_running, stats.num_waiting) == (running, len(self.waiting))
        assert stats.num_preemptions == 0, "a preemption although admission reserves blocks"

    def _check_end(self) -> None:
        sched = self.sched
        for state in self.states.values():
            assert state.status in ("finished", "aborted"), f"{state.spec.rid}: {state.status}"
            if state.status == "finished":
                out, stops = state.outputs, state.spec.stops
                assert not any(t in stops for t in out[:-1]), "generated past a stop token"
                assert out[-1] in stops or len(out) == state.spec.max_tokens
        assert sched.pool.num_free_blocks == sched.pool.num_usable_blocks, "blocks leaked"
        assert sched.block_tables() == {}
        stats = sched.make_stats()
        assert stats.kv_cache_usage == 0.0
        # Queries: prompt tokens of admitted requests that looked up the cache (a bypassed
        # lookup, caching off or needs_prompt_logits, is no query, as in vLLM).
        looked_up = [r for r in self.admitted if not self.states[r].spec.needs_prompt_logits]
        if not self.cfg.enable_prefix_caching:
            looked_up = []
        queried = sum(len(self.states[r].spec.prompt) for r in looked_up)
        hits = sum(self.states[r].cached_tokens or 0 for r in self.admitted)
        assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (queried, hits)
        assert stats.num_prefill_chunks_computed == self.num_prefill_steps
        assert stats.num_prefill_chunks_skipped == self.num_chunks_skipped
        assert stats.num_decode_steps == self.num_decode_steps
        if self.cfg.enable_prefix_caching and not self.evicted:
            assert sched.pool.num_cached_blocks == len(self.model_cache)
        if not self.cfg.enable_prefix_caching:
            assert sched.pool.num_cached_blocks == 0


_REFERENCE: dict[tuple[object, ...], tuple[int, ...]] = {}


def reference_outputs(config: SchedulerConfig, spec: Spec) -> tuple[int, ...]:
    """The request alone on a fresh scheduler (memoised: the run is deterministic)."""
    key = (config, spec.prompt, spec.max_tokens, spec.stop_token_ids, spec.eos_token_id)
    key += (spec.cache_salt, spec.needs_prompt_logits)
    if key not in _REFERENCE:
        alone = Spec(
            "ref",
            spec.prompt,
            spec.max_tokens,
            spec.stop_token_ids,
            spec.eos_token_id,
            spec.cache_salt,
            needs_prompt_logits=spec.needs_prompt_logits,
        )
        states = Run(Scenario(config, (alone,))).drive()
        _REFERENCE[key] = tuple(states["ref"].outputs)
    return _REFERENCE[key]


def check_scenario(scenario: Scenario) -> None:
    states = Run(scenario).drive()
    for spec in scenario.specs:
        state = states[spec.rid]
        if state.status == "aborted":
            continue
        alone = reference_outputs(scenario.config, spec)
        assert alone == pure_generate(spec.prompt, spec.max_tokens, spec.stops)
        assert tuple(state.outputs) == alone, (
            f"{spec.rid}: outputs {state.outputs} differ from the run alone {list(alone)}"
        )


# --------------------------------------------------------------------------- DESIGN §7 examples
def _example(*specs: Spec, **config: object) -> Scenario:
    return Scenario(make_config(specs, **config), specs)  # type: ignore[arg-type]


_A = tuple(BASES[0])
_B = tuple(BASES[2])
_GEN_A100 = pure_generate(_A[:100], 40, frozenset())
_GEN_A192 = pure_generate(_A[:192], 70, frozenset())
EXAMPLES: dict[str, tuple[Scenario, dict[str, tuple[int, int]]]] = {
    # name: (scenario, {request: (hit blocks, cached tokens)}); block size 64, chunk 128 unless set
    "7.1 two identical 192-token prompts together": (
        _example(Spec("r0", _A[:192], 4), Spec("r1", _A[:192], 4)),
        {"r1": (3, 64)},
    ),
    "7.2 two identical 70-token prompts": (
        _example(Spec("r0", _A[:70], 4), Spec("r1", _A[:70], 4)),
        {"r1": (1, 0)},
    ),
    "7.3 prompt + generated tokens: a block filled by prefill and decode": (
        _example(
            Spec("r0", _A[:100], 40), Spec("r1", _A[:100] + _GEN_A100[:30] + (5,), 4, arrival=60)
        ),
        {"r1": (2, 64)},
    ),
    "7.3 prompt + generated tokens: a block written by decode only, chunk 64": (
        _example(
            Spec("r0", _A[:192], 70),
            Spec("r1", _A[:192] + _GEN_A192[:66] + (5,), 4, arrival=90),
            chunk_size=64,
        ),
        {"r1": (4, 256)},
    ),
    "7.4 the same prompt after the first finished": (
        _example(
            Spec("r0", _A[:300], 2),
            Spec("r1", _B[:300], 2, arrival=10),
            Spec("r2", _A[:300], 2, arrival=20),
        ),
        {"r2": (4, 192)},
    ),
    "7.5 too few blocks: a request in between evicts the cached blocks": (
        _example(
            Spec("r0", _A[:300], 2),
            Spec("r1", _B[:300], 2, arrival=10),
            Spec("r2", _A[:300], 2, arrival=20),
            pool="small",
        ),
        {"r2": (0, 0)},
    ),
    "7.6 A, A, B, A in one batch": (
        _example(
            Spec("r0", _A[:200], 20),
            Spec("r1", _A[:200], 20),
            Spec("r2", _B[:200], 20),
            Spec("r3", _A[:200], 20),
        ),
        {"r1": (3, 128), "r2": (0, 0), "r3": (3, 128)},
    ),
    "7.7 a 384-token prompt twice": (
        _example(Spec("r0", _A[:384], 2), Spec("r1", _A[:384], 2)),
        {"r1": (6, 256)},
    ),
    "7.8 384-token prompts sharing 254 tokens": (
        _example(Spec("r0", _A[:384], 2), Spec("r1", _A[:254] + _B[:130], 2)),
        {"r1": (3, 128)},
    ),
    "7.9 384-token prompts sharing 256 tokens": (
        _example(Spec("r0", _A[:384], 2), Spec("r1", _A[:256] + _B[:128], 2)),
        {"r1": (4, 256)},
    ),
    "7.10 chunk 192, a 64-token prompt then a 320-token prompt starting with it": (
        _example(Spec("r0", _A[:64], 2), Spec("r1", _A[:320], 2, arrival=5), chunk_size=192),
        {"r1": (1, 0)},
    ),
    "7.11 the hit makes the first scheduled chunk the last, tight volumetric limit": (
        _example(
            Spec("r0", _A[:512], 30),
            Spec("r1", _A[:512], 30, arrival=12),
            chunk_size=256,
            tkv="tight",
            tkv_factor=1.5,
        ),
        {"r1": (8, 256)},
    ),
    "7.12 abort part-way through the prefill, between steps": (
        _example(
            Spec("r0", _A[:600], 3, abort_at=2), Spec("r1", _A[:600], 3, arrival=3), chunk_size=64
        ),
        {"r1": (2, 128)},
    ),
    "7.12 abort part-way through the prefill, while the chunk runs": (
        _example(
            Spec("r0", _A[:600], 3, abort_at=2, abort_in_flight=True),
            Spec("r1", _A[:600], 3, arrival=3),
            chunk_size=64,
        ),
        {"r1": (2, 128)},
    ),
}


def _with_examples(test):  # type: ignore[no-untyped-def]
    for scenario, _ in reversed(EXAMPLES.values()):
        test = example(scenario)(test)
    return test


@_with_examples
@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(scenarios())
def test_random_workloads_keep_every_invariant(scenario: Scenario) -> None:
    check_scenario(scenario)


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_design_scenarios_hit_as_described(name: str) -> None:
    """The DESIGN §7 examples above produce the hits they are named after (and pass every check
    of the random test, which also runs them)."""
    scenario, expected = EXAMPLES[name]
    run = Run(scenario)
    states = run.drive()
    got = {rid: (states[rid].hit_blocks, states[rid].cached_tokens) for rid in expected}
    assert got == expected
    if name.startswith("7.6"):
        assert run.max_ref_count == 3, "the first block is shared by r0, r1 and r3"
