"""Cross-tenant time to first token: with ``server.isolate_cache_per_api_key`` one tenant's cached
prefix gives another tenant no speed-up (so TTFT cannot leak whether someone else sent a prompt).

Starts the server in-process (``spyre_server.entrypoints.serve.build_app`` on SmolLM2-135M-Instruct, uvicorn on
127.0.0.1) with two API keys and per-key cache isolation, then, for each repetition, on a fresh
1024-token prompt (token ids, so the length is exact):

    A cold          tenant A, first time                     -> cached_tokens 0
    A warm          tenant A again                           -> cached (768 with chunk 256)
    B same prompt   tenant B, the prompt A just cached       -> cached_tokens 0, TTFT ~ cold
    B warm          tenant B again                           -> cached (its own cache)
    A salt s1       tenant A with cache_salt "s1"            -> cached_tokens 0
    A salt s1 warm  again                                    -> cached
    A salt s2       tenant A with cache_salt "s2"            -> cached_tokens 0
    B salt s1       tenant B with cache_salt "s1"            -> cached_tokens 0

TTFT is measured on the client: from sending a streaming request to the first SSE event that
carries text. The table gives medians over the repetitions (after one warm-up request).

Run: ``.venv/bin/python bench/cross_tenant_ttft.py`` (about 3 minutes at 1 thread in float32: a
cold 1024-token prefill takes ~10 s there). Options: ``--reps N`` (default 3),
``--prompt-tokens N`` (default 1024), ``--threads N`` torch threads (default 1),
``--dtype auto|float32|bfloat16`` (default auto).
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx

KEY_A = "bench-tenant-a-key"
KEY_B = "bench-tenant-b-key"
MAX_TOKENS = 4


@dataclass(frozen=True)
class Case:
    name: str
    key: str
    salt: str | None
    cached: bool  # whether a hit is expected


CASES = [
    Case("A cold", KEY_A, None, False),
    Case("A warm", KEY_A, None, True),
    Case("B same prompt", KEY_B, None, False),
    Case("B warm", KEY_B, None, True),
    Case("A salt s1", KEY_A, "s1", False),
    Case("A salt s1 warm", KEY_A, "s1", True),
    Case("A salt s2", KEY_A, "s2", False),
    Case("B salt s1", KEY_B, "s1", False),
]


def start_server(args: argparse.Namespace) -> tuple[Any, threading.Thread, str, Any]:
    import uvicorn

    from spyre_server.config import load_config
    from spyre_server.entrypoints.serve import build_app, load
    from spyre_server.model.store import default_cache_dir, prepare_default_model

    model = prepare_default_model(default_cache_dir())
    config = load_config(
        environ={},
        overrides={
            "model.path": str(model),
            "model.dtype": args.dtype,
            "model.num_threads": args.threads,
            "cache.kv_cache_memory": "1GiB",
            "server.api_keys": [KEY_A, KEY_B],
            "server.isolate_cache_per_api_key": True,
            "server.log_level": "warning",
        },
    )
    app = build_app(config, load(config))
    sock = socket.socket()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise SystemExit("the server did not start")
        time.sleep(0.05)
    return server, thread, f"http://127.0.0.1:{port}", app.state.server


def prompt_ids(tokenizer: Any, num_tokens: int, seed: int) -> list[int]:
    """Exactly ``num_tokens`` ids of ordinary English words, different for every seed."""
    rng = random.Random(seed)
    words = [
        "the",
        "a",
        "lighthouse",
        "keeper",
        "sea",
        "storm",
        "ship",
        "night",
        "light",
        "rock",
        "wave",
        "wind",
        "harbor",
        "old",
    ]
    ids: list[int] = []
    while len(ids) < num_tokens:
        text = " ".join(rng.choice(words) for _ in range(200)) + "."
        ids += tokenizer.encode(text, add_special_tokens=False)
    return ids[:num_tokens]


def measure(client: httpx.Client, case: Case, prompt: list[int]) -> tuple[float, int]:
    """(TTFT in seconds, cached_tokens) of one streaming completion."""
    body: dict[str, Any] = {
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if case.salt is not None:
        body["cache_salt"] = case.salt
    ttft = None
    usage = None
    started = time.perf_counter()
    with client.stream(
        "POST", "/v1/completions", json=body, headers={"Authorization": f"Bearer {case.key}"}
    ) as response:
        if response.status_code != 200:
            response.read()
            raise SystemExit(f"{case.name}: HTTP {response.status_code}: {response.text}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if ttft is None and any(c.get("text") for c in event.get("choices", [])):
                ttft = time.perf_counter() - started
            if event.get("usage"):
                usage = event["usage"]
    if ttft is None or usage is None:
        raise SystemExit(f"{case.name}: no text or no usage in the stream")
    return ttft, int(usage["prompt_tokens_details"]["cached_tokens"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    args = parser.parse_args()

    from spyre_server.model.loading import resolve_dtype

    server, thread, base, state = start_server(args)
    chunk = state.config.scheduler.chunk_size
    print(
        f"SmolLM2-135M-Instruct, dtype {args.dtype} ({resolve_dtype(args.dtype)}), "
        f"{args.threads} torch thread(s), chunk {chunk}, block 64, "
        f"prompt {args.prompt_tokens} tokens, max_tokens {MAX_TOKENS}, {args.reps} repetitions, "
        "isolate_cache_per_api_key: true"
    )
    ttfts: dict[str, list[float]] = {c.name: [] for c in CASES}
    cached: dict[str, set[int]] = {c.name: set() for c in CASES}
    try:
        with httpx.Client(base_url=base, timeout=300) as client:
            warmup = prompt_ids(state.tokenizer, args.prompt_tokens, seed=-1)
            measure(client, Case("warm-up", KEY_A, "warm-up", False), warmup)
            for rep in range(args.reps):
                prompt = prompt_ids(state.tokenizer, args.prompt_tokens, seed=rep)
                for case in CASES:
                    ttft, hit = measure(client, case, prompt)
                    ttfts[case.name].append(ttft)
                    cached[case.name].add(hit)
    finally:
        server.should_exit = True
        thread.join(60)

    cold = statistics.median(ttfts["A cold"])
    print()
    print(
        f"{'case':<16} {'TTFT median':>12} {'min':>9} {'max':>9} {'vs A cold':>10}  cached_tokens"
    )
    problems = []
    for case in CASES:
        values = ttfts[case.name]
        median = statistics.median(values)
        hits = sorted(cached[case.name])
        print(
            f"{case.name:<16} {median * 1000:>9.1f} ms {min(values) * 1000:>6.1f} ms "
            f"{max(values) * 1000:>6.1f} ms {median / cold:>9.2f}x  {hits}"
        )
        if case.cached != (hits != [0]) or len(hits) != 1:
            problems.append(
                f"{case.name}: cached_tokens {hits}, expected {'>0' if case.cached else '0'}"
            )
    cross = statistics.median(ttfts["B same prompt"]) / cold
    warm = statistics.median(ttfts["A warm"]) / cold
    print()
    print(
        f"tenant B on tenant A's cached prompt: {cross:.2f}x A's cold TTFT (no advantage: ~1); "
        f"tenant A warm: {warm:.2f}x"
    )
    if problems:
        print("UNEXPECTED:\n  " + "\n  ".join(problems))
        raise SystemExit(1)
    print("cached_tokens as expected: a hit only within one tenant and one cache_salt")


if __name__ == "__main__":
    main()
