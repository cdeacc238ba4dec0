"""The HTTP side of a benchmark: the model list, and one streamed ``/v1/completions`` request with
its timings (``time.perf_counter``)."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from spyre_server.benchmark.errors import BenchError

MAX_ERROR_CHARS = 300


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def one_line(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def error_message(body: bytes) -> str:
    """The message of an error response: the OpenAI envelope's ``error.message``, FastAPI's
    ``detail``, else the body itself."""
    try:
        data = json.loads(body)
    except ValueError:
        return one_line(body.decode("utf-8", errors="replace")) or "(empty body)"
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and "message" in error:
            return one_line(str(error["message"]))
        if error is not None:
            return one_line(str(error))
        if "detail" in data:
            return one_line(str(data["detail"]))
    return one_line(json.dumps(data))


def describe(exc: BaseException) -> str:
    """``Type: message`` on one line (httpx timeouts have an empty message)."""
    text = one_line(str(exc))
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def fetch_model_ids(base_url: str, api_key: str | None, timeout: float) -> list[str]:
    """The ids of ``GET /v1/models``. Raises BenchError (one line) when the server is unreachable
    or the answer is not a model list."""
    url = f"{base_url}/v1/models"
    try:
        response = httpx.get(url, headers=auth_headers(api_key), timeout=timeout)
    except httpx.ConnectError as exc:
        raise BenchError(f"cannot connect to {base_url}: {one_line(str(exc))}") from None
    except httpx.HTTPError as exc:
        raise BenchError(f"GET {url} failed: {describe(exc)}") from None
    if response.status_code != 200:
        raise BenchError(
            f"GET {url} returned HTTP {response.status_code}: {error_message(response.content)}"
        )
    try:
        models = response.json()["data"]
        ids = [str(m["id"]) for m in models]
    except (ValueError, KeyError, TypeError):
        raise BenchError(f"GET {url} did not return an OpenAI model list") from None
    if not ids:
        raise BenchError(f"GET {url} lists no model")
    return ids


def completion_payload(
    model: str, prompt_ids: Sequence[int], output_len: int, ignore_eos: bool
) -> dict[str, Any]:
    """A greedy streamed completion of exactly these prompt tokens. ``ignore_eos`` (a vLLM
    extension) is only sent when true, so that strict servers accept the request otherwise."""
    payload: dict[str, Any] = {
        "model": model,
        "prompt": list(prompt_ids),
        "max_tokens": output_len,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        payload["ignore_eos"] = True
    return payload


@dataclass(slots=True)
class Completion:
    """The outcome of one streamed request. Times are seconds from the moment it was sent.

    ``ttft_s``: to the first chunk with text (or the first chunk with a choice when no chunk has
    text). ``itl_s``: the gaps between successive chunks with text. ``num_output_tokens``:
    ``usage.completion_tokens`` when the server reports usage, else the number of text chunks.
    ``num_prompt_tokens`` / ``num_cached_tokens``: from ``usage`` when present."""

    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    latency_s: float | None = None
    text: str = ""
    num_output_tokens: int = 0
    num_prompt_tokens: int | None = None
    num_cached_tokens: int | None = None


async def stream_completion(
    client: httpx.AsyncClient, url: str, payload: dict[str, Any]
) -> Completion:
    """POST ``payload`` to ``url`` and read its SSE stream to the end. Never raises for a failed
    request (HTTP error, ``data: {"error": ...}``, broken stream, timeout): the Completion then
    has ``ok=False`` and a one-line ``error``."""
    out = Completion()
    pieces: list[str] = []
    usage: dict[str, Any] | None = None
    num_text_chunks = 0
    first_choice: float | None = None
    last: float | None = None
    start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                body = await response.aread()
                out.error = f"HTTP {response.status_code}: {error_message(body)}"
                return out
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, comments, event names
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if not isinstance(chunk, dict):
                    raise ValueError(f"unexpected SSE payload {one_line(data, 80)}")
                if "error" in chunk:
                    error = chunk["error"]
                    message = error.get("message", error) if isinstance(error, dict) else error
                    out.error = f"stream error: {one_line(str(message))}"
                    return out
                if chunk.get("usage"):
                    usage = chunk["usage"]
                choices = chunk.get("choices") or []
                if not choices:
                    continue
                now = time.perf_counter()
                if first_choice is None:
                    first_choice = now
                text = choices[0].get("text") or ""
                if not text:
                    continue
                if last is None:
                    out.ttft_s = now - start
                else:
                    out.itl_s.append(now - last)
                last = now
                pieces.append(text)
                num_text_chunks += 1
    except Exception as exc:  # whatever goes wrong, it is this request's failure, not the run's
        out.error = describe(exc)
        return out
    out.latency_s = time.perf_counter() - start
    if first_choice is None:
        out.error = "the stream ended without a completion chunk"
        return out
    if out.ttft_s is None:
        out.ttft_s = first_choice - start
    out.text = "".join(pieces)
    out.num_output_tokens = num_text_chunks
    if usage is not None:
        _read_usage(out, usage)
    out.ok = True
    return out


def _read_usage(out: Completion, usage: dict[str, Any]) -> None:
    if isinstance(usage.get("completion_tokens"), int):
        out.num_output_tokens = usage["completion_tokens"]
    if isinstance(usage.get("prompt_tokens"), int):
        out.num_prompt_tokens = usage["prompt_tokens"]
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        out.num_cached_tokens = details["cached_tokens"]
