"""Episodes cannot reach one another through the proxy (the tool sandbox: tests/test_tool_sandbox.py)."""

import socket

import httpx
import pytest
from transformers import AutoTokenizer

from ajet.llm_call import SamplingParams
from ajet.proxy.server import ProxyServer
from tests.scripted_engine import ScriptedEngine


@pytest.fixture()
def proxy(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    p = ProxyServer(ScriptedEngine(tok, ["hi"]), tok, SamplingParams(max_tokens=8)).start()
    yield p
    p.stop()


def test_proxy_binds_loopback_with_unguessable_episode_tokens(proxy):
    assert proxy.host == "127.0.0.1"
    a, b = proxy.open_episode("a"), proxy.open_episode("b")
    assert a.api_key != b.api_key and len(a.api_key) >= 32 and a.api_key in a.base_url
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5):
        pass


def test_an_episode_cannot_reach_another(proxy):
    a, b = proxy.open_episode("a"), proxy.open_episode("b")
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    with httpx.Client(timeout=10) as http:
        assert http.post(a.base_url + "/chat/completions", json=body).status_code == 200
        # b's path with a's key as bearer: the path decides, the call lands in b only
        assert http.post(b.base_url + "/chat/completions", json=body,
                         headers={"Authorization": f"Bearer {a.api_key}"}).status_code == 200
        forged = a.base_url.replace(a.api_key, a.api_key[:-4] + "AAAA")
        assert http.post(forged + "/chat/completions", json=body).status_code == 404
    calls_a, calls_b = proxy.close_episode(a), proxy.close_episode(b)
    assert [c.episode_id for c in calls_a] == ["a"] and [c.episode_id for c in calls_b] == ["b"]
    with httpx.Client(timeout=10) as http:   # a finished episode takes no more calls
        r = http.post(a.base_url + "/chat/completions", json=body)
        assert r.status_code == 404 and r.json()["error"]["code"] == "episode_not_found"
