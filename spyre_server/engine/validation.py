"""What a request must satisfy before it reaches the engine.

Checked once, at the outermost layer of each path into the engine: the HTTP API (generation and
render endpoints) and the offline ``LLM``. ``LLMEngine`` and the scheduler trust it: the prompt
is non-empty, every id is in the vocabulary, and prompt + max_tokens fits ``max_model_len``.
The scheduler itself checks only what it owns (request ids in use, KV blocks, the batch x tkv
limit).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RequestLimits:
    max_model_len: int
    vocab_size: int


class InvalidRequest(ValueError):
    """A request the model cannot take. ``field`` names what is wrong (``prompt`` or
    ``max_tokens``); ``code`` is OpenAI's error code where it has one."""

    def __init__(self, message: str, *, field: str, code: str | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.code = code


def check_prompt(token_ids: Sequence[int], limits: RequestLimits) -> None:
    """The prompt is non-empty, in the vocabulary, and leaves room for at least one token."""
    if not token_ids:
        raise InvalidRequest("the prompt must contain at least one token", field="prompt")
    bad = next((t for t in token_ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise InvalidRequest(
            f"token id {bad} is outside the vocabulary (0..{limits.vocab_size - 1})",
            field="prompt",
        )
    if len(token_ids) >= limits.max_model_len:
        raise context_length_error(limits, len(token_ids), None)


def check_max_tokens(max_tokens: int, num_prompt_tokens: int, limits: RequestLimits) -> None:
    """Prompt + max_tokens fits ``max_model_len``."""
    if num_prompt_tokens + max_tokens > limits.max_model_len:
        raise context_length_error(limits, num_prompt_tokens, max_tokens)


def resolve_max_tokens(
    requested: int | None, num_prompt_tokens: int, limits: RequestLimits, default: int
) -> int:
    """The request's max_tokens: as requested (checked), else ``default`` capped by the room
    the prompt leaves."""
    if requested is None:
        return min(default, limits.max_model_len - num_prompt_tokens)
    check_max_tokens(requested, num_prompt_tokens, limits)
    return requested


def context_length_error(
    limits: RequestLimits, num_prompt_tokens: int, max_tokens: int | None
) -> InvalidRequest:
    """OpenAI's wording and code, which client libraries match to detect an overflow."""
    if max_tokens is None:
        requested = f"{num_prompt_tokens} tokens in the prompt, which leaves no room for output"
    else:
        requested = (
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, "
            f"{max_tokens} in the completion)"
        )
    return InvalidRequest(
        f"This model's maximum context length is {limits.max_model_len} tokens. However, you "
        f"requested {requested}. Please reduce the length of the prompt or the completion.",
        field="prompt" if max_tokens is None else "max_tokens",
        code="context_length_exceeded",
    )
