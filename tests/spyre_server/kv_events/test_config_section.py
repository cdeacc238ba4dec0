"""The kv_events configuration section: defaults, overrides, validation."""

from __future__ import annotations

import pytest

from spyre_server.config import ConfigError, load_config


def test_defaults_are_the_documented_ones() -> None:
    section = load_config(environ={}).kv_events
    assert section.enabled is False
    assert section.endpoint == "tcp://127.0.0.1:5557"
    assert section.topic is None
    assert section.replay_endpoint is None
    assert section.buffer_steps == 10_000


def test_environment_overrides_and_an_explicitly_empty_topic() -> None:
    section = load_config(
        environ={
            "SPYRE_SERVER_KV_EVENTS__ENABLED": "true",
            "SPYRE_SERVER_KV_EVENTS__ENDPOINT": "tcp://0.0.0.0:6000",
            "SPYRE_SERVER_KV_EVENTS__TOPIC": '""',  # vllm-router's static sources use ""
        }
    ).kv_events
    assert (section.enabled, section.endpoint, section.topic) == (True, "tcp://0.0.0.0:6000", "")


@pytest.mark.parametrize(
    ("key", "value"),
    [("endpoint", "127.0.0.1:5557"), ("replay_endpoint", "http://x:1"), ("buffer_steps", 0)],
)
def test_invalid_values_name_the_key(key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"kv_events.{key}"):
        load_config(environ={}, overrides={f"kv_events.{key}": value})
