"""Runs the engine requests behind one HTTP request: validation, sampling parameters, fan-out over
prompts and n samples, metrics, and merging their output streams."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from spyre_server.api.errors import APIError
from spyre_server.api.metrics import ServerMetrics
from spyre_server.engine import validation
from spyre_server.engine.async_engine import AsyncEngine, EngineDeadError
from spyre_server.engine.core import RequestDelta, RequestResult
from spyre_server.engine.validation import InvalidRequest, RequestLimits
from spyre_server.sample.sampler import SamplingParams


@dataclass(slots=True, kw_only=True)
class Choice(RequestResult):
    """One sample of one prompt, accumulated from its deltas."""

    index: int
    prompt_index: int
    prompt_token_ids: list[int]


@dataclass(frozen=True, slots=True)
class GenerationLimits:
    request: RequestLimits
    default_max_tokens: int
    max_waiting: int

    @property
    def max_model_len(self) -> int:
        return self.request.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.request.vocab_size


def check_prompt(token_ids: Sequence[int], limits: GenerationLimits, param: str) -> None:
    """``validation.check_prompt``, refused as HTTP 400 naming ``param``."""
    try:
        validation.check_prompt(token_ids, limits.request)
    except InvalidRequest as exc:
        raise APIError(400, str(exc), param=param, code=exc.code) from None


def resolve_max_tokens(
    requested: int | None, num_prompt_tokens: int, limits: GenerationLimits
) -> int:
    """``validation.resolve_max_tokens`` with the server's default, refused as HTTP 400."""
    try:
        return validation.resolve_max_tokens(
            requested, num_prompt_tokens, limits.request, limits.default_max_tokens
        )
    except InvalidRequest as exc:
        raise APIError(400, str(exc), param="max_tokens", code=exc.code) from None


def _sample_params(params: SamplingParams, sample_index: int) -> SamplingParams:
    """Sample j of a seeded request uses seed + j, so n samples differ (as in vLLM)."""
    if params.seed is None or sample_index == 0:
        return params
    return dataclasses.replace(params, seed=params.seed + sample_index)


def make_params(**kwargs: Any) -> SamplingParams:
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        raise APIError(400, str(exc)) from None


class Generation:
    """The engine requests of one HTTP request: ``n`` samples for each prompt.

    ``await start()`` adds them all (so a refused request is an HTTP error, not a broken
    stream); then ``stream()`` yields their deltas as they come.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        metrics: ServerMetrics,
        request_id: str,
        prompts: list[list[int]],
        params: list[SamplingParams],
        n: int,
        cache_salt: str | None,
    ) -> None:
        self._engine = engine
        self._metrics = metrics
        self._cache_salt = cache_salt
        self._n = n
        # Engine ids must be unique even when clients reuse an X-Request-Id.
        self._engine_prefix = f"{request_id}-{uuid.uuid4().hex[:12]}"
        self.choices = [
            Choice(index=i * n + j, prompt_index=i, prompt_token_ids=prompt)
            for i, prompt in enumerate(prompts)
            for j in range(n)
        ]
        self._params = [_sample_params(params[c.prompt_index], c.index % n) for c in self.choices]
        self._arrival = time.monotonic()

    def _engine_id(self, choice: Choice) -> str:
        return f"{self._engine_prefix}-{choice.index}"

    async def start(self) -> None:
        """Add every sample to the engine; on any refusal abort those added and raise."""
        ids = [self._engine_id(c) for c in self.choices]
        results = await asyncio.gather(
            *(
                self._engine.add_request(
                    engine_id,
                    choice.prompt_token_ids,
                    self._params[choice.index],
                    cache_salt=self._cache_salt,
                )
                for engine_id, choice in zip(ids, self.choices, strict=True)
            ),
            return_exceptions=True,
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if not errors:
            return
        for engine_id, result in zip(ids, results, strict=True):
            if not isinstance(result, BaseException):
                self._engine.abort(engine_id)
        if isinstance(errors[0], ValueError):
            raise APIError(400, str(errors[0]))
        if isinstance(errors[0], EngineDeadError):
            raise APIError(503, str(errors[0]), code="engine_dead")
        raise errors[0]

    async def stream(self) -> AsyncIterator[tuple[Choice, RequestDelta]]:
        """Deltas of all choices as they come, each with its choice as of that delta: a copy
        made when the delta arrived, so a finish that arrived later is not on earlier deltas
        still waiting in the queue (the choices themselves hold the latest state)."""
        queue: asyncio.Queue[tuple[Choice, RequestDelta] | BaseException | None] = asyncio.Queue()
        tasks = [asyncio.create_task(self._run_choice(c, queue)) for c in self.choices]
        remaining = len(tasks)
        try:
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _run_choice(
        self,
        choice: Choice,
        queue: asyncio.Queue[tuple[Choice, RequestDelta] | BaseException | None],
    ) -> None:
        arrival = last = self._arrival
        metrics = self._metrics
        try:
            async for delta in self._engine.stream(self._engine_id(choice)):
                now = time.monotonic()
                if delta.token_ids:
                    if not choice.token_ids:
                        metrics.ttft.observe(now - arrival)
                    else:
                        metrics.itl.observe((now - last) / len(delta.token_ids))
                    last = now
                    metrics.generation_tokens.inc(len(delta.token_ids))
                choice.apply(delta)
                if delta.finished:
                    if delta.error is not None:
                        raise APIError(500, delta.error, code="engine_error")
                    metrics.e2e.observe(now - arrival)
                    if choice.index % self._n == 0:  # a prompt counts once, whatever n is
                        metrics.prompt_tokens.inc(len(choice.prompt_token_ids))
                # A snapshot: the next deltas update `choice` before the consumer may read this
                # one (its finish_reason would then be on every chunk still queued).
                queue.put_nowait((dataclasses.replace(choice), delta))
        except APIError as exc:
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(None)

    def usage(self) -> dict[str, Any]:
        """Prompts are counted once each, whatever ``n`` is."""
        first_samples = {c.prompt_index: c for c in self.choices if c.index % self._n == 0}
        prompt_tokens = sum(len(c.prompt_token_ids) for c in first_samples.values())
        completion_tokens = sum(len(c.token_ids) for c in self.choices)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {
                "cached_tokens": sum(c.num_cached_tokens for c in first_samples.values())
            },
        }
