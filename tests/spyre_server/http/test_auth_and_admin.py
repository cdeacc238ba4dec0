"""API keys (server.api_keys), /metrics auth, /health, /v1/models, /reset_prefix_cache,
served_model_name."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.spyre_server.http.helpers import (
    MAX_MODEL_LEN,
    MODEL_NAME,
    MakeServer,
    Metrics,
    Server,
)

KEYS = ["k1", "k2"]
COMPLETION = {"prompt": "x", "max_tokens": 1}
CHAT = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}


@pytest.fixture
def keyed(make_server: MakeServer) -> Iterator[Server]:
    yield make_server(server__api_keys=KEYS)


def call(server: Server, method: str, path: str, auth: str | None, **kwargs: Any) -> httpx.Response:
    headers = dict(kwargs.pop("headers", {}))
    if auth is not None:
        headers["Authorization"] = auth
    return server.http().request(method, path, headers=headers, **kwargs)


PROTECTED = [
    ("GET", "/v1/models", {}),
    ("POST", "/v1/completions", {"json": COMPLETION}),
    ("POST", "/v1/chat/completions", {"json": CHAT}),
    ("POST", "/reset_prefix_cache", {}),
]


def assert_401(response: httpx.Response) -> None:
    assert response.status_code == 401, response.text
    error = response.json()["error"]
    assert error["type"] == "authentication_error"
    assert set(error) == {"message", "type", "param", "code"}
    assert "k1" not in error["message"] and "k2" not in error["message"]


@pytest.mark.parametrize(("method", "path", "kwargs"), PROTECTED)
def test_every_endpoint_needs_a_valid_key(
    keyed: Server, method: str, path: str, kwargs: dict[str, Any]
) -> None:
    for auth in (
        None,
        "",
        "Bearer",
        "Bearer wrong",
        "Bearer k1x",
        "Bearer k",
        "Basic k1",
        "k1",
    ):
        assert_401(call(keyed, method, path, auth, **kwargs))
    for auth in ("Bearer k1", "Bearer k2", "bearer k1"):
        response = call(keyed, method, path, auth, **kwargs)
        assert response.status_code == 200, (auth, response.text)


def test_health_and_metrics_are_open(keyed: Server) -> None:
    assert call(keyed, "GET", "/health", None).status_code == 200
    metrics = call(keyed, "GET", "/metrics", None)
    assert metrics.status_code == 200
    assert "vllm:kv_cache_usage_perc" in metrics.text


def test_metrics_require_auth_when_configured(make_server: MakeServer) -> None:
    server = make_server(server__api_keys=KEYS, server__metrics_require_auth=True)
    assert_401(call(server, "GET", "/metrics", None))
    assert_401(call(server, "GET", "/metrics", "Bearer nope"))
    response = call(server, "GET", "/metrics", "Bearer k2")
    assert response.status_code == 200
    Metrics.parse(response.text).value("vllm:num_requests_running")
    assert call(server, "GET", "/health", None).status_code == 200


def test_no_keys_means_no_auth(server: Server) -> None:
    for method, path, kwargs in PROTECTED:
        assert call(server, method, path, None, **kwargs).status_code == 200
        assert call(server, method, path, "Bearer anything", **kwargs).status_code == 200


def test_openai_client_with_a_wrong_key(keyed: Server) -> None:
    with pytest.raises(openai.AuthenticationError) as excinfo:
        keyed.openai(api_key="wrong").completions.create(model=MODEL_NAME, prompt="x", max_tokens=1)
    assert excinfo.value.status_code == 401
    out = keyed.openai(api_key="k2").completions.create(model=MODEL_NAME, prompt="x", max_tokens=2)
    assert out.usage is not None and out.usage.completion_tokens == 2


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": 5},
        {"messages": []},
    ],
)
def test_authentication_comes_before_request_validation(
    keyed: Server, body: dict[str, Any]
) -> None:
    """Without a valid key the answer is 401, whatever the body: an unauthenticated client gets
    no validation details (and the server does no work for it)."""
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert_401(call(keyed, "POST", path, None, json=body))
        assert_401(
            call(
                keyed,
                "POST",
                path,
                None,
                content=b"{oops",
                headers={"content-type": "application/json"},
            )
        )


# ----------------------------------------------------------------------------------- admin / info
def test_models_lists_the_model_with_max_model_len(server: Server) -> None:
    body = server.http().get("/v1/models").json()
    assert body["object"] == "list"
    (model,) = body["data"]
    assert model["id"] == MODEL_NAME
    assert model["object"] == "model"
    assert model["max_model_len"] == MAX_MODEL_LEN
    assert model["owned_by"] == "spyre-server"
    assert isinstance(model["created"], int)


def test_health_is_200_with_an_empty_body(server: Server) -> None:
    response = server.http().get("/health")
    assert response.status_code == 200
    assert response.content == b""


def test_served_model_name(make_server: MakeServer) -> None:
    server = make_server(model__served_model_name="team/chat-model", model__max_model_len=512)
    client = server.http()
    (model,) = client.get("/v1/models").json()["data"]
    assert model["id"] == "team/chat-model"
    assert model["max_model_len"] == 512
    ok = client.post(
        "/v1/completions", json={"model": "team/chat-model", "prompt": "x", "max_tokens": 1}
    )
    assert ok.status_code == 200
    assert ok.json()["model"] == "team/chat-model"
    chat = client.post("/v1/chat/completions", json={"model": "team/chat-model"} | CHAT)
    assert chat.json()["model"] == "team/chat-model"
    wrong = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x"})
    assert wrong.status_code == 404
    # Omitting the model is fine (one model is served).
    assert client.post("/v1/completions", json=COMPLETION).status_code == 200
    text = client.get("/metrics").text
    metrics = Metrics.parse(text)
    assert metrics.value("vllm:num_requests_running", model_name="team/chat-model") == 0
    assert 'model_name="micro"' not in text


def test_reset_prefix_cache_reports_dropped_blocks(make_server: MakeServer) -> None:
    server = make_server()
    client = server.http()
    assert client.post("/reset_prefix_cache").json() == {"success": True, "dropped_blocks": 0}
    # 200 tokens: 3 full blocks; their KV is written by the prefill: 3 cached blocks.
    assert (
        client.post("/v1/completions", json={"prompt": "a" * 200, "max_tokens": 1}).status_code
        == 200
    )
    assert client.post("/reset_prefix_cache").json() == {"success": True, "dropped_blocks": 3}
    assert client.post("/reset_prefix_cache").json() == {"success": True, "dropped_blocks": 0}
    again = client.post("/v1/completions", json={"prompt": "a" * 200, "max_tokens": 1})
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
