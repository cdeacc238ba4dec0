"""The ZMQ publisher on real sockets (loopback): three frames per batch, sequence numbers from 0,
replay through the ROUTER socket with vLLM's end marker."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from spyre_server.kv_events import wire
from spyre_server.kv_events.publisher import ZmqEventPublisher
from tests.spyre_server.kv_events import vllm_kv_events as vllm

TOPIC = "kv@test@micro"
POLL_MS = 100
MAX_POLLS = 100  # a bound on waiting, never an assertion on time


@pytest.fixture
def publisher() -> Iterator[ZmqEventPublisher]:
    pub = ZmqEventPublisher(
        "tcp://127.0.0.1:*", TOPIC, replay_endpoint="tcp://127.0.0.1:*", buffer_steps=3
    )
    yield pub
    pub.close()


def _cleared_event(i: int) -> wire.WireEvent:
    return wire.block_removed(i.to_bytes(16, "big"))


def _subscribe(publisher: ZmqEventPublisher, context: zmq.Context[zmq.Socket[bytes]]) -> Any:
    """A SUB socket that has joined: events are offered until one arrives (slow joiner)."""
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(publisher.endpoint)
    for _ in range(MAX_POLLS):
        assert publisher.offer(_cleared_event(0))
        if sub.poll(POLL_MS):
            sub.recv_multipart()
            while sub.poll(POLL_MS):  # drain the probes still in flight
                sub.recv_multipart()
            return sub
    raise AssertionError("the SUB socket never received a batch")


def test_batches_are_three_frames_with_consecutive_sequence_numbers(
    publisher: ZmqEventPublisher,
) -> None:
    context = zmq.Context()
    try:
        sub = _subscribe(publisher, context)
        previous = -1
        for i in range(1, 4):
            assert publisher.offer(_cleared_event(i))
            assert sub.poll(POLL_MS * MAX_POLLS)
            topic, seq, payload = sub.recv_multipart()
            assert topic == TOPIC.encode()
            assert len(seq) == 8
            batch = vllm.decode(payload)
            assert batch.events == [
                vllm.BlockRemoved(
                    block_hashes=[wire.external_hash(i.to_bytes(16, "big"))], medium="GPU"
                )
            ]
            if previous >= 0:
                assert int.from_bytes(seq, "big") == previous + 1
            previous = int.from_bytes(seq, "big")
        sub.close(linger=0)
    finally:
        context.term()


def _publish_one_by_one(publisher: ZmqEventPublisher, sub: Any, first: int, count: int) -> int:
    """Offer ``count`` events, each only after the previous batch arrived (one batch each);
    returns the sequence number of the last."""
    seq = -1
    for i in range(first, first + count):
        assert publisher.offer(_cleared_event(i))
        assert sub.poll(POLL_MS * MAX_POLLS)
        seq = int.from_bytes(sub.recv_multipart()[1], "big")
    return seq


def _replay(publisher: ZmqEventPublisher, context: Any, start: int) -> list[list[bytes]]:
    dealer = context.socket(zmq.DEALER)
    assert publisher.replay_endpoint is not None
    dealer.connect(publisher.replay_endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    replies = []
    while not replies or replies[-1][1] != wire.END_OF_REPLAY_SEQUENCE:
        assert dealer.poll(POLL_MS * MAX_POLLS)
        replies.append(dealer.recv_multipart())
    dealer.close(linger=0)
    return replies


def test_replay_sends_buffered_batches_from_the_start_sequence_then_the_end_marker(
    publisher: ZmqEventPublisher,
) -> None:
    context = zmq.Context()
    try:
        sub = _subscribe(publisher, context)
        newest = _publish_one_by_one(publisher, sub, 1, 3)
        replies = _replay(publisher, context, newest - 1)
        assert [(r[0], int.from_bytes(r[1], "big", signed=True)) for r in replies] == [
            (b"", newest - 1),
            (b"", newest),
            (b"", -1),
        ]
        assert replies[-1][2] == b""
        assert vllm.decode(replies[1][2]).events[0].block_hashes == [
            wire.external_hash((3).to_bytes(16, "big"))
        ]
        sub.close(linger=0)
    finally:
        context.term()


def test_replay_from_zero_starts_at_the_oldest_buffered_batch(
    publisher: ZmqEventPublisher,
) -> None:
    """buffer_steps=3: only the newest three batches are kept."""
    context = zmq.Context()
    try:
        sub = _subscribe(publisher, context)
        newest = _publish_one_by_one(publisher, sub, 1, 4)
        replies = _replay(publisher, context, 0)
        seqs = [int.from_bytes(r[1], "big", signed=True) for r in replies]
        assert seqs == [newest - 2, newest - 1, newest, -1]
        sub.close(linger=0)
    finally:
        context.term()


def test_offer_never_blocks_and_says_when_the_queue_is_full() -> None:
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", TOPIC, max_queued_events=1)
    try:
        results = [pub.offer(_cleared_event(i)) for i in range(1000)]
        assert results[0] is True
        assert False in results  # the thread cannot drain 1000 offers made back to back
    finally:
        pub.close()


def test_an_address_in_use_fails_at_construction() -> None:
    first = ZmqEventPublisher("tcp://127.0.0.1:*", TOPIC)
    try:
        with pytest.raises(zmq.ZMQError):
            ZmqEventPublisher(first.endpoint, TOPIC)
    finally:
        first.close()
