"""Request bodies of the OpenAI-compatible endpoints (pydantic).

Unknown fields are refused (a typo such as ``max_token`` is a 400 naming it, never silently
dropped). Fields of the OpenAI API that this server does not implement are declared, so that a
request carrying them with a meaningful value gets a 400 naming the field (see
``unsupported_fields``), while the neutral values some clients always send pass."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator
from pydantic.json_schema import SkipJsonSchema

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


Unsupported = SkipJsonSchema[Any]
"""A field this server does not implement: accepted with a neutral value only."""


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


def _is_neutral(value: Any) -> bool:
    """A value that asks for nothing: absent, null, false, empty."""
    return value is None or value is False or value == [] or value == {} or value == ""


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Text | None = None
    max_tokens: int | None = Field(None, ge=0)
    """0 only with ``echo`` (completions): score the prompt, generate nothing."""
    # Sampling fields left out (None) take the model's generation_config.json value, else
    # OpenAI's default (temperature 1, top_p 1, no top_k, repetition_penalty 1).
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
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
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(None, max_length=300)
    """Token id (as a string, as OpenAI's API has it) -> bias added to its logit (-100..100)."""
    min_tokens: int = Field(0, ge=0)
    response_format: dict[str, Any] | None = None
    """``{"type": "text" | "json_object" | "json_schema", "json_schema": {"schema": ...}}``."""
    # Known OpenAI / vLLM fields this server does not implement (see ``unsupported_fields``);
    # left out of the OpenAPI schema, which lists what the server does.
    tools: Unsupported = None
    tool_choice: Unsupported = None
    functions: Unsupported = None
    function_call: Unsupported = None
    parallel_tool_calls: Unsupported = None
    suffix: Unsupported = None
    guided_json: Unsupported = None
    guided_regex: Unsupported = None
    guided_choice: Unsupported = None
    guided_grammar: Unsupported = None
    # Fields vllm-router adds to every request it forwards, with these values; they ask for
    # what this server does anyway (special tokens left out of the text, stop strings trimmed,
    # no hidden states). Any other value is refused.
    skip_special_tokens: Unsupported = None
    no_stop_trim: Unsupported = None
    return_hidden_states: Unsupported = None

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.isdigit():
                raise ValueError(f"logit_bias keys are token ids; {key!r} is not one")
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values must be in -100..100, got {bias}")
        return value

    _unsupported_here: ClassVar[tuple[str, ...]] = ()
    """Unsupported fields of this endpoint only."""

    def unsupported_fields(self) -> list[str]:
        """Fields set to something this server cannot do; ``tool_choice: "none"`` and
        ``parallel_tool_calls`` without tools ask for nothing."""
        names = [
            name
            for name in (*_UNSUPPORTED, *self._unsupported_here)
            if name in self.model_fields_set and not _asks_for_nothing(name, getattr(self, name))
        ]
        if "tool_choice" in names and self.tool_choice in ("none", "auto") and not self.tools:
            names.remove("tool_choice")
        if "parallel_tool_calls" in names and not self.tools:
            names.remove("parallel_tool_calls")
        return names

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


_WHAT_WE_DO: dict[str, Any] = {"skip_special_tokens": True}
"""Unsupported fields whose one accepted value is this server's own behaviour."""


def _asks_for_nothing(name: str, value: Any) -> bool:
    if name in _WHAT_WE_DO:
        return value is None or value == _WHAT_WE_DO[name]
    return _is_neutral(value)


_UNSUPPORTED = (
    "skip_special_tokens",
    "no_stop_trim",
    "return_hidden_states",
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "parallel_tool_calls",
    "suffix",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)


class CompletionRequest(_SamplingFields):
    prompt: Text | list[Text] | list[NonNegInt] | list[list[NonNegInt]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    """Generate this many samples per prompt and return the ``n`` of highest cumulative
    logprob (not with ``stream``); ``None``: ``n``."""

    @property
    def num_samples(self) -> int:
        return self.best_of if self.best_of is not None else self.n

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
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    """Accepted and not passed on (the chat templates of the models served here ignore it)."""

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
    continue_final_message: Unsupported = None
    echo: Unsupported = None
    """vLLM's chat ``echo`` (repeat the last message); not implemented."""

    _unsupported_here: ClassVar[tuple[str, ...]] = ("continue_final_message", "echo")

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens
