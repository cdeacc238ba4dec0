"""LLMEngine (spyre_server/engine/core.py) and the offline LLM (spyre_server/entrypoints/llm.py) on a tiny
random fms llama with a byte tokenizer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from scheduler import DecodeBatch, FinishReason, PrefillChunk
from spyre_server.engine.core import LLMEngine, RequestDelta
from spyre_server.entrypoints.llm import LLM, GenerationOutput
from spyre_server.sample.sampler import SamplingParams
from tests.spyre_server.conftest import ByteTokenizer, assert_pool_clean

MakeEngine = Callable[..., LLMEngine]
PROMPTS = ["hello world", "the quick brown fox jumps over the lazy dog. " * 3, "x"]


def greedy(max_tokens: int, **kwargs: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, **kwargs)


def run_alone(make_engine: MakeEngine, prompt: str | list[int], params: SamplingParams) -> Any:
    return LLM(make_engine()).generate([prompt], params)[0]


def run_engine(engine: LLMEngine, max_steps: int = 500) -> list[RequestDelta]:
    deltas: list[RequestDelta] = []
    for _ in range(max_steps):
        if not engine.has_unfinished_requests:
            return deltas
        deltas += engine.step()
    raise AssertionError("the engine did not finish")


def same_text(text: str, decoded: str) -> bool:
    """``text`` is the full decode of the output tokens, up to trailing U+FFFD: undecodable
    bytes at the very end are dropped at finish (see
    test_detokenizer.py::test_trailing_undecodable_bytes_are_flushed_at_finish)."""
    return text.rstrip("\ufffd") == decoded.rstrip("\ufffd")


def first_repeat_free_index(tokens: list[int], start: int) -> int:
    """An index ``k >= start`` whose token does not occur before it."""
    return next(k for k in range(start, len(tokens)) if tokens[k] not in tokens[:k])


# --- generate: order, lengths, finish reasons -----------------------------------------------------


def test_outputs_in_prompt_order_with_length_finish(make_engine: MakeEngine) -> None:
    llm = LLM(make_engine())
    params = [greedy(3), greedy(6), greedy(4)]
    outputs = llm.generate(PROMPTS, params)
    assert [o.prompt_token_ids for o in outputs] == [list(p.encode()) for p in PROMPTS]
    assert len({o.request_id for o in outputs}) == 3
    for out, p in zip(outputs, params, strict=True):
        assert len(out.token_ids) == p.max_tokens
        assert out.finish_reason is FinishReason.LENGTH
        assert out.error is None
        assert same_text(out.text, ByteTokenizer().decode(out.token_ids))
        assert out.logprobs == []
    # batching does not change greedy results: each prompt alone gives the same tokens
    for prompt, p, out in zip(PROMPTS, params, outputs, strict=True):
        assert run_alone(make_engine, prompt, p).token_ids == out.token_ids
    assert_pool_clean(llm.engine)


def test_single_params_apply_to_every_prompt_and_count_must_match(make_engine: MakeEngine) -> None:
    llm = LLM(make_engine())
    outputs = llm.generate(["ab", "cd"], greedy(2))
    assert [len(o.token_ids) for o in outputs] == [2, 2]
    with pytest.raises(ValueError, match="2 prompts but 1 sampling params"):
        llm.generate(["ab", "cd"], [greedy(2)])
    assert_pool_clean(llm.engine)


def test_stop_token_ids_end_the_request(make_engine: MakeEngine) -> None:
    prompt = PROMPTS[0]
    full = run_alone(make_engine, prompt, greedy(12))
    k = first_repeat_free_index(full.token_ids, 2)
    stop_token = full.token_ids[k]
    llm = LLM(make_engine())
    out = llm.generate([prompt], greedy(12, stop_token_ids=(stop_token, 255)))[0]
    assert out.token_ids == full.token_ids[: k + 1]  # the stop token is the last one returned
    assert out.finish_reason is FinishReason.STOP
    assert out.text.startswith(ByteTokenizer().decode(full.token_ids[:k]).rstrip("\ufffd"))
    assert_pool_clean(llm.engine)


def test_stop_string_cuts_the_text_before_it(make_engine: MakeEngine) -> None:
    prompt = PROMPTS[0]
    full = run_alone(make_engine, prompt, greedy(16))
    text = full.text
    # a stop string made of two printable characters, at their first occurrence after the start
    start = next(
        i
        for i in range(2, len(text) - 1)
        if text[i : i + 2].isprintable()
        and "\ufffd" not in text[i : i + 2]
        and text.find(text[i : i + 2]) == i
    )
    stop = text[start : start + 2]
    llm = LLM(make_engine())
    out = llm.generate([prompt], greedy(16, stop=(stop, "never-generated")))[0]
    assert out.finish_reason is FinishReason.STOP
    assert out.text == text[:start]
    assert stop not in out.text
    # generation ended with the token that completed the stop string
    assert len(out.token_ids) < 16
    assert out.token_ids == full.token_ids[: len(out.token_ids)]
    assert_pool_clean(llm.engine)


def test_min_tokens_defers_stop_strings(make_engine: MakeEngine) -> None:
    """The stop string that ends the request at its first occurrence (the test above) does not
    while fewer than ``min_tokens`` tokens exist: with min_tokens = max_tokens the output is the
    whole greedy output (the tiny model's greedy run has no EOS to mask)."""
    prompt = PROMPTS[0]
    full = run_alone(make_engine, prompt, greedy(16))
    assert full.finish_reason is FinishReason.LENGTH
    stop = next(
        full.text[i : i + 2]
        for i in range(2, len(full.text) - 1)
        if full.text[i : i + 2].isprintable() and "\ufffd" not in full.text[i : i + 2]
    )
    stopped = run_alone(make_engine, prompt, greedy(16, stop=(stop,)))
    assert stopped.finish_reason is FinishReason.STOP and len(stopped.token_ids) < 16
    deferred = run_alone(make_engine, prompt, greedy(16, stop=(stop,), min_tokens=16))
    assert deferred.finish_reason is FinishReason.LENGTH
    assert (deferred.text, deferred.token_ids) == (full.text, full.token_ids)


def test_stop_string_never_seen_releases_all_text_at_the_end(make_engine: MakeEngine) -> None:
    full = run_alone(make_engine, PROMPTS[2], greedy(8))
    out = run_alone(make_engine, PROMPTS[2], greedy(8, stop=("\x00\x00\x00 not there",)))
    assert out.finish_reason is FinishReason.LENGTH
    assert (out.text, out.token_ids) == (full.text, full.token_ids)


def test_eos_ends_a_request_unless_ignore_eos(make_engine: MakeEngine) -> None:
    prompt = PROMPTS[0]
    full = run_alone(make_engine, prompt, greedy(10))
    k = first_repeat_free_index(full.token_ids, 1)
    eos = full.token_ids[k]
    tokenizer = ByteTokenizer(special_ids=[eos])
    llm = LLM(make_engine(eos_token_id=eos, tokenizer=tokenizer))

    stopped, ignored = llm.generate([prompt, prompt], [greedy(10), greedy(10, ignore_eos=True)])
    assert stopped.token_ids == full.token_ids[: k + 1]
    assert stopped.finish_reason is FinishReason.STOP
    assert stopped.text == tokenizer.decode(full.token_ids[:k])
    assert ignored.token_ids == full.token_ids
    assert ignored.finish_reason is FinishReason.LENGTH
    assert_pool_clean(llm.engine)


def test_logprobs_through_the_engine(make_engine: MakeEngine) -> None:
    out = run_alone(make_engine, PROMPTS[0], greedy(4, logprobs=3))
    assert [lp.token_id for lp in out.logprobs] == out.token_ids
    for lp in out.logprobs:
        assert len(lp.top) == 3 and lp.top[0] == (lp.token_id, lp.logprob)  # greedy: the best


# --- rejected requests ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([1, 2, 256], greedy(4), "outside the vocabulary"),
        ([1, -1, 2], greedy(4), "outside the vocabulary"),
        ([], greedy(4), "at least one token"),
        ([7] * 1000, greedy(25), "maximum context length is 1024 tokens"),
        ([7] * 1024, greedy(1), "maximum context length is 1024 tokens"),
    ],
)
def test_bad_requests_raise_and_leave_nothing_queued(
    make_engine: MakeEngine, prompt: list[int], params: SamplingParams, message: str
) -> None:
    """The offline LLM is the engine's door for scripts: it checks each request against the
    engine's limits (validation.py) before queueing any."""
    llm = LLM(make_engine())
    engine = llm.engine
    with pytest.raises(ValueError, match=message):
        llm.generate([prompt], params)
    assert not engine.has_unfinished_requests
    assert engine.step() == []
    assert_pool_clean(engine)
    assert llm.generate([[1, 2, 3]], greedy(1))[0].finish_reason is FinishReason.LENGTH


def test_max_model_len_is_inclusive(make_engine: MakeEngine) -> None:
    engine = make_engine(model__max_model_len=200, cache__num_blocks=8)
    engine.add_request("r", [7] * 198, greedy(2))
    assert run_engine(engine)[-1].finish_reason is FinishReason.LENGTH


def test_request_needing_more_blocks_than_the_pool_is_rejected(make_engine: MakeEngine) -> None:
    engine = make_engine(cache__num_blocks=3)  # 2 usable blocks = 128 tokens
    with pytest.raises(ValueError, match="KV blocks"):
        engine.add_request("r", [7] * 100, greedy(29))
    engine.add_request("ok", [7] * 100, greedy(28))
    assert run_engine(engine)[-1].finish_reason is FinishReason.LENGTH


def test_request_over_the_volumetric_limit_is_rejected(make_engine: MakeEngine) -> None:
    engine = make_engine(scheduler__max_batch_tkv_limit=136)
    with pytest.raises(ValueError, match="max_batch_tkv_limit"):
        engine.add_request("r", [7] * 100, greedy(30))  # 129 tokens: 3 blocks = 192 > 136
    engine.add_request("ok", [7] * 100, greedy(29))  # 128 tokens: 2 blocks = 128
    assert run_engine(engine)[-1].finish_reason is FinishReason.LENGTH
    assert_pool_clean(engine)


def test_duplicate_request_id_is_rejected(make_engine: MakeEngine) -> None:
    engine = make_engine()
    engine.add_request("same", [1, 2], greedy(2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("same", [3, 4], greedy(2))
    deltas = run_engine(engine)
    assert [d.request_id for d in deltas] == ["same", "same"]


def test_llm_generate_is_all_or_nothing(make_engine: MakeEngine) -> None:
    llm = LLM(make_engine())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate(["fine", "also fine", [300], "never added"], greedy(3))
    assert not llm.engine.has_unfinished_requests
    assert_pool_clean(llm.engine)
    with pytest.raises(ValueError, match="maximum context length"):
        llm.generate(["fine", "x" * 1020], greedy(5))
    assert_pool_clean(llm.engine)
    outputs = llm.generate(["fine"], greedy(2))  # the engine still works
    assert outputs[0].finish_reason is FinishReason.LENGTH


# --- abort ----------------------------------------------------------------------------------------


def test_abort_while_decoding_frees_the_blocks(make_engine: MakeEngine) -> None:
    engine = make_engine()
    engine.add_request("a", list(b"first prompt"), greedy(50))
    engine.add_request("b", list(b"second prompt"), greedy(5))
    produced: dict[str, int] = {"a": 0, "b": 0}
    while produced["a"] < 3:
        for d in engine.step():
            produced[d.request_id] += len(d.token_ids)
    delta = engine.abort_request("a")
    assert delta is not None
    assert (delta.finish_reason, delta.text, delta.token_ids) == (FinishReason.ABORT, "", [])
    assert delta.num_prompt_tokens == len(b"first prompt")
    assert engine.abort_request("a") is None  # gone
    assert engine.abort_request("unknown") is None
    engine.scheduler.check_integrity()
    rest = run_engine(engine)
    assert all(d.request_id == "b" for d in rest)
    assert rest[-1].finish_reason is FinishReason.LENGTH
    assert_pool_clean(engine)


def test_abort_in_the_middle_of_a_prefill_and_while_waiting(make_engine: MakeEngine) -> None:
    engine = make_engine()
    engine.add_request("long", [5] * 300, greedy(4))  # 3 chunks of 128
    engine.add_request("waiting", [6] * 10, greedy(4))
    step = engine.scheduler.schedule  # observe what runs
    seen: list[Any] = []

    def spy() -> Any:
        out = step()
        seen.append(out)
        return out

    engine.scheduler.schedule = spy  # type: ignore[method-assign]
    assert engine.step() == []  # the first chunk samples nothing
    assert isinstance(seen[0], PrefillChunk) and not seen[0].is_last_chunk
    assert engine.abort_request("long") is not None
    aborted = engine.abort_request("waiting")
    assert aborted is not None and aborted.finish_reason is FinishReason.ABORT
    assert_pool_clean(engine)
    # Only the written block became cached: chunk 0 of a 300-token prompt (left pad 1 block)
    # wrote tokens 0..63, so the same prompt later hits exactly 1 block (64 cached tokens), and
    # the result equals a fresh engine's.
    engine.add_request("again", [5] * 300, greedy(3))
    deltas = run_engine(engine)
    assert deltas[-1].num_cached_tokens == 64
    assert [t for d in deltas for t in d.token_ids] == run_alone(
        make_engine, [5] * 300, greedy(3)
    ).token_ids
    assert_pool_clean(engine)


# --- a failing model step -------------------------------------------------------------------------


def test_a_failed_step_ends_exactly_its_requests(
    make_engine: MakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = {"a": list(b"alpha"), "b": list(b"bravo"), "c": list(b"charlie")}
    expected = {rid: run_alone(make_engine, p, greedy(5)).token_ids for rid, p in prompts.items()}

    engine = make_engine()
    execute = engine.runner.execute
    failed: list[Any] = []

    def flaky(step: Any, params: Any) -> Any:
        if not failed and isinstance(step, DecodeBatch) and len(step.entries) == 2:
            failed.append(step)
            raise RuntimeError("device lost")
        return execute(step, params)

    monkeypatch.setattr(engine.runner, "execute", flaky)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, greedy(5))
    deltas = run_engine(engine)
    assert failed, "the injected failure never triggered"
    failed_ids = {e.request_id for e in failed[0].entries}
    assert failed_ids == {"a", "b"}  # c was still waiting

    finals = {d.request_id: d for d in deltas if d.finished}
    assert set(finals) == {"a", "b", "c"}
    for rid in failed_ids:
        assert finals[rid].finish_reason is FinishReason.ERROR
        assert finals[rid].error is not None
        assert "device lost" in finals[rid].error and "RuntimeError" in finals[rid].error
    assert finals["c"].finish_reason is FinishReason.LENGTH and finals["c"].error is None
    c_tokens = [t for d in deltas if d.request_id == "c" for t in d.token_ids]
    assert c_tokens == expected["c"]
    # the error deltas are the whole output of the failed step
    error_step = [d for d in deltas if d.finish_reason is FinishReason.ERROR]
    assert len(error_step) == 2
    assert_pool_clean(engine)

    engine.add_request("d", prompts["a"], greedy(5))  # a later request is served normally
    d_tokens = [t for d in run_engine(engine) for t in d.token_ids]
    assert d_tokens == expected["a"]
    assert_pool_clean(engine)


def test_a_failed_prefill_ends_only_that_request(
    make_engine: MakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine()
    execute = engine.runner.execute

    def flaky(step: Any, params: Any) -> Any:
        if isinstance(step, PrefillChunk) and step.request_id == "bad":
            raise ValueError("bad chunk")
        return execute(step, params)

    monkeypatch.setattr(engine.runner, "execute", flaky)
    engine.add_request("good", [1, 2, 3], greedy(3))
    engine.add_request("bad", [4] * 200, greedy(3))
    finals = {d.request_id: d for d in run_engine(engine) if d.finished}
    assert finals["bad"].finish_reason is FinishReason.ERROR
    assert finals["bad"].num_prompt_tokens == 200
    assert finals["good"].finish_reason is FinishReason.LENGTH
    assert_pool_clean(engine)


def test_llm_generate_reports_errors(
    make_engine: MakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = LLM(make_engine())

    def broken(step: Any, params: Any) -> Any:
        raise RuntimeError("no device")

    monkeypatch.setattr(llm.engine.runner, "execute", broken)
    outputs: list[GenerationOutput] = llm.generate(["a", "b"], greedy(3))
    assert [o.finish_reason for o in outputs] == [FinishReason.ERROR] * 2
    assert all(o.error and "no device" in o.error for o in outputs)
    assert_pool_clean(llm.engine)


# --- prefix caching and seeds ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("backend", "length", "cached"),
    [
        # cpu: every position of a hit block is skipped but the logits one, min(hit, L - 1)
        ("cpu", 100, 64),  # 1 full block hit
        ("cpu", 200, 192),  # 3 full blocks hit
        ("cpu", 384, 383),  # 6 blocks hit: only the logits position is computed
        ("cpu", 320, 319),  # 5 blocks hit
        # spyre: whole windows run, so only whole skipped chunks count; chunk 128 = 2 blocks,
        # usable = max(0, min((pad + hit) // 2, chunks - 1) * 2 - pad) blocks
        ("spyre", 100, 0),  # one chunk: it is the last, nothing is skipped
        ("spyre", 200, 128),  # 3 full blocks hit, whole chunks only: chunk 0 (2 blocks) skipped
        ("spyre", 384, 256),  # 6 blocks hit, the last chunk is always computed
        ("spyre", 320, 192),  # left pad 1 block: min((1 + 5) // 2, 3 - 1) * 2 - 1 = 3 blocks
    ],
)
def test_cached_tokens_for_a_repeated_prompt(
    make_engine: MakeEngine, backend: str, length: int, cached: int
) -> None:
    engine = make_engine(model__backend=backend, model__compile_backend="eager")
    llm = LLM(engine)
    prompt = [(7 * i) % 251 for i in range(length)]
    first = llm.generate([prompt], greedy(3))[0]
    second = llm.generate([prompt], greedy(3))[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == cached
    assert second.token_ids == first.token_ids  # the cached KV gives the same result
    salted = llm.generate([prompt], greedy(3), cache_salt="other tenant")[0]
    assert salted.num_cached_tokens == 0
    assert salted.token_ids == first.token_ids
    assert_pool_clean(engine)


def test_no_cached_tokens_with_prefix_caching_off(make_engine: MakeEngine) -> None:
    llm = LLM(make_engine(cache__enable_prefix_caching=False))
    prompt = [(5 * i) % 253 for i in range(384)]
    first, second = (llm.generate([prompt], greedy(2))[0] for _ in range(2))
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 0)
    assert first.token_ids == second.token_ids
    assert_pool_clean(llm.engine)


def test_same_seed_same_output_across_runs_and_engines(make_engine: MakeEngine) -> None:
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=42)
    llm = LLM(make_engine())
    first = llm.generate([PROMPTS[0]], params)[0]
    again = llm.generate([PROMPTS[0], PROMPTS[1]], [params, SamplingParams(max_tokens=3)])[0]
    fresh = LLM(make_engine()).generate([PROMPTS[0]], params)[0]
    assert first.token_ids == again.token_ids == fresh.token_ids
    other = llm.generate(
        [PROMPTS[0]] * 3, [SamplingParams(max_tokens=6, seed=s) for s in (1, 2, 3)]
    )
    assert any(o.token_ids != first.token_ids for o in other)
