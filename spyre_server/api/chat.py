"""``POST /v1/chat/completions``: streaming (SSE) and not."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from spyre_server.api.errors import APIError
from spyre_server.api.generation import Choice, check_prompt
from spyre_server.api.logprobs import chat_logprobs
from spyre_server.api.protocol import ChatCompletionRequest
from spyre_server.api.serving import (
    check_request,
    compile_response_format,
    now,
    run_to_end,
    sampling_params,
    server_state,
    sse,
    sse_response,
    start_generation,
)
from spyre_server.api.state import ServerState
from spyre_server.sample.sampler import TokenLogprobs

router = APIRouter()


@router.post("/v1/chat/completions")
async def create_chat_completion(
    body: ChatCompletionRequest,
    request: Request,
    state: Annotated[ServerState, Depends(server_state)],
) -> Any:
    check_request(state, body)
    if body.max_new_tokens == 0:
        raise APIError(400, "max_tokens must be at least 1", param="max_tokens")
    prompt = chat_prompt(state, body)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    num_top = (body.top_logprobs or 0) if body.logprobs else None
    grammar = await compile_response_format(state, body)
    params = [
        sampling_params(
            state,
            body,
            prompt,
            logprobs=num_top,
            max_tokens=body.max_new_tokens,
            grammar=grammar,
        )
    ]
    generation = await start_generation(state, request, body, [prompt], params)
    response = _Response(state, body, f"chatcmpl-{request.state.request_id}")

    if not body.stream:
        await run_to_end(generation, request)
        out = response.envelope(
            "chat.completion",
            [
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": response.logprobs(c.logprobs),
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                for c in generation.choices
            ],
        )
        out["usage"] = generation.usage()
        return JSONResponse(out)

    async def events() -> AsyncIterator[str]:
        for choice in generation.choices:
            first = {"role": "assistant", "content": ""}
            yield sse(response.chunk(choice, first, None))
        async for choice, delta in generation.stream():
            if delta.text or delta.logprobs or delta.finished:
                content = {"content": delta.text} if delta.text else {}
                logprobs = response.logprobs(delta.logprobs)
                yield sse(response.chunk(choice, content, logprobs))
        if body.stream_options is not None and body.stream_options.include_usage:
            usage = response.envelope("chat.completion.chunk", [])
            usage["usage"] = generation.usage()
            yield sse(usage)

    return sse_response(events())


class _Response:
    """Builds the JSON of one chat response (whole, or chunk by chunk)."""

    def __init__(self, state: ServerState, body: ChatCompletionRequest, rid: str) -> None:
        self.state = state
        self.body = body
        self.rid = rid
        self.created = now()

    def logprobs(self, logprobs: list[TokenLogprobs]) -> dict[str, Any] | None:
        if not self.body.logprobs:
            return None
        return {"content": chat_logprobs(self.state, logprobs)}

    def chunk(
        self, choice: Choice, delta: dict[str, Any], logprobs: dict[str, Any] | None
    ) -> dict[str, Any]:
        return self.envelope(
            "chat.completion.chunk",
            [
                {
                    "index": choice.index,
                    "delta": delta,
                    "logprobs": logprobs,
                    "finish_reason": choice.finish_reason,
                    "stop_reason": choice.stop_reason,
                }
            ],
        )

    def envelope(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.rid,
            "object": kind,
            "created": self.created,
            "model": self.state.model_name,
            "choices": choices,
        }


def chat_prompt(state: ServerState, body: ChatCompletionRequest) -> list[int]:
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
