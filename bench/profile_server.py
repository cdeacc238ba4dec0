"""Where a loaded server's decode step goes: model forward vs everything else.

Starts the real server (``build_app`` + uvicorn on loopback, the step thread on ``--threads``
torch threads as ``serve`` sets them) on SmolLM2-135M-Instruct or the HF folder ``--model``, sends
``--batch`` concurrent streaming completions over HTTP (``ignore_eos``, so every request decodes
``--max-tokens`` tokens), and for every step of the engine loop records the wall time from its
start to the next step's start (so the loop's own work, command handling and GIL contention with
the HTTP thread count too) and the time inside the model forward. For the steps where the decode
batch is full it reports the median step time and the share spent outside the forward:
scheduling, sampling, detokenizing, queueing output, HTTP.

Run greedy and with top-p sampling (temperature 0.8, top-p 0.9, seeded), then a pyinstrument
profile of the engine thread during the greedy decode steps:

    .venv/bin/python bench/profile_server.py [--threads 2] [--batch 8] [--max-tokens 48]
        [--prompt-len 256] [--model PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn

import spyre_server.model.runner as model_runner
from scheduler import DecodeBatch
from spyre_server.config import load_config
from spyre_server.entrypoints.serve import build_app, load

TARGET_OUTSIDE_SHARE = 0.10


@dataclass
class StepLog:
    """Per engine step: (start time, forward seconds, sampling seconds, decode batch size or 0 for
    prefill)."""

    steps: list[tuple[float, float, float, int]] = field(default_factory=list)
    forward_s: float = 0.0
    sample_s: float = 0.0
    profile_steps: int = 0
    profiler: Any = None
    profile_text: str = ""


def instrument(engine: Any, log: StepLog, profile: bool, batch: int) -> None:
    """Wrap the engine's step and the runner's model forward with timers (in the step thread);
    with ``profile``, run pyinstrument over the 24 engine steps that follow the first full
    decode batch."""
    runner = engine.runner
    forward = runner._forward
    sample = model_runner.sample
    step = engine.step
    schedule = engine.scheduler.schedule
    kinds: list[int] = []

    def timed_forward(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return forward(*args, **kwargs)
        finally:
            log.forward_s += time.perf_counter() - start

    def timed_sample(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return sample(*args, **kwargs)
        finally:
            log.sample_s += time.perf_counter() - start

    def recording_schedule() -> Any:
        out = schedule()
        kinds.append(len(out.entries) if isinstance(out, DecodeBatch) else 0)
        return out

    def timed_step() -> Any:
        start = time.perf_counter()
        log.forward_s = log.sample_s = 0.0
        kinds.clear()
        if profile and log.profiler is None and log.steps and log.steps[-1][3] == batch:
            from pyinstrument import Profiler

            log.profiler = Profiler(interval=0.001)
            log.profiler.start()
        out = step()
        log.steps.append((start, log.forward_s, log.sample_s, kinds[0] if kinds else 0))
        if log.profiler is not None and log.profiler.is_running:
            log.profile_steps += 1
            if log.profile_steps >= 24:
                log.profiler.stop()
                log.profile_text = log.profiler.output_text(unicode=False, color=False)
        return out

    runner._forward = timed_forward
    model_runner.sample = timed_sample  # type: ignore[assignment]
    engine.scheduler.schedule = recording_schedule
    engine.step = timed_step


def start_server(app: Any) -> tuple[uvicorn.Server, int, threading.Thread]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    return server, port, thread


async def stream_one(client: httpx.AsyncClient, body: dict[str, Any]) -> int:
    chunks = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                payload = json.loads(line[6:])
                if "error" in payload:
                    raise RuntimeError(payload["error"])
                chunks += 1
    return chunks


TOPICS = ("the sea", "a city at night", "an old library", "the first snow", "a long train ride")
TOPICS += ("a market in spring", "a lighthouse keeper", "the last day of school", "a storm")


def prompts(tokenizer: Any, batch: int, prompt_len: int) -> list[list[int]]:
    """``batch`` natural-language prompts of exactly ``prompt_len`` tokens that share no prefix
    (each starts with its own topic), so every row attends its own context."""
    out = []
    for i in range(batch):
        text = f"Story {i} is about {TOPICS[i % len(TOPICS)]}. Write it in plain words. " * 60
        ids = tokenizer.encode(text, add_special_tokens=False)[:prompt_len]
        assert len(ids) == prompt_len, "the prompt text is too short"
        out.append(ids)
    return out


async def load_server(port: int, prompt_ids: list[list[int]], sampling: dict[str, Any]) -> float:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
        bodies = [
            {"prompt": ids, "stream": True, "ignore_eos": True, **sampling} for ids in prompt_ids
        ]
        start = time.perf_counter()
        await asyncio.gather(*(stream_one(client, body) for body in bodies))
        return time.perf_counter() - start


def report(label: str, log: StepLog, batch: int) -> None:
    full = [
        (log.steps[i + 1][0] - start, forward, sample)
        for i, (start, forward, sample, size) in enumerate(log.steps[:-1])
        if size == batch
    ]
    if not full:
        print(f"{label}: no step with a full batch of {batch}")
        return
    step = statistics.median(s for s, _, _ in full)
    forward = statistics.median(f for _, f, _ in full)
    sample = statistics.median(x for _, _, x in full)
    outside = statistics.median((s - f) / s for s, f, _ in full)
    verdict = "PASS" if outside <= TARGET_OUTSIDE_SHARE else "FAIL"
    print(
        f"{label:<28} {len(full):>3} full decode steps: step {step * 1e3:6.1f} ms, "
        f"forward {forward * 1e3:6.1f} ms (sampling {sample * 1e3:4.1f} ms), "
        f"outside the forward {outside:5.1%} "
        f"(target <= {TARGET_OUTSIDE_SHARE:.0%}: {verdict})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--model", default=None, help="HF model folder (default: SmolLM2-135M)")
    args = parser.parse_args()

    config = load_config(
        environ={},
        overrides={
            "model.num_threads": args.threads,
            "model.path": args.model,
            "scheduler.max_num_seqs": args.batch,
            "server.log_level": "warning",
        },
    )
    loaded = load(config)
    app = build_app(config, loaded, num_threads=args.threads)
    prompt_ids = prompts(loaded.tokenizer, args.batch, args.prompt_len)
    server, port, thread = start_server(app)
    engine = app.state.server.engine.core
    runs = [
        ("greedy", {"temperature": 0}, not args.no_profile),
        ("top-p 0.9, temperature 0.8", {"temperature": 0.8, "top_p": 0.9, "seed": 1}, False),
    ]
    profile_text = ""
    sample = model_runner.sample
    try:
        asyncio.run(load_server(port, prompt_ids[:1], {"max_tokens": 2}))  # warm-up
        for label, sampling, profile in runs:
            log = StepLog()
            instrument(engine, log, profile, args.batch)
            wall = asyncio.run(
                load_server(port, prompt_ids, {"max_tokens": args.max_tokens, **sampling})
            )
            del engine.step, engine.runner._forward, engine.scheduler.schedule
            model_runner.sample = sample
            report(label, log, args.batch)
            print(f"{'':<28} wall time of the run {wall:.2f} s, {len(log.steps)} engine steps")
            profile_text = profile_text or log.profile_text
    finally:
        server.should_exit = True
        thread.join(30)
    if profile_text:
        print("\npyinstrument profile of the engine thread over 24 steps at full batch (greedy):")
        print(profile_text)


if __name__ == "__main__":
    main()
