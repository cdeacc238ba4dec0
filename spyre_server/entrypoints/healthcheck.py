"""Container health check: ``python -m spyre_server.entrypoints.healthcheck`` exits 0 when the server running
beside it answers ``GET /health`` with 200, and 1 otherwise (the Dockerfile's HEALTHCHECK).

It asks the kernel where the server listens instead of reading the configuration: the TCP sockets
in LISTEN state held by a ``spyre-server serve`` process (found through /proc). So a port set in
config.yaml, by ``--port`` or by ``SPYRE_SERVER_SERVER__PORT`` is found alike, and with
``--network host`` only the server's own sockets count. A wildcard address (0.0.0.0, ::) is
reached on loopback. Standard library only, so that a check costs a few milliseconds.
"""

from __future__ import annotations

import ipaddress
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
TIMEOUT_SECONDS = 4.0
_LISTEN = "0A"  # TCP state in /proc/net/tcp*


@dataclass(frozen=True, slots=True)
class Address:
    host: str
    port: int

    @property
    def health_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/health"


def is_server_command(argv: list[str]) -> bool:
    """Whether ``argv`` (a /proc cmdline) is ``spyre-server serve`` or ``-m spyre_server.entrypoints.cli serve``."""
    for i, arg in enumerate(argv):
        if os.path.basename(arg) == "spyre-server" or arg == "spyre_server.entrypoints.cli":
            return "serve" in argv[i + 1 :]
    return False


def server_pids(proc: Path = PROC) -> list[int]:
    """PIDs of the ``spyre-server serve`` processes this user can see."""
    pids = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if is_server_command(argv):
            pids.append(int(entry.name))
    return pids


def socket_inodes(pid: int, proc: Path = PROC) -> set[int]:
    """Inodes of the sockets among ``pid``'s open files (empty if they cannot be read)."""
    inodes = set()
    try:
        fds = list((proc / str(pid) / "fd").iterdir())
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[len("socket:[") : -1]))
    return inodes


def decode_address(hex_address: str) -> Address:
    """``"0100007F:1F40"`` -> 127.0.0.1:8000. /proc/net/tcp* prints each 32-bit word of the IP
    in host byte order (little-endian here) and the port in big-endian hex."""
    hex_ip, hex_port = hex_address.split(":")
    raw = bytes.fromhex(hex_ip)
    ip = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    address = ipaddress.ip_address(ip)
    if address.is_unspecified:
        address = ipaddress.ip_address("::1" if address.version == 6 else "127.0.0.1")
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return Address(str(address), int(hex_port, 16))


def listening(table: Iterable[str], inodes: set[int]) -> Iterator[Address]:
    """The LISTEN sockets of a /proc/net/tcp or tcp6 table whose inode is in ``inodes``."""
    for line in table:
        fields = line.split()
        if len(fields) < 10 or fields[3] != _LISTEN or not fields[9].isdigit():
            continue
        if int(fields[9]) in inodes:
            yield decode_address(fields[1])


def server_addresses(pid: int, proc: Path = PROC) -> list[Address]:
    """Where process ``pid`` listens for TCP connections, lowest port first."""
    inodes = socket_inodes(pid, proc)
    found: set[Address] = set()
    for name in ("tcp", "tcp6"):
        try:
            table = (proc / str(pid) / "net" / name).read_text().splitlines()[1:]
        except OSError:
            continue
        found.update(listening(table, inodes))
    return sorted(found, key=lambda a: (a.port, a.host))


def is_healthy(address: Address, timeout: float = TIMEOUT_SECONDS) -> bool:
    try:
        with urllib.request.urlopen(address.health_url, timeout=timeout) as response:
            return bool(response.status == 200)
    except (OSError, urllib.error.URLError, ValueError):
        return False


def main() -> int:
    pids = server_pids()
    if not pids:
        print("unhealthy: no spyre-server serve process", file=sys.stderr)
        return 1
    addresses = [address for pid in pids for address in server_addresses(pid)]
    for address in addresses:
        if is_healthy(address):
            return 0
    where = ", ".join(a.health_url for a in addresses) or "no listening socket yet"
    print(f"unhealthy: {where}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
