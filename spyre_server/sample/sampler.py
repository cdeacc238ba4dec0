"""The batched sampler (greedy, temperature, top-k, top-p, seeds, logprobs); the logits processors
(penalties, biases, min_tokens) run first, see logits_processors.py.

Everything is vectorised over the batch; only rows with a seed draw their random number from their
own generator. A seeded row's randomness depends only on (seed, position), so the same seed gives
the same output whatever else is in the batch, and a recomputed token is sampled the same way
again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from spyre_server.sample.logits_processors import apply_logits_processors
from spyre_server.sample.params import (
    MAX_LOGPROBS,
    SamplingParams,
    SequenceSampling,
    TokenLogprobs,
)

__all__ = [
    "MAX_LOGPROBS",
    "SampleResult",
    "SamplingParams",
    "SequenceSampling",
    "TokenLogprobs",
    "prompt_logprobs",
    "sample",
]

CANDIDATES = 256
"""Top-k / top-p sort only this many of the best tokens first (see ``_top_k_top_p``)."""
_GOLDEN = 0x9E3779B97F4A7C15
_MASK_63 = (1 << 63) - 1


@dataclass(frozen=True, slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def sample(
    logits: torch.Tensor,
    rows: Sequence[SamplingParams | SequenceSampling],
    positions: Sequence[int],
) -> SampleResult:
    """Sample one token per row of ``logits`` ``[batch, vocab]``; ``positions[i]`` is the position
    the sampled token will take (it keys the seeded randomness). A row given as bare
    ``SamplingParams`` has no history (no tokens so far). Logprobs are those of the model's
    logits, before temperature, penalties and biases (as vLLM's default)."""
    sequences = [r if isinstance(r, SequenceSampling) else SequenceSampling(r) for r in rows]
    params = [s.params for s in sequences]
    raw = logits.float()
    logits = apply_logits_processors(raw, sequences)
    batch = logits.shape[0]
    token_ids = logits.argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
    if random_rows:
        token_ids[random_rows] = _sample_random(
            logits[random_rows],
            [params[i] for i in random_rows],
            [positions[i] for i in random_rows],
        )

    logprobs: list[TokenLogprobs | None] = [None] * batch
    wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
    if wanted:
        scored = _token_logprobs(
            torch.log_softmax(raw[wanted], dim=-1),
            token_ids[wanted],
            [params[i].logprobs or 0 for i in wanted],
        )
        for i, entry in zip(wanted, scored, strict=True):
            logprobs[i] = entry
    return SampleResult(token_ids.tolist(), logprobs)


def prompt_logprobs(
    logprob_rows: torch.Tensor, targets: Sequence[int], num_top: int
) -> list[TokenLogprobs]:
    """The logprob of ``targets[i]`` under ``logprob_rows[i]`` (log-softmax rows of the positions
    before each target) and each row's ``num_top`` best tokens."""
    target_ids = torch.tensor(list(targets), dtype=torch.long)
    return _token_logprobs(logprob_rows.float(), target_ids, [num_top] * len(targets))


def _token_logprobs(
    logprob_rows: torch.Tensor, token_ids: torch.Tensor, num_top: Sequence[int]
) -> list[TokenLogprobs]:
    top_values, top_ids = logprob_rows.topk(max(max(num_top, default=0), 1), dim=-1)
    chosen = logprob_rows.gather(1, token_ids.unsqueeze(1)).squeeze(1).tolist()
    top_ids_list, top_values_list = top_ids.tolist(), top_values.tolist()
    ids = token_ids.tolist()
    return [
        TokenLogprobs(
            token_id=ids[row],
            logprob=chosen[row],
            top=tuple(zip(top_ids_list[row][:n], top_values_list[row][:n], strict=True)),
        )
        for row, n in enumerate(num_top)
    ]


def _sample_random(
    logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int]
) -> torch.Tensor:
    """One token id per row of ``logits`` (no row greedy), by inverse transform sampling: one
    uniform number per row picks a token from the row's cumulative distribution, in vocabulary
    order, or in probability order over the top-k / top-p candidates."""
    vocab = logits.shape[1]
    temperature = torch.tensor([p.temperature for p in params]).unsqueeze(1)
    scaled = logits / temperature
    uniform = _uniform(params, positions)
    restricted = [
        i for i, p in enumerate(params) if p.top_p < 1 or (p.top_k is not None and p.top_k < vocab)
    ]
    if not restricted:
        return _inverse_cdf(torch.softmax(scaled, dim=-1), uniform)
    token_ids = torch.empty(len(params), dtype=torch.long)
    if len(restricted) < len(params):
        free = sorted(set(range(len(params))) - set(restricted))
        token_ids[free] = _inverse_cdf(torch.softmax(scaled[free], dim=-1), uniform[free])
    weights, candidate_ids = _top_k_top_p(scaled[restricted], [params[i] for i in restricted])
    chosen = _inverse_cdf(weights, uniform[restricted])
    token_ids[restricted] = candidate_ids.gather(1, chosen.unsqueeze(1)).squeeze(1)
    return token_ids


def _top_k_top_p(
    scaled: torch.Tensor, params: Sequence[SamplingParams]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The candidate tokens of each row, best first, and their weights (0 where top-k or top-p
    removes them): ``([rows, n], [rows, n])``. Top-k applies first; top-p then keeps a token iff
    the probability mass (renormalised after top-k) of the tokens ranked before it is < top_p,
    so the best token is always kept.

    Only the best ``CANDIDATES`` tokens are sorted, unless a row's kept set may reach beyond
    them (a flat distribution); then more, up to the whole vocabulary."""
    vocab = scaled.shape[1]
    top_k = torch.tensor([p.top_k if p.top_k is not None else vocab for p in params])
    top_p = torch.tensor([p.top_p for p in params]).unsqueeze(1)
    log_total = torch.logsumexp(scaled, dim=-1, keepdim=True)
    num_candidates = min(vocab, max(CANDIDATES, *(min(p.top_k or 0, vocab) for p in params)))
    while True:
        values, ids = scaled.topk(num_candidates, dim=-1)
        probs = (values - log_total).exp_()
        top_k_cut = top_k <= num_candidates  # else the top-k set is the whole vocabulary
        probs.masked_fill_(torch.arange(num_candidates) >= top_k.unsqueeze(1), 0.0)
        mass = torch.where(top_k_cut, probs.sum(dim=-1), 1.0).unsqueeze(1)
        probs /= mass
        if num_candidates == vocab or bool((top_k_cut | (probs.sum(dim=-1) >= top_p[:, 0])).all()):
            break
        num_candidates = min(vocab, num_candidates * 4)
    mass_before = probs.cumsum(dim=-1) - probs
    return probs.masked_fill_(mass_before >= top_p, 0.0), ids


def _inverse_cdf(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Per row, the first index whose cumulative weight exceeds ``uniform`` times the row's total
    (never a zero-weight index)."""
    cdf = weights.double().cumsum(dim=-1)
    target = uniform.double().unsqueeze(1) * cdf[:, -1:]
    index = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return index.clamp_(max=weights.shape[1] - 1)


def _uniform(params: Sequence[SamplingParams], positions: Sequence[int]) -> torch.Tensor:
    """One U[0, 1) number per row; a seeded row's comes from its own (seed, position) stream."""
    uniform = torch.rand(len(params), dtype=torch.float64)
    for i, p in enumerate(params):
        if p.seed is not None:
            generator = torch.Generator().manual_seed((p.seed * _GOLDEN + positions[i]) & _MASK_63)
            uniform[i] = torch.rand((), dtype=torch.float64, generator=generator)
    return uniform
