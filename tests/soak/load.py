"""The soak load generator, shared by tests/soak/test_soak.py and bench/soak_memory.py.

It talks to a server only over HTTP (so it can drive a server in this process or in a child
process):

1. ``make_plan(shape)``: every choice from one seeded ``random.Random``: shared prefixes of a few
   blocks, random suffix lengths, exact repeats of earlier prompts, random ``max_tokens``,
   ``/v1/completions`` and ``/v1/chat/completions``, streaming or not, chat logprobs (their
   ``bytes`` pin the exact tokens), and what the client does: read to the end, disconnect
   mid-stream after ``k`` chunks (a share of the streaming clients), or give up while its
   request still waits in the queue (streaming: close as soon as the 200 headers arrive, i.e.
   once the engine accepted the request; non-streaming: cancel after a short delay).
2. ``run_load``: ``concurrency`` clients (one ``httpx.AsyncClient``, one worker task each) work
   through the plan; a sampler records the peak of the queue and KV gauges from /metrics.
3. ``wait_drained``: /metrics shows no request running or waiting and ``kv_cache_usage_perc`` 0.
4. ``verify_alone``: every distinct completed request is sent again alone (sequentially,
   temperature 0, non-streaming, prefix cache reset before each one, so it neither batches
   nor hits the cache) and its text (and, for chat logprobs, its token bytes) must equal what
   the concurrent run produced.

``run_soak`` does all four and returns a ``SoakReport``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"

COMPLETE = "complete"
DISCONNECT = "disconnect"  # streaming client that leaves after k chunks
ABORT_WAITING = "abort_waiting"  # client that leaves while its request is still queued

# ASCII words: one token per character for the byte tokenizer of the micro model, ordinary
# English-ish text for SmolLM2's BPE.
_WORDS_TEXT = """
the of and to in is was for on that with as by at from his her they this which had not are but
were be have one all their has been there would more when who will no if out so river stone garden
window market silver quiet yellow engine paper winter letter forest machine kitchen harbor mountain
number system question island signal cloud table bridge orange planet music cotton butter little
ancient simple narrow golden rapid gentle
"""
_WORDS = tuple(_WORDS_TEXT.split())


def words_text(rng: random.Random, num_chars: int) -> str:
    """Random words, exactly ``num_chars`` ASCII characters long."""
    out: list[str] = []
    length = 0
    while length < num_chars:
        word = rng.choice(_WORDS)
        out.append(word)
        length += len(word) + 1
    return " ".join(out)[:num_chars]


# ------------------------------------------------------------------------------------------ plan
@dataclass(frozen=True)
class LoadShape:
    """The knobs of one soak run. Lengths are in characters (= tokens for the byte tokenizer)."""

    num_requests: int = 300
    concurrency: int = 32
    seed: int = 0
    max_tokens: tuple[int, int] = (1, 24)
    """Inclusive range of each request's max_tokens."""
    prefix_chars: tuple[int, ...] = (64, 128, 192, 256)
    """One shared prefix per entry (1-4 blocks of 64 on the byte tokenizer)."""
    suffix_chars: tuple[int, int] = (1, 200)
    no_prefix_fraction: float = 0.1
    repeat_fraction: float = 0.15
    """Requests that repeat an earlier request's exact prompt."""
    chat_fraction: float = 0.5
    chat_logprobs_fraction: float = 0.5
    stream_fraction: float = 0.5
    disconnect_fraction: float = 0.2
    """Share of the streaming clients that disconnect mid-stream."""
    abort_waiting_fraction: float = 0.08
    """Share of all clients that give up while their request waits."""
    abort_delay: tuple[float, float] = (0.05, 0.3)
    """Seconds after which a non-streaming ``abort_waiting`` client gives up."""


def full_shape(seed: int, num_requests: int = 300, concurrency: int = 32) -> LoadShape:
    """The full soak on SmolLM2 (test with --soak-full, bench/soak_memory.py). Its tokenizer
    makes ~4-5 characters of these words one token: prefixes of ~1-5 blocks, prompts up to
    ~500 tokens."""
    return LoadShape(
        num_requests=num_requests,
        concurrency=concurrency,
        seed=seed,
        max_tokens=(1, 24),
        prefix_chars=(300, 600, 900, 1300),
        suffix_chars=(1, 800),
    )


@dataclass(frozen=True)
class RequestSpec:
    index: int
    path: str
    stream: bool
    max_tokens: int
    prompt: str | None  # completions
    messages: tuple[tuple[str, str], ...] | None  # chat: (role, content)
    logprobs: bool  # chat only: logprobs with the token bytes
    action: str
    disconnect_after: int = 0  # chunks carrying tokens, for DISCONNECT
    abort_delay: float = 0.0  # seconds, for a non-streaming ABORT_WAITING

    def body(self, model: str | None, ignore_eos: bool, *, stream: bool | None = None) -> dict:
        stream = self.stream if stream is None else stream
        body: dict[str, Any] = {"max_tokens": self.max_tokens, "temperature": 0}
        if model is not None:
            body["model"] = model
        if ignore_eos:
            body["ignore_eos"] = True
        if self.path == COMPLETIONS:
            body["prompt"] = self.prompt
        else:
            assert self.messages is not None
            body["messages"] = [{"role": r, "content": c} for r, c in self.messages]
            if self.logprobs:
                body["logprobs"] = True
                body["top_logprobs"] = 0
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return body

    @property
    def reference_key(self) -> tuple[Any, ...]:
        """Requests with equal keys must produce equal output (greedy)."""
        return (self.path, self.prompt, self.messages, self.max_tokens, self.logprobs)


def make_plan(shape: LoadShape) -> list[RequestSpec]:
    rng = random.Random(shape.seed)
    prefixes = [words_text(rng, n) for n in shape.prefix_chars]
    plan: list[RequestSpec] = []
    for index in range(shape.num_requests):
        if plan and rng.random() < shape.repeat_fraction:
            earlier = rng.choice(plan)
            path, prompt, messages = earlier.path, earlier.prompt, earlier.messages
            logprobs = earlier.logprobs
        else:
            prefix = "" if rng.random() < shape.no_prefix_fraction else rng.choice(prefixes)
            suffix = words_text(rng, rng.randint(*shape.suffix_chars))
            if rng.random() < shape.chat_fraction:
                path, prompt = CHAT, None
                messages = ((("system", prefix),) if prefix else ()) + (("user", suffix),)
                logprobs = rng.random() < shape.chat_logprobs_fraction
            else:
                path, prompt, messages, logprobs = COMPLETIONS, prefix + suffix, None, False
        stream = rng.random() < shape.stream_fraction
        max_tokens = rng.randint(*shape.max_tokens)
        action, disconnect_after, delay = COMPLETE, 0, 0.0
        if rng.random() < shape.abort_waiting_fraction:
            action = ABORT_WAITING
            delay = rng.uniform(*shape.abort_delay)
        elif stream and rng.random() < shape.disconnect_fraction:
            action = DISCONNECT
            # Leave after at most half the tokens: a chunk can carry several tokens (text held
            # back inside a multi-byte character), so k near max_tokens may already be the end.
            max_tokens = max(max_tokens, 4)
            disconnect_after = rng.randint(1, max_tokens // 2)
        plan.append(
            RequestSpec(
                index=index,
                path=path,
                stream=stream,
                max_tokens=max_tokens,
                prompt=prompt,
                messages=messages,
                logprobs=logprobs,
                action=action,
                disconnect_after=disconnect_after,
                abort_delay=delay,
            )
        )
    return plan


# --------------------------------------------------------------------------------------- clients
@dataclass
class Outcome:
    """What one client saw."""

    spec: RequestSpec
    request_id: str
    status: int | None = None
    text: str = ""
    token_bytes: list[list[int]] | None = None  # chat logprobs: the bytes of every token
    completion_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    """Kind of failure: ``http_<status>``, ``sse_<code>``, ``exc_<Type>`` or ``bad_<what>``."""
    detail: str = ""
    abandoned: str | None = None
    """``mid_stream`` or ``before_first_token`` when the client left early on purpose."""
    seconds: float = 0.0

    @property
    def completed(self) -> bool:
        return self.abandoned is None and self.error is None


def request_id_of(seed: int, index: int) -> str:
    return f"soak{seed}-{index}"


def _bad(outcome: Outcome, kind: str, detail: str) -> None:
    if outcome.error is None:
        outcome.error, outcome.detail = kind, detail


def _check_complete(outcome: Outcome) -> None:
    """A client that read to the end got exactly max_tokens tokens, finish_reason length."""
    spec = outcome.spec
    if outcome.error is not None:
        return
    if outcome.completion_tokens != spec.max_tokens:
        _bad(outcome, "bad_token_count", f"{outcome.completion_tokens} != {spec.max_tokens}")
    elif outcome.finish_reason != "length":
        _bad(outcome, "bad_finish_reason", str(outcome.finish_reason))
    elif outcome.token_bytes is not None and len(outcome.token_bytes) != spec.max_tokens:
        _bad(outcome, "bad_logprobs_count", f"{len(outcome.token_bytes)} != {spec.max_tokens}")


def _read_json(outcome: Outcome, data: dict[str, Any]) -> None:
    choice = data["choices"][0]
    if outcome.spec.path == COMPLETIONS:
        outcome.text = choice["text"]
    else:
        outcome.text = choice["message"]["content"]
        if outcome.spec.logprobs:
            outcome.token_bytes = [e["bytes"] for e in choice["logprobs"]["content"]]
    outcome.finish_reason = choice["finish_reason"]
    outcome.completion_tokens = data["usage"]["completion_tokens"]


async def _post(
    client: httpx.AsyncClient, outcome: Outcome, body: dict[str, Any], headers: dict[str, str]
) -> None:
    response = await client.post(outcome.spec.path, json=body, headers=headers)
    outcome.status = response.status_code
    if response.status_code != 200:
        _bad(outcome, f"http_{response.status_code}", response.text[:300])
        return
    _read_json(outcome, response.json())
    _check_complete(outcome)


async def _stream(
    client: httpx.AsyncClient, outcome: Outcome, body: dict[str, Any], headers: dict[str, str]
) -> None:
    spec = outcome.spec
    async with client.stream("POST", spec.path, json=body, headers=headers) as response:
        outcome.status = response.status_code
        if response.status_code != 200:
            await response.aread()
            _bad(outcome, f"http_{response.status_code}", response.text[:300])
            return
        if spec.action == ABORT_WAITING:
            # The headers come once the engine has accepted the request: leave now, before
            # any token. Leaving the block closes the connection.
            outcome.abandoned = "before_first_token"
            return
        token_chunks = 0
        done = False
        if spec.logprobs:
            outcome.token_bytes = []
        async for line in response.aiter_lines():
            if not line:
                continue
            if not line.startswith("data: "):
                _bad(outcome, "bad_sse_line", line[:200])
                return
            payload = line[len("data: ") :]
            if payload == "[DONE]":
                done = True
                break
            data = json.loads(payload)
            if "error" in data:
                _bad(outcome, f"sse_{data['error'].get('code')}", data["error"].get("message"))
                continue
            if data.get("usage") is not None:
                outcome.completion_tokens = data["usage"]["completion_tokens"]
            if not data["choices"]:
                continue
            choice = data["choices"][0]
            if spec.path == COMPLETIONS:
                carries_token = True
                outcome.text += choice["text"]
            else:
                delta = choice["delta"]
                outcome.text += delta.get("content") or ""
                carries_token = "role" not in delta
                if choice.get("logprobs") and outcome.token_bytes is not None:
                    outcome.token_bytes += [e["bytes"] for e in choice["logprobs"]["content"]]
            if choice.get("finish_reason") is not None:
                outcome.finish_reason = choice["finish_reason"]
            if carries_token:
                token_chunks += 1
            if (
                spec.action == DISCONNECT
                and token_chunks >= spec.disconnect_after
                and outcome.finish_reason is None
            ):
                outcome.abandoned = "mid_stream"
                return
        if not done:
            _bad(outcome, "bad_no_done", "the stream ended without data: [DONE]")
    _check_complete(outcome)


async def send_one(
    client: httpx.AsyncClient, spec: RequestSpec, seed: int, model: str | None, ignore_eos: bool
) -> Outcome:
    outcome = Outcome(spec, request_id_of(seed, spec.index))
    headers = {"X-Request-Id": outcome.request_id}
    body = spec.body(model, ignore_eos)
    start = time.monotonic()
    try:
        if spec.stream:
            await _stream(client, outcome, body, headers)
        elif spec.action == ABORT_WAITING:
            try:
                await asyncio.wait_for(_post(client, outcome, body, headers), spec.abort_delay)
            except TimeoutError:  # cancelled: httpx closes the connection
                outcome.abandoned = "before_first_token"
        else:
            await _post(client, outcome, body, headers)
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        _bad(outcome, f"exc_{type(exc).__name__}", str(exc)[:300])
    outcome.seconds = time.monotonic() - start
    return outcome


# ---------------------------------------------------------------------------------------- metrics
def parse_metrics(text: str) -> dict[str, float]:
    """``{sample_name: value}`` of the samples with no label but ``model_name`` (one model)."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if set(sample.labels) <= {"model_name"}:
                values[sample.name] = sample.value
    return values


async def scrape(client: httpx.AsyncClient) -> dict[str, float]:
    response = await client.get("/metrics")
    response.raise_for_status()
    return parse_metrics(response.text)


@dataclass
class Peaks:
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    scrapes: int = 0

    def add(self, m: dict[str, float]) -> None:
        self.running = max(self.running, m.get("vllm:num_requests_running", 0.0))
        self.waiting = max(self.waiting, m.get("vllm:num_requests_waiting", 0.0))
        self.kv_usage = max(self.kv_usage, m.get("vllm:kv_cache_usage_perc", 0.0))
        self.scrapes += 1


async def _sample(client: httpx.AsyncClient, peaks: Peaks, stop: asyncio.Event) -> None:
    while not stop.is_set():
        with contextlib.suppress(httpx.HTTPError):
            peaks.add(await scrape(client))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.25)


def is_drained(m: dict[str, float]) -> bool:
    return (
        m.get("vllm:num_requests_running") == 0
        and m.get("vllm:num_requests_waiting") == 0
        and m.get("vllm:kv_cache_usage_perc") == 0
    )


async def wait_drained(base_url: str, timeout: float = 60.0) -> tuple[bool, dict[str, float]]:
    """Poll /metrics until nothing runs or waits and every KV block is free."""
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
        deadline = time.monotonic() + timeout
        while True:
            m = await scrape(client)
            if is_drained(m) or time.monotonic() > deadline:
                return is_drained(m), m
            await asyncio.sleep(0.05)


# ------------------------------------------------------------------------------------------- run
async def run_load(
    base_url: str,
    plan: Sequence[RequestSpec],
    *,
    concurrency: int,
    seed: int,
    model: str | None = None,
    ignore_eos: bool = False,
    timeout: float = 300.0,
) -> tuple[list[Outcome], Peaks, float]:
    """``concurrency`` clients work through ``plan``; returns the outcomes in plan order, the
    gauge peaks seen on /metrics, and the wall time in seconds."""
    queue: asyncio.Queue[RequestSpec] = asyncio.Queue()
    for spec in plan:
        queue.put_nowait(spec)
    outcomes: dict[int, Outcome] = {}
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency)
    http_timeout = httpx.Timeout(timeout, connect=30.0)
    peaks = Peaks()
    stop = asyncio.Event()
    async with (
        httpx.AsyncClient(base_url=base_url, limits=limits, timeout=http_timeout) as client,
        httpx.AsyncClient(base_url=base_url, timeout=30) as probe,
    ):

        async def worker() -> None:
            while not queue.empty():
                spec = queue.get_nowait()
                outcomes[spec.index] = await send_one(client, spec, seed, model, ignore_eos)

        sampler = asyncio.create_task(_sample(probe, peaks, stop))
        start = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        seconds = time.monotonic() - start
        stop.set()
        await sampler
    return [outcomes[spec.index] for spec in plan], peaks, seconds


@dataclass
class Mismatch:
    index: int
    request_id: str
    what: str
    concurrent: Any
    alone: Any

    def __str__(self) -> str:
        return (
            f"{self.request_id} {self.what}: concurrent {self.concurrent!r} != alone {self.alone!r}"
        )


async def verify_alone(
    base_url: str,
    outcomes: Sequence[Outcome],
    *,
    model: str | None = None,
    ignore_eos: bool = False,
    reset_cache: bool = True,
    timeout: float = 300.0,
) -> tuple[int, list[Mismatch], list[Outcome]]:
    """Send every distinct completed request alone (sequentially, non-streaming, temperature 0;
    with ``reset_cache`` the prefix cache is reset before each, so nothing is reused) and
    compare. Returns (requests sent, mismatches, the alone outcomes that failed)."""
    references: dict[tuple[Any, ...], Outcome] = {}
    failed: list[Outcome] = []
    mismatches: list[Mismatch] = []
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout) as client:
        for outcome in outcomes:
            if not outcome.completed:
                continue
            spec = outcome.spec
            key = spec.reference_key
            if key not in references:
                if reset_cache:
                    (await client.post("/reset_prefix_cache")).raise_for_status()
                alone = Outcome(spec, f"alone-{outcome.request_id}")
                body = spec.body(model, ignore_eos, stream=False)
                try:
                    await _post(client, alone, body, {"X-Request-Id": alone.request_id})
                except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
                    _bad(alone, f"exc_{type(exc).__name__}", str(exc)[:300])
                references[key] = alone
                if alone.error is not None:
                    failed.append(alone)
            alone = references[key]
            if alone.error is not None:
                continue
            if outcome.text != alone.text:
                mismatches.append(
                    Mismatch(spec.index, outcome.request_id, "text", outcome.text, alone.text)
                )
            elif outcome.token_bytes != alone.token_bytes:
                mismatches.append(
                    Mismatch(
                        spec.index,
                        outcome.request_id,
                        "token bytes",
                        outcome.token_bytes,
                        alone.token_bytes,
                    )
                )
    return len(references), mismatches, failed


@dataclass
class SoakReport:
    seed: int
    shape: LoadShape
    outcomes: list[Outcome]
    peaks: Peaks
    seconds: float
    drained: bool = False
    drained_seconds: float = 0.0
    after: dict[str, float] = field(default_factory=dict)
    """/metrics once drained."""
    verified: int | None = None
    """Distinct requests sent alone (None: not verified)."""
    mismatches: list[Mismatch] = field(default_factory=list)
    verify_failures: list[Outcome] = field(default_factory=list)
    verify_seconds: float = 0.0

    @property
    def sent(self) -> int:
        return len(self.outcomes)

    @property
    def completed(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.completed]

    @property
    def abandoned(self) -> Counter[str]:
        return Counter(o.abandoned for o in self.outcomes if o.abandoned is not None)

    @property
    def errors(self) -> Counter[str]:
        return Counter(o.error for o in self.outcomes if o.error is not None)

    @property
    def statuses(self) -> Counter[int | None]:
        return Counter(o.status for o in self.outcomes)

    @property
    def num_5xx(self) -> int:
        server_errors = sum(n for s, n in self.statuses.items() if s is not None and s >= 500)
        return server_errors + sum(
            1 for o in self.outcomes if o.error is not None and o.error.startswith("sse_")
        )

    @property
    def tokens(self) -> int:
        return sum(o.completion_tokens or 0 for o in self.completed)

    def summary(self) -> str:
        actions = Counter(o.spec.action for o in self.outcomes)
        kinds = Counter(
            ("chat" if o.spec.path == CHAT else "cmpl") + ("/stream" if o.spec.stream else "")
            for o in self.outcomes
        )
        verified = (
            "not verified"
            if self.verified is None
            else f"verified alone={self.verified} mismatches={len(self.mismatches)} "
            f"verify_errors={len(self.verify_failures)} verify_s={self.verify_seconds:.1f}"
        )
        return (
            f"soak seed={self.seed} sent={self.sent} concurrency={self.shape.concurrency} "
            f"completed={len(self.completed)} abandoned={sum(self.abandoned.values())} "
            f"{dict(self.abandoned)} planned={dict(actions)} kinds={dict(kinds)} "
            f"errors={dict(self.errors)} statuses={dict(self.statuses)} "
            f"tokens={self.tokens} run_s={self.seconds:.1f} "
            f"peak_running={self.peaks.running:g} peak_waiting={self.peaks.waiting:g} "
            f"peak_kv_usage={self.peaks.kv_usage:.3f} drained={self.drained} "
            f"drain_s={self.drained_seconds:.2f} "
            f"kv_usage_after={self.after.get('vllm:kv_cache_usage_perc')} "
            f"preemptions={self.after.get('vllm:num_preemptions_total')} "
            f"cache_hit_tokens={self.after.get('vllm:prefix_cache_hits_total')}/"
            f"{self.after.get('vllm:prefix_cache_queries_total')} {verified}"
        )

    def problems(self, limit: int = 10) -> list[str]:
        """The first failures, for assertion messages."""
        lines = [
            f"{o.request_id} {o.spec.path} stream={o.spec.stream}: {o.error} {o.detail}"
            for o in self.outcomes
            if o.error is not None
        ][:limit]
        lines += [str(m) for m in self.mismatches[:limit]]
        lines += [f"alone {o.request_id}: {o.error} {o.detail}" for o in self.verify_failures]
        return lines[: 2 * limit]


async def run_soak(
    base_url: str,
    shape: LoadShape,
    *,
    model: str | None = None,
    ignore_eos: bool = False,
    verify: bool = True,
    timeout: float = 300.0,
    drain_timeout: float = 60.0,
) -> SoakReport:
    """Plan, run the load, wait until the server drained, then (``verify``) send every distinct
    completed request alone and compare."""
    plan = make_plan(shape)
    outcomes, peaks, seconds = await run_load(
        base_url,
        plan,
        concurrency=shape.concurrency,
        seed=shape.seed,
        model=model,
        ignore_eos=ignore_eos,
        timeout=timeout,
    )
    report = SoakReport(shape.seed, shape, outcomes, peaks, seconds)
    start = time.monotonic()
    report.drained, report.after = await wait_drained(base_url, drain_timeout)
    report.drained_seconds = time.monotonic() - start
    if verify:
        start = time.monotonic()
        report.verified, report.mismatches, report.verify_failures = await verify_alone(
            base_url, outcomes, model=model, ignore_eos=ignore_eos, timeout=timeout
        )
        report.verify_seconds = time.monotonic() - start
    return report
