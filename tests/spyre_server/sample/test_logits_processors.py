"""Logits processors (spyre_server/sample/logits_processors.py): min_tokens, logit_bias, repetition,
frequency and presence penalties, with exact values; and how ``sample`` uses them."""

from __future__ import annotations

import math

import pytest
import torch

from spyre_server.sample.logits_processors import apply_logits_processors
from spyre_server.sample.sampler import SamplingParams, SequenceSampling, prompt_logprobs, sample

GREEDY = SamplingParams(temperature=0)


def seq(
    params: SamplingParams, prompt: tuple[int, ...] = (), output: tuple[int, ...] = ()
) -> SequenceSampling:
    return SequenceSampling(params, prompt, list(output), min_tokens_stop_ids=(0, 6))


def test_frequency_and_presence_penalties_subtract_per_occurrence_and_once() -> None:
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=1.0)
    out = apply_logits_processors(logits, [seq(params, prompt=(1,), output=(3, 3, 5))])
    # token 3: 1 - 0.5 * 2 - 1 = -1; token 5: 1 - 0.5 - 1 = -0.5; the prompt's token 1 untouched
    assert out.tolist() == [[1.0, 1.0, 1.0, -1.0, 1.0, -0.5]]


def test_negative_penalties_raise_the_logits() -> None:
    logits = torch.zeros(1, 4)
    params = SamplingParams(frequency_penalty=-1.0, presence_penalty=-0.5)
    out = apply_logits_processors(logits, [seq(params, output=(2, 2))])
    assert out.tolist() == [[0.0, 0.0, 2.5, 0.0]]


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    logits = torch.tensor([[2.0, 2.0, -2.0, 1.0, -1.0]])
    params = SamplingParams(repetition_penalty=2.0)
    # prompt holds 1, output holds 2: both seen; 0, 3 and 4 were never seen
    out = apply_logits_processors(logits, [seq(params, prompt=(1,), output=(2,))])
    assert out.tolist() == [[2.0, 1.0, -4.0, 1.0, -1.0]]


def test_logit_bias_adds_to_the_named_tokens() -> None:
    logits = torch.tensor([[0.5, 0.5, 0.5, 0.5]])
    params = SamplingParams(logit_bias=((0, -100.0), (3, 2.0)))
    out = apply_logits_processors(logits, [seq(params)])
    assert out.tolist() == [[-99.5, 0.5, 0.5, 2.5]]


def test_min_tokens_masks_stop_ids_until_enough_tokens_exist() -> None:
    logits = torch.zeros(2, 8)
    params = SamplingParams(min_tokens=2)
    out = apply_logits_processors(logits, [seq(params, output=(4,)), seq(params, output=(4, 5))])
    # row 0 has one token < 2: EOS (0) and the stop token 6 are masked; row 1 has two: free
    assert out[0].tolist() == [-math.inf, 0, 0, 0, 0, 0, -math.inf, 0]
    assert out[1].tolist() == [0.0] * 8


def test_rows_without_processors_and_the_input_are_untouched() -> None:
    logits = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    before = logits.clone()
    rows = [seq(GREEDY), seq(SamplingParams(presence_penalty=1.0), output=(1,)), seq(GREEDY)]
    out = apply_logits_processors(logits, rows)
    assert torch.equal(logits, before)
    assert torch.equal(out[0], before[0]) and torch.equal(out[2], before[2])
    assert out[1].tolist() == [4.0, 4.0, 6.0, 7.0]
    # no processor at all: the very same tensor comes back (no copy per step)
    assert apply_logits_processors(logits, [seq(GREEDY)] * 3) is logits


def test_sample_chooses_from_processed_logits_but_reports_raw_logprobs() -> None:
    logits = torch.tensor([[3.0, 1.0, 0.0, 0.0]])
    biased = SamplingParams(temperature=0, logprobs=1, logit_bias=((2, 10.0),))
    result = sample(logits, [seq(biased)], [0])
    assert result.token_ids == [2]
    raw = torch.log_softmax(logits, dim=-1)[0]
    assert result.logprobs[0] is not None
    assert result.logprobs[0].logprob == pytest.approx(float(raw[2]), abs=1e-6)
    assert result.logprobs[0].top[0][0] == 0  # the raw distribution's best
    # the same row as bare SamplingParams without bias: argmax
    assert sample(logits, [GREEDY], [0]).token_ids == [0]


def test_min_tokens_keeps_greedy_off_eos() -> None:
    logits = torch.tensor([[5.0, 1.0, 2.0, 0.0, 0.0, 0.0, 4.0]])  # EOS (0) then stop id 6 best
    params = SamplingParams(temperature=0, min_tokens=1)
    assert sample(logits, [seq(params)], [0]).token_ids == [2]
    assert sample(logits, [seq(params, output=(2,))], [1]).token_ids == [0]


def test_presence_penalty_changes_a_greedy_choice_in_a_mixed_batch() -> None:
    logits = torch.tensor([[2.0, 1.5, 0.0], [2.0, 1.5, 0.0]])
    rows = [
        seq(GREEDY, output=(0,)),
        seq(SamplingParams(temperature=0, presence_penalty=1.0), output=(0,)),
    ]
    assert sample(logits, rows, [1, 1]).token_ids == [0, 1]


def test_prompt_logprobs_are_the_targets_log_softmax_and_the_best_tokens() -> None:
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(3))
    rows = torch.log_softmax(logits, dim=-1)
    targets = [7, 0, 49, 7, 12]
    scored = prompt_logprobs(rows, targets, 3)
    for i, entry in enumerate(scored):
        assert entry.token_id == targets[i]
        assert entry.logprob == float(rows[i, targets[i]])
        values, ids = rows[i].topk(3)
        assert entry.top == tuple(zip(ids.tolist(), values.tolist(), strict=True))
    assert [e.top for e in prompt_logprobs(rows, targets, 0)] == [()] * 5


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("frequency_penalty", 2.5),
        ("presence_penalty", -3.0),
        ("repetition_penalty", 0.0),
        ("logit_bias", ((1, 101.0),)),
        ("min_tokens", -1),
        ("prompt_logprobs", 21),
    ],
)
def test_bad_processor_field_raises_value_error_naming_it(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


def test_max_tokens_zero_needs_prompt_logprobs_and_min_tokens_fits_max_tokens() -> None:
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(max_tokens=0)
    assert SamplingParams(max_tokens=0, prompt_logprobs=1).max_tokens == 0
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3)
