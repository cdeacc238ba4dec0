"""Helpers of the HTTP tests: a real uvicorn server in a background thread around
``spyre_server.entrypoints.serve.build_app``, a byte-level test tokenizer for the tiny random llama, /metrics
parsing, SSE reading, and an independent greedy reference (a plain full forward pass of the model,
no KV cache, fms's default attention).
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

VOCAB_SIZE = 256
MODEL_NAME = "micro"
BLOCK = 64
USABLE_BLOCKS = 127  # cache.num_blocks 128, block 0 reserved
MAX_MODEL_LEN = 1024
CHUNK = 128
DEFAULT_MAX_TOKENS = 8
TIMEOUT = 30.0

# The configuration of every micro server unless a test overrides keys.
MICRO_DEFAULTS: dict[str, Any] = {
    "cache.num_blocks": USABLE_BLOCKS + 1,
    "model.max_model_len": MAX_MODEL_LEN,
    "scheduler.chunk_size": CHUNK,
    "server.default_max_tokens": DEFAULT_MAX_TOKENS,
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte <-> printable-unicode table (what HF byte-level BPE vocabularies use)."""
    bs = list(range(ord("!"), ord("~") + 1))
    bs += list(range(ord("\xa1"), ord("\xac") + 1)) + list(range(ord("\xae"), ord("\xff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs], strict=True))


_BYTE_TO_UNICODE = _bytes_to_unicode()


class ByteChatTokenizer:
    """Token ids 0..255 are the bytes of the UTF-8 text; a multi-byte character spans several
    tokens. No special tokens, except ``eos_id`` when given (``decode(skip_special_tokens=True)``
    drops it).

    The chat template renders ``<role>: <content>\\n`` per message, then ``assistant: ``; it
    rejects the role ``tool`` (to reach the template-error path). ``convert_ids_to_tokens`` follows
    the HF byte-level BPE convention (GPT-2's byte-to-unicode table)."""

    def __init__(self, eos_id: int | None = None) -> None:
        self.eos_id = eos_id
        self.eos_token_id = eos_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        kept = [int(t) for t in ids if not (skip_special_tokens and t == self.eos_id)]
        return bytes(kept).decode("utf-8", errors="replace")

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | list[str]:
        if isinstance(ids, int):
            return _BYTE_TO_UNICODE[ids]
        return [_BYTE_TO_UNICODE[int(i)] for i in ids]

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        chat_template: str | None = None,
    ) -> Any:
        if chat_template is not None:  # as HF tokenizers do: render the given Jinja template
            import jinja2

            template = jinja2.Environment().from_string(chat_template)
            text = template.render(messages=messages, add_generation_prompt=add_generation_prompt)
            return self.encode(text) if tokenize else text
        lines = []
        for message in messages:
            if message["role"] == "tool":
                raise ValueError("this template has no tool role")
            lines.append(f"{message['role']}: {message['content']}\n")
        text = "".join(lines) + ("assistant: " if add_generation_prompt else "")
        return self.encode(text) if tokenize else text


def chat_prompt_ids(messages: Sequence[dict[str, str]]) -> list[int]:
    return ByteChatTokenizer().encode(ByteChatTokenizer().apply_chat_template(messages))


def unique_text(tag: str, length: int) -> str:
    """ASCII hex text of exactly ``length`` bytes (= tokens), different for every ``tag``."""
    out = ""
    counter = 0
    while len(out) < length:
        out += hashlib.sha256(f"{tag}/{counter}".encode()).hexdigest()
        counter += 1
    return out[:length]


def expected_cached_tokens(num_tokens: int, num_hit_blocks: int) -> int:
    """The cpu backend's count (DESIGN §4): every position of a hit block is skipped, but the
    one that produces the logits. For tests whose prompt lengths vary; fixed cases pin literals
    (with this derivation in a comment)."""
    return min(num_hit_blocks * BLOCK, num_tokens - 1)


# ------------------------------------------------------------------------------------ reference
@dataclass(frozen=True)
class RefStep:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


def reference_greedy(model: Any, prompt: Sequence[int], max_tokens: int, top: int) -> list[RefStep]:
    """Greedy decoding by full forward passes (no cache): the independent oracle."""
    import torch

    ids = list(prompt)
    steps = []
    with torch.inference_mode():
        for _ in range(max_tokens):
            logits = model(torch.tensor([ids]))
            row = torch.log_softmax(logits[0, -1].float(), dim=-1)
            values, indices = row.topk(max(top, 1))
            token = int(indices[0])
            steps.append(
                RefStep(
                    token,
                    float(row[token]),
                    list(zip(indices.tolist()[:top], values.tolist()[:top], strict=True)),
                )
            )
            ids.append(token)
    return steps


# --------------------------------------------------------------------------------------- server
@dataclass
class Server:
    """A running uvicorn server and handles into its app."""

    app: Any
    uv: Any
    thread: threading.Thread
    port: int
    api_key: str | None = None
    _cache: dict[tuple[str, str | None], Any] = field(default_factory=dict)
    _extra: list[Any] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def state(self) -> Any:
        return self.app.state.server

    @property
    def async_engine(self) -> Any:
        return self.state.engine

    @property
    def engine(self) -> Any:
        """The LLMEngine (scheduler, runner)."""
        return self.state.engine.core

    def openai(self, api_key: str | None = None) -> Any:
        """An ``openai.OpenAI`` client of this server (one per key: creating one costs ~50 ms)."""
        import openai

        key = api_key or self.api_key or "unused"
        if ("openai", key) not in self._cache:
            self._cache["openai", key] = openai.OpenAI(
                base_url=f"{self.url}/v1", api_key=key, timeout=TIMEOUT, max_retries=0
            )
        return self._cache["openai", key]

    def http(self, api_key: str | None = None, timeout: Any = TIMEOUT) -> httpx.Client:
        """An httpx client of this server sending ``Authorization: Bearer <key>`` (``api_key``,
        else the server's default key, else none); one per key for the default timeout."""
        key = api_key or self.api_key
        if timeout == TIMEOUT and ("http", key) in self._cache:
            return self._cache["http", key]  # type: ignore[no-any-return]
        headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
        client = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)
        if timeout == TIMEOUT:
            self._cache["http", key] = client
        else:
            self._extra.append(client)
        return client

    def metrics(self, api_key: str | None = None) -> Metrics:
        response = self.http(api_key).get("/metrics")
        assert response.status_code == 200, response.text
        return Metrics.parse(response.text)

    def wait_until(
        self, predicate: Callable[[Metrics], bool], timeout: float = TIMEOUT, what: str = ""
    ) -> Metrics:
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics(self.api_key)
            if predicate(m):
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"not reached in {timeout} s: {what} ({m.samples})")
            time.sleep(0.02)

    def wait_idle(self, timeout: float = TIMEOUT) -> Metrics:
        """Poll /metrics until no request runs or waits and every KV block is free."""
        return self.wait_until(
            lambda m: (
                m.value("vllm:num_requests_running") == 0
                and m.value("vllm:num_requests_waiting") == 0
                and m.value("vllm:kv_cache_usage_perc") == 0
            ),
            timeout,
            "idle",
        )

    def reset_cache(self) -> int:
        response = self.http().post("/reset_prefix_cache")
        assert response.status_code == 200, response.text
        return int(response.json()["dropped_blocks"])

    def close(self) -> None:
        for client in [*self._cache.values(), *self._extra]:
            client.close()
        self.uv.should_exit = True
        self.thread.join(TIMEOUT)
        assert not self.thread.is_alive(), "the uvicorn thread did not stop"


def start_server(app: Any, api_key: str | None = None) -> Server:
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted connections inherit it. Without it a response written in two parts (headers,
    # body) waits ~40 ms for the client's delayed ACK (Nagle): every request would cost 45 ms.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + TIMEOUT
    while not uv.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            uv.should_exit = True
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    return Server(app=app, uv=uv, thread=thread, port=port, api_key=api_key)


def micro_config(**overrides: Any) -> Any:
    """Config keys with ``__`` for the dot: ``server__api_keys=["k"]``."""
    from spyre_server.config import load_config

    values = MICRO_DEFAULTS | {k.replace("__", "."): v for k, v in overrides.items()}
    return load_config(environ={}, overrides=values)


def micro_loaded(model: Any, eos_token_id: int | None = None) -> Any:
    import torch

    from spyre_server.model.loading import LoadedModel

    return LoadedModel(
        path=Path(MODEL_NAME),
        name=MODEL_NAME,
        model=model,
        tokenizer=ByteChatTokenizer(eos_token_id),
        dtype=torch.float32,
        eos_token_id=eos_token_id,
        vocab_size=VOCAB_SIZE,
    )


MakeServer = Callable[..., Server]


def slow_down(monkeypatch: Any, server: Server, seconds: float) -> None:
    """Make every model step of ``server`` take at least ``seconds`` longer."""
    runner = server.engine.runner
    original = runner.execute

    def execute(step: Any, params: Any) -> Any:
        time.sleep(seconds)
        return original(step, params)

    monkeypatch.setattr(runner, "execute", execute)


# ---------------------------------------------------------------------------------------- metrics
@dataclass
class Metrics:
    """Parsed /metrics: ``samples[(sample_name, frozenset(labels))] = value``."""

    samples: dict[tuple[str, frozenset[tuple[str, str]]], float]
    families: list[Any]

    @classmethod
    def parse(cls, text: str) -> Metrics:
        from prometheus_client.parser import text_string_to_metric_families

        families = list(text_string_to_metric_families(text))
        samples = {}
        for family in families:
            for s in family.samples:
                samples[(s.name, frozenset(s.labels.items()))] = s.value
        return cls(samples, families)

    def value(self, name: str, model_name: str = MODEL_NAME, **labels: str) -> float:
        """The sample ``name`` whose labels are exactly ``model_name`` plus ``labels``."""
        wanted = frozenset(({"model_name": model_name} | labels).items())
        try:
            return self.samples[(name, wanted)]
        except KeyError:
            raise KeyError(f"no sample {name} {dict(wanted)} in {sorted(self.samples)}") from None


def delta(after: Metrics, before: Metrics, name: str, **labels: str) -> float:
    return after.value(name, **labels) - before.value(name, **labels)


# -------------------------------------------------------------------------------------------- SSE
def sse_payloads(raw: str) -> list[str]:
    """The ``data:`` payloads of a complete SSE body, checking its framing: every event is exactly
    ``data: <payload>\\n\\n``."""
    assert raw.endswith("\n\n"), repr(raw[-50:])
    events = raw[:-2].split("\n\n")
    payloads = []
    for event in events:
        assert event.startswith("data: "), repr(event)
        assert "\n" not in event, repr(event)
        payloads.append(event[len("data: ") :])
    return payloads


def iter_sse(response: httpx.Response) -> Iterator[str]:
    """The ``data:`` payloads of a streaming httpx response, as they arrive."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield line[len("data: ") :]
        else:
            assert line == "", repr(line)


def json_payloads(payloads: Sequence[str]) -> list[dict[str, Any]]:
    assert payloads[-1] == "[DONE]", payloads[-3:]
    assert "[DONE]" not in payloads[:-1]
    return [json.loads(p) for p in payloads[:-1]]
