"""Prometheus metrics with vLLM-compatible names (DESIGN §6), each labelled with model_name.

Scheduler gauges and counters are read from the scheduler at scrape time (always fresh, also when
idle); request latencies and token counts are recorded by the HTTP layer as requests progress.
The registry also carries prometheus_client's standard ``process_*`` (CPU, memory, open files)
and ``python_*`` (version, garbage collector) metrics, without a model_name label.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from scheduler import SchedulerConfig, SchedulerStats
from spyre_server.model.runner import ProgramStats

_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
)  # fmt: skip


class _SchedulerCollector(Collector):
    def __init__(self, read_stats: Callable[[], SchedulerStats], model_name: str) -> None:
        self._read_stats = read_stats
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self._read_stats()
        name = [self._model_name]

        def gauge(metric: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(metric, doc, labels=["model_name"])
            family.add_metric(name, value)
            return family

        def counter(metric: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(metric, doc, labels=["model_name"])
            family.add_metric(name, value)
            return family

        yield gauge(
            "vllm:num_requests_running", "Requests prefilling or decoding.", stats.num_running
        )
        yield gauge(
            "vllm:num_requests_waiting", "Requests waiting for admission.", stats.num_waiting
        )
        yield gauge(
            "vllm:kv_cache_usage_perc",
            "KV blocks in use / usable KV blocks (0..1).",
            stats.kv_cache_usage,
        )
        yield counter(
            "vllm:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache (once per admitted request).",
            stats.prefix_cache_queries,
        )
        yield counter(
            "vllm:prefix_cache_hits",
            "Prompt tokens whose compute the prefix cache skipped.",
            stats.prefix_cache_hits,
        )
        yield counter("vllm:num_preemptions", "Preemptions by recompute.", stats.num_preemptions)
        steps = CounterMetricFamily(
            "spyre:engine_steps", "Engine steps by kind.", labels=["model_name", "kind"]
        )
        steps.add_metric([self._model_name, "prefill"], stats.num_prefill_chunks_computed)
        steps.add_metric([self._model_name, "decode"], stats.num_decode_steps)
        yield steps
        chunks = CounterMetricFamily(
            "spyre:prefill_chunks",
            "Prefill chunks computed, or skipped because the prefix cache held them.",
            labels=["model_name", "source"],
        )
        chunks.add_metric([self._model_name, "computed"], stats.num_prefill_chunks_computed)
        chunks.add_metric([self._model_name, "cache"], stats.num_prefill_chunks_skipped)
        yield chunks


class _ProgramCollector(Collector):
    """The fixed-shape programs of the spyre backend (none on the cpu backend)."""

    def __init__(self, read_stats: Callable[[], ProgramStats | None], model_name: str) -> None:
        self._read_stats = read_stats
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self._read_stats()
        warmed = GaugeMetricFamily(
            "spyre:warmed_programs",
            "Programs (graphs) compiled at start: one dynamic prefill and one dynamic decode "
            "graph (0: a backend without programs).",
            labels=["model_name"],
        )
        warmed.add_metric([self._model_name], sum(stats.graphs.values()) if stats else 0)
        yield warmed
        if stats is None:
            return
        late = CounterMetricFamily(
            "spyre:programs_compiled_after_warmup",
            "Graphs compiled after start: steps the warmed-up programs did not serve (0 when "
            "all is well; a card would compile a program it has not validated).",
            labels=["model_name"],
        )
        late.add_metric([self._model_name], stats.graphs_after_warmup)
        yield late
        steps = CounterMetricFamily(
            "spyre:program_steps",
            "Engine steps run per program shape, by kind (prefill or decode).",
            labels=["model_name", "kind", "shape"],
        )
        for program, count in sorted(stats.num_steps.items()):
            steps.add_metric([self._model_name, program.kind, program.shape], count)
        yield steps


class ServerMetrics:
    def __init__(
        self,
        model_name: str,
        read_stats: Callable[[], SchedulerStats],
        read_program_stats: Callable[[], ProgramStats | None] = lambda: None,
        *,
        tensor_parallel_size: int = 1,
    ) -> None:
        self.registry = CollectorRegistry()
        self._model_name = model_name
        self.registry.register(_SchedulerCollector(read_stats, model_name))
        self.registry.register(_ProgramCollector(read_program_stats, model_name))
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        labels = ["model_name"]

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=self.registry)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, labels, buckets=_LATENCY_BUCKETS, registry=self.registry)

        model = (model_name,)
        Gauge(
            "spyre:tensor_parallel_size",
            "Ranks (processes, one per card or core group) the model is split over.",
            labels,
            registry=self.registry,
        ).labels(*model).set(tensor_parallel_size)
        self.prompt_tokens = counter(
            "vllm:prompt_tokens", "Prompt tokens of finished requests."
        ).labels(*model)
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens.").labels(
            *model
        )
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Arrival to first generated token."
        ).labels(*model)
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Time between generated tokens."
        ).labels(*model)
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Arrival to the request's end."
        ).labels(*model)

    def add_cache_config_info(self, config: SchedulerConfig) -> None:
        """``vllm:cache_config_info``: constant 1, the cache settings as labels (as in vLLM;
        routers and dashboards read ``block_size`` from it)."""
        labels = {
            "model_name": self._model_name,
            "block_size": str(config.block_size),
            "num_gpu_blocks": str(config.num_blocks),
            "enable_prefix_caching": str(config.enable_prefix_caching),
        }
        Gauge(
            "vllm:cache_config_info",
            "Information of the KV cache configuration.",
            list(labels),
            registry=self.registry,
        ).labels(**labels).set(1)
