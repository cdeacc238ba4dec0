"""The kv_events configuration section: defaults, overrides, validation."""

from __future__ import annotations

from pathlib import Path

import pytest

from spyre_server.config import ConfigError, load_config


def test_defaults_are_the_documented_ones() -> None:
    section = load_config(environ={}).kv_events
    assert section.enabled is False
    assert section.endpoint == "tcp://127.0.0.1:5557"
    assert section.topic is None
    assert section.replay_endpoint is None
    assert section.buffer_steps == 10_000


def test_environment_overrides_and_an_empty_topic_from_the_file(tmp_path: Path) -> None:
    config_file = tmp_path / "config.yaml"
    config_file.write_text('kv_events:\n  topic: ""\n')  # vllm-router's static sources use ""
    section = load_config(
        config_file,
        environ={
            "SPYRE_SERVER_KV_EVENTS__ENABLED": "true",
            "SPYRE_SERVER_KV_EVENTS__ENDPOINT": "tcp://0.0.0.0:6000",
        },
    ).kv_events
    assert (section.enabled, section.endpoint, section.topic) == (True, "tcp://0.0.0.0:6000", "")


@pytest.mark.parametrize(
    ("key", "value"),
    [("endpoint", "127.0.0.1:5557"), ("replay_endpoint", "http://x:1"), ("buffer_steps", 0)],
)
def test_invalid_values_name_the_key(key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"kv_events.{key}"):
        load_config(environ={}, overrides={f"kv_events.{key}": value})


def test_an_endpoint_in_use_stops_the_start_with_the_key_named() -> None:
    from scheduler import Scheduler, SchedulerConfig
    from spyre_server.kv_events.publisher import ZmqEventPublisher
    from spyre_server.kv_events.service import start_kv_events

    taken = ZmqEventPublisher("tcp://127.0.0.1:*", "t")
    try:
        section = load_config(
            environ={}, overrides={"kv_events.enabled": True, "kv_events.endpoint": taken.endpoint}
        ).kv_events
        with pytest.raises(RuntimeError, match=f"kv_events: cannot bind {taken.endpoint}"):
            start_kv_events(section, Scheduler(SchedulerConfig()), "m")
    finally:
        taken.close()


def test_disabled_starts_nothing() -> None:
    from scheduler import Scheduler, SchedulerConfig
    from spyre_server.kv_events.service import start_kv_events

    assert (
        start_kv_events(load_config(environ={}).kv_events, Scheduler(SchedulerConfig()), "m")
        is None
    )
