"""Slow and abandoned requests on `ajet gateway`'s front: they cannot starve the model, and leave no rows.

The gateway app is served by the proxy's own uvicorn server (`ProxyServer.start`, the protocol the gateway
sets: ajet/gateway/timeouts.py; httptools', and h11's where httptools is missing) on 127.0.0.1 over a scripted engine, with `read_timeout_s` 3, 2 calls decoded
together and 2 more allowed to wait. Raw sockets play the slow clients (bounded in count and time):

- 96 uploads that send their headers and 10 of 1,000 body bytes, then stall, plus connections that stall in
  their headers or send nothing: while they stall, every normal call through httpx is answered 200 (a stalled
  upload holds no place in the queue), and the server closes every one of them (the socket reads end-of-file),
  each counted in /metrics.
- requests that never reach the engine (a prompt longer than `max_model_len`, which the proxy refuses after the
  session is resolved; a client that leaves while its call waits behind an update's hold) write no session row,
  and their sessions are forgotten when they close: the store holds the one session whose call was recorded.
"""

from __future__ import annotations

import json
import socket
import sqlite3
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from ajet.gateway.app import GatewayApp
from ajet.gateway.gate import LiveHold
from ajet.gateway.sessions import SessionBook
from ajet.gateway.source import attach
from ajet.gateway.store import GatewayStore
from ajet.gateway.timeouts import ReadTimeouts, _h11_protocol
from ajet.llm_call import SamplingParams
from ajet.proxy.server import ProxyServer
from tests.scripted_engine import ScriptedEngine
from tests.test_gateway_backpressure import calls_held

STALLED = 96
READ_TIMEOUT_S = 3.0


@pytest.fixture(params=["httptools", "h11"])
def gateway(request, tokenizer, tmp_path, monkeypatch):
    if request.param == "h11":                     # the protocol used where httptools is not installed
        monkeypatch.setattr(ReadTimeouts, "protocol", lambda self: _h11_protocol(self))
    engine = ScriptedEngine(tokenizer, ["The answer is 7."])
    proxy = ProxyServer(engine, tokenizer, SamplingParams(temperature=1.0, max_tokens=16), max_model_len=64)
    store = GatewayStore(tmp_path / "gateway.sqlite")
    now = [1000.0]
    book = SessionBook(proxy, store, idle_s=600, deadline_s=600, on_no_feedback="drop", clock=lambda: now[0])
    gate = SimpleNamespace(hold=LiveHold(), counts={})
    apps = []
    attach(proxy, book, lambda p, b: apps.append(GatewayApp(p, b, None, lambda: 0, gate=gate, max_queued=2,
                                                            decoding=2, read_timeout_s=READ_TIMEOUT_S)) or apps[0])
    proxy.start()
    try:
        yield SimpleNamespace(url=proxy.url, port=proxy.port, app=apps[0], engine=engine, hold=gate.hold,
                              book=book, store=store, now=now, db=tmp_path / "gateway.sqlite")
    finally:
        proxy.stop()
        store.close()


def _chat(url: str, text: str, timeout: float = 60) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", timeout=timeout,
                      json={"model": "ajet-policy", "messages": [{"role": "user", "content": text}]})


def _head(port: int, length: int) -> bytes:
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def _closed_by_server(sock: socket.socket, deadline: float) -> bool:
    """Whether the server has closed `sock` by the `time.monotonic()` `deadline` (it reads end-of-file or a
    reset)."""
    sock.settimeout(max(0.1, deadline - time.monotonic()))
    try:
        while True:
            data = sock.recv(4096)
            if not data:
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_stalled_uploads_take_no_place_and_are_closed(gateway):
    g = gateway
    socks = []
    try:
        for _ in range(STALLED):                   # headers and 10 of 1,000 body bytes, then nothing
            s = socket.create_connection(("127.0.0.1", g.port), timeout=30)
            s.sendall(_head(g.port, 1000) + b'{"model":"')
            socks.append(s)
        half = socket.create_connection(("127.0.0.1", g.port), timeout=30)
        half.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le")   # stalls in its headers
        silent = socket.create_connection(("127.0.0.1", g.port), timeout=30)                   # sends nothing
        socks += [half, silent]
        # every normal call is answered while they stall (they hold no place among the 2 + 2)
        answers = [_chat(g.url, f"Question {i}?") for i in range(6)]
        assert [a.status_code for a in answers] == [200] * 6, [a.text[:200] for a in answers]
        assert g.app.admitted == 0
        deadline = time.monotonic() + 60           # for all of them together
        closed = [_closed_by_server(s, deadline) for s in socks]
        assert all(closed), f"{closed.count(False)} of {len(socks)} stalled connections still open"
    finally:
        for s in socks:
            s.close()
    assert g.app.read_timeouts.timed_out == len(socks)
    metrics = httpx.get(g.url + "/metrics", timeout=30).text
    assert f"ajet_gateway_read_timeouts_total {len(socks)}" in metrics.splitlines(), metrics[-2000:]
    assert len(g.engine.prompts) == 6                  # only the normal calls reached the engine


def test_a_complete_request_is_not_cut_by_a_slow_answer(gateway, monkeypatch):
    """The timeout is on reading the request only: a call whose answer takes longer than it is answered."""
    g = gateway
    original = g.engine.generate

    async def slow(prompt_ids, params, on_tokens=None):
        import asyncio

        await asyncio.sleep(2 * READ_TIMEOUT_S)    # the answer is late, the request arrived at once
        return await original(prompt_ids, params, on_tokens)
    monkeypatch.setattr(g.engine, "generate", slow)
    assert _chat(g.url, "Take your time?").status_code == 200


def _rows(db) -> dict[str, int]:
    with sqlite3.connect(db) as c:
        return {t: c.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in ("sessions", "closes", "calls")}


def test_requests_that_never_reach_the_engine_leave_no_session_row(gateway):
    g = gateway
    too_long = " ".join(["word"] * 200)            # longer than max_model_len 64: refused after the session is found
    refused = [_chat(g.url, f"{i} {too_long}") for i in range(5)]
    assert [r.status_code for r in refused] == [400] * 5, [r.text[:200] for r in refused]

    with calls_held(g.hold, take_s=60, hold_s=120):  # what an update without serving-while-training does
        body = json.dumps({"model": "ajet-policy", "messages": [{"role": "user", "content": "Waiting?"}]}).encode()
        for _ in range(3):                             # each leaves while its call waits behind the hold
            with socket.create_connection(("127.0.0.1", g.port), timeout=30) as s:
                s.sendall(_head(g.port, len(body)) + body)
                deadline = time.monotonic() + 60
                while g.app.admitted == 0:
                    assert time.monotonic() < deadline, "the call never waited"
                    time.sleep(0.01)
            deadline = time.monotonic() + 60
            while g.app.admitted:
                assert time.monotonic() < deadline, "the gone client's call never left"
                time.sleep(0.01)

    ok = _chat(g.url, "What is 3 plus 4?")
    assert ok.status_code == 200, ok.text
    assert _rows(g.db)["sessions"] == 1                # only the session with a recorded answer
    g.now[0] += 3600                                   # every session idle: closed
    g.book.tick()
    assert _rows(g.db) == {"sessions": 1, "closes": 1, "calls": 1}, _rows(g.db)
    assert g.book.states() == {**{k: 0 for k in g.book.states()}, "closed": 1}, g.book.states()
    assert len(g.engine.prompts) == 1
