"""The server's listening socket, bound before the model loads: a port that is in use fails the
start at once instead of after a long load and a misleading "serving on" line."""

from __future__ import annotations

import errno
import socket


class ListenError(RuntimeError):
    """The configured address cannot be bound; the message names it and says why."""


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (port 0: any free port), not yet listening, so that
    connections are refused until the server starts (uvicorn listens on it). The options are
    uvicorn's own: SO_REUSEADDR, IPv6 for a host with a colon."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        where = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
        hint = " (another server is running there?)" if exc.errno == errno.EADDRINUSE else ""
        raise ListenError(f"cannot listen on {where}: {exc.strerror or exc}{hint}") from None
    return sock
