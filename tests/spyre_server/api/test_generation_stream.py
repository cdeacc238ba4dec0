"""``Generation.stream``: each delta comes with its choice as of that delta.

The producer (one task per choice) queues ``(choice, delta)`` as the engine hands deltas over;
the SSE writer builds each chunk's ``finish_reason`` from the choice it gets. When the engine
hands several deltas over at once the producer queues them all before the writer runs: with the
live choice in the queue, the last delta's finish reason was on every chunk still queued (a
stream with three "length" chunks, found by the schemathesis fuzz on a busy machine).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from scheduler import FinishReason
from spyre_server.api.generation import Generation
from spyre_server.api.metrics import ServerMetrics
from spyre_server.engine.core import RequestDelta
from spyre_server.sample.sampler import SamplingParams


class BurstEngine:
    """Hands a request's deltas over all at once, never suspending in between."""

    def __init__(self, deltas: list[RequestDelta]) -> None:
        self.deltas = deltas

    async def stream(self, request_id: str) -> AsyncIterator[RequestDelta]:
        for delta in self.deltas:
            yield delta


def delta(text: str, finish_reason: FinishReason | None = None) -> RequestDelta:
    return RequestDelta("r", text, [ord(text)], [], finish_reason, 3, 0)


def test_a_finish_is_only_on_the_delta_that_finished() -> None:
    engine = BurstEngine([delta("a"), delta("b"), delta("c", FinishReason.LENGTH)])
    metrics = ServerMetrics("micro", read_stats=lambda: None)  # type: ignore[arg-type,return-value]
    generation = Generation(
        engine,  # type: ignore[arg-type]
        metrics,
        "req",
        [[1, 2, 3]],
        [SamplingParams(max_tokens=3)],
        1,
        None,
    )

    async def consume() -> list[tuple[str | None, str]]:
        return [(choice.finish_reason, d.text) async for choice, d in generation.stream()]

    assert asyncio.run(consume()) == [(None, "a"), (None, "b"), ("length", "c")]
    # The choice itself holds the whole result (what a non-streamed response is built from).
    (choice,) = generation.choices
    assert (choice.text, choice.finish_reason) == ("abc", "length")
