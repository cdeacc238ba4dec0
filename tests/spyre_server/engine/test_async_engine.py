"""AsyncEngine (spyre_server/engine/async_engine.py): one step thread, per-request asyncio streams.

Plain ``asyncio.run`` in sync tests; every wait has a timeout so that a bug cannot hang the run.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import pytest

from scheduler import FinishReason
from spyre_server.engine.async_engine import AsyncEngine, EngineDeadError
from spyre_server.engine.core import LLMEngine, RequestDelta
from spyre_server.entrypoints.llm import LLM
from spyre_server.model.runner import FatalRunnerError
from spyre_server.sample.sampler import SamplingParams
from tests.spyre_server.conftest import assert_pool_clean
from tests.spyre_server.step_gate import step_gate

MakeEngine = Callable[..., LLMEngine]
T = TypeVar("T")
TIMEOUT = 15.0


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0)


def run(coro_fn: Callable[[], Awaitable[T]], timeout: float = TIMEOUT) -> T:
    async def main() -> T:
        return await asyncio.wait_for(coro_fn(), timeout)

    return asyncio.run(main())


@asynccontextmanager
async def running(engine: LLMEngine) -> AsyncIterator[AsyncEngine]:
    async_engine = AsyncEngine(engine)
    async_engine.start()
    try:
        yield async_engine
    finally:
        await asyncio.wait_for(async_engine.shutdown(), TIMEOUT)


async def collect(
    async_engine: AsyncEngine, request_id: str, prompt: list[int], params: SamplingParams
) -> list[RequestDelta]:
    return [d async for d in async_engine.generate(request_id, prompt, params)]


async def wait_until(
    async_engine: AsyncEngine, predicate: Callable[[LLMEngine], object], timeout: float = 5.0
) -> None:
    """Poll ``predicate(engine)`` on the step thread until it holds."""
    deadline = time.monotonic() + timeout
    while not await asyncio.wait_for(async_engine.call(predicate), timeout):
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


def pool_is_clean(engine: LLMEngine) -> bool:
    scheduler = engine.scheduler
    return (
        not scheduler.has_unfinished_requests
        and scheduler.pool.num_free_blocks == scheduler.pool.num_usable_blocks
    )


def tokens_of(deltas: list[RequestDelta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


# --- streaming ------------------------------------------------------------------------------------


def test_concurrent_streams_get_their_own_deltas_in_order(make_engine: MakeEngine) -> None:
    prompts = {"a": list(b"first"), "b": list(b"the second prompt"), "c": list(b"3")}
    lengths = {"a": 5, "b": 8, "c": 3}
    expected = LLM(make_engine()).generate(
        list(prompts.values()), [greedy(n) for n in lengths.values()]
    )
    engine = make_engine()

    async def main() -> dict[str, list[RequestDelta]]:
        async with running(engine) as async_engine:
            results = await asyncio.gather(
                *(collect(async_engine, rid, p, greedy(lengths[rid])) for rid, p in prompts.items())
            )
            assert async_engine.num_active_requests == 0
            await wait_until(async_engine, pool_is_clean)
            return dict(zip(prompts, results, strict=True))

    streams = run(main)
    for (rid, deltas), exp in zip(streams.items(), expected, strict=True):
        assert all(d.request_id == rid for d in deltas)
        assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
        assert deltas[-1].finish_reason is FinishReason.LENGTH
        assert all(len(d.token_ids) == 1 for d in deltas)  # one token per step, in order
        assert tokens_of(deltas) == exp.token_ids
        assert "".join(d.text for d in deltas) == exp.text
        assert deltas[-1].num_prompt_tokens == len(prompts[rid])
    assert_pool_clean(engine)


def test_generate_before_start_raises(make_engine: MakeEngine) -> None:
    async_engine = AsyncEngine(make_engine())
    assert not async_engine.is_alive

    async def main() -> None:
        with pytest.raises(EngineDeadError):
            await collect(async_engine, "r", [1, 2], greedy(2))

    run(main)


# --- leaving early aborts -------------------------------------------------------------------------


def test_consumer_that_breaks_early_aborts_its_request(
    make_engine: MakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The abort reaches the engine between steps: after the consumer leaves, at most the step
    already in flight runs. The gate holds step 3 (a decode step, planned) while the consumer
    leaves after 2 deltas (prefill, decode 1): exactly 2 decode steps ever run."""
    engine = make_engine()

    async def main() -> int:
        async with running(engine) as async_engine:
            with step_gate(monkeypatch, engine.runner) as gate:
                gate.allow(2)
                received = 0
                stream = async_engine.generate("long", list(b"a long one"), greedy(500))
                async for _delta in stream:
                    received += 1
                    if received == 2:
                        break
                await asyncio.to_thread(gate.wait_until_held, 2)  # step 3 is in flight
                await stream.aclose()  # what the event loop's finaliser does for a dropped stream
                deadline = time.monotonic() + TIMEOUT
                while async_engine.num_active_requests:  # the inner stream closes (sends the
                    assert time.monotonic() < deadline  # abort) on the loop's next turns
                    await asyncio.sleep(0.01)
                assert gate.num_passed == 2 and gate.num_held == 1
            await wait_until(async_engine, pool_is_clean)
            # the engine still serves
            other = await collect(async_engine, "next", list(b"abc"), greedy(2))
            assert other[-1].finish_reason is FinishReason.LENGTH
            return await asyncio.wait_for(
                async_engine.call(lambda e: e.scheduler.make_stats().num_decode_steps), 5
            )  # type: ignore[return-value]

    num_decode_steps = run(main)
    assert num_decode_steps == 2 + 1  # "long": decode 1 and the step in flight; "next": 1
    assert_pool_clean(engine)


def test_dropped_stream_without_aclose_is_aborted_too(make_engine: MakeEngine) -> None:
    engine = make_engine()

    async def main() -> None:
        async with running(engine) as async_engine:

            async def consume_one() -> None:
                async for _delta in async_engine.generate("r", list(b"xyz"), greedy(500)):
                    break  # the stream object is dropped here; asyncio's finaliser closes it

            await consume_one()
            await wait_until(async_engine, pool_is_clean)

    run(main)


def test_cancelled_consumer_task_aborts_its_request(make_engine: MakeEngine) -> None:
    engine = make_engine()

    async def main() -> None:
        async with running(engine) as async_engine:
            first = asyncio.Event()

            async def consume() -> None:
                async for _delta in async_engine.generate("r", list(b"prompt"), greedy(500)):
                    first.set()

            task = asyncio.create_task(consume())
            await asyncio.wait_for(first.wait(), 5)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await wait_until(async_engine, pool_is_clean)
            assert async_engine.num_active_requests == 0
            assert async_engine.is_alive

    run(main)


# --- errors reach the caller ----------------------------------------------------------------------


def test_add_request_value_error_propagates_to_generate(make_engine: MakeEngine) -> None:
    # 2 usable blocks (128 tokens); prompt + max_tokens - 1 in whole blocks within 100
    engine = make_engine(cache__num_blocks=3, scheduler__max_batch_tkv_limit=100)

    async def main() -> None:
        async with running(engine) as async_engine:
            with pytest.raises(ValueError, match="KV blocks"):
                await collect(async_engine, "bad", [1] * 100, greedy(29))
            with pytest.raises(ValueError, match="max_batch_tkv_limit"):
                await collect(async_engine, "long", [1] * 60, greedy(40))
            assert async_engine.num_active_requests == 0
            assert async_engine.is_alive
            ok = await collect(async_engine, "bad", [1, 2], greedy(2))  # the id is free
            assert ok[-1].finish_reason is FinishReason.LENGTH

    run(main)
    assert_pool_clean(engine)


def test_request_id_in_use_is_rejected(make_engine: MakeEngine) -> None:
    engine = make_engine()

    async def main() -> None:
        async with running(engine) as async_engine:
            stream = async_engine.generate("dup", list(b"abc"), greedy(50))
            first = await anext(stream)
            assert first.request_id == "dup"
            with pytest.raises(ValueError, match="already in use"):
                await collect(async_engine, "dup", [1], greedy(1))
            await stream.aclose()
            await wait_until(async_engine, pool_is_clean)

    run(main)


def test_call_runs_on_the_step_thread_and_propagates_errors(make_engine: MakeEngine) -> None:
    engine = make_engine()

    def fail(_: LLMEngine) -> None:
        raise KeyError("nope")

    async def main() -> None:
        async with running(engine) as async_engine:
            name = await async_engine.call(lambda e: threading.current_thread().name)
            assert name == "spyre-engine"
            assert name != threading.current_thread().name
            assert await async_engine.call(lambda e: e is engine)
            with pytest.raises(KeyError, match="nope"):
                await async_engine.call(fail)
            assert async_engine.is_alive
            assert await async_engine.call(lambda e: e.scheduler.reset_prefix_cache()) == 0

    run(main)


# --- shutdown and a dying step loop ---------------------------------------------------------------


def test_shutdown_ends_pending_streams_with_an_error_and_joins(make_engine: MakeEngine) -> None:
    engine = make_engine()

    async def main() -> tuple[AsyncEngine, list[RequestDelta]]:
        async_engine = AsyncEngine(engine)
        async_engine.start()
        deltas: list[RequestDelta] = []
        got_one = asyncio.Event()

        async def consume() -> None:
            async for delta in async_engine.generate("r", list(b"hello"), greedy(500)):
                deltas.append(delta)
                got_one.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(got_one.wait(), 5)
        await asyncio.wait_for(async_engine.shutdown(), 5)
        await asyncio.wait_for(task, 5)  # the stream ends instead of hanging
        assert not async_engine.is_alive
        with pytest.raises(EngineDeadError):
            await collect(async_engine, "after", [1], greedy(1))
        return async_engine, deltas

    async_engine, deltas = run(main)
    assert async_engine._thread is not None and not async_engine._thread.is_alive()
    assert async_engine.error is None  # a clean stop, not a crash
    last = deltas[-1]
    assert last.finish_reason is FinishReason.ERROR
    assert last.error is not None and "shutting down" in last.error
    assert last.num_prompt_tokens == 5
    assert len(tokens_of(deltas)) < 500
    assert_pool_clean(engine)


def test_step_loop_death_fails_waiting_streams(
    make_engine: MakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine()
    real_step = engine.step
    calls = [0]

    def dying_step() -> list[RequestDelta]:
        calls[0] += 1
        both_known = all(engine.scheduler.get_request(rid) is not None for rid in "ab")
        if calls[0] >= 3 and both_known:  # both streams are waiting for output
            raise AssertionError("scheduler invariant broken")
        return real_step()

    monkeypatch.setattr(engine, "step", dying_step)

    async def main() -> tuple[AsyncEngine, dict[str, list[RequestDelta]]]:
        async_engine = AsyncEngine(engine)
        async_engine.start()
        results = await asyncio.gather(
            collect(async_engine, "a", list(b"one"), greedy(50)),
            collect(async_engine, "b", list(b"two"), greedy(50)),
        )
        assert not async_engine.is_alive
        with pytest.raises(EngineDeadError):
            await collect(async_engine, "c", [1], greedy(1))
        await asyncio.wait_for(async_engine.shutdown(), 5)  # joins a dead thread at once
        return async_engine, dict(zip("ab", results, strict=True))

    async_engine, streams = run(main)
    assert isinstance(async_engine.error, AssertionError)
    for deltas in streams.values():
        last = deltas[-1]
        assert last.finish_reason is FinishReason.ERROR
        assert last.error is not None
        assert "AssertionError" in last.error and "scheduler invariant broken" in last.error


def test_a_fatal_runner_error_stops_the_engine_and_the_runner(
    make_engine: MakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A runner that can run no further step (a tensor-parallel rank died) ends the engine, not
    only the step's requests: every stream gets the error, ``on_death`` runs once (the server
    then exits) and the runner is closed (its ranks stopped)."""
    engine = make_engine()
    real_execute = engine.runner.execute
    calls = {"execute": 0, "close": 0, "died": 0}

    def dying_execute(*args: Any, **kwargs: Any) -> Any:
        calls["execute"] += 1
        if calls["execute"] == 4:
            raise FatalRunnerError("rank 1 (pid 4242) ended with exit code -9")
        return real_execute(*args, **kwargs)

    def close() -> None:
        calls["close"] += 1

    monkeypatch.setattr(engine.runner, "execute", dying_execute)
    monkeypatch.setattr(engine.runner, "close", close)

    def died() -> None:
        calls["died"] += 1

    async def main() -> tuple[AsyncEngine, list[list[RequestDelta]]]:
        async_engine = AsyncEngine(engine, on_death=died)
        async_engine.start()
        results = await asyncio.gather(
            collect(async_engine, "a", list(b"one"), greedy(50)),
            collect(async_engine, "b", list(b"two"), greedy(50)),
        )
        await asyncio.wait_for(async_engine.shutdown(), 5)
        return async_engine, list(results)

    async_engine, streams = run(main)
    assert isinstance(async_engine.error, FatalRunnerError)
    assert not async_engine.is_alive
    assert calls == {"execute": 4, "close": 1, "died": 1}
    for deltas in streams:
        assert deltas[-1].finish_reason is FinishReason.ERROR
        assert deltas[-1].error is not None and "rank 1 (pid 4242)" in deltas[-1].error


def test_step_loop_death_fails_requests_still_being_added(
    make_engine: MakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request sent while the fatal step runs is answered with EngineDeadError, not a hang."""
    engine = make_engine()
    in_step = threading.Event()
    release = threading.Event()

    def blocking_dying_step() -> list[RequestDelta]:
        in_step.set()
        release.wait(TIMEOUT)
        raise AssertionError("boom")

    monkeypatch.setattr(engine, "step", blocking_dying_step)

    async def main() -> None:
        async_engine = AsyncEngine(engine)
        async_engine.start()
        try:
            first = asyncio.create_task(collect(async_engine, "a", [1, 2], greedy(5)))
            assert await asyncio.to_thread(in_step.wait, 5)
            second = asyncio.create_task(collect(async_engine, "b", [3, 4], greedy(5)))
            await asyncio.sleep(0.05)  # "b" is queued as a command behind the running step
            release.set()
            deltas = await asyncio.wait_for(first, 5)
            assert deltas[-1].finish_reason is FinishReason.ERROR
            with pytest.raises(EngineDeadError, match="boom"):
                await asyncio.wait_for(second, 5)
        finally:
            release.set()
            await asyncio.wait_for(async_engine.shutdown(), 5)

    run(main)


def test_call_after_the_loop_died_raises_instead_of_hanging(
    make_engine: MakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """BUG: ``AsyncEngine.call`` does not check that the step loop runs. After the loop died (or
    after shutdown) the command is queued where nobody reads it, and the caller (e.g. the
    /reset_prefix_cache handler) waits forever. ``generate`` checks ``is_alive``; ``call`` must
    too (and raise EngineDeadError)."""
    engine = make_engine()

    def dying_step() -> list[RequestDelta]:
        raise AssertionError("dead")

    monkeypatch.setattr(engine, "step", dying_step)

    async def main() -> None:
        async_engine = AsyncEngine(engine)
        async_engine.start()
        deltas = await collect(async_engine, "a", [1, 2], greedy(3))
        assert deltas[-1].finish_reason is FinishReason.ERROR
        assert not async_engine.is_alive
        try:
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(async_engine.call(lambda e: 1), 1)
        finally:
            await asyncio.wait_for(async_engine.shutdown(), 5)

    run(main)


# --- a client leaving while its command waits for the step thread ---------------------------------


async def _block_step_thread(
    async_engine: AsyncEngine,
) -> tuple[threading.Event, asyncio.Future[Any]]:
    """Occupy the step thread inside a ``call`` until the returned event is set (a stand-in for
    a long model step)."""
    release = threading.Event()
    entered = threading.Event()

    def hold(_: LLMEngine) -> None:
        entered.set()
        release.wait(TIMEOUT)

    task = asyncio.ensure_future(async_engine.call(hold))
    assert await asyncio.to_thread(entered.wait, 5)
    return release, task


def test_client_cancelled_while_its_request_is_being_added(make_engine: MakeEngine) -> None:
    """BUG: a consumer cancelled while ``generate`` awaits the add (the step thread is busy, e.g.
    in a long prefill step) cancels the concurrent future ``_Add.done`` through
    ``asyncio.wrap_future``. The step thread then calls ``done.set_result(None)`` on a cancelled
    future, which raises ``InvalidStateError`` and kills the step loop
    (async_engine.py ``_apply_commands``): one disconnecting client takes the whole server down.
    Fix: skip commands whose future is cancelled (``if not command.done.set_running_or_notify_cancel():
    continue``) before applying them."""
    engine = make_engine()

    async def main() -> None:
        async with running(engine) as async_engine:
            release, hold = await _block_step_thread(async_engine)
            try:
                client = asyncio.create_task(collect(async_engine, "r", [1, 2, 3], greedy(50)))
                await asyncio.sleep(0.05)  # the client now awaits its add
                client.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await client
            finally:
                release.set()
            await asyncio.wait_for(hold, 5)
            await asyncio.sleep(0.2)
            assert async_engine.error is None, repr(async_engine.error)
            assert async_engine.is_alive
            await wait_until(async_engine, pool_is_clean)
            after = await collect(async_engine, "next", [4, 5], greedy(2))
            assert after[-1].finish_reason is FinishReason.LENGTH

    run(main)


def test_call_cancelled_while_waiting_for_the_step_thread(make_engine: MakeEngine) -> None:
    """BUG (same cause): a cancelled ``call`` (e.g. an admin request whose client went away)
    makes the step thread call ``set_result`` then ``set_exception`` on a cancelled future; the
    InvalidStateError escapes ``_apply_commands`` and the step loop dies."""
    engine = make_engine()

    async def main() -> None:
        async with running(engine) as async_engine:
            release, hold = await _block_step_thread(async_engine)
            try:
                waiting = asyncio.ensure_future(async_engine.call(lambda e: 42))
                await asyncio.sleep(0.05)
                waiting.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await waiting
            finally:
                release.set()
            await asyncio.wait_for(hold, 5)
            await asyncio.sleep(0.2)
            assert async_engine.error is None, repr(async_engine.error)
            assert async_engine.is_alive
            assert await asyncio.wait_for(async_engine.call(lambda e: 7), 5) == 7

    run(main)


@pytest.mark.parametrize("num_threads", [1, 2])
def test_the_step_thread_sets_the_compute_threads(
    make_engine: Callable[..., LLMEngine], num_threads: int
) -> None:
    """The server loads on one torch thread and hands the compute threads to the step thread,
    which sets them before its first step (so its OpenMP pool is the only one)."""
    import torch

    async def body() -> tuple[int, str]:
        torch.set_num_threads(3)  # what the loading thread left
        async_engine = AsyncEngine(make_engine(), num_threads=num_threads)
        async_engine.start()
        try:
            seen = await async_engine.call(
                lambda _: (torch.get_num_threads(), threading.current_thread().name)
            )
        finally:
            await async_engine.shutdown()
        return seen  # type: ignore[return-value]

    previous = torch.get_num_threads()
    try:
        assert run(body) == (num_threads, "spyre-engine")
    finally:
        torch.set_num_threads(previous)


def test_the_server_loads_the_model_on_one_torch_thread(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """Loading must not open a second OpenMP pool beside the step thread's (see AsyncEngine)."""
    import torch

    from spyre_server.config import load_config
    from spyre_server.entrypoints import serve

    (tmp_path / "config.json").write_text("{}")
    seen: list[int] = []
    monkeypatch.setattr(
        serve, "load_model", lambda path, dtype, **_: seen.append(torch.get_num_threads())
    )
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        serve.load(load_config(environ={}, overrides={"model.path": str(tmp_path)}))
    finally:
        torch.set_num_threads(previous)
    assert seen == [1]


def test_serving_starts_with_the_startup_objects_frozen_out_of_the_collector(
    monkeypatch: pytest.MonkeyPatch, micro_model: Any
) -> None:
    """Full collections over everything loaded at start took 150-380 ms each in the middle of
    requests; serve() freezes those objects (gc.freeze) before it serves."""
    import gc

    from spyre_server.entrypoints import serve
    from tests.spyre_server.http.helpers import micro_config, micro_loaded

    seen: list[int] = []
    monkeypatch.setattr(serve, "load", lambda config: micro_loaded(micro_model))
    monkeypatch.setattr(
        serve.DrainingServer, "run", lambda self, sockets: seen.append(gc.get_freeze_count())
    )
    import signal

    previous_sigterm = signal.getsignal(signal.SIGTERM)
    gc.unfreeze()
    try:
        serve.serve(micro_config(**{"server.port": 0, "server.host": "127.0.0.1"}))
    finally:
        gc.unfreeze()
        signal.signal(signal.SIGTERM, previous_sigterm)
    assert len(seen) == 1 and seen[0] > 10_000
