"""Prompt logprobs through LLMEngine on the micro model: every prompt token after the first is
scored against a teacher-forced full forward, across chunk boundaries, once, also when the
request is preempted and its prompt recomputed; max_tokens 0 scores without output."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from scheduler import FinishReason
from spyre_server.engine.core import LLMEngine, RequestDelta
from spyre_server.sample.sampler import SamplingParams

MakeEngine = Callable[..., LLMEngine]
PROMPT = list(range(7, 7 + 150))  # chunk 128 (the engine tests' default): two chunks


def run(
    engine: LLMEngine, on_step: Callable[[list[RequestDelta]], None] | None = None
) -> list[RequestDelta]:
    deltas: list[RequestDelta] = []
    for _ in range(500):
        if not engine.has_unfinished_requests:
            return deltas
        step = engine.step()
        deltas += step
        if on_step is not None:
            on_step(step)
    raise AssertionError("the engine did not finish")


def teacher_forced(model: Any, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([prompt]))[0].float(), dim=-1)


def assert_scored(scored: list[Any], prompt: list[int], rows: torch.Tensor, top: int) -> None:
    assert len(scored) == len(prompt)
    assert scored[0] is None
    for t in range(1, len(prompt)):
        entry = scored[t]
        assert entry.token_id == prompt[t]
        assert entry.logprob == pytest.approx(float(rows[t - 1, prompt[t]]), abs=2e-4)
        assert [i for i, _ in entry.top] == rows[t - 1].topk(top).indices.tolist()


def test_prompt_logprobs_match_a_full_forward_across_chunks(
    make_engine: MakeEngine, micro_model: Any
) -> None:
    engine = make_engine()
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2))
    deltas = run(engine)
    assert [d.prompt_logprobs is not None for d in deltas] == [True, False, False]
    assert_scored(deltas[0].prompt_logprobs or [], PROMPT, teacher_forced(micro_model, PROMPT), 2)


def test_max_tokens_zero_scores_the_prompt_and_outputs_nothing(
    make_engine: MakeEngine, micro_model: Any
) -> None:
    engine = make_engine()
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=0, prompt_logprobs=0))
    [delta] = run(engine)
    assert delta.token_ids == [] and delta.text == ""
    assert delta.finish_reason is FinishReason.LENGTH
    assert_scored(delta.prompt_logprobs or [], PROMPT, teacher_forced(micro_model, PROMPT), 0)
    assert engine.scheduler.block_tables() == {}


def test_a_preempted_request_is_scored_once_and_generates_the_same(
    make_engine: MakeEngine, micro_model: Any
) -> None:
    params = SamplingParams(max_tokens=6, temperature=0, prompt_logprobs=1)
    alone = make_engine()
    alone.add_request("r", PROMPT, params)
    expected = run(alone)

    engine = make_engine()
    engine.add_request("r", PROMPT, params)
    preempted = []

    def preempt_after_two_tokens(step: list[RequestDelta]) -> None:
        request = engine.scheduler.get_request("r")
        if not preempted and request is not None and len(request.output_token_ids) == 2:
            engine.scheduler._preempt(request)  # the last resort, forced here
            preempted.append(True)

    deltas = run(engine, preempt_after_two_tokens)
    assert preempted and engine.scheduler.make_stats().num_preemptions == 1
    assert [t for d in deltas for t in d.token_ids] == [t for d in expected for t in d.token_ids]
    scored = [d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None]
    assert len(scored) == 1  # handed out once, not again after the recompute
    assert_scored(scored[0], PROMPT, teacher_forced(micro_model, PROMPT), 1)


def test_offline_llm_returns_prompt_logprobs_and_stop_reason(
    make_engine: MakeEngine, micro_model: Any
) -> None:
    from spyre_server.entrypoints.llm import LLM

    params = SamplingParams(
        max_tokens=4,
        temperature=0,
        prompt_logprobs=0,
        stop_token_ids=(65,),
        logit_bias=((65, 100.0),),
    )
    [out] = LLM(make_engine()).generate([PROMPT], params)
    assert_scored(out.prompt_logprobs or [], PROMPT, teacher_forced(micro_model, PROMPT), 0)
    assert out.token_ids == [65] and out.stop_reason == 65
