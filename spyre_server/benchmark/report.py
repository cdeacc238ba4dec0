"""The results of a run: statistics (a flat dict, also the JSON file) and the table on stdout.

Latencies are in milliseconds; percentiles interpolate linearly between the sorted values (numpy's
default). TTFT and end-to-end latency have one value per completed request; ITL pools the gaps of
all completed requests. Throughputs divide by the run's duration. Input tokens are the prompt
lengths sent, output tokens the servers' ``usage.completion_tokens`` (text chunks without usage).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from spyre_server.benchmark.runner import RunOutcome, RunSettings

MAX_ERRORS = 5


def percentile(values: Sequence[float], p: float) -> float | None:
    """The ``p``-th percentile (0..100) with linear interpolation; ``None`` for no values."""
    if not values:
        return None
    if not 0 <= p <= 100:
        raise ValueError("p must be in [0, 100]")
    ordered = sorted(values)
    rank = p / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _ms(value: float | None) -> float | None:
    return None if value is None else value * 1000


def _latency_stats(name: str, seconds: Sequence[float], ps: Sequence[int]) -> dict[str, Any]:
    stats = {f"mean_{name}_ms": _ms(_mean(seconds))}
    stats |= {f"p{p}_{name}_ms": _ms(percentile(seconds, p)) for p in ps}
    return stats


def summarize(
    outcome: RunOutcome,
    settings: RunSettings,
    workload: str,
    workload_options: dict[str, int],
) -> dict[str, Any]:
    """The statistics of a run as a flat, JSON-ready dict (``None`` where unknown)."""
    done = [r for r in outcome.results if r.completion.ok]
    failed = [r for r in outcome.results if not r.completion.ok]
    errors = Counter(str(r.completion.error) for r in failed)  # insertion order: first seen first
    ttft = [r.completion.ttft_s for r in done if r.completion.ttft_s is not None]
    latency = [r.completion.latency_s for r in done if r.completion.latency_s is not None]
    itl = [gap for r in done for gap in r.completion.itl_s]
    cached = [r.completion.num_cached_tokens for r in done]
    num_output_tokens = sum(r.completion.num_output_tokens for r in done)
    duration = outcome.duration_s
    cache = outcome.cache
    rate = settings.request_rate
    return {
        "workload": workload,
        "base_url": settings.base_url,
        "model": settings.model,
        "workload_options": dict(workload_options),
        "request_rate": "inf" if math.isinf(rate) else rate,
        "max_concurrency": settings.max_concurrency,
        "seed": settings.seed,
        "ignore_eos": settings.ignore_eos,
        "num_requests": len(outcome.results),
        "num_completed": len(done),
        "num_failed": len(failed),
        "errors": [
            {"message": message, "count": count}
            for message, count in list(errors.items())[:MAX_ERRORS]
        ],
        "duration_s": duration,
        "request_throughput": len(done) / duration if duration > 0 else None,
        "output_throughput": num_output_tokens / duration if duration > 0 else None,
        "total_input_tokens": sum(len(r.prompt_ids) for r in done),
        "total_output_tokens": num_output_tokens,
        **_latency_stats("ttft", ttft, (50, 90, 99)),
        **_latency_stats("itl", itl, (50, 99)),
        **_latency_stats("e2e_latency", latency, (50, 90, 99)),
        "prefix_cache_hit_rate": None if cache is None else cache.hit_rate,
        "prefix_cache_hits": None if cache is None else cache.hits,
        "prefix_cache_queries": None if cache is None else cache.queries,
        "cached_tokens": None
        if all(c is None for c in cached)
        else sum(c for c in cached if c is not None),
    }


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def format_table(summary: dict[str, Any]) -> str:
    """The human-readable result (vLLM's layout)."""
    width = 50
    rows: list[str] = []

    def title(text: str, fill: str) -> None:
        rows.append(f" {text} ".center(width, fill) if text else fill * width)

    def row(label: str, value: Any, digits: int = 2) -> None:
        rows.append(f"{label + ':':<38}{_fmt(value, digits):>12}")

    s = summary
    title("Serving Benchmark Result", "=")
    rows.append(f"{'Workload:':<20}{s['workload']:>30}")
    rows.append(f"{'Model:':<20}{s['model']:>30}")
    row("Successful requests", s["num_completed"])
    row("Failed requests", s["num_failed"])
    row("Benchmark duration (s)", s["duration_s"])
    row("Total input tokens", s["total_input_tokens"])
    row("Total generated tokens", s["total_output_tokens"])
    row("Request throughput (req/s)", s["request_throughput"])
    row("Output token throughput (tok/s)", s["output_throughput"])
    title("Prefix Cache", "-")
    rate = s["prefix_cache_hit_rate"]
    row("Hit rate (server /metrics)", "n/a" if rate is None else f"{rate:.2%}")
    row("Hit / queried tokens (server)", _hits_of_queries(s))
    row("Cached prompt tokens (usage)", s["cached_tokens"])
    for name, label, ps in (
        ("ttft", "Time to First Token", (50, 90, 99)),
        ("itl", "Inter-token Latency", (50, 99)),
        ("e2e_latency", "End-to-end Latency", (50, 90, 99)),
    ):
        title(label, "-")
        short = {"ttft": "TTFT", "itl": "ITL", "e2e_latency": "E2E"}[name]
        row(f"Mean {short} (ms)", s[f"mean_{name}_ms"])
        for p in ps:
            row(f"P{p} {short} (ms)", s[f"p{p}_{name}_ms"])
    title("", "=")
    if s["errors"]:
        rows.append("First errors:")
        rows += [f"  ({e['count']}x) {e['message']}" for e in s["errors"]]
    return "\n".join(rows)


def _hits_of_queries(summary: dict[str, Any]) -> str:
    hits, queries = summary["prefix_cache_hits"], summary["prefix_cache_queries"]
    if hits is None or queries is None:
        return "n/a"
    return f"{hits:.0f} / {queries:.0f}"


def write_json(path: Path, summary: dict[str, Any]) -> None:
    path.write_text(json.dumps(summary, indent=2, allow_nan=False) + "\n")
