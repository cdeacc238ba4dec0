"""``POST /v1/completions``: streaming (SSE) and not."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from spyre_server.api.errors import APIError
from spyre_server.api.generation import Choice, check_prompt
from spyre_server.api.logprobs import completion_logprobs
from spyre_server.api.protocol import CompletionRequest
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


@router.post("/v1/completions")
async def create_completion(
    body: CompletionRequest,
    request: Request,
    state: Annotated[ServerState, Depends(server_state)],
) -> Any:
    check_request(state, body)
    if body.max_tokens == 0 and not body.echo:
        raise APIError(
            400,
            "max_tokens must be at least 1; 0 is accepted with echo (to score the prompt)",
            param="max_tokens",
        )
    _check_best_of(body)
    prompts = completion_prompts(state, body.prompt)
    ranked = body.num_samples > body.n  # ranking the samples needs their logprobs
    grammar = await compile_response_format(state, body)
    params = [
        sampling_params(
            state,
            body,
            p,
            logprobs=body.logprobs if body.logprobs is not None or not ranked else 0,
            max_tokens=body.max_tokens,
            prompt_logprobs=_prompt_logprobs(body),
            grammar=grammar,
        )
        for p in prompts
    ]
    generation = await start_generation(state, request, body, prompts, params, body.num_samples)
    response = _Response(state, body, f"cmpl-{request.state.request_id}", prompts)

    if not body.stream:
        await run_to_end(generation, request)
        choices = best_of(generation.choices, body.n) if ranked else generation.choices
        out = response.envelope([response.choice(c, c.text, c.logprobs, True) for c in choices])
        out["usage"] = generation.usage()
        return JSONResponse(out)

    async def events() -> AsyncIterator[str]:
        started: set[int] = set()
        async for choice, delta in generation.stream():
            first = choice.index not in started
            started.add(choice.index)
            if (first and body.echo) or delta.text or delta.logprobs or delta.finished:
                chunk = response.choice(choice, delta.text, delta.logprobs, first)
                yield sse(response.envelope([chunk]))
        if body.stream_options is not None and body.stream_options.include_usage:
            usage = response.envelope([])
            usage["usage"] = generation.usage()
            yield sse(usage)

    return sse_response(events())


def _check_best_of(body: CompletionRequest) -> None:
    if body.best_of is None:
        return
    if body.best_of < body.n:
        raise APIError(400, f"best_of ({body.best_of}) must be >= n ({body.n})", param="best_of")
    if body.best_of > body.n and body.stream:
        raise APIError(400, "best_of > n cannot be streamed", param="best_of")


def best_of(choices: list[Choice], n: int) -> list[Choice]:
    """Per prompt, the ``n`` samples of highest cumulative logprob (ties: the earlier sample),
    re-indexed ``prompt_index * n + rank``."""
    kept: list[Choice] = []
    by_prompt: dict[int, list[Choice]] = {}
    for choice in choices:
        by_prompt.setdefault(choice.prompt_index, []).append(choice)
    for prompt_index in sorted(by_prompt):
        samples = by_prompt[prompt_index]
        ranked = sorted(samples, key=lambda c: -sum(lp.logprob for lp in c.logprobs))
        for rank, choice in enumerate(ranked[:n]):
            kept.append(dataclasses.replace(choice, index=prompt_index * n + rank))
    return kept


def _prompt_logprobs(body: CompletionRequest) -> int | None:
    """Prompt logprobs are computed for ``echo`` with ``logprobs``; ``max_tokens`` 0 needs them
    too (it runs the prompt for nothing else)."""
    if body.echo and body.logprobs is not None:
        return body.logprobs
    return 0 if body.max_tokens == 0 else None


class _Response:
    """Builds the JSON of one completion response (whole, or chunk by chunk)."""

    def __init__(
        self, state: ServerState, body: CompletionRequest, rid: str, prompts: list[list[int]]
    ) -> None:
        self.state = state
        self.body = body
        self.rid = rid
        self.created = now()
        self.prefix = [_text(state, p) if body.echo else "" for p in prompts]
        """What each prompt's first chunk starts with (the prompt's text with ``echo``)."""

    def choice(
        self, choice: Choice, text: str, logprobs: list[TokenLogprobs], first: bool
    ) -> dict[str, Any]:
        """A choice, or the chunk of one; the ``first`` part of a choice carries the echo."""
        entries: list[tuple[int, TokenLogprobs | None]] = [(lp.token_id, lp) for lp in logprobs]
        if first and self.body.echo:
            text = self.prefix[choice.prompt_index] + text
            prompt_entries = zip(
                choice.prompt_token_ids, choice.prompt_logprobs or [], strict=False
            )
            entries = [*prompt_entries, *entries]
        return {
            "index": choice.index,
            "text": text,
            "logprobs": completion_logprobs(self.state, entries)
            if self.body.logprobs is not None
            else None,
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
        }

    def envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.rid,
            "object": "text_completion",
            "created": self.created,
            "model": self.state.model_name,
            "choices": choices,
        }


def completion_prompts(
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


def _text(state: ServerState, token_ids: list[int]) -> str:
    return str(state.tokenizer.decode(token_ids, skip_special_tokens=True))
