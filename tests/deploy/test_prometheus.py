"""A real Prometheus (Debian's ``prometheus``) scrapes a running server: the README's hit-rate
PromQL, asked through Prometheus' HTTP API, equals the ratio of the server's own counters, and
every expression of the Grafana dashboard returns data."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.deploy.local import free_port, require_executable
from tests.deploy.promql import (
    dashboard_expressions,
    readme_hit_rate_query,
    split_label_values,
    substitute_grafana_variables,
)
from tests.spyre_server.http.helpers import MODEL_NAME, Server, unique_text

pytestmark = pytest.mark.slow

SCRAPE_INTERVAL = "1s"
TIMEOUT = 60.0


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    def query(self, expr: str) -> list[dict[str, Any]]:
        response = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
        body = response.json()
        assert response.status_code == 200 and body["status"] == "success", (expr, body)
        assert body["data"]["resultType"] == "vector", body
        return body["data"]["result"]  # type: ignore[no-any-return]

    def value(self, expr: str) -> float | None:
        """The single sample of ``expr`` now, or None while it has none."""
        result = self.query(expr)
        assert len(result) <= 1, result
        return float(result[0]["value"][1]) if result else None

    def wait_for(self, expr: str, expected: float) -> None:
        deadline = time.monotonic() + TIMEOUT
        while (value := self.value(expr)) != expected:
            assert time.monotonic() < deadline, f"{expr} = {value}, expected {expected}"
            time.sleep(0.2)


@pytest.fixture
def prometheus_of(tmp_path: Path) -> Iterator[Callable[[Server], Prometheus]]:
    """``prometheus_of(server)`` starts Prometheus on 127.0.0.1 scraping ``server`` every 1 s."""
    binary = require_executable("prometheus")
    processes: list[subprocess.Popen[bytes]] = []

    def start(server: Server) -> Prometheus:
        config = tmp_path / "prometheus.yml"
        # docs/deployment.md's scrape config, pointed at the test server.
        config.write_text(
            "global:\n"
            f"  scrape_interval: {SCRAPE_INTERVAL}\n"
            "scrape_configs:\n"
            "  - job_name: spyre-server\n"
            "    metrics_path: /metrics\n"
            "    static_configs:\n"
            f"      - targets: ['127.0.0.1:{server.port}']\n"
        )
        port = free_port()
        log = (tmp_path / "prometheus.log").open("wb")
        process = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        processes.append(process)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + TIMEOUT
        while True:
            assert process.poll() is None, (tmp_path / "prometheus.log").read_text()
            try:
                if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    return Prometheus(url)
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "Prometheus did not become ready"
            time.sleep(0.2)

    yield start
    for process in processes:
        process.terminate()
        process.wait(30)


def test_readme_hit_rate_query_matches_the_servers_counters(
    make_micro_server: Callable[..., Server], prometheus_of: Callable[[Server], Prometheus]
) -> None:
    server = make_micro_server()
    prometheus = prometheus_of(server)
    selector = f'{{job="spyre-server", model_name="{MODEL_NAME}"}}'
    # A scrape before any traffic: both counters start at 0 in Prometheus too.
    prometheus.wait_for(f"vllm:prefix_cache_queries_total{selector}", 0.0)
    client = server.openai()
    shared = unique_text("shared", 384)
    for suffix in ("a", "b", "c"):
        client.completions.create(
            model=MODEL_NAME, prompt=shared + unique_text(suffix, 60), max_tokens=2
        )
    client.completions.create(model=MODEL_NAME, prompt=unique_text("other", 200), max_tokens=2)
    server.wait_idle()
    own = server.metrics()
    hits = own.value("vllm:prefix_cache_hits_total")
    queries = own.value("vllm:prefix_cache_queries_total")
    assert queries == 3 * 444 + 200
    assert hits > 0
    prometheus.wait_for(f"vllm:prefix_cache_queries_total{selector}", queries)
    prometheus.wait_for(f"vllm:prefix_cache_hits_total{selector}", hits)
    # the README's query, verbatim
    assert prometheus.value(readme_hit_rate_query()) == pytest.approx(hits / queries, rel=1e-9)

    for expr in dashboard_expressions():
        query, label = split_label_values(substitute_grafana_variables(expr))
        result = prometheus.query(query)
        assert result, f"no data for the dashboard's {expr}"
        if label is not None:  # a variable's values: this label of the series found
            assert {series["metric"][label] for series in result} == {
                {"job": "spyre-server", "model_name": MODEL_NAME}[label]
            }, expr
