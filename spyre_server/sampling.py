"""Sampling parameters and the batched sampler (greedy, temperature, top-k, top-p, seeds, logprobs).

Everything is vectorised over the batch; only rows with a seed draw their noise from their own
generator. A seeded row's randomness depends only on (seed, position), so the same seed gives the
same output whatever else is in the batch, and a recomputed token is sampled the same way again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

MAX_LOGPROBS = 20
_GOLDEN = 0x9E3779B97F4A7C15
_MASK_63 = (1 << 63) - 1


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
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

    def __post_init__(self) -> None:
        errors = []
        if self.max_tokens < 1:
            errors.append(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not self.temperature >= 0:
            errors.append(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            errors.append(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            errors.append(f"top_k must be >= 1 or unset, got {self.top_k}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            errors.append(f"logprobs must be in 0..{MAX_LOGPROBS}, got {self.logprobs}")
        if any(not s for s in self.stop):
            errors.append("stop strings must not be empty")
        if errors:
            raise ValueError("; ".join(errors))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    """The most likely tokens and their logprobs, best first."""


@dataclass(frozen=True, slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int]
) -> SampleResult:
    """Sample one token per row of ``logits`` ``[batch, vocab]``; ``positions[i]`` is the position
    the sampled token will take (it keys the seeded noise)."""
    logits = logits.float()
    batch = logits.shape[0]
    greedy = torch.tensor([p.is_greedy for p in params])
    token_ids = logits.argmax(dim=-1)
    if not bool(greedy.all()):
        temperature = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params])
        scaled = logits / temperature.unsqueeze(1)
        scaled = _apply_top_k_top_p(scaled, params)
        probs = torch.softmax(scaled, dim=-1)
        noise = _exponential_noise(probs.shape, params, positions)
        sampled = (probs / noise).argmax(dim=-1)
        token_ids = torch.where(greedy, token_ids, sampled)

    logprobs: list[TokenLogprobs | None] = [None] * batch
    wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
    if wanted:
        rows = torch.log_softmax(logits[wanted], dim=-1)
        num_top = max(params[i].logprobs or 0 for i in wanted)
        top_values, top_ids = rows.topk(max(num_top, 1), dim=-1)
        chosen = rows.gather(1, token_ids[wanted].unsqueeze(1)).squeeze(1)
        for row, i in enumerate(wanted):
            n = params[i].logprobs or 0
            logprobs[i] = TokenLogprobs(
                token_id=int(token_ids[i]),
                logprob=float(chosen[row]),
                top=tuple(
                    zip(top_ids[row, :n].tolist(), top_values[row, :n].tolist(), strict=True)
                ),
            )
    return SampleResult(token_ids.tolist(), logprobs)


def _apply_top_k_top_p(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    vocab = logits.shape[1]
    top_k = [p.top_k if p.top_k is not None else vocab for p in params]
    top_p = [p.top_p for p in params]
    if all(k >= vocab for k in top_k) and all(p >= 1.0 for p in top_p):
        return logits
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab).unsqueeze(0)
    remove = ranks >= torch.tensor(top_k).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # the best token is always kept
    remove = mass_before >= torch.tensor(top_p).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, sorted_ids, sorted_logits)


def _exponential_noise(
    shape: torch.Size, params: Sequence[SamplingParams], positions: Sequence[int]
) -> torch.Tensor:
    """Exp(1) noise: argmax(probs / noise) is a sample from probs (the exponential race)."""
    noise = torch.empty(shape).exponential_()
    for i, p in enumerate(params):
        if p.seed is not None and not p.is_greedy:
            generator = torch.Generator().manual_seed((p.seed * _GOLDEN + positions[i]) & _MASK_63)
            noise[i].exponential_(generator=generator)
    return noise
