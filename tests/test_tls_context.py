"""The OpenAI clients ajet builds per episode share one TLS context (`ajet.tls`): the CA bundle is loaded once
per process, not once per episode, and the shared context still verifies certificates and host names."""

from __future__ import annotations

import asyncio
import json
import ssl
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from ajet.client import AsyncEpisodeHandle, EpisodeHandle
from ajet.tls import shared_ssl_context
from ajet.workflow import Tuner


@pytest.fixture
def ca_loads(monkeypatch):
    """Counts `SSLContext.load_verify_locations` calls (httpx loads certifi's bundle with it for every context)."""
    shared_ssl_context.cache_clear()
    calls = []
    real = ssl.SSLContext.load_verify_locations

    def counting(self, *args, **kwargs):
        calls.append(args or kwargs)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ssl.SSLContext, "load_verify_locations", counting)
    yield calls
    shared_ssl_context.cache_clear()


def _episode(cls):
    ep = cls.__new__(cls)                    # only the fields `openai()` reads
    ep.base_url, ep.api_key = "http://127.0.0.1:9/v1", "k"
    return ep


def test_twenty_episode_clients_load_the_ca_bundle_once(ca_loads):
    import openai

    clients = [Tuner("http://127.0.0.1:9/v1", "k", "m", f"e{i}").client for i in range(20)]
    clients += [_episode(EpisodeHandle).openai() for _ in range(5)] + [_episode(AsyncEpisodeHandle).openai() for _ in range(5)]
    assert len(ca_loads) == 1
    assert len({id(c._client) for c in clients}) == 30        # each client its own httpx client (its own pool)
    # a client given its own http_client keeps it
    own = openai.DefaultHttpxClient()
    assert _episode(EpisodeHandle).openai(http_client=own)._client is own
    # what the SDK builds without ajet loads the bundle per client: the count above is the shared context's doing
    openai.AsyncOpenAI(base_url="http://127.0.0.1:9/v1", api_key="k")
    assert len(ca_loads) == 2 + 1                             # `own` above, and this one


def test_the_shared_context_verifies_like_the_default():
    ctx = shared_ssl_context()
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    assert ctx.cert_store_stats()["x509_ca"] > 0             # a CA bundle is loaded


def test_a_tuner_client_talks_to_a_real_server():
    """The shared-context client reaches a real plain-HTTP server on 127.0.0.1 (what every workflow does)."""
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            reply = {"id": "c", "object": "chat.completion", "created": 0, "model": body["model"],
                     "choices": [{"index": 0, "finish_reason": "stop",
                                  "message": {"role": "assistant", "content": body["messages"][-1]["content"][::-1]}}]}
            data = json.dumps(reply).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        tuner = Tuner(f"http://127.0.0.1:{server.server_port}/v1", "k", "m", "e0")

        async def call():
            r = await tuner.client.chat.completions.create(model="m", messages=[{"role": "user", "content": "abc"}])
            await tuner.client.close()
            return r.choices[0].message.content

        assert asyncio.run(asyncio.wait_for(call(), 60)) == "cba"
    finally:
        server.shutdown()
        server.server_close()
