"""Raw HTTP (httpx) error cases: every error is the OpenAI envelope
``{"error": {"message", "type", "param", "code"}}`` with the right status; body limit; unknown
routes and models; queue full (429)."""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
import pytest

from spyre_server.config import ConfigError, load_config
from tests.spyre_server.http.helpers import (
    MAX_MODEL_LEN,
    MODEL_NAME,
    MakeServer,
    Server,
    iter_sse,
    slow_down,
    unique_text,
)

MAX_BODY = 4 * 2**20
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


OVERFLOW = "context_length_exceeded"


def overflow_code(field: str, value: Any) -> str | None:
    """The code of a refusal: OpenAI's ``context_length_exceeded`` when ``value`` of a
    max-tokens field cannot fit in the context, else none."""
    too_many = isinstance(value, int) and value > MAX_MODEL_LEN
    return OVERFLOW if field in ("max_tokens", "max_completion_tokens") and too_many else None


def assert_envelope(
    response: httpx.Response,
    status: int,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == type_, error
    assert_param(error["param"], param)
    assert error["code"] == code, error
    return error


# Segments a ``param`` path may have after the top-level field: list indices and nested fields.
_NESTED_FIELDS = {"role", "content", "type", "text", "include_usage"}


def assert_param(got: str | None, field: str | None) -> None:
    """``param`` names the request field: exactly ``field``, or a path into it through list
    indices and nested fields (``messages.0.role``, ``stop_token_ids.0``); never a pydantic
    union-member tag such as ``prompt.str`` or ``prompt.list[int]``."""
    if field is None or got == field:
        assert got == field
        return
    assert got is not None and got.startswith(field + "."), (got, field)
    rest = got[len(field) + 1 :].split(".")
    assert all(seg.isdigit() or seg in _NESTED_FIELDS for seg in rest), (got, field)


def post(server: Server, path: str, body: Any) -> httpx.Response:
    return server.http().post(path, json=body)


# ------------------------------------------------------------------------------ malformed bodies
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_malformed_json_is_400(server: Server, path: str) -> None:
    response = server.http().post(
        path, content=b'{"prompt": "x",', headers={"content-type": "application/json"}
    )
    error = assert_envelope(response, 400)
    assert "JSON" in error["message"]


@pytest.mark.parametrize("body", [[], "text", 5, None])
def test_body_that_is_not_an_object_is_400(server: Server, body: Any) -> None:
    assert_envelope(post(server, COMPLETIONS, body), 400)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"max_tokens": 3}, "prompt"),  # missing
        ({"prompt": "x", "max_tokens": "abc"}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 2.5}, "max_tokens"),
        ({"prompt": "x", "temperature": "hot"}, "temperature"),
        ({"prompt": "x", "top_p": [1]}, "top_p"),
        ({"prompt": "x", "n": "many"}, "n"),
        ({"prompt": "x", "logprobs": "yes please"}, "logprobs"),
        ({"prompt": "x", "stop": 5}, "stop"),
        ({"prompt": "x", "stop_token_ids": ["a"]}, "stop_token_ids"),
        ({"prompt": "x", "seed": "s"}, "seed"),
        ({"prompt": "x", "echo": "maybe"}, "echo"),
        ({"prompt": "x", "stream_options": 3}, "stream_options"),
        ({"prompt": "x", "cache_salt": 7}, "cache_salt"),
    ],
)
def test_wrong_types_name_the_field(server: Server, body: dict[str, Any], param: str) -> None:
    error = assert_envelope(post(server, COMPLETIONS, body), 400, param=param)
    assert param in error["message"]


@pytest.mark.parametrize("prompt", [123, 1.5, {"text": "x"}, [1, "a"], True])
def test_wrong_prompt_type_names_the_prompt_field(server: Server, prompt: Any) -> None:
    """``param`` is the request field (``prompt``), not pydantic's union-member path such as
    ``prompt.str``."""
    assert_envelope(post(server, COMPLETIONS, {"prompt": prompt}), 400, param="prompt")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": "hi"}, "messages"),
        ({}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"content": "x"}]}, "messages.0.role"),
        ({"messages": MESSAGES, "logprobs": "x"}, "logprobs"),
        ({"messages": MESSAGES, "max_completion_tokens": 0}, "max_completion_tokens"),
    ],
)
def test_chat_wrong_fields(server: Server, body: dict[str, Any], param: str) -> None:
    assert_envelope(post(server, CHAT, body), 400, param=param)


def test_chat_template_rejection_is_400(server: Server) -> None:
    response = post(server, CHAT, {"messages": [{"role": "tool", "content": "x"}]})
    error = assert_envelope(response, 400, param="messages")
    assert "no tool role" in error["message"]


def test_chat_top_logprobs_without_logprobs_is_400(server: Server) -> None:
    response = post(server, CHAT, {"messages": MESSAGES, "top_logprobs": 2})
    assert_envelope(response, 400, param="top_logprobs")


# ----------------------------------------------------------------------------------- prompt size
@pytest.mark.parametrize("prompt", ["", [], [[]], ["x", ""], [[1], []]])
def test_empty_prompt_is_400(server: Server, prompt: Any) -> None:
    assert_envelope(post(server, COMPLETIONS, {"prompt": prompt}), 400, param="prompt")


def test_empty_chat_template_output_is_not_a_crash(server: Server) -> None:
    """A conversation of empty messages still renders the template: 200."""
    response = post(server, CHAT, {"messages": [{"role": "user", "content": ""}], "max_tokens": 1})
    assert response.status_code == 200, response.text


def test_prompt_plus_max_tokens_over_max_model_len_is_400(server: Server) -> None:
    prompt = unique_text("too-long-with-output", MAX_MODEL_LEN - 10)
    response = post(server, COMPLETIONS, {"prompt": prompt, "max_tokens": 11})
    error = assert_envelope(response, 400, param="max_tokens", code=OVERFLOW)
    # OpenAI's wording, which client libraries match to detect an overflow: 1014 + 11 = 1025
    assert error["message"] == (
        f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you requested "
        f"{MAX_MODEL_LEN + 1} tokens ({MAX_MODEL_LEN - 10} in the prompt, 11 in the completion). "
        "Please reduce the length of the prompt or the completion."
    )
    chat = post(server, CHAT, {"messages": MESSAGES, "max_tokens": MAX_MODEL_LEN})
    assert_envelope(chat, 400, param="max_tokens", code=OVERFLOW)
    chat = post(server, CHAT, {"messages": MESSAGES, "max_completion_tokens": MAX_MODEL_LEN})
    assert_envelope(chat, 400, param="max_tokens", code=OVERFLOW)


@pytest.mark.parametrize("length", [MAX_MODEL_LEN, MAX_MODEL_LEN + 1, 3 * MAX_MODEL_LEN])
def test_prompt_alone_at_or_over_max_model_len_is_400(server: Server, length: int) -> None:
    prompt = unique_text("too-long", length)
    for body in ({"prompt": prompt}, {"prompt": prompt, "max_tokens": 1}):
        response = post(server, COMPLETIONS, body)
        error = assert_envelope(response, 400, param="prompt", code=OVERFLOW)
        assert error["message"].startswith(
            f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you "
            f"requested {length} tokens in the prompt"
        )
    as_ids = post(server, COMPLETIONS, {"prompt": [65] * length})
    assert_envelope(as_ids, 400, param="prompt", code=OVERFLOW)
    chat = post(server, CHAT, {"messages": [{"role": "user", "content": prompt}]})
    assert_envelope(chat, 400, param="messages", code=OVERFLOW)


@pytest.mark.parametrize("prompt", [[256], [1, 2, 1000], [[1], [2**40]], [-1], [[3, -5]]])
def test_token_ids_outside_the_vocabulary_are_400(server: Server, prompt: Any) -> None:
    assert_envelope(
        post(server, COMPLETIONS, {"prompt": prompt, "max_tokens": 1}), 400, param="prompt"
    )


# ------------------------------------------------------------------------------- numeric ranges
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("max_tokens", -1),
        ("max_tokens", 10**12),
        ("max_tokens", 2**80),
        ("n", 0),
        ("n", -3),
        ("n", 10**6),
        ("temperature", -0.1),
        ("temperature", 1e9),
        ("top_p", 0),
        ("top_p", -1),
        ("top_p", 1.5),
        ("top_k", 0),
        ("logprobs", -1),
        ("logprobs", 21),
        ("logprobs", 10**9),
        ("seed", -1),
        ("seed", 2**64),
        ("stop_token_ids", [-1]),
    ],
)
def test_out_of_range_sampling_values_are_400(server: Server, field: str, value: Any) -> None:
    response = post(server, COMPLETIONS, {"prompt": "x", field: value})
    assert_envelope(response, 400, param=field, code=overflow_code(field, value))


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_tokens", -5), ("n", 0), ("temperature", 3), ("top_p", 0), ("top_logprobs", 21)],
)
def test_out_of_range_chat_values_are_400(server: Server, field: str, value: Any) -> None:
    body = {"messages": MESSAGES, "logprobs": True, field: value}
    assert_envelope(post(server, CHAT, body), 400, param=field)


def test_nan_temperature_is_400(server: Server) -> None:
    response = server.http().post(
        COMPLETIONS,
        content=b'{"prompt": "x", "temperature": NaN}',
        headers={"content-type": "application/json"},
    )
    assert_envelope(response, 400, param="temperature")


def test_too_many_or_empty_stop_strings_are_400(server: Server) -> None:
    assert_envelope(
        post(server, COMPLETIONS, {"prompt": "x", "stop": ["a"] * 17}), 400, param="stop"
    )
    assert_envelope(post(server, COMPLETIONS, {"prompt": "x", "stop": ""}), 400, param="stop")
    assert_envelope(
        post(server, COMPLETIONS, {"prompt": "x", "stop": ["a", ""]}), 400, param="stop"
    )


# ------------------------------------------------------------------------------ model and routes
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_unknown_model_is_404(server: Server, path: str) -> None:
    body: dict[str, Any] = {"model": "gpt-4", "max_tokens": 1}
    body |= {"prompt": "x"} if path == COMPLETIONS else {"messages": MESSAGES}
    error = assert_envelope(
        post(server, path, body), 404, "not_found_error", param="model", code="model_not_found"
    )
    assert "gpt-4" in error["message"]
    body["model"] = MODEL_NAME
    assert post(server, path, body).status_code == 200


def test_unknown_route_and_wrong_method_use_the_envelope(server: Server) -> None:
    client = server.http()
    assert_envelope(client.get("/v1/nothing"), 404, "not_found_error")
    assert_envelope(client.get(COMPLETIONS), 405)
    assert_envelope(client.get("/reset_prefix_cache"), 405)


# ------------------------------------------------------------------------------------ body limit
def test_body_over_4_mib_is_413(server: Server) -> None:
    client = server.http()
    body = b'{"prompt": "' + b"a" * MAX_BODY + b'"}'
    error = assert_envelope(
        client.post(COMPLETIONS, content=body, headers={"content-type": "application/json"}), 413
    )
    assert str(MAX_BODY) in error["message"]
    assert_envelope(client.post(CHAT, content=b"x" * (MAX_BODY + 1)), 413)


def test_body_of_exactly_4_mib_is_not_413(server: Server) -> None:
    response = server.http().post(
        COMPLETIONS, content=b"{" * MAX_BODY, headers={"content-type": "application/json"}
    )
    assert_envelope(response, 400)


def test_chunked_body_over_4_mib_is_413(server: Server) -> None:
    """Without a Content-Length (chunked transfer encoding) the limit must answer 413 too."""

    def chunks() -> Any:
        yield b'{"prompt": "'
        for _ in range(5):
            yield b"a" * 2**20
        yield b'"}'

    response = server.http().post(
        COMPLETIONS, content=chunks(), headers={"content-type": "application/json"}
    )
    assert "content-length" not in response.request.headers
    assert_envelope(response, 413)


# ------------------------------------------------------------------------------------ request id
def test_request_id_is_echoed_and_names_the_response(server: Server) -> None:
    client = server.http()
    response = client.post(
        COMPLETIONS, json={"prompt": "x", "max_tokens": 1}, headers={"X-Request-Id": "trace-42"}
    )
    assert response.status_code == 200
    assert response.headers["x-request-id"] == "trace-42"
    assert response.json()["id"] == "cmpl-trace-42"
    chat = client.post(
        CHAT, json={"messages": MESSAGES, "max_tokens": 1}, headers={"x-request-id": "trace-43"}
    )
    assert chat.headers["x-request-id"] == "trace-43"
    assert chat.json()["id"] == "chatcmpl-trace-43"
    with client.stream(
        "POST",
        COMPLETIONS,
        json={"prompt": "x", "max_tokens": 3, "stream": True},
        headers={"x-request-id": "trace-44"},
    ) as stream:
        assert stream.headers["x-request-id"] == "trace-44"
        ids = {json.loads(p)["id"] for p in iter_sse(stream) if p != "[DONE]"}
    assert ids == {"cmpl-trace-44"}
    error = client.post(COMPLETIONS, json={"prompt": ""}, headers={"x-request-id": "trace-45"})
    assert error.status_code == 400
    assert error.headers["x-request-id"] == "trace-45"
    assert client.get("/health", headers={"x-request-id": "h"}).headers["x-request-id"] == "h"


def test_request_id_is_generated_when_absent(server: Server) -> None:
    client = server.http()
    first = client.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 1})
    second = client.post(CHAT, json={"messages": MESSAGES, "max_tokens": 1})
    rid1, rid2 = first.headers["x-request-id"], second.headers["x-request-id"]
    assert rid1 and rid2 and rid1 != rid2
    assert first.json()["id"] == f"cmpl-{rid1}"
    assert second.json()["id"] == f"chatcmpl-{rid2}"


def test_a_reused_request_id_does_not_fail_a_concurrent_request(server: Server) -> None:
    """X-Request-Id is a client's tracing id: two requests in flight may carry the same one (a
    retry, a proxy's fixed header). Both must be served."""
    client = server.http()
    headers = {"x-request-id": "dup"}
    with client.stream(
        "POST",
        COMPLETIONS,
        json={"prompt": "x", "max_tokens": 300, "stream": True},
        headers=headers,
    ) as stream:
        events = iter_sse(stream)
        next(events)  # the first request is running
        second = client.post(COMPLETIONS, json={"prompt": "y", "max_tokens": 2}, headers=headers)
    assert second.status_code == 200, second.text


# ------------------------------------------------------------------------------------ queue full
def test_queue_full_is_429(make_server: MakeServer, monkeypatch: pytest.MonkeyPatch) -> None:
    server = make_server(scheduler__max_num_seqs=1, scheduler__max_waiting=1)
    slow_down(monkeypatch, server, 0.005)
    client = server.http()
    results: dict[str, httpx.Response] = {}
    with client.stream(
        "POST", COMPLETIONS, json={"prompt": "running", "max_tokens": 400, "stream": True}
    ) as running:
        events = iter_sse(running)  # keep it: dropping the iterator closes the connection
        next(events)  # A runs and fills the batch (max_num_seqs 1)
        waiter = threading.Thread(
            target=lambda: results.setdefault(
                "waiting", client.post(COMPLETIONS, json={"prompt": "waiting", "max_tokens": 2})
            )
        )
        waiter.start()
        server.wait_until(lambda m: m.value("vllm:num_requests_waiting") == 1, 10, "B waits")
        for path, body in (
            (COMPLETIONS, {"prompt": "rejected", "max_tokens": 2}),
            (CHAT, {"messages": MESSAGES, "max_tokens": 2}),
        ):
            error = assert_envelope(
                client.post(path, json=body), 429, "rate_limit_error", code="queue_full"
            )
            assert "busy" in error["message"]
    # A's client went away: A is aborted, B is admitted and served.
    waiter.join(30)
    assert results["waiting"].status_code == 200, results["waiting"].text
    assert results["waiting"].json()["usage"]["completion_tokens"] == 2
    server.wait_idle()
    assert client.post(COMPLETIONS, json={"prompt": "later", "max_tokens": 2}).status_code == 200


def test_queue_full_via_openai_client(
    make_server: MakeServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    import openai

    server = make_server(scheduler__max_num_seqs=1, scheduler__max_waiting=1)
    slow_down(monkeypatch, server, 0.005)
    client = server.openai()
    stream = client.completions.create(model=MODEL_NAME, prompt="a", max_tokens=400, stream=True)
    next(iter(stream))
    waiter = threading.Thread(
        target=lambda: client.completions.create(model=MODEL_NAME, prompt="b", max_tokens=1)
    )
    waiter.start()
    try:
        server.wait_until(lambda m: m.value("vllm:num_requests_waiting") == 1, 10, "B waits")
        with pytest.raises(openai.RateLimitError) as excinfo:
            client.completions.create(model=MODEL_NAME, prompt="c", max_tokens=1)
        assert excinfo.value.status_code == 429
        assert excinfo.value.code == "queue_full"
    finally:
        stream.close()
        waiter.join(30)


def test_max_waiting_zero_is_refused_at_start() -> None:
    """``scheduler.max_waiting: 0`` would reject every request (each one waits, however
    briefly, before admission): the configuration refuses it, naming the key."""
    with pytest.raises(ConfigError, match=r"scheduler\.max_waiting"):
        load_config(overrides={"scheduler.max_waiting": 0})


def test_max_waiting_one_serves_an_idle_server(make_server: MakeServer) -> None:
    server = make_server(scheduler__max_waiting=1)
    response = server.http().post(COMPLETIONS, json={"prompt": "x", "max_tokens": 1})
    assert response.status_code == 200, response.text


# ------------------------------------------------------------------- hostile input
def assert_still_serves(server: Server) -> None:
    """A follow-up request on a fresh connection succeeds."""
    with httpx.Client(base_url=server.url, timeout=30) as client:
        ok = client.post(COMPLETIONS, json={"prompt": "still here", "max_tokens": 2})
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] == 2


def post_raw(server: Server, path: str, content: bytes) -> httpx.Response:
    # A fresh connection: a failing request must not hide behind a broken keep-alive one.
    with httpx.Client(base_url=server.url, timeout=30) as client:
        return client.post(path, content=content, headers={"content-type": "application/json"})


@pytest.mark.parametrize(
    ("path", "content"),
    [
        (COMPLETIONS, b'{"prompt": "\xff\xfe", "max_tokens": 1}'),
        (COMPLETIONS, b'{"prompt": "ok", "max_tokens": 1, "stop": ["\xc3"]}'),
        (COMPLETIONS, b'{"prompt": "ok", "max_tokens": 1, "cache_salt": "\x80"}'),
        (COMPLETIONS, b'\xff{"prompt": "ok"}'),
        (CHAT, b'{"messages": [{"role": "user", "content": "\xc3\x28"}], "max_tokens": 1}'),
        (CHAT, b'{"messages": [{"role": "us\xe9r", "content": "x"}], "max_tokens": 1}'),
    ],
)
def test_invalid_utf8_in_the_body_is_400(server: Server, path: str, content: bytes) -> None:
    error = assert_envelope(post_raw(server, path, content), 400)
    assert "body" in error["message"] or "UTF-8" in error["message"], error
    assert_still_serves(server)


@pytest.mark.parametrize(
    ("path", "content", "param"),
    [
        (COMPLETIONS, b'{"prompt": "\\ud800", "max_tokens": 1}', "prompt"),
        (COMPLETIONS, b'{"prompt": ["ok", "a\\udfffb"], "max_tokens": 1}', "prompt"),
        (CHAT, b'{"messages": [{"role": "user", "content": "\\ud800x"}]}', "messages"),
        (CHAT, b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}]}', "messages"),
        (
            CHAT,
            b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
            "messages",
        ),
    ],
)
def test_lone_surrogates_in_prompt_text_are_400(
    server: Server, path: str, content: bytes, param: str
) -> None:
    response = post_raw(server, path, content)
    try:
        assert_envelope(response, 400, param=param)
    finally:
        assert_still_serves(server)


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_too_many_stop_strings_or_stop_token_ids_are_400(server: Server, path: str) -> None:
    base: dict[str, Any] = {"prompt": "x"} if path == COMPLETIONS else {"messages": MESSAGES}
    for field, value in (
        ("stop", ["s"] * 17),
        ("stop", [f"stop-{i}" for i in range(1000)]),
        ("stop_token_ids", [1] * 65),
        ("stop_token_ids", list(range(100_000))),
    ):
        error = assert_envelope(post(server, path, base | {field: value}), 400, param=field)
        assert field in error["message"]
    # at the limits: served
    for field, value in (("stop", [f"s{i}" for i in range(16)]), ("stop_token_ids", [1] * 64)):
        ok = post(server, path, base | {field: value, "max_tokens": 1})
        assert ok.status_code == 200, ok.text
    assert_still_serves(server)


@pytest.mark.parametrize(
    ("field", "value", "param"),
    [
        ("max_tokens", 10**12, "max_tokens"),
        ("max_tokens", 2**80, "max_tokens"),
        ("max_tokens", -1, "max_tokens"),
        # over the context, it is reported as max_tokens (the sampling limit both fields set)
        ("max_completion_tokens", 10**12, "max_tokens"),
        ("max_completion_tokens", -1, "max_completion_tokens"),
        ("n", 17, "n"),
        ("n", 10**12, "n"),
        ("n", -1, "n"),
        ("top_logprobs", -1, "top_logprobs"),
        ("top_logprobs", 10**12, "top_logprobs"),
        ("logprobs", 5, "logprobs"),
        ("temperature", 10**12, "temperature"),
    ],
)
def test_absurd_chat_values_name_the_field(
    server: Server, field: str, value: Any, param: str
) -> None:
    body = {"messages": MESSAGES, "logprobs": True, field: value}
    code = overflow_code(field, value)
    error = assert_envelope(post(server, CHAT, body), 400, param=param, code=code)
    assert (param in error["message"]) or code == OVERFLOW
    assert_still_serves(server)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 17),
        ("n", 2**80),
        ("logprobs", 2**80),
        ("max_tokens", 2**1000),
        ("top_k", -(2**80)),
        ("seed", -(2**80)),
    ],
)
def test_absurd_completion_values_name_the_field(server: Server, field: str, value: Any) -> None:
    response = post(server, COMPLETIONS, {"prompt": "x", field: value})
    assert_envelope(response, 400, param=field, code=overflow_code(field, value))
    assert_still_serves(server)


@pytest.mark.parametrize("literal", [b"Infinity", b"-Infinity", b"1e400", b"NaN"])
@pytest.mark.parametrize("field", ["max_tokens", "n", "logprobs"])
def test_non_finite_numbers_are_400(server: Server, field: str, literal: bytes) -> None:
    content = b'{"prompt": "x", "' + field.encode() + b'": ' + literal + b"}"
    assert_envelope(post_raw(server, COMPLETIONS, content), 400, param=field)
    assert_still_serves(server)


@pytest.mark.parametrize(
    "prompt",
    [
        [1] * 1_000_000,  # ~3 MB of ids, within the body limit
        [[1] * 400_000, [2] * 400_000],
        [256] * 1_000_000,  # out of the vocabulary as well
    ],
    ids=["1M-ids", "2x400k-ids", "1M-out-of-vocab"],
)
def test_huge_prompt_token_id_lists_are_refused_quickly(server: Server, prompt: Any) -> None:
    """Rejected with a 4xx naming ``prompt`` (too long, outside the vocabulary) within a few
    seconds; no engine work is started."""
    import time

    before = server.metrics()
    started = time.monotonic()
    response = server.http().post(COMPLETIONS, json={"prompt": prompt, "max_tokens": 1})
    elapsed = time.monotonic() - started
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:300])
    code = None if max(max(p) if isinstance(p, list) else p for p in prompt) > 255 else OVERFLOW
    error = assert_envelope(response, response.status_code, param="prompt", code=code)
    assert error["message"]
    assert elapsed < 15, f"took {elapsed:.1f} s"
    after = server.metrics()
    assert after.value("vllm:prompt_tokens_total") == before.value("vllm:prompt_tokens_total")
    assert_still_serves(server)


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": [[1]] * 12, "max_tokens": 1},
        {"prompt": ["a", "b", "c"], "n": 4, "max_tokens": 1},
    ],
    ids=["12-prompts", "3-prompts-x-n4"],
)
def test_one_request_cannot_queue_more_than_max_waiting(
    make_server: MakeServer, body: dict[str, Any]
) -> None:
    server = make_server(scheduler__max_waiting=4)
    response = post(server, COMPLETIONS, body)
    try:
        assert response.status_code in (400, 429), response.text[:300]
        if response.status_code == 400:
            param = response.json()["error"]["param"]
            assert param in ("prompt", "n"), response.text
            assert_envelope(response, 400, param=param)
        else:
            assert_envelope(response, 429, "rate_limit_error", code="queue_full")
    finally:
        assert_still_serves(server)
