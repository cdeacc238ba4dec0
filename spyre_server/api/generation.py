"""Runs the engine requests behind one HTTP request: validation, sampling parameters, fan-out over
prompts and n samples, metrics, and merging their output streams."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from spyre_server.api.errors import APIError
from spyre_server.api.metrics import ServerMetrics
from spyre_server.async_engine import AsyncEngine, EngineDeadError
from spyre_server.engine import RequestDelta
from spyre_server.sampling import SamplingParams, TokenLogprobs


@dataclass(slots=True)
class Choice:
    """One sample of one prompt, accumulated from its deltas."""

    index: int
    prompt_index: int
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    """What stopped it with ``finish_reason`` "stop": the stop token id or stop string (None: EOS)."""
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass(frozen=True, slots=True)
class GenerationLimits:
    max_model_len: int
    vocab_size: int
    default_max_tokens: int
    max_waiting: int


def check_prompt(token_ids: Sequence[int], limits: GenerationLimits, param: str) -> None:
    if not token_ids:
        raise APIError(400, "the prompt must contain at least one token", param=param)
    bad = next((t for t in token_ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise APIError(
            400,
            f"token id {bad} is outside the vocabulary (0..{limits.vocab_size - 1})",
            param=param,
        )
    if len(token_ids) >= limits.max_model_len:
        raise context_length_error(limits, len(token_ids), None, param)


def context_length_error(
    limits: GenerationLimits, num_prompt_tokens: int, max_tokens: int | None, param: str
) -> APIError:
    """OpenAI's wording and code, which client libraries match to detect an overflow."""
    if max_tokens is None:
        requested = f"{num_prompt_tokens} tokens in the prompt, which leaves no room for output"
    else:
        requested = (
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, "
            f"{max_tokens} in the completion)"
        )
    return APIError(
        400,
        f"This model's maximum context length is {limits.max_model_len} tokens. However, you "
        f"requested {requested}. Please reduce the length of the prompt or the completion.",
        param=param,
        code="context_length_exceeded",
    )


def resolve_max_tokens(
    requested: int | None, num_prompt_tokens: int, limits: GenerationLimits
) -> int:
    room = limits.max_model_len - num_prompt_tokens
    if requested is None:
        return min(limits.default_max_tokens, room)
    if requested > room:
        raise context_length_error(limits, num_prompt_tokens, requested, "max_tokens")
    return requested


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
                choice.text += delta.text
                choice.token_ids += delta.token_ids
                choice.logprobs += delta.logprobs
                choice.num_cached_tokens = delta.num_cached_tokens
                if delta.prompt_logprobs is not None:
                    choice.prompt_logprobs = delta.prompt_logprobs
                if delta.finished:
                    if delta.error is not None:
                        raise APIError(500, delta.error, code="engine_error")
                    assert delta.finish_reason is not None
                    choice.finish_reason = str(delta.finish_reason)
                    choice.stop_reason = delta.stop_reason
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
