"""The Grafana dashboard (deploy/grafana/spyre-server.json) reads only metrics the server
exposes, and shows what operators need."""

from __future__ import annotations

from collections.abc import Callable

from tests.deploy.promql import dashboard_expressions, metric_names, readme_hit_rate_query
from tests.spyre_server.http.helpers import Server


def test_metric_names_are_read_from_promql() -> None:
    expr = (
        "histogram_quantile(0.9, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket"
        '{job=~"$job", model_name=~"a|b"}[$__rate_interval]))) / on (instance) '
        "group_left () process_open_fds"
    )
    assert metric_names(expr) == {"vllm:time_to_first_token_seconds_bucket", "process_open_fds"}
    assert metric_names('label_values(vllm:num_requests_running{job=~"$job"}, model_name)') == {
        "vllm:num_requests_running"
    }
    assert metric_names("sum(rate(a_total[5m])) / sum(rate(b_total[5m])) > bool 0") == {
        "a_total",
        "b_total",
    }


def test_every_dashboard_expression_names_metrics_the_server_exposes(
    make_micro_server: Callable[..., Server],
) -> None:
    server = make_micro_server()
    exposed = {name for name, _labels in server.metrics().samples}
    exprs = dashboard_expressions()
    assert len(exprs) >= 15
    used: set[str] = set()
    for expr in exprs:
        names = metric_names(expr)
        assert names, expr
        assert names <= exposed, f"{sorted(names - exposed)} in {expr}"
        used |= names
    # what the dashboard must show: hit rate, TTFT and ITL quantiles, KV usage,
    # running and waiting requests, prefill chunks computed vs skipped
    assert {
        "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "spyre:prefill_chunks_total",
    } <= used
    assert metric_names(readme_hit_rate_query()) <= exposed


def test_the_server_exposes_the_standard_process_and_python_metrics(
    make_micro_server: Callable[..., Server],
) -> None:
    metrics = make_micro_server().metrics()
    types = {family.name: family.type for family in metrics.families}
    assert types["process_resident_memory_bytes"] == "gauge"
    assert types["process_cpu_seconds"] == "counter"
    assert types["process_open_fds"] == "gauge"
    assert types["python_info"] == "gauge"
    assert types["python_gc_collections"] == "counter"
    resident = metrics.samples[("process_resident_memory_bytes", frozenset())]
    assert resident > 10 * 2**20  # this test process holds torch: far more than 10 MiB
