"""Logprobs in the two OpenAI response shapes: completions' parallel lists, chat's entries."""

from __future__ import annotations

from typing import Any

from spyre_server.api.state import ServerState
from spyre_server.api.token_bytes import token_bytes
from spyre_server.sample.sampler import TokenLogprobs


def token_text(state: ServerState, token_id: int) -> str:
    return str(state.tokenizer.decode([token_id]))


def completion_logprobs(
    state: ServerState, entries: list[tuple[int, TokenLogprobs | None]]
) -> dict[str, Any]:
    """``entries``: each token id with its logprobs, ``None`` where it has none (the first
    prompt token of an echo)."""
    tokens = [token_text(state, token_id) for token_id, _ in entries]
    offsets = [0]
    for token in tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob if lp else None for _, lp in entries],
        "top_logprobs": [
            {token_text(state, t): v for t, v in lp.top} if lp else None for _, lp in entries
        ],
        "text_offset": offsets if tokens else [],
    }


def chat_logprobs(state: ServerState, logprobs: list[TokenLogprobs]) -> list[dict[str, Any]]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        raw = token_bytes(state.tokenizer, token_id)
        return {"token": token_text(state, token_id), "logprob": logprob, "bytes": list(raw)}

    return [
        {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
        for lp in logprobs
    ]
