"""`gateway.keys`: client keys and admin keys on `ajet gateway`.

One real `ajet gateway` (a subprocess on the tiny model, the debug backbone, three keys: client `alice` given in
the YAML, client `bob` read from an environment variable, admin `ops`; no secret, none generated) serves the
module's scope tests, called with the OpenAI SDK and httpx: a client key calls the model and rates, reads and
closes its own sessions, and gets a 403 (in the calling dialect's error shape) on rollback, /metrics,
/v1/admin/*, and another key's session, also when it continues another key's conversation; the admin key may do
all; no key or an unknown key is a 401; a key in the URL (`?key=`) is refused. `gateway.allow_query_key` and the
rate limit per key name are checked on the gateway app in this process over a scripted engine, and
`ajet gateway keys` by running it."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from ajet.cli import main as ajet_main
from ajet.config import GatewayConfig
from ajet.gateway.app import GatewayApp
from ajet.gateway.ops import RateLimiter
from ajet.gateway.sessions import SessionBook
from ajet.gateway.source import attach
from ajet.gateway.store import GatewayStore
from ajet.llm_call import SamplingParams
from ajet.proxy.server import ProxyServer
from ajet.viewer.gateway_reader import GatewayReader
from tests.local_servers import announced_url, serving
from tests.scripted_engine import ScriptedEngine

ALICE = "alice-client-key-0123456789"      # client, in the YAML
BOB = "bob-client-key-9876543210abc"       # client, from the environment variable AJET_TEST_BOB_KEY
OPS = "ops-admin-key-0123456789abcdef"     # admin
CONF = """
model: {{path: "{model}", max_model_len: 256}}
rollout: {{num_repeat: 2, max_tokens: 4}}
trainer: {{total_steps: 2, tasks_per_step: 8, save_freq: 100, tensorboard: false}}
gateway:
  session_idle_s: 600
  keys:
    - {{name: alice, key: {alice}}}
    - {{name: bob, key_env: AJET_TEST_BOB_KEY, scope: client}}
    - {{name: ops, key: {ops}, scope: admin}}
"""


class Served:
    """`ajet gateway` in a subprocess; `url` once its 'proxy on' line is printed."""

    def __init__(self, conf: Path, exp: Path):
        self.exp = exp
        env = {k: v for k, v in os.environ.items() if k != "AJET_SECRET"}
        self.proc = subprocess.Popen([sys.executable, "-m", "ajet", "gateway", "--conf", str(conf), "--exp-dir",
                                      str(exp), "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     env={**env, "AJET_TEST_BOB_KEY": BOB}, cwd=conf.parent, text=True)
        self.lines, self.url = announced_url(self.proc, "proxy on ", "ajet gateway", 180)

    def client(self, key: str | None) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120,
                            headers={"Authorization": f"Bearer {key}"} if key else {})

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


@pytest.fixture(scope="module")
def gw(tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("gateway_keys")
    conf = folder / "conf.yaml"
    conf.write_text(textwrap.dedent(CONF.format(model=tiny_model_dir, alice=ALICE, ops=OPS)))
    g = Served(conf, folder / "exp")
    yield g
    g.stop()


def _chat(g: Served, key: str, messages: list[dict], session: str | None = None) -> httpx.Response:
    headers = {"X-Ajet-Session": session} if session else {}
    with g.client(key) as c:
        return c.post("/v1/chat/completions", headers=headers,
                      json={"model": "ajet-policy", "max_tokens": 4, "messages": messages})


def _sdk(g: Served, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=g.url + "/v1", api_key=key, max_retries=0, timeout=120)


def test_a_client_key_calls_the_model_and_uses_its_own_sessions(gw):
    raw = _sdk(gw, ALICE).chat.completions.with_raw_response.create(
        model="ajet-policy", max_tokens=4, messages=[{"role": "user", "content": "What is 3 plus 4?"}])
    sid, rid = raw.headers["x-ajet-session"], raw.parse().id
    assert "gateway secret:" not in "".join(gw.lines)          # an admin key is configured: no secret generated
    with gw.client(ALICE) as alice:
        fb = alice.post("/v1/feedback", json={"session_id": sid, "reward": 1.0, "comment": "by alice"})
        by_response = alice.post("/v1/feedback", json={"response_id": rid, "reward": 0.5})
        state = alice.get(f"/v1/sessions/{sid}")
        closed = alice.post(f"/v1/sessions/{sid}/close")
    assert fb.status_code == 200 and by_response.status_code == 200, (fb.text, by_response.text)
    assert state.status_code == 200 and state.json()["key"] == "alice" and state.json()["reward"] == 0.5
    assert closed.status_code == 200, closed.text
    with sqlite3.connect(gw.exp / "gateway.sqlite") as db:
        assert db.execute("SELECT key_name FROM sessions WHERE session_id = ?", (sid,)).fetchone() == ("alice",)
        assert db.execute("SELECT key_name, reward FROM feedback WHERE session_id = ? ORDER BY rowid",
                          (sid,)).fetchall() == [("alice", 1.0), ("alice", 0.5)]
    recent = GatewayReader(gw.exp).overview(windows=4)["feedback"]["recent"]      # the viewer's gateway page
    assert [(x["session_id"], x["key_name"]) for x in recent if x["session_id"] == sid] == [(sid, "alice")] * 2


def test_a_client_key_gets_403_on_admin_routes_and_the_admin_key_passes(gw):
    with gw.client(ALICE) as alice, gw.client(OPS) as ops:
        refused = {"rollback": alice.post("/v1/admin/rollback", json={"to": 0}),
                   "versions": alice.get("/v1/admin/versions"), "metrics": alice.get("/metrics")}
        admin_rollback = ops.post("/v1/admin/rollback", json={"to": 7})      # never served: refused by the gate
        admin_versions = ops.get("/v1/admin/versions")
        admin_metrics = ops.get("/metrics")
    for what, r in refused.items():
        assert r.status_code == 403, (what, r.status_code, r.text)
        err = r.json()["error"]
        assert err["code"] == "admin_key_required" and err["type"] == "permission_error", (what, err)
        assert "alice" in err["message"] and "admin" in err["message"]
    assert admin_rollback.status_code == 409 and admin_rollback.json()["error"]["code"] == "rollback_refused"
    assert admin_versions.status_code == 200 and admin_versions.json()["versions"][0]["version"] == 0
    assert admin_metrics.status_code == 200 and "ajet_gateway_policy_version 0" in admin_metrics.text


def test_another_keys_session_is_403_in_each_dialect_and_open_to_the_admin_key(gw):
    question = [{"role": "user", "content": "Name a colour."}]
    mine = _chat(gw, BOB, question, session="bob-conversation-1")           # bob's key comes from key_env
    assert mine.status_code == 200, mine.text
    rid = mine.json()["id"]
    answer = mine.json()["choices"][0]["message"]
    more = [*question, {"role": "assistant", "content": answer["content"]}, {"role": "user", "content": "Another?"}]
    with gw.client(ALICE) as alice:
        reads = {"get": alice.get("/v1/sessions/bob-conversation-1"),
                 "feedback": alice.post("/v1/feedback", json={"session_id": "bob-conversation-1", "reward": -1}),
                 "feedback by response": alice.post("/v1/feedback", json={"response_id": rid, "reward": -1}),
                 "close": alice.post("/v1/sessions/bob-conversation-1/close")}
        chat = alice.post("/v1/chat/completions", headers={"X-Ajet-Session": "bob-conversation-1"},
                          json={"model": "ajet-policy", "max_tokens": 4, "messages": more})
        anthropic = alice.post("/v1/messages", headers={"X-Ajet-Session": "bob-conversation-1"},
                               json={"model": "ajet-policy", "max_tokens": 4, "messages": question})
        gemini = alice.post("/v1beta/models/ajet-policy:generateContent",
                            headers={"X-Ajet-Session": "bob-conversation-1"},
                            json={"contents": [{"role": "user", "parts": [{"text": "Name a colour."}]}]})
    for what, r in {**reads, "chat": chat}.items():
        assert r.status_code == 403, (what, r.status_code, r.text)
        assert r.json()["error"]["code"] == "session_forbidden" and r.json()["error"]["type"] == "permission_error"
    assert anthropic.status_code == 403 and anthropic.json()["type"] == "error", anthropic.text
    assert anthropic.json()["error"]["type"] == "permission_error" and "alice" in anthropic.json()["error"]["message"]
    assert gemini.status_code == 403, gemini.text
    assert gemini.json()["error"]["code"] == 403 and gemini.json()["error"]["status"] == "PERMISSION_DENIED"
    # continuing bob's conversation without a header: alice's request opens a session of her own
    alice_cont, bob_cont = _chat(gw, ALICE, more), _chat(gw, BOB, more)
    assert alice_cont.status_code == bob_cont.status_code == 200
    assert bob_cont.headers["x-ajet-session"] == "bob-conversation-1"
    assert alice_cont.headers["x-ajet-session"] != "bob-conversation-1"
    with gw.client(OPS) as ops:                                   # the admin key: any session
        state = ops.get("/v1/sessions/bob-conversation-1")
        fb = ops.post("/v1/feedback", json={"session_id": "bob-conversation-1", "reward": 0.25})
        closed = ops.post("/v1/sessions/bob-conversation-1/close")
    assert state.status_code == 200 and state.json()["key"] == "bob" and state.json()["reward"] is None
    assert fb.status_code == 200 and closed.status_code == 200, (fb.text, closed.text)


def test_no_key_401_and_no_key_from_the_url(gw):
    with gw.client(None) as anon:
        none = anon.get("/v1/models")
        wrong = anon.get("/v1/models", headers={"x-api-key": "not-a-key-of-this-gateway"})
        query = anon.get("/v1/models", params={"key": ALICE})
        query_chat = anon.post("/v1/chat/completions", params={"key": OPS},
                               json={"model": "ajet-policy", "max_tokens": 4,
                                     "messages": [{"role": "user", "content": "hi"}]})
        gemini_query = anon.post("/v1beta/models/ajet-policy:generateContent", params={"key": ALICE},
                                 json={"contents": [{"role": "user", "parts": [{"text": "hi"}]}]})
        header = anon.get("/v1/models", headers={"x-goog-api-key": ALICE})
        health = anon.get("/healthz")
    for r in (none, wrong):
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
    for r in (query, query_chat):
        assert r.status_code == 401 and r.json()["error"]["code"] == "query_key_refused", r.text
        assert "allow_query_key" in r.json()["error"]["message"]
    assert gemini_query.status_code == 401 and gemini_query.json()["error"]["status"] == "UNAUTHENTICATED"
    assert header.status_code == 200 and health.status_code == 200
    with pytest.raises(openai.AuthenticationError):
        _sdk(gw, "sk-wrong-key-0000000000").models.list()


# ---- in this process, over a scripted engine ---------------------------------------------------------------

@pytest.fixture
def scripted(tokenizer, tmp_path, request):
    """A gateway app over a scripted engine, served on 127.0.0.1: keys alice (client) and ops (admin); the
    parameters: allow_query_key, and the limiter (None: none)."""
    allow_query, limiter = request.param
    engine = ScriptedEngine(tokenizer, ["The answer is 7."])
    proxy = ProxyServer(engine, tokenizer, SamplingParams(temperature=1.0, max_tokens=8))
    store = GatewayStore(tmp_path / "gateway.sqlite")
    book = SessionBook(proxy, store, idle_s=60, deadline_s=600, on_no_feedback="drop")
    keys = [("alice", ALICE, "client"), ("bob", BOB, "client"), ("ops", OPS, "admin")]
    attach(proxy, book, lambda p, b: GatewayApp(p, b, None, lambda: engine.policy_version, limiter,
                                                keys=keys, allow_query_key=allow_query))
    with serving(proxy.app) as url:
        yield url
    store.close()


@pytest.mark.parametrize("scripted", [(True, None)], indirect=True)
def test_allow_query_key_takes_the_key_from_the_url(scripted):
    ok = httpx.get(scripted + "/v1/models", params={"key": ALICE})
    metrics = httpx.get(scripted + "/metrics", params={"key": ALICE})
    admin = httpx.get(scripted + "/metrics", params={"key": OPS})
    wrong = httpx.get(scripted + "/v1/models", params={"key": "not-a-key-of-this-gateway"})
    assert ok.status_code == 200 and admin.status_code == 200, (ok.text, admin.text)
    assert metrics.status_code == 403                                   # the scope still holds
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"


class Clock:
    def __init__(self):
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("scripted", [(False, RateLimiter(rps=0.5, burst=1, clock=Clock()))], indirect=True)
def test_rate_limits_count_per_key_name(scripted):
    def chat(key: str) -> int:
        return httpx.post(scripted + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                          json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}).status_code

    assert [chat(ALICE), chat(ALICE)] == [200, 429]      # one burst per key, from the same address
    assert chat(BOB) == 200                               # another key: a bucket of its own
    assert chat(BOB) == 429


def test_gateway_keys_prints_distinct_long_keys_as_yaml(tmp_path):
    out = subprocess.run([sys.executable, "-m", "ajet", "gateway", "keys", "--client", "3", "--admin", "2"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    parsed = yaml.safe_load(out.stdout)
    keys = parsed["gateway"]["keys"]
    assert [(k["name"], k["scope"]) for k in keys] == [("client-1", "client"), ("client-2", "client"),
                                                      ("client-3", "client"), ("admin-1", "admin"),
                                                      ("admin-2", "admin")]
    values = [k["key"] for k in keys]
    assert len(set(values)) == 5 and all(isinstance(v, str) and len(v) >= 40 for v in values), values
    assert len(GatewayConfig(**parsed["gateway"]).keys) == 5              # pastes into a config as it is


def test_bad_keys_are_one_line_config_errors(tmp_path, tiny_model_dir, capsys, monkeypatch):
    monkeypatch.delenv("AJET_TEST_UNSET_KEY", raising=False)
    for keys, expected in (
            ("[{name: a, key_env: AJET_TEST_UNSET_KEY}]", "AJET_TEST_UNSET_KEY is unset"),
            (f"[{{name: a, key: {ALICE}}}, {{name: a, key: {BOB}}}]", "two keys are named 'a'"),
            (f"[{{name: a, key: {ALICE}}}, {{name: b, key: {ALICE}}}]", "one key is given twice"),
            ("[{name: a}]", "exactly one of `key` and `key_env`"),
            (f"[{{name: a, key: {ALICE}, key_env: X}}]", "exactly one of `key` and `key_env`"),
            (f"[{{name: secret, key: {ALICE}}}]", "the name `secret` is gateway.secret's")):
        conf = tmp_path / "conf.yaml"
        conf.write_text(f'model: {{path: "{tiny_model_dir}"}}\ngateway: {{keys: {keys}}}\n')
        assert ajet_main(["gateway", "--conf", str(conf), "--exp-dir", str(tmp_path / "exp")]) == 2, keys
        err = capsys.readouterr().err
        assert expected in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, (keys, err)
        assert ALICE not in err and BOB not in err                         # no message shows a key


def test_a_gateway_sqlite_from_before_keys_gets_the_key_columns(tmp_path):
    old_schema = GatewayStore.SCHEMA.replace(",\n    key_name TEXT);", ");").replace(", key_name TEXT);", ");")
    assert "key_name" not in old_schema
    with sqlite3.connect(tmp_path / "gateway.sqlite") as db:           # the tables as written before keys
        db.executescript(old_schema)
        db.execute("INSERT INTO sessions VALUES ('old', 1.0, 'q', 'new')")
        db.execute("INSERT INTO feedback VALUES ('old', NULL, 1.0, NULL, 'client', 2.0)")
    db.close()
    assert GatewayReader(tmp_path).overview(windows=2)["feedback"]["recent"][0]["key_name"] is None
    store = GatewayStore(tmp_path / "gateway.sqlite")
    try:
        store.open_session("new", "q2", "header", at=3.0, key_name="alice")
        store.add_feedback("new", 0.5, None, "client", at=4.0, key_name="alice")
        got = store.sessions()
    finally:
        store.close()
    assert (got["old"].key_name, got["old"].feedback[0]["key_name"]) == (None, None)
    assert (got["new"].key_name, got["new"].feedback[0]["key_name"]) == ("alice", "alice")
