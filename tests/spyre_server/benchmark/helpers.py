"""Helpers of the benchmark tests: a real local HF tokenizer folder for the micro model's byte
vocabulary, and a stub OpenAI-compatible server that the benchmark does not know (no /metrics, no
cached_tokens), which records what it receives."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tests.spyre_server.http.helpers import _BYTE_TO_UNICODE, VOCAB_SIZE

EOS = "<|endoftext|>"
CHAT_MARKER = "<|im_start|>"


def write_byte_tokenizer(folder: Path) -> Path:
    """An HF tokenizer folder whose ids 0..255 are the UTF-8 bytes of the text (byte-level BPE
    without merges, GPT-2's byte table), like the micro server's ByteChatTokenizer, plus two
    special tokens outside the model's vocabulary: ``EOS`` (256) and ``CHAT_MARKER`` (257)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {_BYTE_TO_UNICODE[b]: b for b in range(VOCAB_SIZE)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=EOS, additional_special_tokens=[CHAT_MARKER]
    )
    fast.save_pretrained(str(folder))
    return folder


@dataclass
class StubLog:
    """What the stub server saw: request bodies and headers, arrival times
    (``time.perf_counter``, comparable with the test's own: uvicorn runs in a thread), and the
    largest number of completions in flight at once."""

    bodies: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0


STUB_MODEL = "stub-model"


def stub_app(
    log: StubLog,
    *,
    token_delay: float = 0.005,
    fail: Callable[[dict[str, Any]], str | None] | None = None,
) -> FastAPI:
    """A FastAPI app speaking only ``GET /v1/models`` (two models, ``STUB_MODEL`` first) and
    streaming ``POST /v1/completions``: ``max_tokens`` chunks with text ``" t<i>"``, one every
    ``token_delay`` s, then usage without ``prompt_tokens_details`` when asked. ``fail(body)``
    returning a message makes the request fail with HTTP 400 and that message."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": STUB_MODEL, "object": "model"}, {"id": "other", "object": "model"}],
        }

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await request.json()
        log.arrivals.append(time.perf_counter())
        log.bodies.append(body)
        log.headers.append(dict(request.headers))
        message = fail(body) if fail is not None else None
        if message is not None:
            return JSONResponse(
                {"error": {"message": message, "type": "invalid_request_error"}}, status_code=400
            )
        log.in_flight += 1
        log.max_in_flight = max(log.max_in_flight, log.in_flight)
        num_tokens = int(body["max_tokens"])

        async def events() -> AsyncIterator[str]:
            try:
                for i in range(num_tokens):
                    await asyncio.sleep(token_delay)
                    chunk = {"choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]}
                    yield f"data: {json.dumps(chunk)}\n\n"
                if (body.get("stream_options") or {}).get("include_usage"):
                    usage = {
                        "prompt_tokens": len(body["prompt"]),
                        "completion_tokens": num_tokens,
                        "total_tokens": len(body["prompt"]) + num_tokens,
                    }
                    yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                log.in_flight -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    return app
