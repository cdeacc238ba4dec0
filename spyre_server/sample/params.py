"""What the sampler is told about each sequence: its parameters and, for penalties and
``min_tokens``, the tokens it has seen so far."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from spyre_server.sample.structured_output import Grammar, GrammarState

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    """0 generates nothing: the prompt is only scored (with ``prompt_logprobs``)."""
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    """Strings that end the output; the stop string itself is not returned."""
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    """Return the sampled token's logprob and this many top alternatives (0..20)."""
    prompt_logprobs: int | None = None
    """Return the logprob of every prompt token after the first (the first has none) and this
    many top alternatives (0..20). Such a request computes its whole prompt (no cache lookup)."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it occurs in the output (as OpenAI)."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token that occurs in the output (as OpenAI)."""
    repetition_penalty: float = 1.0
    """Logits of tokens in the prompt or the output: positive ones divided by it, negative ones
    multiplied (as vLLM and HF transformers)."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs added to the logits before sampling (-100..100)."""
    min_tokens: int = 0
    """EOS and ``stop_token_ids`` cannot be sampled before this many tokens were generated."""
    grammar: Grammar | None = None
    """Structured output: only tokens this grammar allows are sampled; the sequence ends when
    it is complete (at EOS, or right away when there is no EOS)."""

    def __post_init__(self) -> None:
        errors = []
        if self.max_tokens < 0:
            errors.append(f"max_tokens must be at least 0, got {self.max_tokens}")
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            errors.append("max_tokens 0 only scores a prompt: it needs prompt_logprobs")
        if not self.temperature >= 0:
            errors.append(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            errors.append(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            errors.append(f"top_k must be >= 1 or unset, got {self.top_k}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                errors.append(f"{name} must be in 0..{MAX_LOGPROBS}, got {value}")
        if any(not s for s in self.stop):
            errors.append("stop strings must not be empty")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                errors.append(f"{name} must be in -2..2, got {getattr(self, name)}")
        if not self.repetition_penalty > 0:
            errors.append(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if any(not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS for _, bias in self.logit_bias):
            errors.append(f"logit_bias values must be in -{MAX_LOGIT_BIAS:g}..{MAX_LOGIT_BIAS:g}")
        if self.min_tokens < 0:
            errors.append(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens and self.min_tokens > self.max_tokens:
            errors.append(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        if errors:
            raise ValueError("; ".join(errors))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def needs_history(self) -> bool:
        """The sampler must see the tokens so far (penalties, ``min_tokens``)."""
        return bool(
            self.frequency_penalty
            or self.presence_penalty
            or self.repetition_penalty != 1.0
            or self.min_tokens
        )


@dataclass(slots=True)
class SequenceSampling:
    """One sequence as the sampler sees it. ``output_token_ids`` is the scheduler's own list of
    the request's output tokens (read here, written only by the scheduler);
    ``min_tokens_stop_ids`` are the ids masked while fewer than ``params.min_tokens`` tokens
    exist (its stop token ids, and EOS unless ignored)."""

    params: SamplingParams
    prompt_token_ids: tuple[int, ...] = ()
    output_token_ids: list[int] = field(default_factory=list)
    min_tokens_stop_ids: tuple[int, ...] = ()
    grammar: GrammarState | None = None
    """The sequence's matcher of ``params.grammar``; the engine advances it."""


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    """The most likely tokens and their logprobs, best first."""
