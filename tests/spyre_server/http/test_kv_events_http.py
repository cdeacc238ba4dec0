"""KV events from a real server: what a prompt, a salted prompt and a reset publish, read back
through the replay socket and decoded with vLLM's own structs."""

from __future__ import annotations

import socket
import time
from typing import Any

import pytest
import zmq

from tests.spyre_server.http.helpers import BLOCK, MakeServer, unique_text
from tests.spyre_server.http.router_cluster import free_port
from tests.spyre_server.kv_events import vllm_kv_events as vllm

POLL_MS = 100
MAX_TRIES = 100  # a bound on waiting for the publisher thread, never an assertion on time


def replay_events(replay_endpoint: str, until: type) -> list[Any]:
    """Every buffered event, replayed from sequence 0, once an event of type ``until`` is there."""
    context = zmq.Context()
    try:
        for _ in range(MAX_TRIES):
            dealer = context.socket(zmq.DEALER)
            dealer.connect(replay_endpoint)
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            events: list[Any] = []
            while True:
                assert dealer.poll(POLL_MS * MAX_TRIES), "no replay answer"
                _, seq, payload = dealer.recv_multipart()
                if int.from_bytes(seq, "big", signed=True) == -1:
                    break
                events += vllm.decode(payload).events
            dealer.close(linger=0)
            if any(isinstance(e, until) for e in events):
                return events
            time.sleep(POLL_MS / 1000)
        raise AssertionError(f"no {until.__name__} was published: {events}")
    finally:
        context.term()


def test_a_prompt_publishes_its_full_blocks_salted_ones_nothing_reset_a_clear(
    make_server: MakeServer,
) -> None:
    replay = f"tcp://127.0.0.1:{free_port()}"
    server = make_server(
        kv_events__enabled=True,
        kv_events__endpoint=f"tcp://127.0.0.1:{free_port()}",
        kv_events__replay_endpoint=replay,
    )
    http = server.http()
    prompt = list(unique_text("events", 2 * BLOCK + 22).encode())
    salted = list(unique_text("salted", 3 * BLOCK).encode())
    assert http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}).status_code == 200
    response = http.post(
        "/v1/completions", json={"prompt": salted, "max_tokens": 1, "cache_salt": "tenant"}
    )
    assert response.status_code == 200
    server.reset_cache()

    events = replay_events(replay, until=vllm.AllBlocksCleared)
    assert [type(e) for e in events] == [vllm.BlockStored, vllm.BlockStored, vllm.AllBlocksCleared]
    first, second = events[0], events[1]
    assert first.token_ids == prompt[:BLOCK] and second.token_ids == prompt[BLOCK : 2 * BLOCK]
    assert first.parent_block_hash is None
    assert second.parent_block_hash == first.block_hashes[0]
    assert first.block_size == second.block_size == BLOCK
    assert len(first.block_hashes) == 1 and 0 <= first.block_hashes[0] < 2**64
    assert first.medium == "GPU" and first.lora_name is None


@pytest.mark.parametrize("topic", [None, ""])
def test_the_topic_defaults_to_kv_hostname_model(
    make_server: MakeServer, topic: str | None
) -> None:
    server = make_server(
        kv_events__enabled=True,
        kv_events__endpoint=f"tcp://127.0.0.1:{free_port()}",
        kv_events__topic=topic,
    )
    reported = server.http().get("/server_info").json()["kv_events"]["topic"]
    assert reported == (f"kv@{socket.gethostname()}@micro" if topic is None else "")
