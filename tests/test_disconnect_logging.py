"""A client that closes its connection mid-upload (an agent killed or timed out while sending a request) is
one warning line per disconnect, never an ERROR with a traceback: on the real proxy (every model route) and
on the real episode API of `ajet serve`, each on 127.0.0.1, driven by a raw socket that sends the headers,
a few bytes of the body, and closes."""

from __future__ import annotations

import logging
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest

from ajet.llm_call import SamplingParams
from ajet.proxy.server import ProxyServer
from ajet.rollout.episode_queue import EpisodeQueue
from ajet.serve.api import build_api, compose
from ajet.task import Task
from ajet.task_sampler import MultiTaskSampler
from tests.scripted_engine import ScriptedEngine

SECRET = "test-secret-0123456789abcdef"
GONE = "closed the connection"


def _upload_and_vanish(url: str, extra_headers: str = "", chunked: bool = False) -> None:
    """POST to `url` announcing a 1000-byte body (or a chunked one), send 10 bytes of it, then close the socket."""
    u = urlsplit(url)
    framing = "Transfer-Encoding: chunked\r\n" if chunked else "Content-Length: 1000\r\n"
    head = (f"POST {u.path} HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json\r\n{framing}"
            f"{extra_headers}\r\n")
    with socket.create_connection((u.hostname, u.port), timeout=30) as sock:
        sock.sendall(head.encode() + (b"3e8\r\n" if chunked else b"") + b'{"model": ')


def _wait_for_lines(caplog, n: int, timeout_s: float = 120.0) -> list[logging.LogRecord]:
    """The records that mention a client gone, once there are `n` of them or `n` records about the requests
    that went (errors included), or the deadline passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        gone = [r for r in caplog.records if GONE in r.getMessage()]
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        if len(gone) >= n or len(gone) + len(errors) >= n or time.monotonic() > deadline:
            return gone
        time.sleep(0.05)


def _assert_one_quiet_line_each(caplog, capfd, n: int, where: str) -> None:
    gone = _wait_for_lines(caplog, n)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not errors, [f"{r.levelname} {r.getMessage()}" for r in errors][:3]
    assert len(gone) == n, [r.getMessage() for r in gone][:3]
    assert all(r.levelno == logging.WARNING and r.getMessage().startswith(where) for r in gone)
    assert all("\n" not in r.getMessage() for r in gone)
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err and "ClientDisconnect" not in out + err, err[-2000:]
    assert "ERROR" not in err and "without starting response" not in err, err[-2000:]   # uvicorn's own log


@pytest.fixture
def proxy(tokenizer):
    server = ProxyServer(ScriptedEngine(tokenizer, ["ok"]), tokenizer, SamplingParams(max_tokens=8)).start()
    try:
        yield server
    finally:
        server.stop()


def test_a_client_gone_mid_upload_is_one_warning_line_at_the_proxy(proxy, caplog, capfd):
    caplog.set_level(logging.INFO)
    ep = proxy.open_episode("ep")
    gemini = ep.base_url.removesuffix("/v1") + "/v1beta/models/m:generateContent"
    routes = [ep.base_url + "/chat/completions", ep.base_url + "/responses", ep.base_url + "/messages",
              ep.base_url + "/messages/count_tokens", gemini]
    n = 0
    for _ in range(6):
        for url in routes:
            _upload_and_vanish(url)
            n += 1
        _upload_and_vanish(routes[0], chunked=True)
        n += 1
    _assert_one_quiet_line_each(caplog, capfd, n, "proxy: POST ")
    assert "after 10 of the 1000 body bytes" in _wait_for_lines(caplog, n)[0].getMessage()
    # the proxy still answers, on this episode, with nothing recorded for the vanished requests
    r = httpx.post(routes[0], json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}, timeout=60)
    assert r.status_code == 200, r.text[:300]
    assert len(proxy.close_episode(ep)) == 1
    assert len(_wait_for_lines(caplog, n, timeout_s=0)) == n


def test_a_client_gone_mid_upload_is_one_warning_line_at_the_episode_api(tokenizer, caplog, capfd):
    caplog.set_level(logging.INFO)
    proxy = ProxyServer(ScriptedEngine(tokenizer, ["7"]), tokenizer, SamplingParams(max_tokens=8))
    tasks = [Task(f"t{i}", f"What is {i} + 1?", str(i + 1)) for i in range(4)]
    queue = EpisodeQueue(MultiTaskSampler({"train": tasks}), num_repeat=2, tasks_per_step=2, total_steps=2,
                         first_step=1, attempt=0, record=lambda step, ep: None, idle_timeout_s=300.0)
    queue.bind(proxy)
    proxy.app = compose(proxy.app, build_api(queue, SECRET), queue.activity)
    proxy.start()
    try:
        auth = f"Authorization: Bearer {SECRET}\r\n"
        for _ in range(20):
            _upload_and_vanish(proxy.url + "/ajet/v1/episodes", auth)
        _upload_and_vanish(proxy.url + "/ajet/v1/episodes", auth, chunked=True)
        _assert_one_quiet_line_each(caplog, capfd, 21, "episode API: POST /ajet/v1/episodes")
        # nothing was begun by them, and the API still answers
        with httpx.Client(base_url=proxy.url, headers={"Authorization": f"Bearer {SECRET}"}, timeout=30) as http:
            assert http.get("/ajet/v1/status").status_code == 200
            r = http.post("/ajet/v1/episodes", json={"client_id": "c"})
            assert r.status_code == 200, r.text[:300]
        assert len(_wait_for_lines(caplog, 21, timeout_s=0)) == 21
    finally:
        proxy.stop()


def test_closing_the_proxy_bridge_under_open_connections_prints_no_traceback(caplog):
    """`ProxyBridge` (the sandbox's unix socket -> the proxy's TCP port) closed while a coding agent's
    connections are still open: each is closed, and no CancelledError reaches asyncio's exception handler."""
    import asyncio
    import os

    from ajet.tools.workdir_sandbox import SOCKET_NAME, ProxyBridge

    caplog.set_level(logging.DEBUG)
    reported: list[dict] = []

    async def echo(reader, writer):
        while data := await reader.read(1024):
            writer.write(data)
            await writer.drain()
        writer.close()

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda _loop, context: reported.append(context))
        upstream = await asyncio.start_server(echo, "127.0.0.1", 0)
        port = upstream.sockets[0].getsockname()[1]
        clients = []
        async with ProxyBridge("127.0.0.1", port) as folder:
            for i in range(5):
                reader, writer = await asyncio.open_unix_connection(os.path.join(folder, SOCKET_NAME))
                writer.write(b"ping %d" % i)
                assert await asyncio.wait_for(reader.readexactly(6), 30) == b"ping %d" % i   # forwarded both ways
                clients.append((reader, writer))
        # the bridge closed every connection it held
        for reader, writer in clients:
            assert await asyncio.wait_for(reader.read(), 30) == b""
            writer.close()
        upstream.close()
        await upstream.wait_closed()
        for _ in range(20):   # let any done-callback of the bridge's tasks run
            await asyncio.sleep(0)

    asyncio.run(main())
    assert not reported, [c.get("message") for c in reported]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
