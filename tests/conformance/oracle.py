"""HF transformers' own answers on a checkpoint: greedy tokens (a plain loop over the full
forward, no KV cache) and teacher-forced logprobs of given tokens."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class Greedy:
    tokens: list[int]
    logprobs: list[float]
    """Of each chosen token."""
    margins: list[float]
    """Top-1 minus top-2 logit at each step: how far float32 rounding is from a tie."""


@dataclass(frozen=True)
class Scored:
    chosen: list[float]
    """The logprob of each given token."""
    best: list[float]
    """The highest logprob at each of those positions."""


def load(path: Path, dtype: torch.dtype, **config_changes: Any) -> Any:
    """The checkpoint as HF's model class for it, in ``dtype``, eval mode; ``config_changes``
    set config attributes before the weights load (the same weights, other math)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    for key, value in config_changes.items():
        setattr(config, key, value)
    model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype)
    return model.eval()


@torch.no_grad()
def greedy(model: Any, prompt: list[int], max_tokens: int) -> Greedy:
    ids = list(prompt)
    logprobs, margins = [], []
    for _ in range(max_tokens):
        logits = model(torch.tensor([ids]), logits_to_keep=1).logits[0, -1].float()
        top = torch.topk(logits, 2)
        token = int(top.indices[0])
        logprobs.append(float(torch.log_softmax(logits, -1)[token]))
        margins.append(float(top.values[0] - top.values[1]))
        ids.append(token)
    return Greedy(ids[len(prompt) :], logprobs, margins)


@torch.no_grad()
def score(model: Any, prompt: list[int], tokens: list[int]) -> Scored:
    """Teacher-forced: one forward over the prompt and ``tokens`` (all but the last)."""
    ids = torch.tensor([prompt + tokens[:-1]])
    logits = model(ids, logits_to_keep=len(tokens)).logits[0].float()
    logprobs = torch.log_softmax(logits, -1)
    chosen = logprobs[torch.arange(len(tokens)), torch.tensor(tokens)]
    return Scored(chosen.tolist(), logprobs.max(-1).values.tolist())
