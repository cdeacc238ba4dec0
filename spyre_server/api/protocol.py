"""Request bodies of the OpenAI-compatible endpoints (pydantic; unknown fields are ignored)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

MAX_STOP_SEQUENCES = 16
MAX_N = 16

NonNegInt = Annotated[int, Field(ge=0)]


def _encodable(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("the text is not valid Unicode (it holds a lone surrogate)") from None
    return value


Text = Annotated[str, AfterValidator(_encodable)]
"""A string that can be encoded as UTF-8 (JSON's \\ud800 escapes can produce one that cannot)."""


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Text | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: Text | list[Text] | None = None
    stop_token_ids: list[NonNegInt] | None = Field(None, max_length=64)
    ignore_eos: bool = False
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    cache_salt: Text | None = Field(None, min_length=1, max_length=256)

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed")
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        return value

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_SamplingFields):
    prompt: Text | list[Text] | list[NonNegInt] | list[list[NonNegInt]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _prompt(
        cls, value: str | list[str] | list[int] | list[list[int]]
    ) -> str | list[str] | list[int] | list[list[int]]:
        if isinstance(value, list) and not value:
            raise ValueError("the prompt must not be empty")
        if isinstance(value, list) and any(isinstance(p, list | str) and not p for p in value):
            raise ValueError("no prompt in the list may be empty")
        if isinstance(value, str) and not value:
            raise ValueError("the prompt must not be empty")
        return value


class TextPart(BaseModel):
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Text | list[TextPart] | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens
