"""SSE framing, errors in the middle of a stream, failed model steps (500), a dead engine loop
(/health 503), and that the server keeps serving after a failed step."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.spyre_server.http.helpers import (
    MODEL_NAME,
    USABLE_BLOCKS,
    MakeServer,
    Server,
    iter_sse,
    json_payloads,
    sse_payloads,
)

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


# -------------------------------------------------------------------------------------- framing
def test_completion_sse_framing(server: Server) -> None:
    response = server.http().post(
        COMPLETIONS,
        json={"prompt": "framing", "max_tokens": 6, "temperature": 0, "stream": True},
    )
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = json_payloads(sse_payloads(response.text))
    assert all(e["object"] == "text_completion" and e["model"] == MODEL_NAME for e in events)
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in e for e in events)
    full = server.http().post(
        COMPLETIONS, json={"prompt": "framing", "max_tokens": 6, "temperature": 0}
    )
    assert "".join(e["choices"][0]["text"] for e in events) == full.json()["choices"][0]["text"]


def test_chat_sse_framing_with_usage(server: Server) -> None:
    response = server.http().post(
        CHAT,
        json={
            "messages": MESSAGES,
            "max_tokens": 5,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert response.status_code == 200
    events = json_payloads(sse_payloads(response.text))
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[-1]["choices"] == []
    assert events[-1]["usage"]["completion_tokens"] == 5
    assert events[-2]["choices"][0]["finish_reason"] == "length"


def test_invalid_streaming_request_gets_a_json_error_not_a_stream(server: Server) -> None:
    response = server.http().post(COMPLETIONS, json={"prompt": "", "stream": True})
    assert response.status_code == 400
    assert response.headers["content-type"] == "application/json"
    assert response.json()["error"]["param"] == "prompt"


def test_request_the_cache_cannot_hold_is_400_also_when_streaming(make_server: MakeServer) -> None:
    """A request that can never run (more KV blocks than the pool has) is rejected with 400
    before anything is streamed: the status says so, not an SSE event after a 200."""
    server = make_server(cache__num_blocks=4)  # 3 usable blocks: 192 tokens
    body = {"prompt": "a" * 150, "max_tokens": 100}
    plain = server.http().post(COMPLETIONS, json=body)
    assert plain.status_code == 400, plain.text
    assert "KV blocks" in plain.json()["error"]["message"]
    streamed = server.http().post(COMPLETIONS, json=body | {"stream": True})
    assert streamed.status_code == 400, streamed.text
    assert streamed.json()["error"]["type"] == "invalid_request_error"


# ----------------------------------------------------------------------------- failing a step
class StepFailure:
    """Wraps the runner's execute; ``arm()`` makes the next model step raise once."""

    def __init__(self, server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
        runner = server.engine.runner
        self.original = runner.execute
        self.armed = threading.Event()
        self.failures = 0
        monkeypatch.setattr(runner, "execute", self.execute)

    def arm(self) -> None:
        self.armed.set()

    def execute(self, step: Any, params: Any) -> Any:
        if self.armed.is_set():
            self.armed.clear()
            self.failures += 1
            raise RuntimeError("injected step failure")
        return self.original(step, params)


@pytest.fixture
def failing(
    make_server: MakeServer, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Server, StepFailure]]:
    server = make_server()
    yield server, StepFailure(server, monkeypatch)


def assert_still_serving(server: Server) -> None:
    client = server.http()
    assert client.get("/health").status_code == 200
    ok = client.post(COMPLETIONS, json={"prompt": "after", "max_tokens": 3})
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] == 3
    server.wait_idle(timeout=10)
    assert server.engine.scheduler.pool.num_free_blocks == USABLE_BLOCKS
    server.engine.scheduler.check_integrity()


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_mid_stream_step_failure_sends_an_error_event_then_done(
    failing: tuple[Server, StepFailure], path: str
) -> None:
    server, failure = failing
    body: dict[str, Any] = {"max_tokens": 200, "stream": True}
    body |= {"prompt": "stream me"} if path == COMPLETIONS else {"messages": MESSAGES}
    with server.http().stream("POST", path, json=body) as response:
        assert response.status_code == 200
        events = iter_sse(response)
        first = json.loads(next(events))
        assert "error" not in first
        failure.arm()
        rest = list(events)
    assert failure.failures == 1
    assert rest[-1] == "[DONE]"
    payloads = [json.loads(p) for p in rest[:-1]]
    assert all("error" not in p for p in payloads[:-1])
    error = payloads[-1]
    assert set(error) == {"error"}
    assert set(error["error"]) == {"message", "type", "param", "code"}
    assert error["error"]["type"] == "internal_server_error"
    assert error["error"]["code"] == "engine_error"
    assert "injected step failure" in error["error"]["message"]
    assert_still_serving(server)


def test_non_streaming_request_hit_by_a_failed_step_is_500(
    failing: tuple[Server, StepFailure],
) -> None:
    server, failure = failing
    failure.arm()
    response = server.http().post(COMPLETIONS, json={"prompt": "fail me", "max_tokens": 5})
    assert failure.failures == 1
    assert response.status_code == 500
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "internal_server_error"
    assert error["code"] == "engine_error"
    assert "injected step failure" in error["message"]
    assert_still_serving(server)


def test_failed_decode_step_ends_every_request_of_its_batch(
    failing: tuple[Server, StepFailure],
) -> None:
    server, failure = failing
    client = server.http()
    with (
        client.stream(
            "POST", COMPLETIONS, json={"prompt": "a", "max_tokens": 300, "stream": True}
        ) as a,
        client.stream(
            "POST", COMPLETIONS, json={"prompt": "b", "max_tokens": 300, "stream": True}
        ) as b,
    ):
        events_a, events_b = iter_sse(a), iter_sse(b)
        next(events_a)
        next(events_b)
        failure.arm()
        rest_a, rest_b = list(events_a), list(events_b)
    for rest in (rest_a, rest_b):
        assert rest[-1] == "[DONE]"
        assert json.loads(rest[-2])["error"]["code"] == "engine_error"
    assert_still_serving(server)


def test_failed_prefill_ends_only_its_request(
    make_server: MakeServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """B's prefill chunk fails while A decodes: B gets 500, A finishes with its normal output."""
    from scheduler import PrefillChunk

    server = make_server()
    client = server.http()
    body_a = {"prompt": "survivor", "max_tokens": 60, "temperature": 0}
    reference = client.post(COMPLETIONS, json=body_a).json()["choices"][0]["text"]
    runner = server.engine.runner
    original = runner.execute

    def execute(step: Any, params: Any) -> Any:
        if isinstance(step, PrefillChunk) and step.request_id.startswith("victim"):
            raise RuntimeError("injected prefill failure")
        return original(step, params)

    monkeypatch.setattr(runner, "execute", execute)
    with client.stream("POST", COMPLETIONS, json=body_a | {"stream": True}) as a:
        events = iter_sse(a)
        texts = [json.loads(next(events))["choices"][0]["text"]]
        b = client.post(
            COMPLETIONS,
            json={"prompt": "x" * 200, "max_tokens": 5},
            headers={"x-request-id": "victim"},
        )
        payloads = list(events)
    assert b.status_code == 500
    assert "injected prefill failure" in b.json()["error"]["message"]
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert all("error" not in c for c in chunks)
    texts += [c["choices"][0]["text"] for c in chunks]
    assert "".join(texts) == reference
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert_still_serving(server)


# ----------------------------------------------------------------------------------- dead loop
def test_health_is_503_when_the_engine_loop_dies(
    make_server: MakeServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = make_server()
    client = server.http()
    assert client.get("/health").status_code == 200

    def broken_step() -> Any:
        raise AssertionError("scheduler invariant broken")

    monkeypatch.setattr(server.engine, "step", broken_step)
    hit = client.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 3})
    assert hit.status_code == 500
    assert "AssertionError" in hit.json()["error"]["message"]

    health = client.get("/health")
    assert health.status_code == 503
    assert health.json()["error"]["type"] == "service_unavailable"
    assert not server.async_engine.is_alive
    assert isinstance(server.async_engine.error, AssertionError)

    after = client.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 3})
    assert after.status_code == 503
    assert after.json()["error"]["code"] == "engine_dead"
    # metrics still scrape
    assert client.get("/metrics").status_code == 200


def test_engine_dying_mid_stream_ends_the_stream_with_an_error(
    make_server: MakeServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = make_server()
    engine = server.engine
    original = engine.step
    dead = threading.Event()

    def step() -> Any:
        if dead.is_set():
            raise AssertionError("dead")
        return original()

    monkeypatch.setattr(engine, "step", step)
    with server.http(timeout=httpx.Timeout(10)).stream(
        "POST", COMPLETIONS, json={"prompt": "x", "max_tokens": 500, "stream": True}
    ) as response:
        events = iter_sse(response)
        next(events)
        dead.set()
        rest = list(events)
    assert rest[-1] == "[DONE]"
    assert "engine step loop died" in json.loads(rest[-2])["error"]["message"]
    assert server.http().get("/health").status_code == 503


def test_streaming_request_to_a_dead_engine_is_503(
    make_server: MakeServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once the loop is dead a streaming request is refused with 503 like any other, not with a
    200 whose stream holds the error."""
    server = make_server()

    def broken_step() -> Any:
        raise AssertionError("dead")

    monkeypatch.setattr(server.engine, "step", broken_step)
    client = server.http()
    assert client.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 1}).status_code == 500
    assert client.get("/health").status_code == 503
    streamed = client.post(CHAT, json={"messages": MESSAGES, "stream": True})
    assert streamed.status_code == 503, streamed.text
    assert streamed.json()["error"]["code"] == "engine_dead"
