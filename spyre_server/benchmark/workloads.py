"""Workloads: the prompts of a benchmark, as exact token-id lists drawn with a seeded RNG.

Every workload is a list of conversations. A conversation's turns are sent one after another; the
single-request workloads are conversations of one turn. Prompt tokens are drawn uniformly from the
tokenizer's ordinary ids (``tokenizer.ordinary_token_ids``), so lengths are exact and unrelated
prompts share no prefix.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

WORKLOADS = ("prefix-repetition", "shared-system-prompt", "multi-turn")


@dataclass(frozen=True, slots=True)
class Conversation:
    """Requests sent in order, each after the previous one finished.

    ``turns[0]`` is the first prompt. Turn ``k > 0`` is sent as the history (the previous prompt,
    then the previous response's text encoded without special tokens) followed by ``turns[k]``.
    ``group`` is the prefix / system prompt / conversation the prompt belongs to."""

    group: int
    turns: tuple[tuple[int, ...], ...]
    output_len: int

    @property
    def num_turns(self) -> int:
        return len(self.turns)


def _random_ids(rng: random.Random, vocab: Sequence[int], num_tokens: int) -> tuple[int, ...]:
    return tuple(rng.choices(vocab, k=num_tokens))


def _check(vocab: Sequence[int], prompt_len: int, output_len: int) -> None:
    if not vocab:
        raise ValueError("the vocabulary is empty")
    if prompt_len < 1:
        raise ValueError("prompts need at least one token")
    if output_len < 1:
        raise ValueError("the output length must be at least 1")


def prefix_repetition(
    vocab: Sequence[int],
    seed: int,
    *,
    num_prompts: int,
    prefix_len: int,
    suffix_len: int,
    num_prefixes: int,
    output_len: int,
) -> list[Conversation]:
    """vLLM's prefix-repetition dataset: ``num_prefixes`` random prefixes; prompt ``i`` is prefix
    ``i % num_prefixes`` followed by its own random suffix (so the prompts spread over the
    prefixes evenly, counts differing by at most one); the list is shuffled with the seed."""
    _check(vocab, prefix_len + suffix_len, output_len)
    if num_prefixes < 1:
        raise ValueError("num_prefixes must be at least 1")
    rng = random.Random(seed)
    prefixes = [_random_ids(rng, vocab, prefix_len) for _ in range(num_prefixes)]
    out = [
        Conversation(
            i % num_prefixes,
            (prefixes[i % num_prefixes] + _random_ids(rng, vocab, suffix_len),),
            output_len,
        )
        for i in range(num_prompts)
    ]
    rng.shuffle(out)
    return out


def shared_system_prompt(
    vocab: Sequence[int],
    seed: int,
    *,
    num_groups: int,
    prompts_per_group: int,
    system_prompt_len: int,
    question_len: int,
    output_len: int,
) -> list[Conversation]:
    """SGLang's generated-shared-prefix dataset: ``num_groups`` random system prompts, each
    followed by ``prompts_per_group`` random questions of its own; shuffled with the seed."""
    _check(vocab, system_prompt_len + question_len, output_len)
    rng = random.Random(seed)
    out = []
    for group in range(num_groups):
        system = _random_ids(rng, vocab, system_prompt_len)
        out += [
            Conversation(group, (system + _random_ids(rng, vocab, question_len),), output_len)
            for _ in range(prompts_per_group)
        ]
    rng.shuffle(out)
    return out


def multi_turn(
    vocab: Sequence[int],
    seed: int,
    *,
    num_conversations: int,
    num_turns: int,
    turn_len: int,
    output_len: int,
) -> list[Conversation]:
    """``num_conversations`` chats of ``num_turns`` user turns of ``turn_len`` random tokens each;
    every turn resends the whole history (see Conversation)."""
    _check(vocab, turn_len, output_len)
    rng = random.Random(seed)
    return [
        Conversation(
            c, tuple(_random_ids(rng, vocab, turn_len) for _ in range(num_turns)), output_len
        )
        for c in range(num_conversations)
    ]


_BUILDERS: dict[str, Callable[..., list[Conversation]]] = {
    "prefix-repetition": prefix_repetition,
    "shared-system-prompt": shared_system_prompt,
    "multi-turn": multi_turn,
}


def build(
    workload: str, vocab: Sequence[int], seed: int, options: Mapping[str, int]
) -> list[Conversation]:
    """The workload named ``workload`` (one of WORKLOADS) with its keyword ``options``."""
    return _BUILDERS[workload](vocab, seed, **options)
