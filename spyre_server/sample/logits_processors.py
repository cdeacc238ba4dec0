"""Changes to the logits before a token is chosen, vectorised over the rows that ask for them:
``min_tokens``, ``logit_bias``, then repetition, frequency and presence penalties (vLLM's order),
and last the structured-output grammar's token mask.

Python loops only run over rows and their token lists (to build index tensors), never over the
vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from spyre_server.sample.params import SequenceSampling


def apply_logits_processors(logits: torch.Tensor, rows: Sequence[SequenceSampling]) -> torch.Tensor:
    """``logits`` ``[len(rows), vocab]`` (float32) with every row's processors applied; the
    input itself is returned untouched when no row has any."""
    masked = [
        i
        for i, r in enumerate(rows)
        if r.params.min_tokens
        and len(r.output_token_ids) < r.params.min_tokens
        and r.min_tokens_stop_ids
    ]
    biased = [i for i, r in enumerate(rows) if r.params.logit_bias]
    penalised = [i for i, r in enumerate(rows) if _has_penalty(r)]
    constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
    if not (masked or biased or penalised or constrained):
        return logits
    logits = logits.clone()
    vocab = logits.shape[1]
    if masked:
        rows_i, cols = _pairs([(i, t) for i in masked for t in rows[i].min_tokens_stop_ids], vocab)
        logits[rows_i, cols] = float("-inf")
    if biased:
        pairs = [(i, t, b) for i in biased for t, b in rows[i].params.logit_bias if t < vocab]
        index = torch.tensor([(i, t) for i, t, _ in pairs], dtype=torch.long).reshape(-1, 2)
        values = torch.tensor([b for _, _, b in pairs], dtype=logits.dtype)
        logits.index_put_((index[:, 0], index[:, 1]), values, accumulate=True)
    if penalised:
        logits[penalised] = _penalise(logits[penalised], [rows[i] for i in penalised])
    if constrained:
        from spyre_server.sample.structured_output import apply_grammars

        part = logits[constrained]
        apply_grammars(part, [rows[i].grammar for i in constrained])  # type: ignore[misc]
        logits[constrained] = part
    return logits


def _has_penalty(row: SequenceSampling) -> bool:
    p = row.params
    return bool(p.frequency_penalty or p.presence_penalty or p.repetition_penalty != 1.0)


def _pairs(pairs: list[tuple[int, int]], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    kept = [(i, t) for i, t in pairs if 0 <= t < vocab]
    index = torch.tensor(kept, dtype=torch.long).reshape(-1, 2)
    return index[:, 0], index[:, 1]


def _counts(token_lists: Sequence[Sequence[int]], vocab: int) -> torch.Tensor:
    """``[rows, vocab]`` occurrence counts of each row's tokens (ids outside the vocabulary go
    to a dropped extra column)."""
    width = max((len(t) for t in token_lists), default=0)
    ids = torch.full((len(token_lists), max(width, 1)), vocab, dtype=torch.long)
    for row, tokens in enumerate(token_lists):
        if tokens:
            ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long).clamp_(0, vocab)
    counts = torch.zeros(len(token_lists), vocab + 1)
    counts.scatter_add_(1, ids, torch.ones(ids.shape))
    return counts[:, :vocab]


def _penalise(logits: torch.Tensor, rows: Sequence[SequenceSampling]) -> torch.Tensor:
    vocab = logits.shape[1]
    output_counts = _counts([r.output_token_ids for r in rows], vocab)
    in_output = output_counts > 0
    repetition = torch.tensor([r.params.repetition_penalty for r in rows]).unsqueeze(1)
    if bool((repetition != 1.0).any()):
        seen = in_output | (_counts([r.prompt_token_ids for r in rows], vocab) > 0)
        penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits = torch.where(seen, penalised, logits)
    frequency = torch.tensor([r.params.frequency_penalty for r in rows]).unsqueeze(1)
    presence = torch.tensor([r.params.presence_penalty for r in rows]).unsqueeze(1)
    return logits - frequency * output_counts - presence * in_output.to(logits.dtype)
