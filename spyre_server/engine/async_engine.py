"""Runs an ``LLMEngine`` on one background thread and streams per-request output to asyncio.

All engine and scheduler calls happen on the step thread: requests and aborts reach it through a
command queue and are applied between steps, so the scheduler needs no locks. Output crosses back
with ``loop.call_soon_threadsafe`` into one ``asyncio.Queue`` per request.

The step thread should be the only thread that runs parallel torch ops. libgomp (torch's OpenMP)
keeps a pool of worker threads for every thread that opens a parallel region, and once the pools
hold more threads than there are CPUs it lets an idle worker spin only ~100 iterations before it
sleeps, so every op of a step then waits for sleeping workers to wake (OMP_WAIT_POLICY=ACTIVE is
worse: the other pool's idle worker spins forever on a core of its own). The server therefore
loads the model on one torch thread and the step thread sets the compute threads when it starts
(``num_threads``); bench/bench_threads.py measures the difference ("second pool").

Request ids: the scheduler refuses an id that an unfinished request holds; the async engine also
refuses one whose output stream is still open (a finished request's client may still be reading
it), so two requests never share a stream.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import torch

from scheduler import FinishReason
from spyre_server.engine.core import LLMEngine, RequestDelta
from spyre_server.sample.sampler import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The step loop has stopped; no request can be served."""


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt_token_ids: Sequence[int]
    params: SamplingParams
    cache_salt: str | None
    done: concurrent.futures.Future[None]


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Call:
    fn: Callable[[LLMEngine], object]
    done: concurrent.futures.Future[object]


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine,
        *,
        num_threads: int | None = None,
        on_death: Callable[[], None] | None = None,
    ) -> None:
        """``num_threads``: torch threads the step thread sets when it starts (``None``: leave
        torch's setting as it is). ``on_death``: called on the step thread once the loop has
        died and every request has its error (the server then exits)."""
        self.core = engine
        """The synchronous engine it drives (touched only on the step thread)."""
        self._num_threads = num_threads
        self._commands: deque[_Add | _Abort | _Call] = deque()
        self._wakeup = threading.Event()
        self._stopping = False
        self._queues: dict[str, asyncio.Queue[RequestDelta]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        """Why the step loop died, if it did."""
        self.on_death = on_death

    # --------------------------------------------------------------- lifecycle
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="spyre-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ask the step thread to stop after its current step; it then ends every request still
        known with an error ("the server is shutting down"). Callable from any thread."""
        self._stopping = True
        self._wakeup.set()

    async def shutdown(self) -> None:
        """Abort what is left and stop the step thread."""
        self.stop()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def num_active_requests(self) -> int:
        return len(self._queues)

    @property
    def num_waiting(self) -> int:
        """Requests not yet admitted: queued in the scheduler or still on their way to it.
        Read from other threads: an estimate for admission control, not an exact count."""
        pending = sum(1 for c in list(self._commands) if isinstance(c, _Add))
        return self.core.scheduler.num_waiting + pending

    # ---------------------------------------------------------------- requests
    async def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
    ) -> None:
        """Queue a request and wait until the engine accepted it; then read it with
        ``stream(request_id)``. Raises ValueError for a rejected request, EngineDeadError if the
        loop is gone. A caller that gives up before streaming must ``abort(request_id)``."""
        if not self.is_alive:
            raise EngineDeadError("the engine step loop is not running")
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._queues[request_id] = asyncio.Queue()
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        try:
            self._send(_Add(request_id, prompt_token_ids, params, cache_salt, done))
            await asyncio.wrap_future(done)
        except BaseException:
            self._queues.pop(request_id, None)
            if done.done() and not done.cancelled() and done.exception() is None:
                self._send(_Abort(request_id))  # accepted, but our caller is gone
            raise

    async def stream(self, request_id: str) -> AsyncIterator[RequestDelta]:
        """The output of an added request. Leaving the iteration early (client gone, task
        cancelled) aborts the request."""
        queue = self._queues[request_id]
        finished = False
        try:
            while not finished:
                delta = await queue.get()
                finished = delta.finished
                yield delta
        finally:
            if not finished:
                self._send(_Abort(request_id))
            self._queues.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        """Abort an added request that nobody streams."""
        self._send(_Abort(request_id))
        self._queues.pop(request_id, None)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestDelta]:
        """``add_request`` then ``stream``."""
        await self.add_request(request_id, prompt_token_ids, params, cache_salt=cache_salt)
        async for delta in self.stream(request_id):
            yield delta

    async def call(self, fn: Callable[[LLMEngine], object]) -> object:
        """Run ``fn(engine)`` on the step thread between steps (e.g. reset the prefix cache)."""
        if not self.is_alive:
            raise EngineDeadError("the engine step loop is not running")
        done: concurrent.futures.Future[object] = concurrent.futures.Future()
        self._send(_Call(fn, done))
        return await asyncio.wrap_future(done)

    def _send(self, command: _Add | _Abort | _Call) -> None:
        self._commands.append(command)
        self._wakeup.set()

    # --------------------------------------------------------------- step loop
    def _run(self) -> None:
        if self._num_threads is not None:
            torch.set_num_threads(self._num_threads)
        try:
            while not self._stopping:
                self._apply_commands()
                if not self.core.has_unfinished_requests:
                    self._wakeup.wait(timeout=1.0)
                    self._wakeup.clear()
                    continue
                self._publish(self.core.step())
        except BaseException as exc:  # report it on /health and to every waiting client
            logger.exception("engine step loop died")
            self.error = exc
            self._fail_all(f"engine step loop died: {type(exc).__name__}: {exc}")
            if self.on_death is not None:
                self.on_death()
        else:
            self._fail_all("the server is shutting down")
        finally:
            self.core.runner.close()

    def _apply_commands(self) -> None:
        while self._commands:
            command = self._commands.popleft()
            if (
                isinstance(command, _Add | _Call)
                and not command.done.set_running_or_notify_cancel()
            ):
                if isinstance(command, _Add):
                    self._queues.pop(command.request_id, None)
                continue  # the caller gave up (cancelled) before the step thread got to it
            if isinstance(command, _Add):
                try:
                    self.core.add_request(
                        command.request_id,
                        command.prompt_token_ids,
                        command.params,
                        cache_salt=command.cache_salt,
                    )
                except Exception as exc:
                    command.done.set_exception(exc)
                else:
                    command.done.set_result(None)
            elif isinstance(command, _Abort):
                self.core.abort_request(command.request_id)
            else:
                try:
                    command.done.set_result(command.fn(self.core))
                except Exception as exc:
                    command.done.set_exception(exc)

    def _publish(self, deltas: list[RequestDelta]) -> None:
        if deltas and self._loop is not None:
            self._loop.call_soon_threadsafe(self._deliver, deltas)

    def _deliver(self, deltas: list[RequestDelta]) -> None:
        for delta in deltas:
            queue = self._queues.get(delta.request_id)
            if queue is not None:
                queue.put_nowait(delta)

    def _fail_all(self, message: str) -> None:
        """End every request still known to the engine with an error, so no client hangs."""
        for command in list(self._commands):
            if isinstance(command, (_Add, _Call)) and not command.done.done():
                command.done.set_exception(EngineDeadError(message))
        deltas = []
        for request_id in list(self._queues):
            try:
                delta = self.core.abort_request(request_id)
            except Exception:  # the engine may be what broke; the client still gets its answer
                delta = None
            deltas.append(
                RequestDelta(
                    request_id=request_id,
                    text="",
                    token_ids=[],
                    logprobs=[],
                    finish_reason=FinishReason.ERROR,
                    num_prompt_tokens=delta.num_prompt_tokens if delta else 0,
                    num_cached_tokens=delta.num_cached_tokens if delta else 0,
                    error=message,
                )
            )
        self._publish(deltas)
