"""Graceful shutdown under load: a real ``spyre-server serve`` process on SmolLM2 with
16 concurrent requests in flight (streaming and not, completions and chat), most of them still
waiting for admission (``scheduler.max_num_seqs`` 4), receives SIGTERM.

What counts as a clean end for each request (anything else fails the test):

- ``complete``: 200 with the whole output (finish_reason ``length``, every token; a stream ends
  with ``data: [DONE]`` and carries no error event);
- ``http-error``: an HTTP error status whose body is the OpenAI envelope;
- ``sse-error``: a stream that ends with ``data: {"error": {...}}`` then ``data: [DONE]``;
- ``cut``: the connection closed without a complete response, but only once the drain timeout
  (``server.graceful_shutdown_seconds``) has passed since SIGTERM, never earlier.

Nothing may hang: every client call has a timeout, and the process must exit 0 within the drain
timeout plus a margin. A request sent after SIGTERM must be refused (connection refused, or an
error envelope), not left waiting for the drain.

With a drain longer than the work in flight, every request in flight finishes completely. The drain
is then LONG_DRAIN, not the default 25 s: how much 16 requests get done in 25 s depends on the
machine (on a loaded 2-core box only 10 did), and the test asserts behaviour, not speed; the
process still exits as soon as the last request is answered. With a 2 s drain (set through
``SPYRE_SERVER_SERVER__GRACEFUL_SHUTDOWN_SECONDS``, as the long one is) and requests far too long
to finish, every request is ended by the engine shortly before the deadline
(``spyre_server.entrypoints.serve.DEADLINE_MARGIN_SECONDS``, at most a quarter of the drain) with an error
envelope or an SSE error event and ``[DONE]``, and the process still exits 0.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from spyre_server.config import ServerSection
from spyre_server.model.store import ModelStoreError, default_cache_dir, prepare_default_model
from tests.conftest import default_model_missing

pytestmark = pytest.mark.slow

NUM_REQUESTS = 16
MAX_NUM_SEQS = 4
DEFAULT_DRAIN = ServerSection().graceful_shutdown_seconds
LONG_DRAIN = 900.0
"""Longer than 16 requests of 12 tokens take on any machine that runs the test suite at all."""
EXIT_MARGIN = 20.0
LATE_TIMEOUT = 60.0
"""A request after SIGTERM is refused without waiting: this only catches one left hanging."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Child:
    process: subprocess.Popen[bytes]
    base: str
    drain: float
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def metrics(self) -> dict[str, float]:
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.base}/metrics", timeout=5).text
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def _start(drain: float | None, log: Path) -> Child:
    try:
        model = prepare_default_model(default_cache_dir())
    except ModelStoreError as exc:
        default_model_missing(str(exc))
    port = _free_port()
    env = {
        **os.environ,
        "SPYRE_SERVER_CACHE__NUM_BLOCKS": "128",
        "SPYRE_SERVER_MODEL__DTYPE": "float32",
        "SPYRE_SERVER_MODEL__NUM_THREADS": "1",
        "SPYRE_SERVER_SCHEDULER__MAX_NUM_SEQS": str(MAX_NUM_SEQS),
        "SPYRE_SERVER_SERVER__LOG_LEVEL": "warning",
    }
    args = ["serve", "--host", "127.0.0.1", "--port", str(port), "--model", str(model)]
    if drain is not None:
        env["SPYRE_SERVER_SERVER__GRACEFUL_SHUTDOWN_SECONDS"] = str(drain)
    command = [sys.executable, "-m", "spyre_server.entrypoints.cli", *args]
    # A file, not a pipe: nobody reads a pipe while the test runs, and a full one blocks the
    # child (16 cancelled requests log 16 tracebacks).
    with log.open("wb") as sink:
        process = subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT)
    child = Child(
        process, f"http://127.0.0.1:{port}", DEFAULT_DRAIN if drain is None else drain, log
    )
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"the server exited during start-up:\n{child.output()}")
        try:
            if httpx.get(f"{child.base}/health", timeout=1).status_code == 200:
                return child
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    process.kill()
    raise AssertionError("the server was not healthy within 180 s")


@contextmanager
def _child(drain: float | None, log: Path) -> Iterator[Child]:
    child = _start(drain, log)
    try:
        yield child
    finally:
        if child.process.poll() is None:
            child.process.kill()
        child.process.wait(30)


# ------------------------------------------------------------------------------------ clients
@dataclass
class Outcome:
    name: str
    kind: str = "pending"
    """complete | http-error | http-error-no-envelope | sse-error | cut | refused | other"""
    detail: str = ""
    ended: float = 0.0
    first_output: threading.Event = field(default_factory=threading.Event)


def _body(name: str, chat: bool, stream: bool, max_tokens: int) -> dict[str, Any]:
    text = f"Request {name}: write a long story about a lighthouse keeper."
    body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    body |= {"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text}
    return body | ({"stream": True} if stream else {})


def _is_envelope_response(response: httpx.Response) -> bool:
    try:
        payload = response.json()
    except ValueError:
        return False
    return response.headers.get("content-type") == "application/json" and _is_envelope(payload)


def _is_envelope(payload: Any) -> bool:
    return (
        isinstance(payload, dict)
        and set(payload) == {"error"}
        and isinstance(payload["error"], dict)
        and set(payload["error"]) == {"message", "type", "param", "code"}
        and bool(payload["error"]["message"])
    )


def _run_stream(
    base: str, path: str, body: dict[str, Any], out: Outcome, chat: bool, timeout_s: float
) -> None:
    frames: list[str] = []
    with (
        httpx.Client(timeout=httpx.Timeout(timeout_s, connect=5)) as client,
        client.stream("POST", f"{base}{path}", json=body) as response,
    ):
        if response.status_code != 200:
            response.read()
            ok = _is_envelope_response(response)
            out.kind = "http-error" if ok else "http-error-no-envelope"
            out.detail = f"{response.status_code} {response.text[:300]!r}"
            return
        for line in response.iter_lines():
            if line.startswith("data: "):
                frames.append(line[len("data: ") :])
                out.first_output.set()
            elif line:
                out.kind, out.detail = "other", f"not an SSE line: {line!r}"
                return
    if not frames or frames[-1] != "[DONE]":
        out.kind, out.detail = "other", f"stream ended without [DONE]: {frames[-2:]}"
        return
    events = [json.loads(f) for f in frames[:-1]]
    errors = [e for e in events if "error" in e]
    if errors:
        clean = len(errors) == 1 and errors[0] is events[-1] and _is_envelope(errors[0])
        out.kind, out.detail = ("sse-error" if clean else "other"), json.dumps(errors)[:300]
        return
    choices = [e["choices"][0] for e in events if e["choices"]]
    text = "".join(c["delta"].get("content", "") if chat else c["text"] for c in choices)
    finished = [c["finish_reason"] for c in choices if c["finish_reason"] is not None]
    ok = finished == ["length"] and bool(text)
    out.kind, out.detail = ("complete" if ok else "other"), f"finish={finished} text={text!r}"


def _run_plain(
    base: str, path: str, body: dict[str, Any], out: Outcome, chat: bool, timeout_s: float
) -> None:
    with httpx.Client(timeout=httpx.Timeout(timeout_s, connect=5)) as client:
        response = client.post(f"{base}{path}", json=body)
    if response.status_code != 200:
        ok = _is_envelope_response(response)
        out.kind = "http-error" if ok else "http-error-no-envelope"
        out.detail = f"{response.status_code} {response.text[:300]!r}"
        return
    result = response.json()
    choice = result["choices"][0]
    complete = (
        choice["finish_reason"] == "length"
        and result["usage"]["completion_tokens"] == body["max_tokens"]
    )
    out.kind, out.detail = ("complete" if complete else "other"), json.dumps(result)[:300]


def _client(base: str, index: int, max_tokens: int, out: Outcome, timeout_s: float) -> None:
    """One request; ``timeout_s`` bounds every read (so that nothing can hang the test)."""
    chat, stream = bool(index % 2), bool((index // 2) % 2)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = _body(out.name, chat, stream, max_tokens)
    try:
        (_run_stream if stream else _run_plain)(base, path, body, out, chat, timeout_s)
    except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
        out.kind, out.detail = "cut", repr(exc)
    except httpx.ConnectError as exc:
        out.kind, out.detail = "refused", repr(exc)
    except Exception as exc:  # a timeout (a hang) or anything unexpected
        out.kind, out.detail = "other", repr(exc)
    finally:
        out.ended = time.monotonic()


def _load_then_sigterm(child: Child, max_tokens: int) -> tuple[list[Outcome], float, int, float]:
    """16 clients; once all are admitted or queued, SIGTERM. Returns the outcomes, the time of
    the signal, the exit code and how long the process took to exit."""
    outcomes = [Outcome(f"r{i}") for i in range(NUM_REQUESTS)]
    threads = [
        threading.Thread(
            target=_client,
            args=(child.base, i, max_tokens, o, child.drain + EXIT_MARGIN),
            daemon=True,
        )
        for i, o in enumerate(outcomes)
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 300  # a failure timeout only: no speed is asserted
    while True:  # every request reached the engine, most of them wait for admission
        m = child.metrics()
        running = m["vllm:num_requests_running"]
        waiting = m["vllm:num_requests_waiting"]
        if running + waiting == NUM_REQUESTS and running == MAX_NUM_SEQS:
            break
        assert time.monotonic() < deadline, f"load not in place: {running=} {waiting=}"
        time.sleep(0.05)
    streaming = [o for i, o in enumerate(outcomes) if (i // 2) % 2]
    deadline = time.monotonic() + 300
    while not any(o.first_output.is_set() for o in streaming):  # tokens are flowing
        assert time.monotonic() < deadline, "no streamed output within 300 s"
        time.sleep(0.05)
    still_waiting = child.metrics()["vllm:num_requests_waiting"]
    assert still_waiting > 0, "no request waits for admission any more"
    signalled = time.monotonic()
    child.process.send_signal(signal.SIGTERM)

    # A newcomer after SIGTERM is refused at once, never left waiting.
    time.sleep(0.5)
    late = Outcome("late")
    _client(child.base, 0, 4, late, LATE_TIMEOUT)
    assert late.kind in ("refused", "http-error"), (late.kind, late.detail)

    try:
        code = child.process.wait(child.drain + EXIT_MARGIN)
    except subprocess.TimeoutExpired:
        raise AssertionError(
            f"no exit {child.drain + EXIT_MARGIN} s after SIGTERM:\n"
            f"{_report(outcomes, signalled)}\n{child.output()}"
        ) from None
    exited = time.monotonic() - signalled
    for thread in threads:
        thread.join(10)
        assert not thread.is_alive(), "a client hangs after the server exited"
    return outcomes, signalled, code, exited


def _report(outcomes: list[Outcome], signalled: float) -> str:
    return "\n".join(
        f"{o.name}: {o.kind} after {o.ended - signalled:+.1f} s: {o.detail[:200]}" for o in outcomes
    )


@dataclass(frozen=True)
class Run:
    outcomes: list[Outcome]
    signalled: float
    code: int
    exited: float
    drain: float

    @property
    def report(self) -> str:
        return _report(self.outcomes, self.signalled)


def _run(tmp_path: Path, drain: float | None, max_tokens: int) -> Run:
    with _child(drain, tmp_path / "server.log") as child:
        outcomes, signalled, code, exited = _load_then_sigterm(child, max_tokens)
    return Run(outcomes, signalled, code, exited, child.drain)


def test_sigterm_under_load_finishes_every_request_in_flight(tmp_path: Path) -> None:
    run = _run(tmp_path, drain=LONG_DRAIN, max_tokens=12)
    assert run.code == 0, run.report
    assert run.exited < LONG_DRAIN + EXIT_MARGIN
    # Within the drain timeout: every request, waiting ones included, is served in full.
    assert [o.kind for o in run.outcomes] == ["complete"] * NUM_REQUESTS, run.report


SHORT_DRAIN = 2.0


@pytest.fixture(scope="module")
def short_drain_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """16 requests of 600 tokens each (4 at a time) cannot finish in a 2 s drain."""
    return _run(tmp_path_factory.mktemp("short-drain"), drain=SHORT_DRAIN, max_tokens=600)


def test_sigterm_with_a_short_drain_exits_0_and_ends_every_request_at_the_deadline(
    short_drain_run: Run,
) -> None:
    """The process exits 0 soon after the drain timeout; no client hangs; no request is ended
    before the engine's deadline (the drain minus its margin); a request still running then ends
    at once."""
    from spyre_server.entrypoints.serve import DEADLINE_MARGIN_SECONDS

    run = short_drain_run
    margin = min(DEADLINE_MARGIN_SECONDS, SHORT_DRAIN / 4)
    assert run.code == 0, run.report
    assert run.exited < SHORT_DRAIN + EXIT_MARGIN, run.report
    assert all(o.kind != "complete" for o in run.outcomes), run.report
    for o in run.outcomes:
        assert SHORT_DRAIN - margin - 0.1 <= o.ended - run.signalled <= run.exited + 1, run.report
        assert o.kind in ("cut", "http-error", "sse-error", "http-error-no-envelope"), run.report


def test_requests_ended_by_the_drain_timeout_never_get_a_bare_500(short_drain_run: Run) -> None:
    """The engine ends every request before uvicorn's deadline: an HTTP error carries the
    envelope (DESIGN §6), a stream ends with an error event and [DONE], none is cut."""
    run = short_drain_run
    assert {o.kind for o in run.outcomes} <= {"http-error", "sse-error"}, run.report
