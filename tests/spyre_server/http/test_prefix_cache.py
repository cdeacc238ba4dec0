"""Prefix caching seen through HTTP: usage.prompt_tokens_details.cached_tokens, the Prometheus
counters, cache_salt, per-API-key isolation, blocks freed on disconnect, reset while running."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest

from tests.spyre_server.http.helpers import (
    BLOCK,
    MODEL_NAME,
    USABLE_BLOCKS,
    ByteChatTokenizer,
    MakeServer,
    Metrics,
    Server,
    delta,
    iter_sse,
    json_payloads,
    reference_greedy,
    slow_down,
    sse_payloads,
    unique_text,
)
from tests.spyre_server.step_gate import step_gate

TOK = ByteChatTokenizer()


def complete(
    server: Server, prompt: Any, api_key: str | None = None, **kwargs: Any
) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0} | kwargs
    response = server.http(api_key=api_key).post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def cached(out: dict[str, Any]) -> int:
    return int(out["usage"]["prompt_tokens_details"]["cached_tokens"])


# ---------------------------------------------------------------------------- hits and metrics
def test_same_long_prompt_twice_hits_and_the_metrics_agree(server: Server) -> None:
    length, max_tokens = 300, 4
    prompt = unique_text("prefix-300", length)
    expected = 256  # 300 tokens, 4 blocks hit (cpu backend): min(4 * 64, 300 - 1) = 256

    before = server.metrics()
    first = complete(server, prompt, max_tokens=max_tokens)
    second = complete(server, prompt, max_tokens=max_tokens)
    after = server.metrics()

    assert cached(first) == 0
    assert cached(second) == expected
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    for out in (first, second):
        assert out["usage"]["prompt_tokens"] == length
        assert out["usage"]["completion_tokens"] == max_tokens

    assert delta(after, before, "vllm:prefix_cache_queries_total") == 2 * length
    assert delta(after, before, "vllm:prefix_cache_hits_total") == cached(first) + cached(second)
    # chunks: 3 computed for the first; 2 skipped and 1 computed for the second
    assert delta(after, before, "spyre:prefill_chunks_total", source="cache") == 2
    assert delta(after, before, "spyre:prefill_chunks_total", source="computed") == 4
    assert delta(after, before, "spyre:engine_steps_total", kind="prefill") == 4
    assert delta(after, before, "spyre:engine_steps_total", kind="decode") == 2 * (max_tokens - 1)
    assert delta(after, before, "vllm:prompt_tokens_total") == 2 * length
    assert delta(after, before, "vllm:generation_tokens_total") == 2 * max_tokens
    assert delta(after, before, "vllm:e2e_request_latency_seconds_count") == 2
    assert delta(after, before, "vllm:time_to_first_token_seconds_count") == 2
    assert delta(after, before, "vllm:inter_token_latency_seconds_count") == 2 * (max_tokens - 1)
    assert delta(after, before, "vllm:num_preemptions_total") == 0
    assert after.value("vllm:kv_cache_usage_perc") == 0
    assert after.value("vllm:num_requests_running") == 0
    assert after.value("vllm:num_requests_waiting") == 0


@pytest.mark.parametrize("stream", [False, True])
def test_cached_tokens_of_several_prompts_is_the_sum_over_them(
    server: Server, stream: bool
) -> None:
    """One request, three prompts longer than a block: usage counts each prompt's hits once."""
    tag = f"several-{stream}"
    x, y = unique_text(f"{tag}/x", 256), unique_text(f"{tag}/y", 128)
    warm = [x + unique_text(f"{tag}/a", 128), y + unique_text(f"{tag}/d", 72)]
    assert cached(complete(server, warm)) == 0
    prompts = [
        x + unique_text(f"{tag}/b", 128),  # 384 tokens, 4 blocks hit: min(256, 383) = 256
        y + unique_text(f"{tag}/e", 72),  # 200 tokens, 2 blocks hit: min(128, 199) = 128
        unique_text(f"{tag}/z", 150),  # 150 tokens, nothing hit: 0
    ]
    before = server.metrics()
    if stream:
        body = {"prompt": prompts, "max_tokens": 2, "temperature": 0, "stream": True}
        body["stream_options"] = {"include_usage": True}
        response = server.http().post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        chunks = json_payloads(sse_payloads(response.text))
        assert all(c.get("usage") is None for c in chunks[:-1])
        assert chunks[-1]["choices"] == []
        usage = chunks[-1]["usage"]
        assert sorted({c["choices"][0]["index"] for c in chunks[:-1]}) == [0, 1, 2]
    else:
        out = complete(server, prompts)
        usage = out["usage"]
        assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    after = server.metrics()
    assert usage["prompt_tokens"] == 384 + 200 + 150
    assert usage["completion_tokens"] == 3 * 2
    assert usage["prompt_tokens_details"]["cached_tokens"] == 256 + 128 + 0
    assert delta(after, before, "vllm:prefix_cache_hits_total") == 256 + 128
    assert delta(after, before, "vllm:prefix_cache_queries_total") == 384 + 200 + 150


@pytest.mark.parametrize(
    ("length", "shared", "expected", "chunks_skipped"),
    [
        # cached_tokens: the cpu backend skips every hit position but the logits one,
        # min(hit, L - 1); the chunk view (spyre:prefill_chunks_total) follows the grid.
        (384, 384, 383, 2),  # DESIGN §7.7: 6 blocks shared, 2 chunks skipped on the grid
        (384, 254, 192, 1),  # §7.8: 3 blocks hit, 2 usable on the grid (chunk 0)
        (384, 256, 256, 2),  # §7.9: 4 blocks hit and usable
        (70, 70, 64, 0),  # §7.2: one chunk, its full block shared
        (128, 128, 127, 0),  # one chunk exactly: only the logits position is computed
        (129, 129, 128, 1),  # two chunks, 2 blocks hit: left pad + block 0 fill chunk 0
        (640, 640, 639, 4),  # no left padding: 10 blocks hit, the last chunk runs
    ],
)
def test_cached_tokens_count_the_skipped_positions(
    server: Server,
    http_micro_model: Any,
    length: int,
    shared: int,
    expected: int,
    chunks_skipped: int,
) -> None:
    tag = f"grid-{length}-{shared}"
    common = unique_text(tag, shared)
    first = common + unique_text(tag + "/a", length - shared)
    second = common + unique_text(tag + "/b", length - shared)
    assert cached(complete(server, first)) == 0
    before = server.metrics()
    out = complete(server, second, max_tokens=3, logprobs=1)
    after = server.metrics()
    assert cached(out) == expected
    assert delta(after, before, "vllm:prefix_cache_hits_total") == expected
    assert delta(after, before, "spyre:prefill_chunks_total", source="cache") == chunks_skipped
    # the hit changes nothing in the output: same tokens and logprobs as a plain forward pass
    ref = reference_greedy(http_micro_model, TOK.encode(second), 3, 1)
    assert out["choices"][0]["logprobs"]["tokens"] == [TOK.decode([s.token_id]) for s in ref]
    assert out["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(
        [s.logprob for s in ref], abs=1e-4
    )


def test_chunk_192_short_cached_prefix_is_recomputed(
    make_server: MakeServer, http_micro_model: Any
) -> None:
    """DESIGN §7.10: chunk 192, a 64-token prompt, then a 320-token prompt starting with it:
    1 block hit, usable 0 (chunk 0 recomputed); no crash, right output."""
    server = make_server(scheduler__chunk_size=192)
    short = unique_text("c192", 64)
    long = short + unique_text("c192/rest", 256)
    assert cached(complete(server, short)) == 0
    out = complete(server, long, max_tokens=3)
    assert cached(out) == 64  # 320 tokens, 1 block hit: min(64, 319) = 64
    ref = reference_greedy(http_micro_model, TOK.encode(long), 3, 0)
    assert out["choices"][0]["text"] == TOK.decode([s.token_id for s in ref]).rstrip("\ufffd")
    # 320 tokens, 5 blocks hit: min(5 * 64, 320 - 1) = 319
    assert cached(complete(server, long, max_tokens=3)) == 319


def test_chat_history_hits_the_cache(server: Server) -> None:
    system = {"role": "system", "content": unique_text("chat-system", 400)}
    client = server.openai()
    first = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[system, {"role": "user", "content": "one"}],
        max_tokens=2,
        temperature=0,
    )
    second = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[system, {"role": "user", "content": "two"}],
        max_tokens=2,
        temperature=0,
    )
    assert first.usage is not None and second.usage is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # type: ignore[union-attr]
    prompt = TOK.apply_chat_template([system, {"role": "user", "content": "two"}])
    shared = len("system: " + system["content"] + "\nuser: ")
    assert (len(prompt), shared // BLOCK) == (430, 6)
    want = 384  # 430 tokens, 6 blocks hit (cpu backend): min(6 * 64, 430 - 1) = 384
    assert second.usage.prompt_tokens_details.cached_tokens == want  # type: ignore[union-attr]


def test_n_samples_count_the_prompt_once(server: Server) -> None:
    length = 300
    prompt = unique_text("n-prefix", length)
    before = server.metrics()
    out = complete(server, prompt, n=3, max_tokens=2)
    after = server.metrics()
    assert out["usage"]["prompt_tokens"] == length
    assert out["usage"]["completion_tokens"] == 6
    assert cached(out) == 0
    assert delta(after, before, "vllm:prompt_tokens_total") == length
    assert delta(after, before, "vllm:generation_tokens_total") == 6
    # the later samples found the first one's blocks
    # each: 300 tokens, 4 blocks hit (cpu backend): min(4 * 64, 300 - 1) = 256
    assert delta(after, before, "vllm:prefix_cache_hits_total") == 2 * 256


def test_every_metric_carries_model_name_and_the_names_are_vllms(server: Server) -> None:
    metrics = server.metrics()
    names = {f.name for f in metrics.families}
    for name in (
        "vllm:prefix_cache_queries",
        "vllm:prefix_cache_hits",
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:num_preemptions",
        "vllm:prompt_tokens",
        "vllm:generation_tokens",
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds",
        "spyre:engine_steps",
        "spyre:prefill_chunks",
    ):
        assert name in names, name
    types = {f.name: f.type for f in metrics.families}
    assert types["vllm:prefix_cache_queries"] == "counter"
    assert types["vllm:kv_cache_usage_perc"] == "gauge"
    assert types["vllm:e2e_request_latency_seconds"] == "histogram"
    ours = [f for f in metrics.families if f.name.startswith(("vllm:", "spyre:"))]
    assert len(ours) >= 13
    for family in ours:
        assert family.samples
        for sample in family.samples:
            assert sample.labels.get("model_name") == MODEL_NAME, sample
    assert {
        s.labels["kind"] for f in ours if f.name == "spyre:engine_steps" for s in f.samples
    } == {
        "prefill",
        "decode",
    }
    assert {
        s.labels["source"] for f in ours if f.name == "spyre:prefill_chunks" for s in f.samples
    } == {"computed", "cache"}


def test_kv_cache_usage_is_zero_when_idle(server: Server) -> None:
    complete(server, unique_text("idle-usage", 500), max_tokens=3)
    assert server.metrics().value("vllm:kv_cache_usage_perc") == 0


# ------------------------------------------------------------------------------------ cache salt
def test_cache_salt_separates_caches(server: Server) -> None:
    prompt = unique_text("salted", 300)
    hit = 256  # 300 tokens, 4 blocks hit (cpu backend): min(4 * 64, 300 - 1) = 256
    assert cached(complete(server, prompt, cache_salt="tenant-a")) == 0
    assert cached(complete(server, prompt, cache_salt="tenant-b")) == 0
    assert cached(complete(server, prompt, cache_salt="tenant-a")) == hit
    assert cached(complete(server, prompt)) == 0  # unsalted is yet another cache
    assert cached(complete(server, prompt)) == hit
    assert cached(complete(server, prompt, cache_salt="tenant-b")) == hit
    chat = server.openai().chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=1,
        extra_body={"cache_salt": "tenant-c"},
    )
    assert chat.usage.prompt_tokens_details.cached_tokens == 0  # type: ignore[union-attr]
    chat = server.openai().chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=1,
        extra_body={"cache_salt": "tenant-c"},
    )
    assert len("user: " + prompt + "\nassistant: ") == 318  # 4 full blocks in common
    # 318 tokens, 4 blocks hit (cpu backend): min(4 * 64, 318 - 1) = 256
    assert chat.usage.prompt_tokens_details.cached_tokens == 256  # type: ignore[union-attr]


@pytest.mark.parametrize("salt", ["", "x" * 257])
def test_bad_cache_salt_is_400(server: Server, salt: str) -> None:
    response = server.http().post("/v1/completions", json={"prompt": "x", "cache_salt": salt})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "cache_salt"


def test_isolate_cache_per_api_key(make_server: MakeServer) -> None:
    server = make_server(server__api_keys=["k1", "k2"], server__isolate_cache_per_api_key=True)
    prompt = unique_text("isolated", 300)
    hit = 256  # 300 tokens, 4 blocks hit (cpu backend): min(4 * 64, 300 - 1) = 256
    assert cached(complete(server, prompt, api_key="k1")) == 0
    assert cached(complete(server, prompt, api_key="k2")) == 0
    assert cached(complete(server, prompt, api_key="k1")) == hit
    assert cached(complete(server, prompt, api_key="k2")) == hit
    # a request's own salt is combined with its key's
    assert cached(complete(server, prompt, api_key="k1", cache_salt="s")) == 0
    assert cached(complete(server, prompt, api_key="k2", cache_salt="s")) == 0
    assert cached(complete(server, prompt, api_key="k1", cache_salt="s")) == hit


def test_keys_share_the_cache_without_isolation(make_server: MakeServer) -> None:
    server = make_server(server__api_keys=["k1", "k2"])
    prompt = unique_text("shared-keys", 300)
    assert cached(complete(server, prompt, api_key="k1")) == 0
    # 300 tokens, 4 blocks hit (cpu backend): min(4 * 64, 300 - 1) = 256
    assert cached(complete(server, prompt, api_key="k2")) == 256


# ----------------------------------------------------------------------------------- disconnects
def wait_until_no_request_streams(server: Server) -> None:
    """Until the server has dropped every request stream: their aborts are queued."""
    deadline = time.monotonic() + 30
    while server.async_engine.num_active_requests:
        assert time.monotonic() < deadline, "the server did not notice the client leave"
        time.sleep(0.01)


def ascii_first_token_prompt(model: Any, tag: str, length: int) -> str:
    """A prompt whose first greedy token is an ASCII byte, so that its text streams at once (a
    byte of a multi-byte character waits for the rest)."""
    for attempt in range(100):
        prompt = unique_text(f"{tag}/{attempt}", length)
        if reference_greedy(model, TOK.encode(prompt), 1, 0)[0].token_id < 0x80:
            return prompt
    raise AssertionError("no prompt with an ASCII first token")


def test_disconnected_stream_frees_its_blocks(
    server: Server, monkeypatch: pytest.MonkeyPatch, http_micro_model: Any
) -> None:
    """The client leaves after the first token while the engine holds decode step 1: the abort
    lands between steps, so that held step is the only decode step the request ever gets."""
    before = server.metrics()
    prompt = ascii_first_token_prompt(http_micro_model, "disconnect", 100)
    body = {"prompt": prompt, "max_tokens": 900, "temperature": 0, "stream": True}
    with step_gate(monkeypatch, server.engine.runner) as gate:
        gate.allow(1)  # the prefill, which makes the first token
        with (
            httpx.Client(timeout=30) as client,
            client.stream("POST", f"{server.url}/v1/completions", json=body) as response,
        ):
            assert response.status_code == 200
            events = iter_sse(response)
            first = json.loads(next(events))
            assert first["choices"][0]["finish_reason"] is None
            gate.wait_until_held(1)
            running = server.metrics()
            assert running.value("vllm:num_requests_running") == 1
            # 100 prompt tokens + the first generated: 2 blocks of 127
            assert running.value("vllm:kv_cache_usage_perc") == pytest.approx(2 / USABLE_BLOCKS)
        wait_until_no_request_streams(server)
        assert gate.num_held == 1 and gate.num_passed == 1
    after = server.wait_idle(timeout=10)
    decoded = delta(after, before, "spyre:engine_steps_total", kind="decode")
    assert decoded == 1, f"the request ran on after its client left ({decoded} decode steps)"
    assert server.engine.scheduler.pool.num_free_blocks == USABLE_BLOCKS


def test_disconnected_non_streaming_request_is_aborted(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine holds decode step 1 until the client gave up: then at most that step runs."""
    before = server.metrics()
    body = {"prompt": unique_text("disconnect-2", 100), "max_tokens": 120}
    with step_gate(monkeypatch, server.engine.runner) as gate:
        gate.allow(1)  # the prefill; the request cannot finish while decode step 1 is held
        with pytest.raises(httpx.ReadTimeout), httpx.Client(timeout=0.3) as client:
            client.post(f"{server.url}/v1/completions", json=body)
        wait_until_no_request_streams(server)
        assert gate.num_passed <= 1 and gate.num_held <= 1
    after = server.wait_idle(timeout=10)
    decoded = delta(after, before, "spyre:engine_steps_total", kind="decode")
    # 0 if the client left before the prefill ended (a very slow machine), else the held step
    assert decoded <= 1, f"the request ran on after its client left ({decoded} decode steps)"


# ---------------------------------------------------------------------------------------- reset
def test_reset_while_a_request_runs(
    make_server: MakeServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = make_server()
    client = server.http()
    length, max_tokens = 300, 20  # 5 blocks throughout (positions < 320); 4 of them cached
    prompt = unique_text("reset-running", length)
    reference = complete(server, prompt, max_tokens=max_tokens)
    assert server.reset_cache() == 4

    slow_down(monkeypatch, server, 0.05)
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        events = iter_sse(response)
        texts = [json.loads(next(events))["choices"][0]["text"]]
        metrics = server.metrics()
        assert metrics.value("vllm:num_requests_running") == 1
        assert metrics.value("vllm:kv_cache_usage_perc") == pytest.approx(5 / USABLE_BLOCKS)
        reset = client.post("/reset_prefix_cache")
        assert reset.status_code == 200
        assert reset.json() == {"success": True, "dropped_blocks": 4}
        # still running after the reset
        assert server.metrics().value("vllm:num_requests_running") == 1
        payloads = list(events)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    texts += [c["choices"][0]["text"] for c in chunks]
    assert "".join(texts) == reference["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    monkeypatch.undo()

    server.wait_idle()
    assert cached(complete(server, prompt)) == 0  # nothing findable after the reset
    # 300 tokens, 4 blocks hit (cpu backend): min(4 * 64, 300 - 1) = 256
    assert cached(complete(server, prompt)) == 256
    server.engine.scheduler.check_integrity()


def test_reset_needs_a_key_when_keys_are_set(make_server: MakeServer) -> None:
    server = make_server(server__api_keys=["admin"])
    assert server.http().post("/reset_prefix_cache").status_code == 401
    ok = server.http(api_key="admin").post("/reset_prefix_cache")
    assert ok.json() == {"success": True, "dropped_blocks": 0}


def test_metrics_refresh_while_idle(make_server: MakeServer) -> None:
    """The gauges are read at scrape time: right after a request, without any further step."""
    server = make_server()
    complete(server, unique_text("idle-refresh", 200), max_tokens=2)
    deadline = time.monotonic() + 5
    while True:
        metrics: Metrics = server.metrics()
        if metrics.value("vllm:num_requests_running") == 0:
            break
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert metrics.value("vllm:kv_cache_usage_perc") == 0
    assert metrics.value("vllm:prefix_cache_queries_total") == 200
