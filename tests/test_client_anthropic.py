"""The Anthropic Messages API against a real proxy: the `anthropic` SDK's `messages.create` and
`messages.stream` with tools, `count_tokens`, its error bodies, and LangChain's `ChatAnthropic`,
unmodified. A ScriptedEngine calls a tool, then answers; every multi-turn episode merges into one exact
sample, also when an episode mixes APIs."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from tests.exact_sample import assert_one_exact_sample
from tests.scripted_engine import scripted_proxy

CALC = {"name": "calculate", "description": "Evaluate an arithmetic expression.",
        "input_schema": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}
REPLIES = ['Let me compute.<tool_call>\n{"name": "calculate", "arguments": {"expression": "2*3"}}\n</tool_call>',
           "The answer is 6."]
SYSTEM = [{"type": "text", "text": "You are a calculator.", "cache_control": {"type": "ephemeral"}}]


@pytest.fixture
def proxy(tokenizer):
    with scripted_proxy(tokenizer, REPLIES) as proxy_and_engine:
        yield proxy_and_engine


def _client(ep) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=ep.anthropic_base_url, api_key=ep.api_key, max_retries=0)


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_anthropic_sdk_tool_episode_is_one_exact_sample(proxy, stream):
    server, engine = proxy
    ep = server.open_episode("ep")
    client = _client(ep)
    messages = [{"role": "user", "content": "What is 2*3?"}]

    def ask():
        kw = dict(model="m", max_tokens=64, system=SYSTEM, messages=messages, tools=[CALC],
                  metadata={"user_id": "u"}, extra_headers={"anthropic-beta": "prompt-caching-2024-07-31"})
        if not stream:
            return client.messages.create(**kw), []
        with client.messages.stream(**kw) as s:
            events = list(s)
            return s.get_final_message(), events

    m1, events = ask()
    assert [b.type for b in m1.content] == ["text", "tool_use"] and m1.stop_reason == "tool_use"
    assert m1.content[0].text == "Let me compute." and m1.content[1].input == {"expression": "2*3"}
    assert m1.usage.output_tokens == len(engine.sampled[0])
    if stream:
        kinds = [e.type for e in events]
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m1.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": m1.content[1].id, "content": "6"}]}]
    m2, _ = ask()
    assert m2.content[0].text == "The answer is 6." and m2.stop_reason == "end_turn"
    n = client.messages.count_tokens(model="m", system=SYSTEM, messages=messages, tools=[CALC]).input_tokens
    calls = server.close_episode(ep)
    assert n == len(server.prompts.encode(server.prompts.render(calls[1].messages, calls[1].tools)))
    assert [c.api for c in calls] == ["messages", "messages"]
    assert_one_exact_sample(calls, engine)


def test_an_episode_may_mix_apis_and_still_merge(proxy):
    """Turn 1 through Chat Completions, turn 2 through Messages: one sample."""
    server, engine = proxy
    ep = server.open_episode("ep")
    oa = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
    r = oa.chat.completions.create(model="m", messages=[{"role": "system", "content": "You are a calculator."},
                                                        {"role": "user", "content": "What is 2*3?"}],
                                   tools=[{"type": "function", "function": {"name": CALC["name"],
                                           "description": CALC["description"], "parameters": CALC["input_schema"]}}])
    tc = r.choices[0].message.tool_calls[0]
    _client(ep).messages.create(model="m", max_tokens=64, system="You are a calculator.", tools=[CALC], messages=[
        {"role": "user", "content": "What is 2*3?"},
        {"role": "assistant", "content": [{"type": "text", "text": r.choices[0].message.content},
                                          {"type": "tool_use", "id": tc.id, "name": "calculate",
                                           "input": {"expression": "2*3"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tc.id, "content": "6"}]}])
    calls = server.close_episode(ep)
    assert [c.api for c in calls] == ["chat", "messages"]
    assert_one_exact_sample(calls, engine)


def test_anthropic_error_bodies(proxy):
    server, _ = proxy
    ep = server.open_episode("ep")
    client = _client(ep)
    with pytest.raises(anthropic.BadRequestError) as exc:
        client.messages.create(model="m", max_tokens=16, messages=[{"role": "user", "content": "x"}],
                               extra_body={"top_k": 5})
    assert exc.value.body["type"] == "error" and exc.value.body["error"]["type"] == "invalid_request_error"
    assert "top_k" in exc.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        anthropic.Anthropic(base_url=server.url + "/ep/nope", api_key="x", max_retries=0).messages.create(
            model="m", max_tokens=16, messages=[{"role": "user", "content": "x"}])
    with httpx.Client(timeout=30) as http:   # bare path, x-api-key auth, ?beta=true
        r = http.post(server.url + "/v1/messages?beta=true", headers={"x-api-key": ep.api_key,
                      "anthropic-version": "2023-06-01"}, json={"model": "m", "max_tokens": 16,
                                                                "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 200 and r.json()["type"] == "message"
        r = http.post(server.url + "/v1/messages", json={"model": "m", "max_tokens": 16, "messages": []})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = http.post(ep.anthropic_base_url + "/v1/messages", content=b"{oops")
        assert r.status_code == 400 and r.json()["type"] == "error"
        r = http.post(ep.anthropic_base_url + "/v1/messages", json={"model": "m", "messages": [
            {"role": "user", "content": "x"}], "tools": [{"type": "web_search_20250305", "name": "web_search"}]})
        assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
        r = http.post(ep.anthropic_base_url + "/v1/messages", json={"model": "m", "max_tokens": 16, "messages": [
            {"role": "user", "content": "x"}], "tools": [{"type": "web_search_20250305", "name": "web_search"}],
            "thinking": {"type": "enabled", "budget_tokens": 1024}})
        assert r.status_code == 200, r.text
    server.close_episode(ep)
    assert server.apis["messages"].hosted_tools_left_out == 1


@pytest.mark.parametrize("streaming", [False, True], ids=["plain", "streaming"])
def test_langchain_chat_anthropic_tool_loop(proxy, tokenizer, streaming):
    pytest.importorskip("langchain_anthropic")
    from langchain_anthropic import ChatAnthropic
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def calculate(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        a, _, b = expression.partition("*")
        return str(int(a) * int(b))

    server, engine = proxy
    ep = server.open_episode("ep")
    llm = ChatAnthropic(model="m", base_url=ep.anthropic_base_url, api_key=ep.api_key, max_tokens=64,
                        max_retries=0, streaming=streaming).bind_tools([calculate])
    history = [SystemMessage("You are a calculator."), HumanMessage("What is 2*3?")]
    ai = llm.invoke(history)
    assert ai.tool_calls[0]["args"] == {"expression": "2*3"}
    history += [ai, ToolMessage(calculate.invoke(ai.tool_calls[0]["args"]), tool_call_id=ai.tool_calls[0]["id"])]
    final = llm.invoke(history)
    assert "The answer is 6." in (final.content if isinstance(final.content, str) else final.content[0]["text"])
    calls = server.close_episode(ep)
    assert [c.api for c in calls] == ["messages", "messages"]
    sample, bridges = assert_one_exact_sample(calls, engine)
    assert "6" in tokenizer.decode(bridges[0])


def test_sdk_tool_runner_drops_its_thread_and_runs_a_three_turn_episode_into_one_sample(tokenizer):
    """The SDK's tool runner sends the beta `thread` field; the proxy refuses it with the error the SDK
    recovers from (`error.details.error_code = "thread_unsupported_request"`), and the runner resends the full
    history unthreaded: two tool turns and an answer, one exact sample."""
    from anthropic import beta_tool

    ran = []

    @beta_tool
    def calculate(expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: e.g. 2*3
        """
        ran.append(expression)
        a, _, b = expression.partition("*")
        return str(int(a) * int(b))

    replies = [REPLIES[0], '<tool_call>\n{"name": "calculate", "arguments": {"expression": "6*7"}}\n</tool_call>',
               "The answer is 42."]
    with scripted_proxy(tokenizer, replies) as (server, engine):
        ep = server.open_episode("ep")
        runner = _client(ep).beta.messages.tool_runner(model="m", max_tokens=64, tools=[calculate],
                                                       messages=[{"role": "user", "content": "2*3, then times 7?"}])
        final = runner.until_done()
        calls = server.close_episode(ep)
    assert final.content[0].text == "The answer is 42." and ran == ["2*3", "6*7"]
    assert len(calls) == 3 and [c.api for c in calls] == ["messages"] * 3
    assert_one_exact_sample(calls, engine)


def test_thread_is_refused_in_the_shape_the_sdks_read(proxy):
    server, _ = proxy
    ep = server.open_episode("ep")
    with httpx.Client(timeout=30) as http:
        r = http.post(ep.anthropic_base_url + "/v1/messages", headers={"x-api-key": ep.api_key}, json={
            "model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "x"}], "thread": {"type": "new"}})
    assert r.status_code == 400 and r.json()["error"]["details"]["error_code"] == "thread_unsupported_request"
    assert server.close_episode(ep) == []
