"""The request checks every path into the engine runs once, at its outermost layer."""

from __future__ import annotations

import pytest

from spyre_server.engine.validation import (
    InvalidRequest,
    RequestLimits,
    check_max_tokens,
    check_prompt,
    resolve_max_tokens,
)

LIMITS = RequestLimits(max_model_len=512, vocab_size=100)


@pytest.mark.parametrize(
    ("prompt", "message", "code"),
    [
        ([], "at least one token", None),
        ([1, 100, 2], r"token id 100 is outside the vocabulary \(0..99\)", None),
        ([1, -1], r"token id -1 is outside the vocabulary", None),
        ([1] * 512, "requested 512 tokens in the prompt, which leaves no room", "context_length"),
    ],
)
def test_check_prompt_refuses(prompt: list[int], message: str, code: str | None) -> None:
    with pytest.raises(InvalidRequest, match=message) as caught:
        check_prompt(prompt, LIMITS)
    assert caught.value.field == "prompt"
    assert caught.value.code == (None if code is None else "context_length_exceeded")


def test_check_prompt_accepts_the_limits() -> None:
    check_prompt([0, 99] + [5] * 509, LIMITS)  # 511 tokens leave room for one


def test_max_tokens_must_fit_max_model_len() -> None:
    check_max_tokens(12, 500, LIMITS)  # 512 exactly
    with pytest.raises(InvalidRequest, match=r"requested 513 tokens \(500 in the prompt, 13 in"):
        check_max_tokens(13, 500, LIMITS)


def test_resolve_max_tokens_defaults_within_the_room() -> None:
    assert resolve_max_tokens(None, 500, LIMITS, default=256) == 12
    assert resolve_max_tokens(None, 10, LIMITS, default=256) == 256
    assert resolve_max_tokens(7, 10, LIMITS, default=256) == 7
    with pytest.raises(InvalidRequest) as caught:
        resolve_max_tokens(503, 10, LIMITS, default=256)
    assert (caught.value.field, caught.value.code) == ("max_tokens", "context_length_exceeded")
