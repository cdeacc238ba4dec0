"""What every generation endpoint shares: the server state, model check, starting a generation,
waiting for its end, and SSE framing."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from spyre_server.api.errors import APIError, sse_error
from spyre_server.api.generation import Generation, make_params, resolve_max_tokens
from spyre_server.api.protocol import ChatCompletionRequest, CompletionRequest
from spyre_server.api.state import ServerState
from spyre_server.sample.sampler import SamplingParams
from spyre_server.sample.structured_output import Grammar, StructuredOutputError

_DISCONNECT_POLL_SECONDS = 0.5


def server_state(request: Request) -> ServerState:
    """FastAPI dependency: the state ``create_app`` attached to the application."""
    state: ServerState = request.app.state.server
    return state


def check_model(state: ServerState, model: str | None) -> None:
    """A request naming another model than the one served is a 404 (``None``: this one)."""
    if model is not None and model != state.model_name:
        raise APIError(
            404,
            f"the model {model!r} does not exist; this server serves {state.model_name!r}",
            param="model",
            code="model_not_found",
        )


def check_request(state: ServerState, body: CompletionRequest | ChatCompletionRequest) -> None:
    """What every generation endpoint refuses before any work: another model, a field this
    server does not implement."""
    check_model(state, body.model)
    unsupported = body.unsupported_fields()
    if unsupported:
        raise APIError(
            400, f"{unsupported[0]!r} is not supported by this server", param=unsupported[0]
        )


async def compile_response_format(
    state: ServerState, body: CompletionRequest | ChatCompletionRequest
) -> Grammar | None:
    """The grammar of ``body.response_format`` (off the event loop: the first compile reads
    the whole vocabulary)."""
    if body.response_format is None:
        return None
    try:
        return await asyncio.to_thread(state.grammars.compile, body.response_format)
    except StructuredOutputError as exc:
        raise APIError(400, str(exc), param="response_format") from None


def sampling_params(
    state: ServerState,
    body: CompletionRequest | ChatCompletionRequest,
    prompt: list[int],
    *,
    logprobs: int | None,
    max_tokens: int | None,
    prompt_logprobs: int | None = None,
    grammar: Grammar | None = None,
) -> SamplingParams:
    """The engine's parameters for one prompt of ``body``; sampling fields it leaves out take
    the model's defaults, else OpenAI's."""
    model = state.generation_defaults
    return make_params(
        max_tokens=resolve_max_tokens(max_tokens, len(prompt), state.limits),
        temperature=_first(body.temperature, model.temperature, 1.0),
        top_p=_first(body.top_p, model.top_p, 1.0),
        top_k=body.top_k if body.top_k is not None else model.top_k,
        seed=body.seed,
        stop=tuple(body.stop_list),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        frequency_penalty=body.frequency_penalty,
        presence_penalty=body.presence_penalty,
        repetition_penalty=_first(body.repetition_penalty, model.repetition_penalty, 1.0),
        logit_bias=_logit_bias(state, body.logit_bias),
        min_tokens=body.min_tokens,
        grammar=grammar,
    )


def _first(requested: float | None, model_default: float | None, openai_default: float) -> float:
    if requested is not None:
        return requested
    return model_default if model_default is not None else openai_default


def _logit_bias(state: ServerState, bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    pairs = tuple((int(token), value) for token, value in (bias or {}).items())
    bad = next((t for t, _ in pairs if t >= state.limits.vocab_size), None)
    if bad is not None:
        raise APIError(
            400,
            f"logit_bias names token id {bad}, outside the vocabulary "
            f"(0..{state.limits.vocab_size - 1})",
            param="logit_bias",
        )
    return pairs


async def start_generation(
    state: ServerState,
    request: Request,
    body: CompletionRequest | ChatCompletionRequest,
    prompts: list[list[int]],
    params: list[SamplingParams],
    num_samples: int | None = None,
) -> Generation:
    """Queue ``num_samples`` (default ``body.n``) samples of every prompt; an HTTP error if the
    server cannot take them."""
    api_key = state.api_keys.key_of(request)
    num_samples = num_samples or body.n
    num_sequences = len(prompts) * num_samples
    max_waiting = state.limits.max_waiting
    if num_sequences > max_waiting:
        raise APIError(
            400,
            f"this request asks for {num_sequences} sequences (prompts x n), more than the "
            f"{max_waiting} the server queues at once",
            param="prompt" if len(prompts) > 1 else ("n" if num_samples == body.n else "best_of"),
        )
    if state.engine.num_waiting + num_sequences > max_waiting:
        raise APIError(429, "the server is busy: too many requests are waiting", code="queue_full")
    salt = body.cache_salt
    if api_key is not None and state.config.server.isolate_cache_per_api_key:
        salt = f"{state.api_keys.tenant_salt(api_key)}:{salt or ''}"
    generation = Generation(
        state.engine,
        state.metrics,
        request.state.request_id,
        prompts,
        params,
        num_samples,
        salt,
    )
    await generation.start()
    return generation


async def run_to_end(generation: Generation, request: Request) -> None:
    """Consume the whole generation; a client that goes away aborts it."""

    async def consume() -> None:
        async for _ in generation.stream():
            pass

    task = asyncio.create_task(consume())
    while not task.done():
        done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_SECONDS)
        if not done and await request.is_disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise APIError(499, "the client disconnected")
    task.result()


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    """Stream ``events``; an APIError on the way becomes an SSE error event; always ``[DONE]``."""

    async def framed() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
        except APIError as exc:
            yield sse_error(exc)
        yield "data: [DONE]\n\n"

    return StreamingResponse(framed(), media_type="text/event-stream")


def now() -> int:
    return int(time.time())
