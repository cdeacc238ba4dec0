"""The container health check (spyre_server.entrypoints.healthcheck) finds where the server listens from
/proc, whatever set the port, and reports a server that answers /health as healthy."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

import pytest

from spyre_server.entrypoints.healthcheck import (
    Address,
    decode_address,
    is_healthy,
    is_server_command,
    listening,
    server_addresses,
)
from tests.spyre_server.http.helpers import Server

TCP_HEADER = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode"


def test_decodes_proc_net_tcp_addresses() -> None:
    assert decode_address("0100007F:1F40") == Address("127.0.0.1", 8000)
    assert decode_address("00000000:238C") == Address("127.0.0.1", 9100)  # 0.0.0.0: loopback
    assert decode_address("0A00020F:0050") == Address("15.2.0.10", 80)
    assert decode_address("00000000000000000000000000000000:1F90") == Address("::1", 8080)
    assert decode_address("00000000000000000000000001000000:1F90") == Address("::1", 8080)
    # ::ffff:127.0.0.1, an IPv4 client of a dual-stack socket
    assert decode_address("0000000000000000FFFF00000100007F:0050") == Address("127.0.0.1", 80)
    assert Address("::1", 8080).health_url == "http://[::1]:8080/health"


def test_only_listening_sockets_of_the_given_inodes_count() -> None:
    table = [
        "   0: 00000000:238C 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 4242 1 0 100 0 0 10 0",
        "   1: 0100007F:1F40 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 777 1 0 100 0 0 10 0",
        "   2: 0100007F:238C 0100007F:D431 01 00000000:00000000 00:00000000 00000000  1000        0 4243 1 0 20 4 30 10 -1",
    ]
    assert list(listening(table, {4242, 4243})) == [Address("127.0.0.1", 9100)]
    assert list(listening(table, {777})) == [Address("127.0.0.1", 8000)]
    assert list(listening([TCP_HEADER], {4242})) == []


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["/opt/venv/bin/python", "/opt/venv/bin/spyre-server", "serve", "--port", "9"], True),
        (["spyre-server", "serve"], True),
        (
            [
                "/usr/bin/python3",
                "-m",
                "spyre_server.entrypoints.cli",
                "serve",
                "--config",
                "c.yaml",
            ],
            True,
        ),
        (["/opt/venv/bin/python", "/opt/venv/bin/spyre-server", "bench", "multi-turn"], False),
        (["/opt/venv/bin/python", "-m", "spyre_server.entrypoints.healthcheck"], False),
        (["python", "-m", "pytest", "serve"], False),
        ([""], False),
    ],
)
def test_recognises_the_serve_command(argv: list[str], expected: bool) -> None:
    assert is_server_command(argv) is expected


def test_finds_the_port_a_live_server_listens_on_and_it_is_healthy(
    make_micro_server: Callable[..., Server],
) -> None:
    running_server = make_micro_server()
    # This process is the server here: its sockets are what /proc/<pid>/fd and net/tcp show.
    other = socket.socket()  # a connected or unrelated socket must not count
    other.connect(("127.0.0.1", running_server.port))
    try:
        addresses = server_addresses(os.getpid())
    finally:
        other.close()
    assert Address("127.0.0.1", running_server.port) in addresses
    assert is_healthy(Address("127.0.0.1", running_server.port))


def test_a_port_without_a_server_is_unhealthy() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert not is_healthy(Address("127.0.0.1", port), timeout=2)
