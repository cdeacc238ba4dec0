"""Running a workload against a server: Poisson arrivals, the concurrency limit, the progress bar,
and the /metrics scrapes around the run."""

from __future__ import annotations

import asyncio
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx
from tqdm import tqdm

from spyre_server.benchmark.client import (
    Completion,
    auth_headers,
    completion_payload,
    stream_completion,
)
from spyre_server.benchmark.metrics import CacheDelta, cache_delta, scrape_cache_counters
from spyre_server.benchmark.workloads import Conversation

Encode = Callable[[str], list[int]]

SKIPPED = "not sent: an earlier turn of its conversation failed"


@dataclass(frozen=True, slots=True)
class RunSettings:
    """How to send a workload. ``request_rate``: conversations started per second on average
    (Poisson arrivals; ``inf``: all at once). ``max_concurrency``: at most this many conversations
    (so requests) in flight; a conversation holds its slot from its first turn to its last."""

    base_url: str
    model: str
    api_key: str | None = None
    request_rate: float = math.inf
    max_concurrency: int | None = None
    seed: int = 0
    ignore_eos: bool = True
    request_timeout_s: float = 600.0
    show_progress: bool = True


@dataclass(slots=True)
class RequestResult:
    """One request of the run. ``scheduled_s``: its conversation's arrival offset; ``sent_s``:
    when it was sent; both in seconds from the run's start."""

    conversation: int
    turn: int
    prompt_ids: list[int]
    output_len: int
    scheduled_s: float
    sent_s: float
    completion: Completion


@dataclass(slots=True)
class RunOutcome:
    """``results`` in the order the requests finished; ``duration_s`` from the run's start to the
    last finish; ``cache``: the server's prefix-cache counter change (``None``: unknown)."""

    results: list[RequestResult]
    duration_s: float
    cache: CacheDelta | None


def arrival_offsets(num_arrivals: int, request_rate: float, seed: int) -> list[float]:
    """Arrival times (s from the start) of a Poisson process of ``request_rate`` per second: the
    first at 0, then exponential gaps of mean ``1 / request_rate`` drawn with
    ``random.Random(f"arrivals/{seed}")``. All 0 when the rate is infinite."""
    if request_rate <= 0:
        raise ValueError("the request rate must be positive")
    if math.isinf(request_rate):
        return [0.0] * num_arrivals
    rng = random.Random(f"arrivals/{seed}")
    offsets = []
    now = 0.0
    for _ in range(num_arrivals):
        offsets.append(now)
        now += rng.expovariate(request_rate)
    return offsets


async def run_benchmark(
    settings: RunSettings, conversations: Sequence[Conversation], encode: Encode
) -> RunOutcome:
    """Send every conversation (see ``Conversation`` for how turns build on the history; ``encode``
    turns a response's text into token ids) and collect one RequestResult per turn. A failed
    request is recorded, never raised; the remaining turns of its conversation are recorded as
    failed without being sent."""
    limits = httpx.Limits(
        max_connections=None,
        max_keepalive_connections=min(settings.max_concurrency or len(conversations), 1000),
    )
    timeout = httpx.Timeout(settings.request_timeout_s, connect=min(settings.request_timeout_s, 30))
    url = f"{settings.base_url}/v1/completions"
    offsets = arrival_offsets(len(conversations), settings.request_rate, settings.seed)
    semaphore = asyncio.Semaphore(settings.max_concurrency) if settings.max_concurrency else None
    results: list[RequestResult] = []
    bar = tqdm(
        total=sum(c.num_turns for c in conversations),
        desc="bench",
        unit="req",
        file=sys.stderr,
        disable=not settings.show_progress,
    )

    async with httpx.AsyncClient(
        headers=auth_headers(settings.api_key), timeout=timeout, limits=limits
    ) as client:
        before = await scrape_cache_counters(client, settings.base_url, settings.model)
        start = time.perf_counter()

        def finish(result: RequestResult) -> None:
            results.append(result)
            bar.update(1)

        async def converse(index: int, conversation: Conversation, offset: float) -> None:
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if semaphore is not None:
                await semaphore.acquire()
            try:
                history: list[int] = []
                for turn, user_ids in enumerate(conversation.turns):
                    prompt = history + list(user_ids)
                    sent = time.perf_counter() - start
                    payload = completion_payload(
                        settings.model, prompt, conversation.output_len, settings.ignore_eos
                    )
                    completion = await stream_completion(client, url, payload)
                    finish(
                        RequestResult(
                            index, turn, prompt, conversation.output_len, offset, sent, completion
                        )
                    )
                    if not completion.ok:
                        for skipped in range(turn + 1, conversation.num_turns):
                            finish(
                                RequestResult(
                                    index,
                                    skipped,
                                    [],
                                    conversation.output_len,
                                    offset,
                                    time.perf_counter() - start,
                                    Completion(error=SKIPPED),
                                )
                            )
                        return
                    history = prompt + encode(completion.text)
            finally:
                if semaphore is not None:
                    semaphore.release()

        try:
            await asyncio.gather(*(converse(i, c, offsets[i]) for i, c in enumerate(conversations)))
        finally:
            bar.close()
        duration = time.perf_counter() - start
        after = await scrape_cache_counters(client, settings.base_url, settings.model)
    return RunOutcome(results, duration, cache_delta(before, after))
