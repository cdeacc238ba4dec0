"""The latency histograms' values (TTFT, inter-token, end-to-end), not only their counts.

Every model step is slowed by a known delay, so each latency has a lower bound that holds on any
machine (a slower one only adds to it); the client's own stopwatch around the request is an upper
bound; and the three histograms must agree exactly: a request's end-to-end latency is its TTFT
plus its inter-token gaps.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.spyre_server.http.helpers import MakeServer, Metrics, slow_down, unique_text

STEP_DELAY = 0.05
"""Every model step takes at least this long."""
BUCKET_BELOW_DELAY = "0.025"
"""A histogram bucket bound below STEP_DELAY: no latency of one step or more falls in it."""

TTFT = "vllm:time_to_first_token_seconds"
ITL = "vllm:inter_token_latency_seconds"
E2E = "vllm:e2e_request_latency_seconds"


def hist(metrics: Metrics, name: str, suffix: str, **labels: str) -> float:
    return metrics.value(f"{name}_{suffix}", **labels)


def buckets(metrics: Metrics, name: str) -> list[tuple[float, float]]:
    """(upper bound, cumulative count) of every bucket, in order."""
    out = [
        (float(dict(labels)["le"]), value)
        for (sample, labels), value in metrics.samples.items()
        if sample == f"{name}_bucket"
    ]
    return sorted(out)


@pytest.mark.parametrize("stream", [False, True])
def test_latency_histograms_hold_the_request_latencies(
    make_server: MakeServer, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    # 300 tokens, chunk 128: 3 prefill steps make the first token; 4 decode steps the other 4
    num_prefill_steps, max_tokens = 3, 5
    server = make_server()
    slow_down(monkeypatch, server, STEP_DELAY)
    body: dict[str, Any] = {
        "prompt": unique_text(f"latency-{stream}", 300),
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    started = time.monotonic()
    response = server.http().post("/v1/completions", json=body)
    elapsed = time.monotonic() - started  # the server's clock runs within the client's
    assert response.status_code == 200, response.text
    m = server.metrics()

    assert hist(m, TTFT, "count") == 1
    assert hist(m, ITL, "count") == max_tokens - 1
    assert hist(m, E2E, "count") == 1
    ttft, itl, e2e = (hist(m, name, "sum") for name in (TTFT, ITL, E2E))
    assert num_prefill_steps * STEP_DELAY <= ttft <= elapsed
    assert (max_tokens - 1) * STEP_DELAY <= itl <= elapsed
    assert (num_prefill_steps + max_tokens - 1) * STEP_DELAY <= e2e <= elapsed
    # one token per step: the end is the first token plus every gap after it
    assert e2e == pytest.approx(ttft + itl, abs=1e-6)

    for name, count in ((TTFT, 1), (ITL, max_tokens - 1), (E2E, 1)):
        counts = buckets(m, name)
        assert counts[-1] == (float("inf"), count)
        assert [c for _, c in counts] == sorted(c for _, c in counts)  # cumulative
        # every observation is at least one step long: none in a bucket below the delay
        assert hist(m, name, "bucket", le=BUCKET_BELOW_DELAY) == 0, name


def test_latency_histograms_sum_over_requests(
    make_server: MakeServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two requests one after the other: counts and sums add up, each request's share bounded."""
    server = make_server()
    slow_down(monkeypatch, server, STEP_DELAY)
    elapsed = 0.0
    for index, max_tokens in enumerate((2, 4)):
        body = {"prompt": unique_text(f"latency-sum-{index}", 100), "max_tokens": max_tokens}
        body |= {"temperature": 0, "ignore_eos": True}
        started = time.monotonic()
        response = server.http().post("/v1/completions", json=body)
        elapsed += time.monotonic() - started
        assert response.status_code == 200, response.text
    m = server.metrics()
    assert (hist(m, TTFT, "count"), hist(m, ITL, "count"), hist(m, E2E, "count")) == (2, 4, 2)
    ttft, itl, e2e = (hist(m, name, "sum") for name in (TTFT, ITL, E2E))
    # 100 tokens: one prefill step each; (2 - 1) + (4 - 1) decode steps
    assert ttft >= 2 * STEP_DELAY and itl >= 4 * STEP_DELAY
    assert e2e == pytest.approx(ttft + itl, abs=1e-6)
    assert e2e <= elapsed
