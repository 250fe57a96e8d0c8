"""`ajet gateway`'s admission queue (`gateway.max_queued`): beyond the calls the engine generates together
(`decoding`) and the `max_queued` waiting, a model call is answered at once with a 503 and `Retry-After`, in the
error shape of its dialect (OpenAI, Anthropic, Gemini); once calls finish, calls are admitted again. A client
that leaves while its call waits (an update holds calls) gives its place back.

The gateway app is served by uvicorn on 127.0.0.1 over an engine that holds every call until the test releases
it (no timing: the test waits for the gateway's own count of admitted calls)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from types import SimpleNamespace
from typing import Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from ajet.gateway.app import GatewayApp
from ajet.gateway.gate import LiveHold
from ajet.gateway.sessions import SessionBook
from ajet.gateway.source import attach
from ajet.gateway.store import GatewayStore
from ajet.llm_call import SamplingParams
from ajet.proxy.server import ProxyServer
from tests.local_servers import serving
from tests.scripted_engine import ScriptedEngine

DECODING, QUEUED = 2, 1


class HeldEngine(ScriptedEngine):
    """Answers each call once `release` is set; `started` counts the calls it received."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer, ["The answer is 7."])
        self.release = threading.Event()
        self.started = 0

    async def generate(self, prompt_ids, params, on_tokens=None):
        self.started += 1
        while not self.release.is_set():
            await asyncio.sleep(0.01)
        return await super().generate(prompt_ids, params, on_tokens)


@pytest.fixture
def gateway(tokenizer, tmp_path):
    engine = HeldEngine(tokenizer)
    proxy = ProxyServer(engine, tokenizer, SamplingParams(temperature=1.0, max_tokens=32))
    store = GatewayStore(tmp_path / "gateway.sqlite")
    book = SessionBook(proxy, store, idle_s=600, deadline_s=600, on_no_feedback="drop")
    gate = SimpleNamespace(hold=LiveHold())       # only the hold of the gate: calls wait while it is held
    apps = []
    attach(proxy, book, lambda p, b: apps.append(GatewayApp(p, b, None, lambda: 0, gate=gate, max_queued=QUEUED,
                                                            decoding=DECODING)) or apps[0])
    try:
        with serving(proxy.app) as url:
            yield url, apps[0], engine, gate.hold
    finally:
        engine.release.set()
        store.close()


def _until(condition, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"still waiting for {what}"
        time.sleep(0.01)


def _chat(url: str, text: str) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", timeout=120,
                      json={"model": "ajet-policy", "messages": [{"role": "user", "content": text}]})


@contextlib.contextmanager
def calls_held(hold, take_s: float, hold_s: float) -> Iterator[None]:
    """`hold` (a LiveHold) held by another thread for the block, as an update holds it: no call is admitted meanwhile.

    Waits up to `take_s` seconds for the hold to be taken (AssertionError if not); when the block ends (or after
    `hold_s` seconds at the latest) lets it go and waits up to `take_s` seconds for the holder to finish."""
    held, release = threading.Event(), threading.Event()

    def hold_calls():
        with hold.held():
            held.set()
            release.wait(hold_s)
    holder = threading.Thread(target=hold_calls, daemon=True)
    holder.start()
    assert held.wait(take_s)
    try:
        yield
    finally:
        release.set()
        holder.join(take_s)


def test_calls_beyond_the_queue_get_503_with_retry_after_in_each_dialect(gateway):
    url, app, engine, _ = gateway
    answers: list[httpx.Response] = []
    callers = [threading.Thread(target=lambda i=i: answers.append(_chat(url, f"Question {i}")), daemon=True)
               for i in range(DECODING + QUEUED)]
    for t in callers:
        t.start()
    _until(lambda: app.admitted == DECODING + QUEUED and engine.started == DECODING + QUEUED, "the calls held")

    r = httpx.post(url + "/v1/chat/completions", timeout=30,
                   json={"model": "ajet-policy", "messages": [{"role": "user", "content": "One more?"}]})
    assert r.status_code == 503 and r.headers["retry-after"] == "1", (r.status_code, r.headers, r.text[:300])
    error = r.json()["error"]
    assert (error["type"], error["code"]) == ("server_error", "overloaded"), error
    assert "gateway.max_queued" in error["message"]

    r = httpx.post(url + "/v1/messages", timeout=30, json={"model": "ajet-policy", "max_tokens": 8,
                                                           "messages": [{"role": "user", "content": "One more?"}]})
    assert r.status_code == 503 and r.headers["retry-after"] == "1", (r.status_code, r.text[:300])
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "overloaded_error", body

    r = httpx.post(url + "/v1beta/models/ajet-policy:generateContent", timeout=30,
                   json={"contents": [{"role": "user", "parts": [{"text": "One more?"}]}]})
    assert r.status_code == 503 and r.headers["retry-after"] == "1", (r.status_code, r.text[:300])
    error = r.json()["error"]
    assert (error["code"], error["status"]) == (503, "UNAVAILABLE"), error

    assert engine.started == DECODING + QUEUED          # the refused calls never reached the engine
    engine.release.set()
    for t in callers:
        t.join(120)
    assert sorted(a.status_code for a in answers) == [200] * (DECODING + QUEUED), [a.text[:200] for a in answers]
    _until(lambda: app.admitted == 0, "the admitted calls to leave")
    assert _chat(url, "And now?").status_code == 200    # admitted again


def test_a_client_gone_while_its_call_waits_gives_its_place_back(gateway):
    url, app, engine, hold = gateway
    engine.release.set()
    with calls_held(hold, take_s=120, hold_s=300):     # what an update does: no call is admitted meanwhile
        body = json.dumps({"model": "ajet-policy", "messages": [{"role": "user", "content": "Waiting?"}]}).encode()
        u = urlsplit(url)
        with socket.create_connection((u.hostname, u.port), timeout=60) as sock:
            sock.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nHost: {u.netloc}\r\n"
                          f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body)
            _until(lambda: app.admitted == 1, "the call to wait")
        _until(lambda: app.admitted == 0, "the gone client's place to be given back")   # while calls are still held
    assert _chat(url, "After the update?").status_code == 200
    assert engine.started == 1                          # the gone client's call never reached the engine
