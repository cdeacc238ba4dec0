"""``/v1/completions`` and ``/v1/chat/completions``: streaming (SSE) and not."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from spyre_server.api.errors import APIError, sse_error
from spyre_server.api.generation import (
    Choice,
    Generation,
    check_prompt,
    make_params,
    resolve_max_tokens,
)
from spyre_server.api.protocol import ChatCompletionRequest, CompletionRequest
from spyre_server.api.state import ServerState
from spyre_server.api.token_bytes import token_bytes
from spyre_server.sampling import SamplingParams, TokenLogprobs

_DISCONNECT_POLL_SECONDS = 0.5


def register_generation_routes(
    app: FastAPI, state: ServerState, authorize: Callable[[Request], str | None]
) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        api_key = authorize(request)
        _check_model(state, body.model)
        if body.echo and body.logprobs is not None:
            raise APIError(400, "echo with logprobs is not supported yet", param="echo")
        prompts = _completion_prompts(state, body.prompt)
        params = [_sampling_params(state, body, p, body.logprobs) for p in prompts]
        generation = await _start(state, request, body, prompts, params, api_key)
        rid = f"cmpl-{request.state.request_id}"
        created = _now()
        prefix = [_text(state, p) if body.echo else "" for p in prompts]

        def choice_json(choice: Choice, text: str, logprobs: list[TokenLogprobs]) -> dict[str, Any]:
            return {
                "index": choice.index,
                "text": text,
                "logprobs": _completion_logprobs(state, logprobs)
                if body.logprobs is not None
                else None,
                "finish_reason": choice.finish_reason,
            }

        def envelope(choices: list[dict[str, Any]]) -> dict[str, Any]:
            return {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": state.model_name,
                "choices": choices,
            }

        if not body.stream:
            await _run_to_end(generation, request)
            out = envelope(
                [
                    choice_json(c, prefix[c.prompt_index] + c.text, c.logprobs)
                    for c in generation.choices
                ]
            )
            out["usage"] = generation.usage()
            return JSONResponse(out)

        async def events() -> AsyncIterator[str]:
            started: set[int] = set()
            async for choice, delta in generation.stream():
                text = delta.text
                if choice.index not in started:
                    started.add(choice.index)
                    text = prefix[choice.prompt_index] + text
                if text or delta.logprobs or delta.finished:
                    yield _sse(envelope([choice_json(choice, text, delta.logprobs)]))
            if body.stream_options is not None and body.stream_options.include_usage:
                usage = envelope([])
                usage["usage"] = generation.usage()
                yield _sse(usage)

        return _sse_response(events())

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        api_key = authorize(request)
        _check_model(state, body.model)
        prompt = _chat_prompt(state, body)
        top = body.top_logprobs if body.logprobs else None
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        max_tokens = body.max_new_tokens
        params = [
            _sampling_params(state, body, prompt, (top or 0) if body.logprobs else None, max_tokens)
        ]
        generation = await _start(state, request, body, [prompt], params, api_key)
        rid = f"chatcmpl-{request.state.request_id}"
        created = _now()

        def logprobs_json(logprobs: list[TokenLogprobs]) -> dict[str, Any] | None:
            return {"content": _chat_logprobs(state, logprobs)} if body.logprobs else None

        def envelope(kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
            return {
                "id": rid,
                "object": kind,
                "created": created,
                "model": state.model_name,
                "choices": choices,
            }

        if not body.stream:
            await _run_to_end(generation, request)
            out = envelope(
                "chat.completion",
                [
                    {
                        "index": c.index,
                        "message": {"role": "assistant", "content": c.text},
                        "logprobs": logprobs_json(c.logprobs),
                        "finish_reason": c.finish_reason,
                    }
                    for c in generation.choices
                ],
            )
            out["usage"] = generation.usage()
            return JSONResponse(out)

        async def events() -> AsyncIterator[str]:
            for choice in generation.choices:
                yield _sse(
                    envelope(
                        "chat.completion.chunk",
                        [
                            {
                                "index": choice.index,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ],
                    )
                )
            async for choice, delta in generation.stream():
                if delta.text or delta.logprobs or delta.finished:
                    yield _sse(
                        envelope(
                            "chat.completion.chunk",
                            [
                                {
                                    "index": choice.index,
                                    "delta": {"content": delta.text} if delta.text else {},
                                    "logprobs": logprobs_json(delta.logprobs),
                                    "finish_reason": choice.finish_reason,
                                }
                            ],
                        )
                    )
            if body.stream_options is not None and body.stream_options.include_usage:
                usage = envelope("chat.completion.chunk", [])
                usage["usage"] = generation.usage()
                yield _sse(usage)

        return _sse_response(events())


# ----------------------------------------------------------------------------- helpers
def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise APIError(
            404,
            f"the model {model!r} does not exist; this server serves {state.model_name!r}",
            param="model",
            code="model_not_found",
        )


def _completion_prompts(
    state: ServerState, prompt: str | list[str] | list[int] | list[list[int]]
) -> list[list[int]]:
    if isinstance(prompt, str):
        raw: list[str | list[int]] = [prompt]
    elif all(isinstance(p, int) for p in prompt):
        raw = [[int(p) for p in prompt]]  # type: ignore[arg-type]
    else:
        raw = list(prompt)  # type: ignore[arg-type]
    prompts = [list(state.tokenizer.encode(p)) if isinstance(p, str) else p for p in raw]
    for prompt_ids in prompts:
        check_prompt(prompt_ids, state.limits, "prompt")
    return prompts


def _chat_prompt(state: ServerState, body: ChatCompletionRequest) -> list[int]:
    messages = [{"role": m.role, "content": m.text} for m in body.messages]
    try:
        text = state.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, chat_template=state.chat_template
        )
    except Exception as exc:  # the template rejects the conversation (roles, order)
        raise APIError(
            400, f"the chat template rejects these messages: {exc}", param="messages"
        ) from None
    # The template already holds the special tokens it needs.
    prompt = [int(t) for t in state.tokenizer.encode(text, add_special_tokens=False)]
    check_prompt(prompt, state.limits, "messages")
    return prompt


def _sampling_params(
    state: ServerState,
    body: CompletionRequest | ChatCompletionRequest,
    prompt: list[int],
    logprobs: int | None,
    max_tokens: int | None = None,
) -> SamplingParams:
    requested = max_tokens if max_tokens is not None else body.max_tokens
    return make_params(
        max_tokens=resolve_max_tokens(requested, len(prompt), state.limits),
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=body.seed,
        stop=tuple(body.stop_list),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
    )


async def _start(
    state: ServerState,
    request: Request,
    body: CompletionRequest | ChatCompletionRequest,
    prompts: list[list[int]],
    params: list[SamplingParams],
    api_key: str | None,
) -> Generation:
    num_sequences = len(prompts) * body.n
    max_waiting = state.limits.max_waiting
    if num_sequences > max_waiting:
        raise APIError(
            400,
            f"this request asks for {num_sequences} sequences (prompts x n), more than the "
            f"{max_waiting} the server queues at once",
            param="prompt" if len(prompts) > 1 else "n",
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
        body.n,
        salt,
    )
    await generation.start()
    return generation


async def _run_to_end(generation: Generation, request: Request) -> None:
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


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    async def framed() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
        except APIError as exc:
            yield sse_error(exc)
        yield "data: [DONE]\n\n"

    return StreamingResponse(framed(), media_type="text/event-stream")


def _text(state: ServerState, token_ids: list[int]) -> str:
    return str(state.tokenizer.decode(token_ids, skip_special_tokens=True))


def _token_text(state: ServerState, token_id: int) -> str:
    return str(state.tokenizer.decode([token_id]))


def _completion_logprobs(state: ServerState, logprobs: list[TokenLogprobs]) -> dict[str, Any]:
    tokens = [_token_text(state, lp.token_id) for lp in logprobs]
    offsets = [0]
    for token in tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{_token_text(state, t): v for t, v in lp.top} for lp in logprobs],
        "text_offset": offsets if tokens else [],
    }


def _chat_logprobs(state: ServerState, logprobs: list[TokenLogprobs]) -> list[dict[str, Any]]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        raw = token_bytes(state.tokenizer, token_id)
        return {"token": _token_text(state, token_id), "logprob": logprob, "bytes": list(raw)}

    return [
        {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
        for lp in logprobs
    ]


def _now() -> int:
    return int(time.time())
