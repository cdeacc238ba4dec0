"""``POST /v1/completions/render`` and ``POST /v1/chat/completions/render``: the token ids the
server would run for a request, chat template included, without running it (vLLM's shapes: a
list of generate requests for completions, one for chat). vllm-router's ``cache_aware`` policy
calls them on every worker to learn a request's token ids."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request

from spyre_server.api.chat import chat_prompt
from spyre_server.api.completions import completion_prompts
from spyre_server.api.generation import resolve_max_tokens
from spyre_server.api.protocol import ChatCompletionRequest, CompletionRequest
from spyre_server.api.serving import check_request
from spyre_server.api.state import ServerState


def register_render_routes(
    app: FastAPI, state: ServerState, authorize: Callable[[Request], str | None]
) -> None:
    @app.post("/v1/completions/render")
    async def render_completion(body: CompletionRequest, request: Request) -> list[dict[str, Any]]:
        authorize(request)
        check_request(state, body)
        prompts = completion_prompts(state, body.prompt)
        rid = f"cmpl-{request.state.request_id}"
        return [
            _generate_request(state, f"{rid}-{i}", prompt, body, body.max_tokens)
            for i, prompt in enumerate(prompts)
        ]

    @app.post("/v1/chat/completions/render")
    async def render_chat(body: ChatCompletionRequest, request: Request) -> dict[str, Any]:
        authorize(request)
        check_request(state, body)
        prompt = chat_prompt(state, body)
        out = _generate_request(
            state, f"chatcmpl-{request.state.request_id}", prompt, body, body.max_new_tokens
        )
        out["assistant_tokens_mask"] = None
        return out


def _generate_request(
    state: ServerState,
    request_id: str,
    token_ids: list[int],
    body: CompletionRequest | ChatCompletionRequest,
    max_tokens: int | None,
) -> dict[str, Any]:
    return {
        "request_id": request_id,
        "token_ids": token_ids,
        "sampling_params": {
            "n": body.n,
            "max_tokens": resolve_max_tokens(max_tokens, len(token_ids), state.limits),
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": body.top_k,
            "seed": body.seed,
            "stop": body.stop_list,
            "stop_token_ids": body.stop_token_ids or [],
            "ignore_eos": body.ignore_eos,
        },
        "model": state.model_name,
        "stream": body.stream,
        "stream_options": None if body.stream_options is None else body.stream_options.model_dump(),
        "cache_salt": body.cache_salt,
        "token_offsets": None,
    }
