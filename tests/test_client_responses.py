"""The OpenAI Responses API against a real proxy: the openai SDK's `client.responses.create` (stateless
and `previous_response_id`, streamed and not) and the OpenAI Agents SDK with its default (Responses)
model, unmodified. A ScriptedEngine calls a tool, then answers; every multi-turn episode merges into one
exact sample."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from tests.exact_sample import assert_one_exact_sample
from tests.scripted_engine import scripted_proxy

CALC = {"type": "function", "name": "calculate", "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"],
                       "additionalProperties": False}, "strict": True}
REPLIES = ['Let me compute.<tool_call>\n{"name": "calculate", "arguments": {"expression": "2*3"}}\n</tool_call>',
           "The answer is 6."]


@pytest.fixture
def proxy(tokenizer):
    with scripted_proxy(tokenizer, REPLIES) as proxy_and_engine:
        yield proxy_and_engine


def _create(client: openai.OpenAI, stream: bool, **kw):
    """`responses.create`, collecting the stream's events into its final response when streaming."""
    if not stream:
        return client.responses.create(**kw), []
    events = list(client.responses.create(stream=True, **kw))
    assert events[-1].type == "response.completed"
    return events[-1].response, events


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streaming"])
@pytest.mark.parametrize("chained", [False, True], ids=["stateless", "previous_response_id"])
def test_openai_sdk_responses_tool_episode_is_one_exact_sample(proxy, tokenizer, stream, chained):
    server, engine = proxy
    ep = server.open_episode("ep")
    client = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
    first = [{"role": "user", "content": "What is 2*3?"}]
    r1, events = _create(client, stream, model="m", instructions="You are a calculator.", input=first, tools=[CALC],
                         store=not chained)
    (msg, call) = r1.output
    assert msg.type == "message" and msg.content[0].text == "Let me compute."
    assert call.type == "function_call" and call.name == "calculate" and json.loads(call.arguments) == {"expression": "2*3"}
    assert r1.status == "completed" and r1.usage.output_tokens == len(engine.sampled[0])
    if stream:
        kinds = [e.type for e in events]
        assert kinds[:2] == ["response.created", "response.in_progress"]
        assert "response.output_text.delta" in kinds and "response.function_call_arguments.delta" in kinds
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Let me compute."
        assert [e.sequence_number for e in events] == list(range(len(events)))
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "6"}
    if chained:
        r2, _ = _create(client, stream, model="m", instructions="You are a calculator.", previous_response_id=r1.id,
                        input=[result], tools=[CALC])
    else:   # stateless: the whole conversation again, the previous output items as the SDK returned them
        r2, _ = _create(client, stream, model="m", instructions="You are a calculator.", store=False,
                        input=first + [o.model_dump(exclude_none=True) for o in r1.output] + [result], tools=[CALC])
    assert r2.output_text == "The answer is 6."
    assert client.responses.retrieve(r2.id).output_text == "The answer is 6."      # GET /v1/responses/{id}
    calls = server.close_episode(ep)
    assert [c.api for c in calls] == ["responses", "responses"]
    assert calls[0].strict_violations == []
    assert_one_exact_sample(calls, engine)


def test_responses_errors_and_hosted_tools(proxy):
    server, engine = proxy
    ep = server.open_episode("ep")
    url = ep.base_url + "/responses"
    with httpx.Client(timeout=30) as http:
        r = http.post(url, json={"model": "m", "input": "hi", "previous_response_id": "resp_nope"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "previous_response_not_found"
        r = http.post(url, json={"model": "m", "input": "hi", "bogus": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "bogus"
        r = http.post(url, json={"model": "m", "input": [{"role": "user", "content": [{"type": "input_image"}]}]})
        assert r.status_code == 400 and "text only" in r.json()["error"]["message"]
        r = http.get(url + "/resp_missing")
        assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"
        # hosted tools are left out of the prompt (and counted); hosted-service fields are ignored
        r = http.post(url, json={"model": "m", "input": "hi", "tools": [{"type": "web_search"}, CALC],
                                 "metadata": {"a": "b"}, "prompt_cache_key": "k", "include": ["reasoning.encrypted_content"],
                                 "reasoning": {"summary": "auto"}, "store": False})
        assert r.status_code == 200, r.text
    calls = server.close_episode(ep)
    assert [t["function"]["name"] for t in calls[0].tools] == ["calculate"]
    assert server.apis["responses"].hosted_tools_left_out == 1


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streaming"])
def test_openai_agents_sdk_default_model_runs_a_tool_episode(proxy, tokenizer, stream):
    agents = pytest.importorskip("agents")
    server, engine = proxy
    ep = server.open_episode("ep")

    @agents.function_tool
    def calculate(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        a, _, b = expression.partition("*")
        return str(int(a) * int(b))

    async def main():
        client = openai.AsyncOpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        agents.set_default_openai_client(client, use_for_tracing=False)
        agents.set_tracing_disabled(True)
        agent = agents.Agent(name="calc", instructions="You are a calculator.", tools=[calculate])
        if stream:
            result = agents.Runner.run_streamed(agent, "What is 2*3?")
            async for _ in result.stream_events():
                pass
            return result.final_output
        return (await agents.Runner.run(agent, "What is 2*3?")).final_output

    try:
        assert asyncio.run(main()) == "The answer is 6."
    finally:   # the default client is process-wide: leave none pointing at this proxy
        agents.set_default_openai_client(openai.AsyncOpenAI(api_key="unused"), use_for_tracing=False)
    calls = server.close_episode(ep)
    assert [c.api for c in calls] == ["responses", "responses"]
    assert calls[0].tools[0]["function"]["strict"] is True
    sample, bridges = assert_one_exact_sample(calls, engine)
    assert "6" in tokenizer.decode(bridges[0])


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streaming"])
def test_item_references_to_the_episodes_items_resolve_into_one_exact_sample(proxy, stream):
    """A client that keeps `store: true` (the default) sends earlier output back as `item_reference`s."""
    server, engine = proxy
    ep = server.open_episode("ep")
    client = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
    question = {"type": "message", "id": "msg_client_1", "role": "user", "content": "What is 2*3?"}
    r1, _ = _create(client, stream, model="m", instructions="You are a calculator.", input=[question], tools=[CALC])
    msg, call = r1.output
    refs = [{"type": "item_reference", "id": i} for i in ("msg_client_1", msg.id, call.id)]   # an input item too
    r2, _ = _create(client, stream, model="m", instructions="You are a calculator.", tools=[CALC], input=refs + [
        {"type": "function_call_output", "call_id": call.call_id, "output": "6"}])
    assert r2.output[0].content[0].text == "The answer is 6."
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(model="m", input=[{"type": "item_reference", "id": "msg_never_issued"}])
    assert exc.value.body["code"] == "item_not_found" and exc.value.body["param"] == "input.0.id"
    calls = server.close_episode(ep)
    assert [c.prompt_parent_by for c in calls] == ["none", "id"]
    assert_one_exact_sample(calls, engine)
