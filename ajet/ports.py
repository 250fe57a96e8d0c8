"""A server's TCP port, checked before anything slow starts: `ajet serve`, `ajet gateway` and `ajet view` report a
port that another process holds in one line naming the port and the flag that changes it.

    check_port("127.0.0.1", 8765, "--port N (serve.port; 0 picks a free one)")   # PortInUseError when taken
    with port_in_use_as_error("127.0.0.1", 8765, hint): ...   # the later bind losing a race: the same error
    sock = bind_port("127.0.0.1", 8420, "--port N")            # bound now (no race), for uvicorn's sockets=[...]
"""

from __future__ import annotations

import errno
import socket
from contextlib import contextmanager
from typing import Iterator

from ajet.errors import AjetError


class PortInUseError(AjetError):
    """Another process holds the TCP port a server was asked to bind (the message names the port and the flag
    that changes it)."""


def _message(host: str, port: int, hint: str) -> str:
    return f"port {port} on {host} is already in use (another ajet server, or another program): choose another " \
           f"with {hint}"


def bind_port(host: str, port: int, hint: str) -> socket.socket:
    """A TCP socket bound (not listening) to (`host`, `port`) the way ajet's servers bind: IPv4, SO_REUSEADDR
    (a port in TIME_WAIT is free; one that a process listens on is not).

    Args:
        host: an IPv4 address or name. port: 0..65535 (0: a free one). hint: how to choose another port, e.g.
            "--port N (serve.port)"; it ends the error's message.

    Raises:
        PortInUseError: the port is taken. OSError: any other bind failure (e.g. an address of no interface).
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise PortInUseError(_message(host, port, hint)) from None
        raise
    return sock


def check_port(host: str, port: int, hint: str) -> None:
    """Raise `PortInUseError` when (`host`, `port`) cannot be bound because another process holds it; port 0
    (a free one) always passes. Other bind failures are left to the server's own bind."""
    if port == 0:
        return
    try:
        bind_port(host, port, hint).close()
    except OSError:   # not a taken port (PortInUseError is no OSError): the server's bind reports it
        pass


@contextmanager
def port_in_use_as_error(host: str, port: int, hint: str) -> Iterator[None]:
    """Turn an EADDRINUSE `OSError` raised inside the block into `PortInUseError`, when (`host`, `port`) is
    indeed held now (a process that took the port between `check_port` and the server's own bind); any other
    error passes unchanged."""
    try:
        yield
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE or port == 0:
            raise
        check_port(host, port, hint)   # PortInUseError when another process holds the port now
        raise


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port of `host` that no process listens on right now (the OS picks it; another process could take it
    before the server binds it, in which case that server fails to start and says so)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
