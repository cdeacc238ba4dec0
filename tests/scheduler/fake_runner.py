"""A deterministic fake model runner with a shadow KV store, and a step driver that records a trace.

The runner stores, for every slot the scheduler tells it to write (block 0 excepted), the token and
position whose "KV" lands there. Every step then reads its whole context back through the block
table it was given, so a skipped chunk whose KV was never written, a hit on the wrong block or a
block table that does not cover the context fails at once. The sampled token is a pure function of
the context it read, so the same token sequence always continues the same way, whatever the
schedule (preemptions, cache hits, interleaving).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from scheduler import (
    DecodeBatch,
    FinishReason,
    ModelRunnerOutput,
    PrefillChunk,
    RequestOutput,
    ScheduledStep,
    Scheduler,
    SchedulerConfig,
)

BS = 64

NextToken = Callable[[Sequence[int]], int]


def default_next_token(context: Sequence[int]) -> int:
    """A polynomial hash of the whole context, in [0, 997): prompts use ids >= 1000."""
    acc = 7
    for token in context:
        acc = (acc * 1_000_003 + token + 1) % (1 << 61)
    return acc % 997


def toks(n: int, base: int) -> list[int]:
    """A prompt of ``n`` distinct token ids starting at ``base`` (use bases >= 1000)."""
    return list(range(base, base + n))


def r(start: int, stop: int) -> tuple[int, ...]:
    """Slots ``start..stop-1``; ``r(0, 64)`` is one block written to block 0 (not stored)."""
    return tuple(range(start, stop))


def make_scheduler(**overrides: object) -> Scheduler:
    """A scheduler with a fixed hash seed; ``overrides`` go to SchedulerConfig."""
    return Scheduler(SchedulerConfig(**overrides), hash_seed=0)


class FakeRunner:
    def __init__(self, next_token: NextToken = default_next_token) -> None:
        self.next_token = next_token
        self.kv: dict[int, tuple[int, int]] = {}
        """slot -> (token id, position) whose KV the slot holds."""

    def execute(self, step: ScheduledStep) -> ModelRunnerOutput:
        if isinstance(step, PrefillChunk):
            for token, position, slot in zip(
                step.token_ids, step.positions, step.slot_mapping, strict=True
            ):
                self._write(slot, token, position)
            context = self._read(step.block_table, step.num_context_tokens)
            assert tuple(context[step.positions[0] :]) == step.token_ids, "cached KV differs"
            if not step.is_last_chunk:
                return ModelRunnerOutput({})
            return ModelRunnerOutput({step.request_id: self.next_token(context)})
        for entry in step.entries:
            self._write(entry.slot, entry.token_id, entry.position)
        sampled = {}
        for entry in step.entries:
            context = self._read(entry.block_table, entry.position + 1)
            assert context[-1] == entry.token_id
            sampled[entry.request_id] = self.next_token(context)
        return ModelRunnerOutput(sampled)

    def _write(self, slot: int, token: int, position: int) -> None:
        if slot >= BS:  # block 0 is the write sink: nothing is stored
            self.kv[slot] = (token, position)

    def _read(self, block_table: Sequence[int], num_tokens: int) -> list[int]:
        context = []
        for position in range(num_tokens):
            slot = block_table[position // BS] * BS + position % BS
            token, stored_position = self.kv.get(slot, (-1, -1))
            assert stored_position == position, f"KV of position {position} missing at {slot}"
            context.append(token)
        return context


@dataclass(frozen=True)
class StepRecord:
    step: ScheduledStep
    outputs: tuple[RequestOutput, ...]

    @property
    def label(self) -> str:
        """``"a:1"``: prefill chunk 1 of request a; ``"D:a,b"``: a decode step of a and b."""
        if isinstance(self.step, PrefillChunk):
            return f"{self.step.request_id}:{self.step.chunk_index}"
        return "D:" + ",".join(e.request_id for e in self.step.entries)

    @property
    def slots(self) -> tuple[int, ...]:
        if isinstance(self.step, PrefillChunk):
            return self.step.slot_mapping
        return tuple(e.slot for e in self.step.entries)

    @property
    def block_tables(self) -> dict[str, tuple[int, ...]]:
        if isinstance(self.step, PrefillChunk):
            return {self.step.request_id: self.step.block_table}
        return {e.request_id: e.block_table for e in self.step.entries}

    @property
    def positions(self) -> tuple[int, ...]:
        """Decode steps only: the position of each entry."""
        assert isinstance(self.step, DecodeBatch)
        return tuple(e.position for e in self.step.entries)


@dataclass
class Driver:
    """Runs the engine loop one step at a time; checks the pool's integrity after every step."""

    sched: Scheduler
    runner: FakeRunner = field(default_factory=FakeRunner)
    trace: list[StepRecord] = field(default_factory=list)
    tokens: dict[str, list[int]] = field(default_factory=dict)
    finish: dict[str, FinishReason] = field(default_factory=dict)
    cached: dict[str, int] = field(default_factory=dict)
    """num_cached_tokens each request reported (every output of a request must agree)."""
    extra_holders: dict[str, Sequence[int]] = field(default_factory=dict)
    """Block references taken by the test itself (blocks stolen from the pool)."""

    def add(self, request_id: str, prompt: Sequence[int], max_tokens: int, **kw: object) -> None:
        self.sched.add_request(request_id, prompt, max_tokens, **kw)

    def check(self) -> None:
        if self.extra_holders:
            self.sched.pool.check_integrity({**self.sched.block_tables(), **self.extra_holders})
        else:
            self.sched.check_integrity()

    def step(self) -> StepRecord | None:
        step = self.sched.schedule()
        if step is None:
            return None
        outputs = self.sched.update_from_output(step, self.runner.execute(step))
        self.check()
        for out in outputs:
            self.record(out)
        record = StepRecord(step, tuple(outputs))
        self.trace.append(record)
        return record

    def record(self, out: RequestOutput) -> None:
        rid = out.request_id
        assert rid not in self.finish, f"output for {rid} after it finished"
        assert self.cached.setdefault(rid, out.num_cached_tokens) == out.num_cached_tokens
        self.tokens.setdefault(rid, []).extend(out.new_token_ids)
        if out.finish_reason is not None:
            self.finish[rid] = out.finish_reason

    def run(self, max_steps: int = 10_000) -> list[str]:
        """Step until nothing is scheduled; returns the labels of the steps run."""
        labels = []
        for _ in range(max_steps):
            record = self.step()
            if record is None:
                return labels
            labels.append(record.label)
        raise AssertionError(f"still running after {max_steps} steps")

    def labels(self) -> list[str]:
        return [record.label for record in self.trace]

    def last_tables(self) -> dict[str, tuple[int, ...]]:
        """Each request's block table as last sent to the runner."""
        return {rid: t for record in self.trace for rid, t in record.block_tables.items()}


def refs(sched: Scheduler, *block_ids: int) -> list[int]:
    return [sched.pool.ref_count(b) for b in block_ids]


def hashed(sched: Scheduler, *block_ids: int) -> list[bool]:
    """Whether each block is registered in the prefix cache."""
    return [sched.pool.block_hash(b) is not None for b in block_ids]


def free_queue(sched: Scheduler) -> tuple[int, ...]:
    """The pool's free queue, front (evicted first) to back."""
    return tuple(sched.pool.free_block_ids())
