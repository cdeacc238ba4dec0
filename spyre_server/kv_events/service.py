"""Starts KV-event publishing for one engine from the ``kv_events`` configuration."""

from __future__ import annotations

import logging
import socket

import zmq

from scheduler import Scheduler
from spyre_server.config import KVEventsSection
from spyre_server.kv_events.collector import EventCollector
from spyre_server.kv_events.publisher import ZmqEventPublisher

logger = logging.getLogger(__name__)


def default_topic(model_name: str) -> str:
    """``kv@<hostname>@<model>``: the topic llm-d expects (the hostname is the pod's name)."""
    return f"kv@{socket.gethostname()}@{model_name}"


def start_kv_events(
    config: KVEventsSection, scheduler: Scheduler, model_name: str
) -> ZmqEventPublisher | None:
    """Bind the sockets and subscribe to the scheduler's block pool; ``None`` when disabled.

    Call it before the engine thread starts (the pool is not thread-safe)."""
    if not config.enabled:
        return None
    topic = config.topic if config.topic is not None else default_topic(model_name)
    try:
        publisher = ZmqEventPublisher(
            config.endpoint,
            topic,
            replay_endpoint=config.replay_endpoint,
            buffer_steps=config.buffer_steps,
        )
    except zmq.ZMQError as exc:
        raise RuntimeError(
            f"kv_events: cannot bind {config.endpoint}"
            + (f" / {config.replay_endpoint}" if config.replay_endpoint else "")
            + f": {exc}"
        ) from exc
    scheduler.pool.subscribe(EventCollector(scheduler.root_hash, publisher.offer))
    logger.info(
        "publishing KV events on %s (topic %r, replay %s)",
        publisher.endpoint,
        topic,
        publisher.replay_endpoint or "off",
    )
    return publisher
