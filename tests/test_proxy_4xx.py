"""Bad input on every API is a 4xx in that API's own error shape, naming the field: never a 500.

Each case was a 500 (or, for `"stream": "yes"`, a stream nobody asked for) before. A real uvicorn proxy
on 127.0.0.1 with a scripted engine, driven by raw HTTP (httpx: the bytes a careless client sends) and by
the OpenAI and Anthropic SDKs (that they read the answer as their own bad-request error). After the bad
requests the episode records nothing and the proxy still answers a good request.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import orjson
import pytest

from ajet.proxy.server import MAX_JSON_ITEMS
from tests.test_proxy_hardening import assert_error, running

USER = [{"role": "user", "content": "hi"}]
RAW_SURROGATE = '"a\udc80b"'.encode("utf-8", "surrogatepass")   # the bytes ED B2 80, not a \u escape


def anthropic_error(r: httpx.Response, status: int = 400) -> str:
    """`r` is an Anthropic-shaped error with this status; returns its message."""
    assert r.status_code == status, (r.status_code, r.text[:500])
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == "invalid_request_error", body
    return body["error"]["message"]


def urls(ep) -> dict[str, str]:
    return {"chat": ep.base_url + "/chat/completions", "responses": ep.base_url + "/responses",
            "messages": ep.anthropic_base_url + "/v1/messages",
            "count_tokens": ep.anthropic_base_url + "/v1/messages/count_tokens"}


def assert_still_serves(proxy, ep, http) -> None:
    r = http.post(urls(ep)["chat"], json={"model": "m", "messages": USER})
    assert r.status_code == 200, r.text[:300]
    assert len(proxy.close_episode(ep)) == 1          # only the good request was recorded


def test_raw_surrogate_bytes_are_400_naming_the_field_on_every_api(tokenizer):
    """Raw UTF-8-encoded surrogate bytes (not a `\\ud800` escape) in a JSON string: the standard parser
    decodes them with surrogatepass, and the tokenizer then raised a TypeError (a 500)."""
    with running(tokenizer) as (proxy, _, ep, http):
        u = urls(ep)
        bodies = {"chat": (b'{"model": "m", "messages": [{"role": "user", "content": ' + RAW_SURROGATE + b"}]}",
                           "messages.0.content"),
                  "responses": (b'{"model": "m", "input": ' + RAW_SURROGATE + b"}", "input"),
                  "messages": (b'{"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": '
                               + RAW_SURROGATE + b"}]}", "messages.0.content"),
                  "count_tokens": (b'{"model": "m", "messages": [{"role": "user", "content": ' + RAW_SURROGATE
                                   + b"}]}", "messages.0.content")}
        for api, (raw, where) in bodies.items():
            r = http.post(u[api], content=raw, headers={"content-type": "application/json"})
            if api in ("chat", "responses"):
                err = assert_error(r, 400, "invalid_value", where)
                message = err["message"]
            else:
                message = anthropic_error(r)
            assert message.startswith(where + ":") and "surrogate" in message, message
        # a surrogate in a key, deeper down
        raw = b'{"model": "m", "messages": [{"role": "user", "content": "x", ' + RAW_SURROGATE + b': 1}]}'
        assert_error(http.post(u["chat"], content=raw), 400, "invalid_value")
        assert_still_serves(proxy, ep, http)


def test_messages_without_a_usable_block_are_400(tokenizer):
    """An empty block list, or a user turn of thinking blocks only, left no chat message (IndexError, a 500)."""
    with running(tokenizer) as (proxy, _, ep, http):
        u = urls(ep)
        thinking = [{"type": "thinking", "thinking": "hmm", "signature": "s"}]
        for content, expected in (([], "messages.0.content: must be a string or a non-empty list"),
                                  (thinking, "messages.0.content: a user message needs a text or tool_result")):
            for api in ("messages", "count_tokens"):
                body = {"model": "m", "messages": [{"role": "user", "content": content}]}
                if api == "messages":
                    body["max_tokens"] = 5
                assert anthropic_error(http.post(u[api], json=body)).startswith(expected)
        # the Anthropic SDK reads it as its own 400
        client = anthropic.Anthropic(base_url=ep.anthropic_base_url, api_key=ep.api_key, max_retries=0)
        with pytest.raises(anthropic.BadRequestError, match="messages.0.content"):
            client.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": []}])
        # thinking beside text is fine: the thinking block is dropped
        r = http.post(u["messages"], json={"model": "m", "max_tokens": 5, "messages": [
            {"role": "user", "content": thinking + [{"type": "text", "text": "hi"}]}]})
        assert r.status_code == 200, r.text[:300]
        assert len(proxy.close_episode(ep)) == 1


def test_non_string_text_is_400_naming_the_field(tokenizer):
    """`"text": 5` in a Messages text block, system block or tool_result content, or a Responses input
    part (each a TypeError, a 500, before)."""
    call = {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]}

    def result(content):
        return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": content}]}

    with running(tokenizer) as (proxy, _, ep, http):
        u = urls(ep)
        base = {"model": "m", "max_tokens": 5}
        for body, where in (
                ({**base, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
                 "messages.0.content.0.text"),
                ({**base, "system": [{"type": "text", "text": 5}], "messages": USER}, "system.0.text"),
                ({**base, "messages": [*USER, call, result([{"type": "text", "text": 5}])]},
                 "messages.2.content.0.content.0.text"),
                ({**base, "messages": [*USER, call, result(5)]}, "messages.2.content.0.content")):
            message = anthropic_error(http.post(u["messages"], json=body))
            assert message.startswith(where + ":"), (where, message)
        for part in ({"type": "input_text", "text": 5}, {"type": "refusal", "refusal": ["no"]}):
            r = http.post(u["responses"], json={"model": "m", "input": [{"role": "user", "content": [part]}]})
            key = "refusal" if part["type"] == "refusal" else "text"
            assert_error(r, 400, "invalid_value", f"input.0.content.0.{key}")
        client = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(model="m", input=[{"role": "user", "content": [{"type": "input_text", "text": 5}]}])
        assert info.value.body["param"] == "input.0.content.0.text"
        assert_still_serves(proxy, ep, http)


def test_responses_text_format_and_grouped_tools_are_400_naming_the_field(tokenizer):
    """`text: {"format": "json"}` / `{"format": null}` and a tool group whose entries are not tools (each an
    AttributeError, a 500, before); a well-formed group is still flattened into the prompt's tools."""
    with running(tokenizer) as (proxy, _, ep, http):
        url = urls(ep)["responses"]
        for text in ({"format": "json"}, {"format": None}, {"format": {"name": "x"}}):
            assert_error(http.post(url, json={"model": "m", "input": "hi", "text": text}), 400, "invalid_value",
                         "text.format" if not isinstance(text["format"], dict) else "text.format.type")
        for tools, where in (([{"tools": [5]}], "tools.0.tools.0"),
                             ([{"type": "namespace", "tools": "calculate"}], "tools.0.tools"),
                             ([{"tools": [{"tools": [{"type": "function"}]}]}], "tools.0.tools.0.tools.0.name")):
            assert_error(http.post(url, json={"model": "m", "input": "hi", "tools": tools}), 400, "invalid_value",
                         where)
        fn = {"type": "function", "name": "calculate", "parameters": {"type": "object", "properties": {}}}
        r = http.post(url, json={"model": "m", "input": "hi", "tools": [{"type": "namespace", "tools": [fn]}],
                                 "text": {"format": {"type": "text"}, "verbosity": "low"}})
        assert r.status_code == 200, r.text[:300]
        assert r.json()["text"] == {"format": {"type": "text"}, "verbosity": "low"}
        (call,) = proxy.close_episode(ep)
        assert [t["function"]["name"] for t in call.tools] == ["calculate"]


@pytest.mark.parametrize("value", ["yes", "true", 1, 0, "false"])
def test_stream_must_be_a_json_boolean(tokenizer, value):
    """`"stream": "yes"` was taken as true (pydantic's lax bool), answering a stream the client never
    asked for; now it is a 400 on all three APIs."""
    with running(tokenizer) as (proxy, _, ep, http):
        u = urls(ep)
        for api, body in (("chat", {"model": "m", "messages": USER}),
                          ("responses", {"model": "m", "input": "hi"}),
                          ("messages", {"model": "m", "max_tokens": 5, "messages": USER})):
            r = http.post(u[api], json={**body, "stream": value})
            if api == "messages":
                assert anthropic_error(r).startswith("stream:")
            else:
                assert_error(r, 400, "invalid_value", "stream")
        r = http.post(u["chat"], json={"model": "m", "messages": USER, "stream": True})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert len(proxy.close_episode(ep)) == 1


def test_a_body_with_too_many_items_is_400_naming_the_field(tokenizer):
    """More than MAX_JSON_ITEMS objects and arrays (200k tiny messages held both prepare threads, and so
    every other episode's calls, for seconds) are refused before validation; the error names the
    top-level field holding most of them. At the cap a request is served."""
    msg = {"role": "user", "content": "a"}
    with running(tokenizer, max_model_len=200_000) as (proxy, _, ep, http):
        u = urls(ep)
        over = MAX_JSON_ITEMS                     # + the messages list itself: one over the cap
        r = http.post(u["chat"], content=orjson.dumps({"model": "m", "messages": [msg] * over}))
        err = assert_error(r, 400, "invalid_value", "messages")
        assert f"more than {MAX_JSON_ITEMS} JSON objects and arrays" in err["message"]
        message = anthropic_error(http.post(u["count_tokens"], content=json.dumps(
            {"model": "m", "messages": [msg] * over})))
        assert message.startswith("messages:")
        r = http.post(u["responses"], json={"model": "m", "input": [{"role": "user", "content": [
            {"type": "input_text", "text": "a"}]}] * (over // 2)})
        assert_error(r, 400, "invalid_value", "input")
        assert_still_serves(proxy, ep, http)
    with running(tokenizer, max_body_items=10) as (proxy, _, ep, http):
        u = urls(ep)
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        r = http.post(u["chat"], json={"model": "m", "messages": USER, "tools": [tool] * 4})
        assert_error(r, 400, "invalid_value", "tools")                   # 1 + 12 in tools, 2 in messages
        # exactly at the cap (root, 2 lists, 7 messages), brackets in text not counted: served
        text = {"role": "user", "content": "{[{[ brackets in text are not objects or arrays"}
        r = http.post(u["chat"], json={"model": "m", "messages": [msg] * 6 + [text], "tools": []})
        assert r.status_code == 200, r.text[:300]
        assert len(proxy.close_episode(ep)) == 1
