"""`ajet gateway` operations: per-client rate limits (429 with Retry-After; one bucket per source address), `/metrics` in the Prometheus text
format, and `gateway.retention_days` (old trained or dropped sessions deleted from gateway.sqlite).

The gateway app is served by uvicorn on 127.0.0.1 over a scripted engine; the rate limiter's and the session
book's clocks are advanced by the test (no sleeps)."""

from __future__ import annotations

import re
import sqlite3

import httpx
import openai
import pytest

from ajet.gateway.app import GatewayApp
from ajet.gateway.ops import RateLimiter
from ajet.gateway.sessions import SessionBook
from ajet.gateway.source import attach
from ajet.gateway.store import GatewayStore
from ajet.llm_call import SamplingParams
from ajet.proxy.server import ProxyServer
from tests.local_servers import serving
from tests.scripted_engine import ScriptedEngine

SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)$')   # the text format's sample line


def parse(text: str) -> dict[tuple[str, frozenset], float]:
    """(metric name, labels) -> value, from the Prometheus text exposition format (comments skipped)."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = SAMPLE.match(line)
        assert m, f"not a sample line: {line!r}"
        labels = frozenset(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(3) or ""))
        out[(m.group(1), labels)] = float(m.group(4))
    return out


class Clock:
    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def ops(tokenizer, tmp_path, request):
    engine = ScriptedEngine(tokenizer, ["The answer is 7."])
    proxy = ProxyServer(engine, tokenizer, SamplingParams(temperature=1.0, max_tokens=32))
    store = GatewayStore(tmp_path / "gateway.sqlite")
    clock, mono = Clock(1000.0), Clock(50.0)
    book = SessionBook(proxy, store, idle_s=60, deadline_s=600, on_no_feedback="drop", clock=clock,
                       retention_s=7 * 86400)
    rps, burst = getattr(request, "param", (0.5, 2))              # default: 2 at once, then one every 2 s
    limiter = RateLimiter(rps=rps, burst=burst, clock=mono)
    attach(proxy, book, lambda p, b: GatewayApp(p, b, None, lambda: engine.policy_version, limiter))
    with serving(proxy.app) as url:
        yield url, book, clock, mono, engine, tmp_path
    store.close()


def _chat(url: str, key: str, text: str = "Hi", source: str = "127.0.0.1", **headers: str) -> httpx.Response:
    with httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=30) as c:
        return c.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}", **headers},
                      json={"model": "ajet-policy", "messages": [{"role": "user", "content": text}]})


UNLIMITED = pytest.mark.parametrize("ops", [(1000.0, 1000)], indirect=True)


def test_rate_limit_per_client_429_with_retry_after(ops):
    url, _, _, mono, _, _ = ops
    assert [_chat(url, "key-a").status_code for _ in range(2)] == [200, 200]      # the burst
    r = _chat(url, "key-a")
    assert r.status_code == 429 and r.headers["retry-after"] == "2", (r.status_code, r.headers)
    assert r.json()["error"]["code"] == "rate_limit_exceeded"
    assert _chat(url, "key-b").status_code == 429                  # another key from the same client: the same bucket
    assert _chat(url, "key-c", **{"X-Ajet-Session": "new"}).status_code == 429   # a new session: the same bucket
    assert _chat(url, "key-a", source="127.0.0.2").status_code == 200    # another client (address) has its own
    # the SDK sees a RateLimitError in its own shape
    with pytest.raises(openai.RateLimitError):
        openai.OpenAI(base_url=url + "/v1", api_key="key-a", max_retries=0).chat.completions.create(
            model="ajet-policy", messages=[{"role": "user", "content": "x"}])
    # feedback is limited too, in the same error shape
    fb = httpx.post(f"{url}/v1/feedback", headers={"x-api-key": "key-a"}, json={"session_id": "x", "reward": 1})
    assert fb.status_code == 429 and "retry-after" in fb.headers
    mono.now += 2.0                                                               # one token back
    assert _chat(url, "key-a").status_code == 200
    assert _chat(url, "key-a").status_code == 429
    assert httpx.get(url + "/healthz").status_code == 200 and httpx.get(url + "/metrics").status_code == 200


@UNLIMITED
def test_metrics_count_requests_latency_feedback_and_sessions(ops):
    url, book, _, _, engine, _ = ops
    before = parse(httpx.get(url + "/metrics").text)
    assert before.get(("ajet_gateway_requests_total",
                       frozenset({("route", "/v1/chat/completions"), ("status", "200")})), 0) == 0
    r = _chat(url, "k1", "What is 3 plus 4?")
    assert r.status_code == 200
    sid = r.headers["x-ajet-session"]
    assert httpx.post(f"{url}/v1/feedback", headers={"x-api-key": "k2"},
                      json={"session_id": sid, "reward": 1.0}).status_code == 200
    assert httpx.post(f"{url}/v1/feedback", headers={"x-api-key": "k3"},
                      json={"session_id": "nope", "reward": 1.0}).status_code == 404
    engine.policy_version = 3                                                      # three swaps served
    resp = httpx.get(url + "/metrics")
    assert resp.headers["content-type"].startswith("text/plain; version=0.0.4")
    m = parse(resp.text)
    chat = frozenset({("route", "/v1/chat/completions")})
    assert m[("ajet_gateway_requests_total", chat | {("status", "200")})] == 1
    assert m[("ajet_gateway_requests_total", frozenset({("route", "/v1/feedback"), ("status", "200")}))] == 1
    assert m[("ajet_gateway_requests_total", frozenset({("route", "/v1/feedback"), ("status", "404")}))] == 1
    assert m[("ajet_gateway_request_duration_seconds_count", chat)] == 1
    assert m[("ajet_gateway_request_duration_seconds_bucket", chat | {("le", "+Inf")})] == 1
    assert m[("ajet_gateway_request_duration_seconds_sum", chat)] > 0
    assert m[("ajet_gateway_feedback_total", frozenset({("source", "client")}))] == 1
    assert m[("ajet_gateway_swaps_total", frozenset())] == 3
    assert m[("ajet_gateway_sessions", frozenset({("state", "open_rated")}))] == 1


@UNLIMITED
def test_retention_deletes_old_trained_and_dropped_sessions(ops):
    url, book, clock, _, _, tmp_path = ops
    sids = [_chat(url, f"k{i}", f"Conversation {i}.").headers["x-ajet-session"] for i in range(3)]
    trained, dropped, kept = sids
    assert httpx.post(f"{url}/v1/feedback", headers={"x-api-key": "f"},
                      json={"session_id": trained, "reward": 1.0}).status_code == 200
    clock.now += 61
    book.tick()                                       # all three closed (idle)
    with book.changed:
        assert [s.session_id for s in book.take(1)] == [trained]
    clock.now += 601
    book.tick()                                       # no feedback by the deadline: dropped
    assert book.get(dropped)["state"] == "dropped" and book.get(kept)["state"] == "dropped"
    db = sqlite3.connect(tmp_path / "gateway.sqlite")
    count = lambda table, sid: db.execute(f"SELECT COUNT(*) FROM {table} WHERE session_id = ?", (sid,)).fetchone()[0]  # noqa: E731
    assert count("sessions", trained) == count("calls", trained) == count("responses", trained) == 1
    clock.now += 7 * 86400 - 1000                     # within retention of all three closes: nothing deleted
    book.tick()
    assert count("sessions", trained) == 1 and book.get(trained)["state"] == "trained"
    # a session still waiting for training is never deleted, however old
    rated = _chat(url, "k9", "A late conversation.").headers["x-ajet-session"]
    httpx.post(f"{url}/v1/feedback", headers={"x-api-key": "g"}, json={"session_id": rated, "reward": 0.5})
    clock.now += 2000                                 # the first three closed more than 7 days ago
    book.tick()
    for sid in (trained, dropped, kept):
        assert all(count(t, sid) == 0 for t in ("sessions", "calls", "responses", "closes", "feedback", "drops")), sid
        assert httpx.get(f"{url}/v1/sessions/{sid}", headers={"x-api-key": sid}).status_code == 404
    clock.now += 10 * 86400
    book.tick()
    assert count("sessions", rated) == 1 and book.get(rated)["state"] == "rated"
    db.close()
