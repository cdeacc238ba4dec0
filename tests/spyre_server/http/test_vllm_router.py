"""Proof with the real router: 3 micro replicas behind ``vllm-router==0.1.17`` with ``kv_aware``
(our KV events), ``cache_aware`` (our /v1/completions/render) and ``round_robin`` (the control).

A shared-prefix workload (6 prefix groups of 4 blocks, 4 requests each, shuffled; the first
request of every group sent at once, so that the router has to spread them) goes through the
router; the routed hit rate (sum of cached_tokens / prompt tokens) is compared with the same
workload on a single replica. The report says which replica served each group.
"""

from __future__ import annotations

import random
import time
from collections import defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.spyre_server.http.helpers import (
    BLOCK,
    Server,
    micro_config,
    micro_loaded,
    start_server,
    unique_text,
)
from tests.spyre_server.http.router_cluster import ServedBy, free_port, vllm_router

pytestmark = pytest.mark.slow

NUM_REPLICAS = 3
NUM_GROUPS = 6
PER_GROUP = 4
PREFIX_TOKENS = 4 * BLOCK
SUFFIX_TOKENS = 40
SETTLE_SECONDS = 1.0  # lets the first wave's KV events reach the router (not asserted on)


def workload() -> tuple[list[tuple[int, list[int]]], list[tuple[int, list[int]]]]:
    """(first wave: one request per group, the rest shuffled), prompts as token ids."""
    rng = random.Random(13)
    prefixes = [list(unique_text(f"prefix-{g}", PREFIX_TOKENS).encode()) for g in range(NUM_GROUPS)]

    def prompt(group: int, j: int) -> list[int]:
        return prefixes[group] + list(unique_text(f"q-{group}-{j}", SUFFIX_TOKENS).encode())

    first = [(g, prompt(g, 0)) for g in range(NUM_GROUPS)]
    rest = [(g, prompt(g, j)) for g in range(NUM_GROUPS) for j in range(1, PER_GROUP)]
    rng.shuffle(rest)
    return first, rest


def run(base_url: str) -> tuple[int, int]:
    """Send the workload; returns (sum of cached_tokens, sum of prompt tokens)."""
    first, rest = workload()
    with httpx.Client(base_url=base_url, timeout=60) as client:

        def send(item: tuple[int, list[int]]) -> dict[str, Any]:
            response = client.post(
                "/v1/completions",
                json={"model": "micro", "prompt": item[1], "max_tokens": 2, "temperature": 0},
            )
            assert response.status_code == 200, response.text
            return response.json()["usage"]  # type: ignore[no-any-return]

        with ThreadPoolExecutor(NUM_GROUPS) as pool:
            usages = list(pool.map(send, first))
        time.sleep(SETTLE_SECONDS)
        usages += [send(item) for item in rest]
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    return cached, sum(u["prompt_tokens"] for u in usages)


@pytest.fixture(scope="module")
def replicas(http_micro_model: Any, one_torch_thread: None) -> Iterator[list[tuple[Server, str]]]:
    from spyre_server.entrypoints.serve import build_app

    started: list[tuple[Server, str]] = []
    try:
        for i in range(NUM_REPLICAS):
            endpoint = f"tcp://127.0.0.1:{free_port()}"
            config = micro_config(
                kv_events__enabled=True,
                kv_events__endpoint=endpoint,
                kv_events__topic="",  # vllm-router's static sources subscribe to topic ""
            )
            app = ServedBy(build_app(config, micro_loaded(http_micro_model)), i)
            started.append((start_server(app), endpoint))
        yield started
    finally:
        for server, _ in started:
            server.close()


def served_groups(replicas: list[tuple[Server, str]]) -> dict[int, list[int]]:
    """Group -> the replica of each of its requests, in arrival order per replica."""
    first, _ = workload()
    group_of = {tuple(p[:PREFIX_TOKENS]): g for g, p in first}
    out: dict[int, list[int]] = defaultdict(list)
    for server, _ in replicas:
        for replica, prompt in server.app.log:
            out[group_of[tuple(prompt[:PREFIX_TOKENS])]].append(replica)
        server.app.log.clear()
    return dict(sorted(out.items()))


def reset(replicas: list[tuple[Server, str]]) -> None:
    for server, _ in replicas:
        server.wait_idle()
        server.reset_cache()
        server.app.log.clear()


def test_cache_aware_routers_reach_the_single_node_hit_rate_round_robin_does_not(
    replicas: list[tuple[Server, str]],
) -> None:
    reset(replicas)
    single_cached, prompt_tokens = run(replicas[0][0].url)
    single = single_cached / prompt_tokens
    served_groups(replicas)
    urls = [server.url for server, _ in replicas]
    endpoints = [endpoint for _, endpoint in replicas]
    report = [f"single replica: hit rate {single:.3f}"]
    ratios: dict[str, float] = {}
    spread: dict[str, int] = {}
    for policy in ("kv_aware", "cache_aware", "round_robin"):
        reset(replicas)
        with vllm_router(urls, policy, endpoints if policy == "kv_aware" else None) as url:
            cached, total = run(url)
        assert total == prompt_tokens
        groups = served_groups(replicas)
        ratios[policy] = cached / total / single
        spread[policy] = len({r for rs in groups.values() for r in rs})
        report.append(
            f"{policy}: hit rate {cached / total:.3f} = {ratios[policy]:.2f} x single; "
            f"replicas per group {groups}"
        )
    print("\n" + "\n".join(report))
    assert single > 0.4
    assert ratios["kv_aware"] >= 0.9, report
    assert ratios["cache_aware"] >= 0.9, report
    assert ratios["round_robin"] < 0.8, report
    assert spread["kv_aware"] >= 2 and spread["cache_aware"] >= 2, report
