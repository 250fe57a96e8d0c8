"""The gateway's read timeout (`gateway.read_timeout_s`): a request's headers and body must arrive within the
timeout, else its connection is closed, so that clients that send slowly (or stall mid-upload) hold no more than
a socket for that long; they never hold a place in the model-call queue, which a call takes only once its body
is complete (ajet/gateway/app.py).

The clock starts at the request's first byte (for a connection's first request: when the connection is made, so
a connection that sends nothing is closed too) and stops when the request's last body byte is parsed; answering
(generation, a stream) is not timed. Between two requests of a kept-alive connection uvicorn's own keep-alive
timeout applies. It is a uvicorn HTTP protocol class (`ProxyServer.http_protocol`), because the headers are read
before any ASGI app runs: httptools' when installed (`uvicorn[standard]`), else h11's.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

log = logging.getLogger(__name__)


class ReadTimeouts:
    """Counts the connections closed for a late request (`timed_out`, read by /metrics) and makes the protocol.

    Args:
        timeout_s: seconds a request's headers and body may take (> 0).
    """

    def __init__(self, timeout_s: float):
        if not timeout_s > 0:
            raise ValueError(f"read timeout must be > 0 seconds, got {timeout_s}")
        self.timeout_s = timeout_s
        self.timed_out = 0
        self._lock = threading.Lock()

    def _count(self) -> None:
        with self._lock:
            self.timed_out += 1

    def protocol(self) -> type[asyncio.Protocol]:
        """A uvicorn HTTP protocol class enforcing the timeout (httptools' if importable, else h11's)."""
        try:
            from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
        except ImportError:
            return _h11_protocol(self)
        return _httptools_protocol(self, HttpToolsProtocol)


class _Deadline:
    """The timer of one connection: `arm` (no-op when armed), `disarm`; on expiry the transport is closed."""

    def __init__(self, owner: ReadTimeouts, loop: asyncio.AbstractEventLoop, transport: asyncio.Transport):
        self.owner, self.loop, self.transport = owner, loop, transport
        self.handle: asyncio.TimerHandle | None = None

    def arm(self) -> None:
        if self.handle is None:
            self.handle = self.loop.call_later(self.owner.timeout_s, self._expired)

    def disarm(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None

    def _expired(self) -> None:
        self.handle = None
        if not self.transport.is_closing():
            self.owner._count()
            log.info("gateway: closed a connection whose request did not arrive within %gs (gateway.read_timeout_s)",
                     self.owner.timeout_s)
            self.transport.close()        # the app, if it was reading the body, gets http.disconnect


def _httptools_protocol(owner: ReadTimeouts, base: Any) -> type[asyncio.Protocol]:
    class ReadDeadlineProtocol(base):
        """uvicorn's httptools protocol with `gateway.read_timeout_s` (ajet/gateway/timeouts.py)."""

        def connection_made(self, transport):
            super().connection_made(transport)
            self._ajet_deadline = _Deadline(owner, self.loop, transport)
            self._ajet_deadline.arm()

        def on_message_begin(self):
            super().on_message_begin()
            self._ajet_deadline.arm()

        def on_message_complete(self):
            self._ajet_deadline.disarm()
            super().on_message_complete()

        def connection_lost(self, exc):
            self._ajet_deadline.disarm()
            super().connection_lost(exc)

    return ReadDeadlineProtocol


def _h11_protocol(owner: ReadTimeouts) -> type[asyncio.Protocol]:
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class ReadDeadlineProtocol(H11Protocol):
        """uvicorn's h11 protocol with `gateway.read_timeout_s` (ajet/gateway/timeouts.py)."""

        def connection_made(self, transport):
            super().connection_made(transport)
            self._ajet_deadline = _Deadline(owner, self.loop, transport)
            self._ajet_deadline.arm()

        def data_received(self, data):
            super().data_received(data)
            if self.conn.their_state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED, h11.SWITCHED_PROTOCOL, h11.ERROR):
                self._ajet_deadline.disarm()      # the request is read (or the connection is ending)
            else:
                self._ajet_deadline.arm()         # headers or body still on their way

        def connection_lost(self, exc):
            self._ajet_deadline.disarm()
            super().connection_lost(exc)

    return ReadDeadlineProtocol
