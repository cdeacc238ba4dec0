"""Property-based fuzzing of the real micro server against its own OpenAPI schema (schemathesis).

The schema comes from the running server's ``/openapi.json``. Every operation is fuzzed with
positive (schema-valid) and negative (schema-violating) data, at least ``MIN_CASES`` cases in all.
For every response:

- no 5xx;
- every non-2xx body is exactly the OpenAI envelope ``{"error": {"message", "type", "param",
  "code"}}`` with a non-empty message, a type matching the status, and a ``param`` that names a
  field of the request body (or ``null``);
- every 2xx body has the OpenAI shape (pydantic models below; the schema FastAPI generates has
  no response schema for the generation endpoints, so schemathesis alone cannot check them),
  streams are well framed, end with ``[DONE]`` and carry no error event;
- ``X-Request-Id`` is always set;
- schemathesis' own ``not_a_server_error`` and ``response_schema_conformance`` pass.

What the schema does not say (so schemathesis' status-code / content-type / negative-data checks
are not asserted, only counted and printed): validation errors are 400 (the schema documents
FastAPI's 422), 401/404/413/429/503 are undocumented, ``/health`` and ``/metrics`` are documented
as JSON, streams as JSON, and pydantic's lax mode accepts some schema-violating values
(``"stream": 0``, ``"max_tokens": "5"``).

Runtime: the micro model decodes ~80 tokens/s, so a case that asks for hundreds of tokens (or
16 samples of them) would cost seconds. ``_bound_cost`` shrinks only token counts the server
would accept anyway (16 < max_tokens <= max_model_len) to 1..16; out-of-range values are kept.
"""

from __future__ import annotations

import collections
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Literal

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ConfigDict, ValidationError
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    negative_data_rejection,
    response_schema_conformance,
)

from tests.spyre_server.http.helpers import MAX_MODEL_LEN, MODEL_NAME, Server, sse_payloads

MIN_CASES = 1000
POSITIVE_EXAMPLES = 1000
NEGATIVE_EXAMPLES = 480
CHEAP_MAX_TOKENS = 16
TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}
OPERATIONS = {
    "GET /health",
    "GET /metrics",
    "GET /v1/models",
    "GET /v1/models/{model_id}",
    "POST /reset_prefix_cache",
    "POST /v1/completions",
    "POST /v1/chat/completions",
    "POST /tokenize",
    "POST /detokenize",
    "POST /v1/completions/render",
    "POST /v1/chat/completions/render",
    "GET /get_load",
    "GET /server_info",
    "GET /version",
}


# ------------------------------------------------------------------------- OpenAI response shapes
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class PromptTokensDetails(_Strict):
    cached_tokens: int


class Usage(_Strict):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(_Strict):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: the first prompt token of an echo
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Strict):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"] | None
    stop_reason: int | str | None


class Completion(_Strict):
    id: str
    object: Literal["text_completion"]
    created: int
    model: Literal["micro"]
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(_Strict):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Strict):
    content: list[ChatTokenLogprob]


class ChatMessageOut(_Strict):
    role: Literal["assistant"]
    content: str


class ChatChoice(_Strict):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length"]
    stop_reason: int | str | None


class ChatCompletion(_Strict):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: Literal["micro"]
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(_Strict):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(_Strict):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length"] | None
    stop_reason: int | str | None


class ChatChunk(_Strict):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: Literal["micro"]
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(_Strict):
    id: Literal["micro"]
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: None
    max_model_len: int


class ModelList(_Strict):
    object: Literal["list"]
    data: list[ModelCard]


class ResetResult(_Strict):
    success: Literal[True]
    dropped_blocks: int


class ErrorDetail(_Strict):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorEnvelope(_Strict):
    error: ErrorDetail


# ---------------------------------------------------------------------------------- the checks
@dataclass(frozen=True)
class Reply:
    """A response as the checks see it: lower-case header names, one value each."""

    status_code: int
    headers: dict[str, str]
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode("utf-8")

    @classmethod
    def of(cls, response: Any) -> Reply:
        """From a schemathesis ``Response`` (header values are lists)."""
        headers = {k.lower(): v[-1] for k, v in response.headers.items()}
        return cls(response.status_code, headers, response.content or b"")


def _json_body(response: Reply) -> Any:
    assert response.headers.get("content-type") == "application/json", response.headers
    return json.loads(response.content)


def _check_usage(usage: Usage) -> None:
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens, usage
    assert 0 <= usage.prompt_tokens_details.cached_tokens <= usage.prompt_tokens, usage


def _check_indices(indices: collections.Counter[int] | list[int], body: Any) -> None:
    expected = _num_choices(body)
    if expected is not None:
        assert sorted(set(indices)) == list(range(expected)), (sorted(indices), expected)


def _num_choices(body: Any) -> int | None:
    """How many choices a request asks for (n per prompt), when the body says it plainly."""
    if not isinstance(body, dict):
        return None
    n = body.get("n", 1)
    if type(n) is not int:
        return None
    prompt = body.get("prompt")
    # A list of numbers is one token-id prompt (pydantic's lax mode takes 138.0 or true as ids).
    if isinstance(prompt, list) and prompt and not all(isinstance(t, int | float) for t in prompt):
        return n * len(prompt)
    return n


def _check_completion_ok(body: Any, response: Reply) -> None:
    out = Completion.model_validate(_json_body(response))
    assert out.usage is not None
    _check_usage(out.usage)
    _check_indices([c.index for c in out.choices], body)
    assert all(c.finish_reason is not None for c in out.choices)


def _check_chat_ok(body: Any, response: Reply) -> None:
    out = ChatCompletion.model_validate(_json_body(response))
    _check_usage(out.usage)
    _check_indices([c.index for c in out.choices], body)


def _check_stream(body: Any, response: Reply, chunk: type[BaseModel]) -> None:
    assert response.headers["content-type"].startswith("text/event-stream"), response.headers
    payloads = sse_payloads(response.text)
    assert payloads[-1] == "[DONE]", payloads[-3:]
    assert "[DONE]" not in payloads[:-1]
    finished: collections.Counter[int] = collections.Counter()
    seen: set[int] = set()
    usage_events = 0
    for raw in payloads[:-1]:
        event = json.loads(raw)
        assert "error" not in event, event  # no engine error on a healthy server
        parsed: Any = chunk.model_validate(event)
        if parsed.usage is not None:
            usage_events += 1
            assert parsed.choices == []
            _check_usage(parsed.usage)
        for choice in parsed.choices:
            seen.add(choice.index)
            if choice.finish_reason is not None:
                finished[choice.index] += 1
    _check_indices(sorted(seen), body)
    assert set(finished.values()) == {1} and set(finished) == seen, (finished, seen)
    options = body.get("stream_options") if isinstance(body, dict) else None
    wants_usage = isinstance(options, dict) and options.get("include_usage") is True
    assert usage_events == (1 if wants_usage else 0)


def _check_completions_ok(body: Any, response: Reply) -> None:
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        _check_stream(body, response, Completion)
    else:
        _check_completion_ok(body, response)


def _check_chat_completions_ok(body: Any, response: Reply) -> None:
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        _check_stream(body, response, ChatChunk)
    else:
        _check_chat_ok(body, response)


def _check_health_ok(body: Any, response: Reply) -> None:
    assert response.content == b""


def _check_metrics_ok(body: Any, response: Reply) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    assert response.headers["content-type"].startswith("text/plain"), response.headers
    names = {f.name for f in text_string_to_metric_families(response.text)}
    assert "vllm:kv_cache_usage_perc" in names


def _check_models_ok(body: Any, response: Reply) -> None:
    out = ModelList.model_validate(_json_body(response))
    assert [m.id for m in out.data] == [MODEL_NAME]
    assert out.data[0].max_model_len == MAX_MODEL_LEN


def _check_model_ok(body: Any, response: Reply) -> None:
    card = ModelCard.model_validate(_json_body(response))
    assert card.max_model_len == MAX_MODEL_LEN


def _check_reset_ok(body: Any, response: Reply) -> None:
    assert ResetResult.model_validate(_json_body(response)).dropped_blocks >= 0


def _check_tokenize_ok(body: Any, response: Reply) -> None:
    out = _json_body(response)
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == MAX_MODEL_LEN
    assert all(isinstance(t, int) and 0 <= t < 256 for t in out["tokens"])


def _check_detokenize_ok(body: Any, response: Reply) -> None:
    assert isinstance(_json_body(response)["prompt"], str)


def _check_render_ok(body: Any, response: Reply) -> None:
    out = _json_body(response)
    for item in out if isinstance(out, list) else [out]:
        assert item["model"] == MODEL_NAME and item["token_ids"], item
        assert len(item["token_ids"]) < MAX_MODEL_LEN


def _check_load_ok(body: Any, response: Reply) -> None:
    assert _json_body(response)["load"] >= 0


def _check_json_object_ok(body: Any, response: Reply) -> None:
    assert isinstance(_json_body(response), dict)


SUCCESS_CHECKS: dict[str, Callable[[Any, Reply], None]] = {
    "POST /tokenize": _check_tokenize_ok,
    "POST /detokenize": _check_detokenize_ok,
    "POST /v1/completions/render": _check_render_ok,
    "POST /v1/chat/completions/render": _check_render_ok,
    "GET /get_load": _check_load_ok,
    "GET /server_info": _check_json_object_ok,
    "GET /version": _check_json_object_ok,
    "GET /health": _check_health_ok,
    "GET /metrics": _check_metrics_ok,
    "GET /v1/models": _check_models_ok,
    "GET /v1/models/{model_id}": _check_model_ok,
    "POST /reset_prefix_cache": _check_reset_ok,
    "POST /v1/completions": _check_completions_ok,
    "POST /v1/chat/completions": _check_chat_completions_ok,
}


def check_error_envelope(response: Reply, body_fields: frozenset[str], status: int) -> None:
    """The OpenAI envelope, exactly; ``param`` names a request field (``messages.0.role``:
    the first segment is a field of the body schema)."""
    error = ErrorEnvelope.model_validate(_json_body(response)).error
    assert error.message.strip(), error
    assert error.type == TYPES.get(status, "invalid_request_error"), (status, error)
    if error.param is not None:
        assert error.param.split(".")[0] in body_fields, (error.param, sorted(body_fields))


# ----------------------------------------------------------------------------------- the fuzzer
def _bound_cost(case: Any) -> Any:
    """Shrink token counts the server would accept (16 < n <= max_model_len) to 1..16, keeping
    their JSON type; anything the server must reject stays as generated."""
    body = case.body
    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens"):
            value = body.get(key)
            if isinstance(value, bool) or not isinstance(value, int | float | str):
                continue
            try:
                number = float(value)
            except ValueError:
                continue
            if CHEAP_MAX_TOKENS < number <= MAX_MODEL_LEN and number.is_integer():
                small = 1 + int(number) % CHEAP_MAX_TOKENS
                body[key] = type(value)(small)
    return case


def _body_fields(openapi: dict[str, Any]) -> dict[str, frozenset[str]]:
    """Operation label -> the property names of its JSON request body."""
    components = openapi["components"]["schemas"]
    fields: dict[str, frozenset[str]] = {}
    for path, item in openapi["paths"].items():
        for method, operation in item.items():
            schema = (
                operation.get("requestBody", {})
                .get("content", {})
                .get("application/json", {})
                .get("schema", {})
            )
            if "$ref" in schema:
                schema = components[schema["$ref"].rsplit("/", 1)[-1]]
            fields[f"{method.upper()} {path}"] = frozenset(schema.get("properties", {}))
    return fields


class Fuzzer:
    """Sends cases, runs every check, and collects (never raises) failures, so that hypothesis
    neither shrinks nor stops early and the count of cases is exact."""

    def __init__(self, server: Server, body_fields: dict[str, frozenset[str]]) -> None:
        self.server = server
        self.body_fields = body_fields
        self.session = requests.Session()
        self.cases = 0
        self.statuses: collections.Counter[tuple[str, int]] = collections.Counter()
        self.failures: list[str] = []
        self.undocumented: collections.Counter[str] = collections.Counter()
        self.slowest: list[tuple[float, str]] = []

    def run(self, case: Any, mode: GenerationMode) -> None:
        label = case.operation.label
        started = time.monotonic()
        try:
            response = case.call(base_url=self.server.url, session=self.session, timeout=60)
        except requests.RequestException as exc:
            self._fail(case, None, f"transport error: {exc!r}")
            return
        elapsed = time.monotonic() - started
        self.slowest = sorted([*self.slowest, (elapsed, repr(case.body)[:200])])[-3:]
        self.cases += 1
        reply = Reply.of(response)
        status = response.status_code
        self.statuses[(label, status)] += 1
        try:
            assert response.headers.get("x-request-id"), "no X-Request-Id"
            case.validate_response(response, checks=[not_a_server_error])
            assert not response.stream_cut_short, "the response body was cut short"
            if reply.headers.get("content-type") == "application/json":
                case.validate_response(response, checks=[response_schema_conformance])
            else:  # /health (empty), /metrics (text), streams (SSE) are documented as JSON
                self.undocumented[f"{label}: {reply.headers.get('content-type')}"] += 1
            if 200 <= status < 300:
                SUCCESS_CHECKS[label](case.body, reply)
            else:
                check_error_envelope(reply, self.body_fields[label], status)
        except (AssertionError, ValidationError, ValueError, BaseExceptionGroup) as exc:
            self._fail(case, response, f"{type(exc).__name__}: {exc}")
        if mode is GenerationMode.NEGATIVE:
            try:
                case.validate_response(response, checks=[negative_data_rejection])
            except (AssertionError, BaseExceptionGroup):
                self.undocumented[f"{label}: schema-violating data accepted"] += 1

    def _fail(self, case: Any, response: Any, reason: str) -> None:
        status = response.status_code if response is not None else "-"
        text = response.text[:300] if response is not None else ""
        self.failures.append(
            f"{case.operation.label} -> {status}: {reason[:500]}\n  body: {text}\n"
            f"  reproduce: {case.as_curl_command(base_url=self.server.url)[:600]}"
        )


def _fuzz(schema: Any, fuzzer: Fuzzer, mode: GenerationMode, examples: int) -> None:
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        phases=[Phase.generate],  # failures are collected, not raised: nothing to shrink
        suppress_health_check=list(HealthCheck),
    )
    @given(case=schema.as_strategy(generation_mode=mode).map(_bound_cost))
    def fuzz(case: Any) -> None:
        fuzzer.run(case, mode)

    fuzz()


@pytest.fixture
def schema_only_draws(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Hypothesis (6.1xx on) biases its draws with constants it mines from every local module
    imported so far, so what a derandomized fuzz draws depended on which test modules the run had
    imported (a full run drew other cases than this file alone) and changed with any new module
    anywhere. Without those constants the draw depends on the seed and the schema alone."""
    from hypothesis.internal.conjecture import providers

    if not hasattr(providers, "_get_local_constants"):  # a Hypothesis without the feature
        yield
        return
    monkeypatch.setattr(providers, "_get_local_constants", providers.Constants)
    providers.CONSTANTS_CACHE.cache.clear()
    yield
    providers.CONSTANTS_CACHE.cache.clear()


@pytest.mark.slow
@pytest.mark.usefixtures("schema_only_draws")
def test_fuzz_every_operation_against_the_openapi_schema(server: Server) -> None:
    openapi = httpx.get(f"{server.url}/openapi.json", timeout=10).json()
    # Read whole streams (schemathesis stops after 20 events by default); no transport retries.
    config = schemathesis.Config.from_dict({"max-stream-events": 100_000, "request-retries": 0})
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json", config=config)
    labels = {op.ok().label for op in schema.get_all_operations()}
    assert labels == OPERATIONS, labels
    fuzzer = Fuzzer(server, _body_fields(openapi))
    started = time.monotonic()
    _fuzz(schema, fuzzer, GenerationMode.POSITIVE, POSITIVE_EXAMPLES)
    _fuzz(schema, fuzzer, GenerationMode.NEGATIVE, NEGATIVE_EXAMPLES)
    elapsed = time.monotonic() - started

    by_status = collections.Counter(status // 100 for (_, status) in fuzzer.statuses.elements())
    print(
        f"\nschemathesis: {fuzzer.cases} cases in {elapsed:.1f} s; by status class "
        f"{dict(sorted(by_status.items()))}; per operation and status "
        f"{dict(sorted(fuzzer.statuses.items()))}; not asserted: {dict(fuzzer.undocumented)}; "
        f"slowest: {fuzzer.slowest}"
    )
    assert not fuzzer.failures, f"{len(fuzzer.failures)} failing cases:\n" + "\n".join(
        fuzzer.failures[:10]
    )
    assert fuzzer.cases >= MIN_CASES, fuzzer.cases
    # The run must have reached every operation, and both outcomes of the generation endpoints.
    assert {label for label, _ in fuzzer.statuses} == OPERATIONS
    for label in ("POST /v1/completions", "POST /v1/chat/completions"):
        assert fuzzer.statuses[(label, 200)] >= 10, fuzzer.statuses
        assert fuzzer.statuses[(label, 400)] >= 10, fuzzer.statuses
    # The server still serves, and nothing is left running.
    ok = server.http().post("/v1/completions", json={"prompt": "after fuzz", "max_tokens": 2})
    assert ok.status_code == 200, ok.text
    server.wait_idle(timeout=30)
    server.engine.scheduler.check_integrity()


# ------------------------------------------------------------------- the checks check something
def _fake_response(status: int, body: bytes, content_type: str) -> Reply:
    return Reply(status, {"content-type": content_type}, body)


@pytest.mark.parametrize(
    "body",
    [
        b'{"detail": "Not Found"}',  # FastAPI's default shape
        b'{"error": {"message": "x", "type": "invalid_request_error", "param": null}}',
        b'{"error": {"message": "", "type": "invalid_request_error", "param": null, "code": null}}',
        b'{"error": {"message": "x", "type": "invalid_request_error", "param": "nope", '
        b'"code": null}}',
        b'{"error": {"message": "x", "type": "server_error", "param": null, "code": null}}',
        b"Bad Request",
    ],
)
def test_the_envelope_check_rejects_other_error_shapes(body: bytes) -> None:
    response = _fake_response(400, body, "application/json")
    with pytest.raises((AssertionError, ValidationError, ValueError)):
        check_error_envelope(response, frozenset({"prompt", "max_tokens"}), 400)


def test_the_envelope_check_accepts_the_envelope() -> None:
    body = b'{"error": {"message": "m", "type": "invalid_request_error", "param": "prompt.0", '
    body += b'"code": null}}'
    check_error_envelope(_fake_response(400, body, "application/json"), frozenset({"prompt"}), 400)


@pytest.mark.parametrize(
    "raw",
    [
        'data: {"error": {"message": "x", "type": "t", "param": null, "code": null}}\n\n'
        "data: [DONE]\n\n",
        'data: {"id": "c", "object": "text_completion", "created": 1, "model": "micro", '
        '"choices": [{"index": 0, "text": "a", "logprobs": null, "finish_reason": null}]}\n\n',
    ],
)
def test_the_stream_check_rejects_errors_and_missing_done(raw: str) -> None:
    response = _fake_response(200, raw.encode(), "text/event-stream; charset=utf-8")
    with pytest.raises((AssertionError, ValidationError)):
        _check_completions_ok({"prompt": "x"}, response)


@given(st.integers(min_value=-5, max_value=3 * MAX_MODEL_LEN))
@settings(max_examples=50, deadline=None, database=None)
def test_bound_cost_keeps_every_value_the_server_rejects(value: int) -> None:
    case = SimpleNamespace(body={"max_tokens": value, "max_completion_tokens": float(value)})
    _bound_cost(case)
    for key in ("max_tokens", "max_completion_tokens"):
        got = case.body[key]
        if CHEAP_MAX_TOKENS < value <= MAX_MODEL_LEN:
            assert 1 <= got <= CHEAP_MAX_TOKENS
        else:
            assert got == value
