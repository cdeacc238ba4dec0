"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's request and response shapes.

``/tokenize`` takes a completion body (``prompt``) or a chat body (``messages``, rendered with the
chat template exactly as ``/v1/chat/completions`` renders it). Routers (vllm-router
``cache_aware``) call it to learn a request's token ids when ``/v1/*/render`` is missing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator

from spyre_server.api.chat import chat_prompt
from spyre_server.api.errors import APIError
from spyre_server.api.protocol import ChatCompletionRequest, ChatMessage, NonNegInt, Text
from spyre_server.api.serving import check_model
from spyre_server.api.state import ServerState


class TokenizeRequest(BaseModel):
    """vLLM's ``TokenizeCompletionRequest`` (``prompt``) or ``TokenizeChatRequest``
    (``messages``): exactly one of the two."""

    model_config = ConfigDict(extra="ignore")

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None
    """Completion default: true. Chat default: false (the template holds the special tokens)."""
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Text | None = None
    tokens: list[NonNegInt]


def register_tokenize_routes(
    app: FastAPI, state: ServerState, authorize: Callable[[Request], str | None]
) -> None:
    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
        authorize(request)
        check_model(state, body.model)
        if body.messages is not None:
            token_ids = _chat_tokens(state, body, body.messages)
        else:
            assert body.prompt is not None
            special = True if body.add_special_tokens is None else body.add_special_tokens
            token_ids = [
                int(t) for t in state.tokenizer.encode(body.prompt, add_special_tokens=special)
            ]
        strs = list(state.tokenizer.convert_ids_to_tokens(token_ids))
        return {
            "count": len(token_ids),
            "max_model_len": state.limits.max_model_len,
            "tokens": token_ids,
            "token_strs": strs if body.return_token_strs else None,
        }

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
        authorize(request)
        check_model(state, body.model)
        vocab_size = state.limits.vocab_size
        bad = next((t for t in body.tokens if t >= vocab_size), None)
        if bad is not None:
            raise APIError(
                400,
                f"token id {bad} is outside the vocabulary (0..{vocab_size - 1})",
                param="tokens",
            )
        return {"prompt": str(state.tokenizer.decode(body.tokens))}


def _chat_tokens(state: ServerState, body: TokenizeRequest, chat: list[ChatMessage]) -> list[int]:
    if body.add_generation_prompt and not body.add_special_tokens:  # what the chat endpoint runs
        return chat_prompt(state, ChatCompletionRequest(messages=chat))
    messages = [{"role": m.role, "content": m.text} for m in chat]
    try:
        text = state.tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=body.add_generation_prompt,
            tokenize=False,
            chat_template=state.chat_template,
        )
    except Exception as exc:
        raise APIError(
            400, f"the chat template rejects these messages: {exc}", param="messages"
        ) from None
    return [
        int(t)
        for t in state.tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))
    ]
