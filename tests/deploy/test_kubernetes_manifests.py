"""deploy/kubernetes/ agrees with itself and with the server: one router worker and one KV event
source per StatefulSet replica, the block size, probes, grace period above the drain, scraping.
(Schema validation runs in .ci/run with kubernetes-validate.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from spyre_server.config import load_config

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"


def _resources() -> dict[tuple[str, str], Any]:
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    out = {}
    for name in kustomization["resources"]:
        for doc in yaml.safe_load_all((DEPLOY / name).read_text()):
            out[(doc["kind"], doc["metadata"]["name"])] = doc
    return out


def _container(workload: Any) -> Any:
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return container


def _router_args(args: list[str]) -> tuple[list[str], list[str], dict[str, str]]:
    """(worker urls, kv event sources, other --key=value options)."""
    workers: list[str] = []
    sources: list[str] = []
    options: dict[str, str] = {}
    collecting = False
    for arg in args:
        if arg == "--worker-urls":
            collecting = True
        elif arg.startswith("--"):
            collecting = False
            key, _, value = arg[2:].partition("=")
            if key == "kv-event-source":
                sources.append(value)
            else:
                options[key] = value
        elif collecting:
            workers.append(arg)
    return workers, sources, options


def test_the_router_names_every_replica_and_its_event_source() -> None:
    resources = _resources()
    replicas = resources[("StatefulSet", "spyre-server")]
    headless = resources[("Service", replicas["spec"]["serviceName"])]
    assert headless["spec"]["clusterIP"] == "None"
    router = _container(resources[("Deployment", "vllm-router")])
    workers, sources, options = _router_args(router["args"])
    count = replicas["spec"]["replicas"]
    hosts = [f"spyre-server-{i}.{headless['metadata']['name']}" for i in range(count)]
    assert workers == [f"http://{h}:8000" for h in hosts]
    assert sources == [f"http://{h}:8000=tcp://{h}:5557" for h in hosts]
    assert options["policy"] == "kv_aware"
    assert options["kv-event-block-size"] == "64"


def _replica_config(tmp_path: Path) -> Any:
    """The configuration a replica pod loads: the ConfigMap's file at --config, then its env."""
    resources = _resources()
    container = _container(resources[("StatefulSet", "spyre-server")])
    args = container["args"]
    (mount,) = container["volumeMounts"]
    assert args[args.index("--config") + 1] == mount["mountPath"]
    config_file = tmp_path / "config.yaml"
    config_file.write_text(
        resources[("ConfigMap", "spyre-server-config")]["data"][mount["subPath"]]
    )
    environ = {e["name"]: e["value"] for e in container["env"]}
    return load_config(config_file, environ=environ)


def test_the_replicas_publish_what_the_router_subscribes_to(tmp_path: Path) -> None:
    container = _container(_resources()[("StatefulSet", "spyre-server")])
    config = _replica_config(tmp_path)
    assert config.kv_events.enabled
    assert config.kv_events.endpoint == "tcp://0.0.0.0:5557"
    assert config.kv_events.topic == ""  # vllm-router 0.1.17 static sources: empty topic
    assert config.cache.block_size == 64
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": 8000, "kv-events": 5557}


def test_probes_grace_period_and_scraping(tmp_path: Path) -> None:
    replicas = _resources()[("StatefulSet", "spyre-server")]
    pod = replicas["spec"]["template"]
    container = _container(replicas)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health"
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300  # model loading
    drain = _replica_config(tmp_path).server.graceful_shutdown_seconds
    assert pod["spec"]["terminationGracePeriodSeconds"] > drain
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == "8000"
    assert annotations["prometheus.io/path"] == "/metrics"
