"""No cross-site requests: the gateway (its real app on 127.0.0.1, secret set) refuses a POST whose body is not
declared JSON (415, what a page on another origin can send without a CORS preflight) before the secret or the
route is looked at, refuses a foreign Host (403, DNS rebinding), and never answers CORS; `ajet serve`'s app is
wrapped by the same guard."""

from __future__ import annotations

import httpx

from ajet.gateway.app import GatewayApp
from ajet.gateway.sessions import SessionBook
from ajet.gateway.source import attach
from ajet.gateway.store import GatewayStore
from ajet.guard import Guard, allowed_hosts
from ajet.llm_call import SamplingParams
from ajet.proxy.server import ProxyServer
from tests.local_servers import serving
from tests.scripted_engine import ScriptedEngine

SECRET = "cross-site-secret-0123456789"


def test_cross_origin_text_plain_post_and_foreign_host_are_refused(tokenizer, tmp_path):
    engine = ScriptedEngine(tokenizer, ["The answer is 7."])
    proxy = ProxyServer(engine, tokenizer, SamplingParams(temperature=1.0, max_tokens=16))
    store = GatewayStore(tmp_path / "gateway.sqlite")
    book = SessionBook(proxy, store, idle_s=60, deadline_s=600, on_no_feedback="drop")
    attach(proxy, book, lambda p, b: GatewayApp(p, b, SECRET, lambda: 0, allowed_hosts=allowed_hosts("127.0.0.1")))
    auth = {"Authorization": f"Bearer {SECRET}"}
    chat = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
    origin = {"Origin": "https://attacker.example"}
    with serving(proxy.app) as url:
        # what a form or fetch() from another origin sends without a preflight: text/plain, form-encoded, multipart
        for kind in ("text/plain;charset=UTF-8", "application/x-www-form-urlencoded", "multipart/form-data; b=x"):
            for path in ("/v1/chat/completions", "/v1/feedback", "/v1/admin/rollback"):
                r = httpx.post(url + path, content=chat, headers={**origin, "Content-Type": kind}, timeout=30)
                assert r.status_code == 415, (kind, path, r.status_code, r.text)
                assert "application/json" in r.json()["error"]["message"]
                assert not any(h.lower().startswith("access-control-") for h in r.headers), r.headers
        # the same even with the secret (a page never has it, but the media type alone is refused)
        r = httpx.post(url + "/v1/chat/completions", content=chat, headers={**auth, "Content-Type": "text/plain"})
        assert r.status_code == 415
        # a body without any Content-Type is refused too
        r = httpx.post(url + "/v1/chat/completions", content=chat, headers={**auth, "Content-Type": ""})
        assert r.status_code == 415
        # DNS rebinding: the page's own name in Host is a 403, whatever it sends
        r = httpx.post(url + "/v1/chat/completions", content=chat, timeout=30,
                       headers={**auth, "Content-Type": "application/json", "Host": "attacker.example"})
        assert r.status_code == 403 and "Host header" in r.json()["error"]["message"], r.text
        assert httpx.get(url + "/healthz", headers={"Host": "attacker.example:80"}).status_code == 403
        # a CORS preflight gets no Access-Control-Allow-* answer
        r = httpx.options(url + "/v1/chat/completions", headers={**origin, "Access-Control-Request-Method": "POST"})
        assert not any(h.lower().startswith("access-control-") for h in r.headers), r.headers
        # the real client, with JSON and the secret on localhost, is answered
        r = httpx.post(url + "/v1/chat/completions", content=chat, timeout=60,
                       headers={**auth, "Content-Type": "application/json", "Host": "localhost"})
        assert r.status_code == 200, r.text
    store.close()


def test_serve_app_guard_refuses_the_same(tmp_path):
    from ajet.serve.api import build_api

    class _NoQueue:   # the guard answers before any route runs
        pass

    app = Guard(build_api(_NoQueue(), SECRET), allowed_hosts("127.0.0.1"), "call the address `ajet serve` printed")
    with serving(app) as url:
        r = httpx.post(url + "/ajet/v1/episodes", content=b"{}", timeout=30,
                       headers={"Authorization": f"Bearer {SECRET}", "Content-Type": "text/plain"})
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
        r = httpx.get(url + "/ajet/v1/status", headers={"Authorization": f"Bearer {SECRET}", "Host": "evil.example"})
        assert r.status_code == 403 and "ajet serve" in r.json()["error"]["message"]
