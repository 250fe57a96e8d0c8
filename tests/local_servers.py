"""Real servers on 127.0.0.1 for the tests: a free port, an ASGI app served by uvicorn in a thread, and the URL an
`ajet` server subprocess announces."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import threading
import time
from typing import Iterator


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (for a server the test starts, or one it
    expects to find absent)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(app, start_timeout_s: float = 20.0) -> Iterator[str]:
    """Serve the ASGI `app` with uvicorn on 127.0.0.1 (a port of its own) in a daemon thread; yields the base URL
    "http://127.0.0.1:PORT" once it accepts connections, and stops it on exit.

    Raises:
        AssertionError: the server did not start within `start_timeout_s` seconds.
    """
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, f"uvicorn did not start within {start_timeout_s:g}s"
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def announced_url(proc: subprocess.Popen, marker: str, what: str, timeout_s: float) -> tuple[list[str], str]:
    """Read `proc`'s stdout (text mode, stderr merged) in a daemon thread until it ends, and wait for the first line
    holding `marker` followed by "http://" (e.g. `ajet gateway`'s "proxy on http://127.0.0.1:PORT").

    Returns (the list the thread appends each line to, live, for as long as `proc` writes; the URL after `marker`).

    Raises:
        AssertionError: no such line within `timeout_s` seconds, or `proc` ended first; the message is "`what` did
            not start:" and the output so far.
    """
    lines: list[str] = []
    url: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if marker + "http://" in line and not url:
                url.append(line.split(marker)[1].split()[0])
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    assert ready.wait(timeout_s) and url, f"{what} did not start:\n" + "".join(lines)
    return lines, url[0]
