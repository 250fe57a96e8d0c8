"""Proxy hardening: every bad input is an OpenAI-style 4xx naming what is wrong, never a 500.

A real uvicorn proxy on 127.0.0.1 with a scripted (instant) engine, driven over HTTP by httpx and the
OpenAI SDK; the fuzz test sends over a thousand generated requests to one running proxy.
"""

from __future__ import annotations

import copy
import json
from contextlib import contextmanager

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ajet.llm_call import SamplingParams
from ajet.proxy.server import DEFAULT_MAX_BODY_BYTES, ProxyError, ProxyServer
from tests.scripted_engine import FailingEngine

CALC_TOOL = {"type": "function", "function": {
    "name": "calculate", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
TOOL_REPLY = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "1+1"}}\n</tool_call>'
USER = [{"role": "user", "content": "hi"}]


@contextmanager
def running(tokenizer, replies=("ok",), **kw):
    """A started proxy with a FailingEngine, one open episode and an httpx client; stopped afterwards."""
    engine = FailingEngine(tokenizer, list(replies))
    proxy = ProxyServer(engine, tokenizer, SamplingParams(temperature=1.0, max_tokens=64), **kw).start()
    try:
        ep = proxy.open_episode("ep")
        with httpx.Client(timeout=60) as http:
            yield proxy, engine, ep, http
    finally:
        proxy.stop()


def chat_url(ep) -> str:
    return ep.base_url + "/chat/completions"


def assert_error(r: httpx.Response, status: int, code: str | None = None, param: str | None = None) -> dict:
    """`r` is an OpenAI-style error with this status (and code/param when given); returns the error object."""
    assert r.status_code == status, (r.status_code, r.text[:500])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str) and err["message"]
    assert err["type"] == ("server_error" if status >= 500 else
                           "authentication_error" if status == 401 else "invalid_request_error")
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    return err


def assert_ok(r: httpx.Response) -> None:
    assert r.status_code == 200, r.text[:500]
    assert r.json()["choices"][0]["message"]["role"] == "assistant"


def test_malformed_json_and_wrong_types_are_400(tokenizer):
    with running(tokenizer) as (proxy, _, ep, http):
        url = chat_url(ep)
        for raw in (b"{not json", b"", b"\xff\xfe\x00garbage", b"[" * 100_000 + b"]" * 100_000,
                    b'{"model": "m", "seed": ' + b"9" * 5000 + b', "messages": []}'):
            assert_error(http.post(url, content=raw), 400, "invalid_json")
        assert_error(http.post(url, json=[1, 2]), 400, "invalid_json")
        # a JSON \ud800 escape decodes to a lone surrogate: not Unicode text, so it cannot be tokenized
        raw = b'{"model": "m", "messages": [{"role": "user", "content": "a\\ud800b"}]}'
        assert_error(http.post(url, content=raw), 400, "invalid_value", "messages.0.content")
        for body, param in (({"model": "m", "messages": "hi"}, "messages"),
                            ({"model": 7, "messages": USER}, "model"),
                            ({"model": "m", "messages": USER, "temperature": "hot"}, "temperature"),
                            ({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "messages.0"),
                            ({"model": "m", "messages": USER, "seed": 2**70}, "seed"),
                            ({"model": "m"}, "messages")):
            err = assert_error(http.post(url, json=body), 400, param=param)
            assert err["message"].startswith(param + ":")
        assert_ok(http.post(url, json={"model": "m", "messages": USER}))
        assert len(proxy.close_episode(ep)) == 1       # rejected requests record nothing


def test_oversized_body_is_413_by_content_length_and_by_bytes_sent(tokenizer):
    with running(tokenizer, max_body_bytes=4096) as (_, _, ep, http):
        url = chat_url(ep)
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 5000}]}).encode()
        err = assert_error(http.post(url, content=body), 413, "request_too_large")
        assert "4096 bytes" in err["message"] and "max_body_bytes" in err["message"]
        # chunked transfer: no Content-Length, the proxy counts the bytes as they arrive
        chunks = (body[i:i + 1000] for i in range(0, len(body), 1000))
        r = http.post(url, content=chunks)
        assert "content-length" not in r.request.headers
        assert_error(r, 413, "request_too_large")
        small = json.dumps({"model": "m", "messages": USER}).encode()
        assert_ok(http.post(url, content=iter([small[:10], small[10:]])))   # chunked and small: fine
        assert_ok(http.post(url, content=small))                           # the connection still serves
    with running(tokenizer) as (proxy, _, ep, http):
        assert proxy.max_body_bytes == DEFAULT_MAX_BODY_BYTES == 8 * 2**20
        huge = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"y" * (8 * 2**20) + b'"}]}'
        assert_error(http.post(chat_url(ep), content=huge), 413, "request_too_large")
        assert_ok(http.post(chat_url(ep), json={"model": "m", "messages": USER}))


def test_unknown_model_is_404_only_when_a_set_is_configured(tokenizer):
    with running(tokenizer) as (_, _, ep, http):               # default: any name (existing clients work)
        assert_ok(http.post(chat_url(ep), json={"model": "gpt-4o-whatever", "messages": USER}))
    with running(tokenizer, model_name="policy", accepted_models={"gpt-4o-mini"}) as (_, _, ep, http):
        url = chat_url(ep)
        err = assert_error(http.post(url, json={"model": "gpt-5", "messages": USER}), 404, "model_not_found", "model")
        assert "'gpt-5'" in err["message"] and "gpt-4o-mini, policy" in err["message"]
        assert_ok(http.post(url, json={"model": "policy", "messages": USER}))
        assert_ok(http.post(url, json={"model": "gpt-4o-mini", "messages": USER}))
        client = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        assert [m.id for m in client.models.list()] == ["policy", "gpt-4o-mini"]
        with pytest.raises(openai.NotFoundError, match="does not exist") as info:
            client.chat.completions.create(model="nope", messages=USER)
        assert info.value.code == "model_not_found"


@pytest.mark.parametrize("params", [
    {"type": "string"}, {"type": ["object", "null"]}, {"type": "object", "properties": ["expression"]},
    {"type": "object", "properties": {"a": 1}}, {"type": "object", "properties": {"a": {}}, "required": "a"},
    "not a schema",
])
def test_invalid_tool_schema_is_400_naming_the_tool(tokenizer, params):
    with running(tokenizer) as (_, _, ep, http):
        bad = {"type": "function", "function": {"name": "f", "parameters": params}}
        r = http.post(chat_url(ep), json={"model": "m", "messages": USER, "tools": [CALC_TOOL, bad],
                                          "tool_choice": {"type": "function", "function": {"name": "f"}}})
        err = assert_error(r, 400, "invalid_value", "tools.1.function.parameters")
        assert err["message"].startswith("tools.1.function.parameters: ")
        for ok in ({}, {"type": "object"}, {"properties": {}}, {"type": "object", "properties": {"a": {}}}):
            good = {"type": "function", "function": {"name": "f", "parameters": ok}}
            assert_ok(http.post(chat_url(ep), json={"model": "m", "messages": USER, "tools": [CALC_TOOL, good]}))


def test_prompt_longer_than_the_context_is_400(tokenizer):
    with running(tokenizer, max_model_len=64) as (_, _, ep, http):
        r = http.post(chat_url(ep), json={"model": "m", "messages": [{"role": "user", "content": "word " * 200}]})
        err = assert_error(r, 400, "context_length_exceeded", "messages")
        assert "64" in err["message"]


def test_validation_errors_never_echo_huge_inputs(tokenizer):
    big = "z" * 1_000_000
    with running(tokenizer) as (_, _, ep, http):
        for body in ({"model": "m", "messages": USER, "temperature": big},
                     {"model": "m", "messages": [{"role": big, "content": "x"}]},
                     {"model": "m", "messages": USER, big: 1},
                     {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": [big]}]}]},
                     {"model": "m", "messages": USER, "tools": [{"type": "function", "function": {
                         "name": "f", "parameters": {"type": big, "properties": {big: {}}}}}]},
                     {"model": "m", "messages": USER, "stop": {"k": [big] * 3}},
                     {"model": "m", "messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}],
                      "tool_choice": {"type": "function", "function": {"name": big}}},
                     {"model": "m", "messages": USER, "response_format": {"type": big}}):
            r = http.post(chat_url(ep), json=body)
            err = assert_error(r, 400)
            assert len(err["message"]) < 1000 and len(err["param"] or "") < 300 and len(r.content) < 2000


def test_engine_failure_is_503_with_retry_after_and_the_proxy_keeps_serving(tokenizer):
    response = ProxyError(503, "down", "server_error").response()
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    assert "retry-after" not in ProxyError(400, "bad").response().headers
    with running(tokenizer, retry_after_s=2) as (proxy, engine, ep, http):
        engine.fail_next = 1
        r = http.post(chat_url(ep), json={"model": "m", "messages": USER})
        err = assert_error(r, 503, "engine_error")
        assert r.headers["retry-after"] == "2" and "CUDA error" in err["message"]
        assert_ok(http.post(chat_url(ep), json={"model": "m", "messages": USER}))
        assert len(proxy.close_episode(ep)) == 1                         # the failed call is not recorded
    with running(tokenizer) as (proxy, engine, ep, _):
        # the OpenAI SDK honours Retry-After and its retry succeeds
        engine.fail_next = 1
        client = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=1)
        assert client.chat.completions.create(model="m", messages=USER).choices[0].message.content == "ok"
        assert engine.fail_next == 0 and len(proxy.close_episode(ep)) == 1


def test_unexpected_exception_is_a_500_openai_body_and_the_proxy_keeps_serving(tokenizer):
    with running(tokenizer) as (_, engine, ep, http):
        engine.broken = True        # a malformed completion: a bug, not bad input
        err = assert_error(http.post(chat_url(ep), json={"model": "m", "messages": USER}), 500, "internal_error")
        assert "TypeError" in err["message"]
        engine.broken = False
        assert_ok(http.post(chat_url(ep), json={"model": "m", "messages": USER}))


def test_unknown_paths_and_methods_get_openai_bodies(tokenizer):
    with running(tokenizer) as (proxy, _, ep, http):
        assert_error(http.post(proxy.url + "/v1/embeddings", json={}), 404, "not_found")
        r = http.get(chat_url(ep))
        assert_error(r, 405, "method_not_allowed")
        assert "POST" in r.headers["allow"]


# ---- fuzzing ------------------------------------------------------------------------------------------
ODD_TEXT = st.text(st.characters(codec="utf-8"), max_size=40)          # any code point but surrogates
SHORT_TEXT = st.one_of(ODD_TEXT, st.sampled_from(["", " ", "<|im_end|>", "<tool_call>", "\x00", "\u202e", "👩‍🚀"]))
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | SHORT_TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(SHORT_TEXT, inner, max_size=4), max_leaves=12)
TOOLS = [CALC_TOOL, {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}},
         {"type": "function", "function": {"name": "ping"}}]
BAD_SCHEMAS = [{"type": "array"}, {"type": "object", "properties": 3}, {"properties": {"a": "string"}},
               {"type": "object", "properties": {}, "required": [1]}, [], "object", 5]
BAD_ROLES = ["wizard", "User", "", "function", None, 3, ["user"], "tool"]
CONTENT = st.one_of(SHORT_TEXT, st.lists(st.builds(lambda t: {"type": "text", "text": t}, SHORT_TEXT), max_size=2))


@st.composite
def messages(draw):
    role = draw(st.sampled_from(["system", "developer", "user", "assistant", "tool"]))
    msg = {"role": role, "content": draw(CONTENT)}
    if role == "tool":
        msg["tool_call_id"] = draw(SHORT_TEXT)
    if role == "assistant" and draw(st.booleans()):
        args = draw(st.one_of(st.just('{"expression": "1+1"}'), SHORT_TEXT,
                              st.dictionaries(SHORT_TEXT, SHORT_TEXT, max_size=2)))
        msg["tool_calls"] = [{"id": "call_1", "type": "function", "function": {"name": "calculate", "arguments": args}}]
        msg["content"] = draw(st.one_of(st.none(), CONTENT))
    return msg


@st.composite
def valid_requests(draw):
    req = {"model": draw(SHORT_TEXT), "messages": draw(st.lists(messages(), min_size=1, max_size=5))}
    if draw(st.booleans()):
        req["tools"] = draw(st.lists(st.sampled_from(TOOLS), min_size=1, max_size=3, unique_by=lambda t: t["function"]["name"]))
        names = [t["function"]["name"] for t in req["tools"]]
        req["tool_choice"] = draw(st.sampled_from(["auto", "none", "required", None]
                                                  + [{"type": "function", "function": {"name": n}} for n in names]))
    optional = {"temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "max_tokens": st.integers(1, 10**6),
                "max_completion_tokens": st.integers(1, 100), "seed": st.integers(-2**63, 2**63 - 1),
                "stop": st.one_of(SHORT_TEXT, st.lists(SHORT_TEXT, max_size=3)), "n": st.integers(1, 3),
                "stream": st.booleans(), "logprobs": st.booleans(), "user": SHORT_TEXT,
                "metadata": st.dictionaries(SHORT_TEXT, SHORT_TEXT, max_size=3), "parallel_tool_calls": st.booleans(),
                "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}]), "store": st.booleans()}
    for key in draw(st.lists(st.sampled_from(sorted(optional)), max_size=4, unique=True)):
        req[key] = draw(optional[key])
    if req.get("stream") and draw(st.booleans()):
        req["stream_options"] = {"include_usage": draw(st.booleans())}
    if req.get("logprobs") and draw(st.booleans()):
        req["top_logprobs"] = draw(st.integers(0, 20))
    if req.get("response_format", {}).get("type") == "json_object":   # OpenAI's rule: say "JSON" somewhere
        req["messages"].insert(0, {"role": "system", "content": "Answer in JSON."})
    return req


def _slots(obj, out):
    """Every (container, key) in a JSON value, depth first."""
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        out.append((obj, k))
        _slots(v, out)
    return out


@st.composite
def mutated_requests(draw):
    req = draw(valid_requests())
    for _ in range(draw(st.integers(1, 3))):
        req = copy.deepcopy(req)   # never mutate objects a strategy handed out (they may be shared)
        slots = _slots(req, [])
        obj, key = draw(st.sampled_from(slots))
        kind = draw(st.sampled_from(["wrong_type", "delete", "extra", "huge", "odd_unicode", "bad_role", "bad_tool"]))
        if kind == "wrong_type":
            obj[key] = draw(JSON_VALUES)
        elif kind == "delete":
            del obj[key]
        elif kind == "extra":
            target = obj if isinstance(obj, dict) else req
            target[draw(SHORT_TEXT)] = draw(JSON_VALUES)
        elif kind == "huge":
            obj[key] = draw(st.sampled_from(["x", "é", "🦜", "<|im_start|>"])) * draw(st.sampled_from([3000, 40_000, 200_000]))
        elif kind == "odd_unicode":
            obj[key] = draw(st.text(st.characters(codec="utf-8", categories=["Cc", "Cf", "Co", "Mn", "Zl", "Zs", "So"]),
                                    min_size=1, max_size=30))
        elif kind == "bad_role":
            msgs = [m for m in req.get("messages") or () if isinstance(m, dict)] if isinstance(req.get("messages"), list) else []
            if msgs:
                draw(st.sampled_from(msgs))["role"] = draw(st.sampled_from(BAD_ROLES))
            else:
                req["messages"] = [{"role": draw(st.sampled_from(BAD_ROLES)), "content": "x"}]
        else:
            req["tools"] = [CALC_TOOL, {"type": "function", "function": {"name": "f", "parameters": draw(st.sampled_from(BAD_SCHEMAS))}}]
        if not req.get("messages"):
            break
    return req


def _raw_bytes():
    truncated = valid_requests().flatmap(
        lambda r: st.integers(0, len(json.dumps(r)) - 1).map(lambda n: json.dumps(r).encode()[:n]))
    surrogate = valid_requests().map(lambda r: json.dumps({**r, "user": "x"}).replace('"x"', '"\\udc80"').encode())
    return st.one_of(st.binary(max_size=200), truncated, surrogate,
                     JSON_VALUES.map(lambda v: json.dumps(v).encode()))


VALID = valid_requests().map(lambda r: ("valid", json.dumps(r).encode()))
MUTATED = mutated_requests().map(lambda r: ("mutated", json.dumps(r).encode()))
FUZZ = st.one_of(   # repeated branches weight the mix towards requests that get past JSON parsing
    VALID, VALID, MUTATED, MUTATED, MUTATED,
    JSON_VALUES.map(lambda v: ("json", json.dumps(v).encode())),
    st.dictionaries(st.sampled_from(["model", "messages", "tools", "stream", "n", "x"]), JSON_VALUES, max_size=4)
    .map(lambda v: ("json", json.dumps(v).encode())),
    _raw_bytes().map(lambda b: ("raw", b)),
)


def test_fuzzed_requests_never_get_a_5xx_and_the_proxy_keeps_serving(tokenizer):
    stats = {"sent": 0, "ok": 0, "choices": 0}
    kinds: dict[str, int] = {}
    statuses: dict[int, int] = {}
    with running(tokenizer, replies=["ok", TOOL_REPLY], max_body_bytes=2 * 2**20) as (proxy, _, ep, http):
        url = chat_url(ep)

        @settings(max_examples=1150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(FUZZ)
        def send(case):
            kind, body = case
            r = http.post(url, content=body, headers={"content-type": "application/json"})
            stats["sent"] += 1
            kinds[kind] = kinds.get(kind, 0) + 1
            assert r.status_code < 500, (kind, body[:300], r.status_code, r.text[:300])
            if kind == "valid":
                assert r.status_code == 200, (body[:300], r.text[:300])
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            if r.status_code == 200:
                stats["ok"] += 1
                stats["choices"] += json.loads(body).get("n") or 1      # each choice is recorded as a call
                streamed = json.loads(body).get("stream") is True
                assert r.headers["content-type"].startswith("text/event-stream" if streamed else "application/json")
            else:
                err = assert_error(r, r.status_code)
                assert 400 <= r.status_code < 500 and len(err["message"]) < 1000

        send()
        assert stats["sent"] >= 1000, stats
        print(f"fuzz: {stats['sent']} requests, kinds {kinds}, statuses {dict(sorted(statuses.items()))}")
        assert all(kinds.get(k, 0) >= 50 for k in ("valid", "mutated", "json", "raw")), kinds
        assert_ok(http.post(url, json={"model": "m", "messages": USER}))
        calls = proxy.close_episode(ep)
    assert len(calls) == stats["choices"] + 1     # exactly the accepted requests' choices were recorded
