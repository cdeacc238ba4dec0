"""ZMQ publisher of KV-event batches, on its own thread (as vLLM's ``ZmqEventPublisher``).

The engine thread only queues events (``offer`` never blocks). The publisher thread takes what
has accumulated, sends it as one batch on the PUB socket (topic, sequence number from 0, payload)
and keeps the last ``buffer_steps`` batches for replay: a client of the optional ROUTER socket
sends an 8-byte big-endian start sequence and receives every buffered batch from there as
``(b"", sequence, payload)``, then the end marker ``(b"", -1, b"")`` (vLLM's replay protocol).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections import deque

import zmq

from spyre_server.kv_events import wire

logger = logging.getLogger(__name__)

MAX_EVENTS_PER_BATCH = 1024
_POLL_SECONDS = 0.05


class ZmqEventPublisher:
    """Binds its sockets at construction (an address in use raises ``zmq.ZMQError`` there)."""

    def __init__(
        self,
        endpoint: str,
        topic: str,
        *,
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
        max_queued_events: int = 100_000,
        high_water_mark: int = 100_000,
    ) -> None:
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, high_water_mark)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self._pub.bind(endpoint)
            if replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = (
            None if self._replay is None else self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        )
        self._topic = topic.encode("utf-8")
        self._queue: queue.Queue[wire.WireEvent] = queue.Queue(maxsize=max_queued_events)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._sequence = itertools.count()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()

    def offer(self, event: wire.WireEvent) -> bool:
        """Queue one event; False (nothing queued) when the queue is full. Never blocks."""
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            return False
        return True

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued, then stop the thread and close the sockets."""
        self._stopping.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("the KV event publisher did not stop within %.1f s", timeout)
            return  # its sockets are still in use; the daemon thread ends with the process
        self._close_sockets()

    # ----------------------------------------------------------- publisher thread
    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                events = [self._queue.get(timeout=_POLL_SECONDS)]
            except queue.Empty:
                if self._stopping.is_set():
                    return
                continue
            while len(events) < MAX_EVENTS_PER_BATCH:
                try:
                    events.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            self._publish(events)

    def _publish(self, events: list[wire.WireEvent]) -> None:
        try:
            payload = wire.encode_batch(events)
            seq = next(self._sequence)
            self._pub.send_multipart((self._topic, wire.sequence_bytes(seq), payload))
            self._buffer.append((seq, payload))
        except Exception:  # never let a bad batch end the thread
            logger.exception("publishing a KV event batch failed")

    def _serve_replay(self) -> None:
        assert self._replay is not None
        try:
            frames = self._replay.recv_multipart()
            if len(frames) != 3:
                logger.warning("ignoring a KV event replay request of %d frames", len(frames))
                return
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    self._replay.send_multipart((client, b"", wire.sequence_bytes(seq), payload))
            self._replay.send_multipart((client, b"", wire.END_OF_REPLAY_SEQUENCE, b""))
        except Exception:
            logger.exception("serving a KV event replay request failed")

    def _close_sockets(self) -> None:
        self._pub.close(linger=500)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._context.term()
