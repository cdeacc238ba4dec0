"""The server's prefix-cache counters from ``GET /metrics`` (Prometheus text), before and after a
run: the run's hit rate is delta(hits) / delta(queries).

Only the vLLM names are read (``vllm:prefix_cache_hits_total``,
``vllm:prefix_cache_queries_total``, both in tokens). A server without /metrics or without these names gives no counters (``None``):
the hit rate is then unknown, which is not an error. The counters are server-wide: traffic from
other clients during the run counts too.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx

HITS = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"


@dataclass(frozen=True, slots=True)
class CacheCounters:
    queries: float
    hits: float


@dataclass(frozen=True, slots=True)
class CacheDelta:
    """The change of the counters over a run."""

    queries: float
    hits: float

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.queries if self.queries > 0 else None


def _sum_samples(values: list[tuple[dict[str, str], float]], model: str) -> float | None:
    if not values:
        return None
    if any("model_name" in labels for labels, _ in values):
        return sum(v for labels, v in values if labels.get("model_name") == model)
    return sum(v for _, v in values)


def parse_cache_counters(text: str, model: str) -> CacheCounters | None:
    """The counters in a /metrics body: per name, the sum of the samples whose ``model_name``
    label is ``model`` (of all samples when none has that label). ``None`` when either name is
    missing or the text does not parse.

    ``text_string_to_metric_families`` strips ``_total`` from counter family names, but not from
    their samples, so samples are matched by name in every family."""
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[str, list[tuple[dict[str, str], float]]] = {HITS: [], QUERIES: []}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in found:
                    found[sample.name].append((dict(sample.labels), float(sample.value)))
    except (ValueError, TypeError, IndexError):
        return None
    hits = _sum_samples(found[HITS], model)
    queries = _sum_samples(found[QUERIES], model)
    if hits is None or queries is None:
        return None
    return CacheCounters(queries=queries, hits=hits)


async def scrape_cache_counters(
    client: httpx.AsyncClient, base_url: str, model: str
) -> CacheCounters | None:
    """``GET /metrics`` and parse it; ``None`` when it fails in any way (404, no such names)."""
    try:
        response = await client.get(f"{base_url}/metrics")
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    return parse_cache_counters(response.text, model)


def cache_delta(before: CacheCounters | None, after: CacheCounters | None) -> CacheDelta | None:
    if before is None or after is None:
        return None
    return CacheDelta(queries=after.queries - before.queries, hits=after.hits - before.hits)
