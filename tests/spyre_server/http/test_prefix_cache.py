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
    expected_cached_tokens,
    iter_sse,
    reference_greedy,
    slow_down,
    unique_text,
)

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
    expected = 256  # 4 full blocks hit: the cpu backend computes none of their positions

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
    assert cached(out) == 64  # the hit block's positions are not computed (cpu backend)
    ref = reference_greedy(http_micro_model, TOK.encode(long), 3, 0)
    assert out["choices"][0]["text"] == TOK.decode([s.token_id for s in ref]).rstrip("\ufffd")
    assert cached(complete(server, long, max_tokens=3)) == 319  # 5 blocks hit: all but logits


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
    want = expected_cached_tokens(len(prompt), shared // BLOCK)
    assert want > 0
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
    assert delta(after, before, "vllm:prefix_cache_hits_total") == 2 * expected_cached_tokens(
        length, length // BLOCK
    )


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
    hit = expected_cached_tokens(300, 4)
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
    assert chat.usage.prompt_tokens_details.cached_tokens == expected_cached_tokens(  # type: ignore[union-attr]
        len(prompt) + len("user: \nassistant: "), (len(prompt) + len("user: ")) // BLOCK
    )


@pytest.mark.parametrize("salt", ["", "x" * 257])
def test_bad_cache_salt_is_400(server: Server, salt: str) -> None:
    response = server.http().post("/v1/completions", json={"prompt": "x", "cache_salt": salt})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "cache_salt"


def test_isolate_cache_per_api_key(make_server: MakeServer) -> None:
    server = make_server(server__api_keys=["k1", "k2"], server__isolate_cache_per_api_key=True)
    prompt = unique_text("isolated", 300)
    hit = expected_cached_tokens(300, 4)
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
    assert cached(complete(server, prompt, api_key="k2")) == expected_cached_tokens(300, 4)


# ----------------------------------------------------------------------------------- disconnects
def test_disconnected_stream_frees_its_blocks(server: Server) -> None:
    before = server.metrics()
    body = {"prompt": unique_text("disconnect", 100), "max_tokens": 900, "stream": True}
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", f"{server.url}/v1/completions", json=body) as response,
    ):
        assert response.status_code == 200
        events = iter_sse(response)
        first = json.loads(next(events))
        assert first["choices"][0]["finish_reason"] is None
        running = server.metrics()
        assert running.value("vllm:num_requests_running") == 1
        # 100 prompt tokens + a few generated: 2 blocks of 127
        assert running.value("vllm:kv_cache_usage_perc") > 0
    after = server.wait_idle(timeout=10)
    decoded = delta(after, before, "spyre:engine_steps_total", kind="decode")
    assert decoded < 800, f"the request ran on after its client left ({decoded} decode steps)"
    assert server.engine.scheduler.pool.num_free_blocks == USABLE_BLOCKS


def test_disconnected_non_streaming_request_is_aborted(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow_down(monkeypatch, server, 0.02)  # 120 tokens take >= 2.4 s unless aborted
    before = server.metrics()
    body = {"prompt": unique_text("disconnect-2", 100), "max_tokens": 120}
    with pytest.raises(httpx.ReadTimeout), httpx.Client(timeout=0.3) as client:
        client.post(f"{server.url}/v1/completions", json=body)
    after = server.wait_idle(timeout=10)
    decoded = delta(after, before, "spyre:engine_steps_total", kind="decode")
    assert decoded < 90, f"the request ran on after its client left ({decoded} decode steps)"


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
    assert cached(complete(server, prompt)) == expected_cached_tokens(length, 4)
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
