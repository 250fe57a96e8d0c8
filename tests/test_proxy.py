"""The proxy as a real uvicorn server on 127.0.0.1, driven by the real OpenAI SDK."""

import json

import httpx
import openai
import pytest

from ajet.llm_call import SamplingParams
from ajet.proxy.server import ProxyServer
from ajet.tracker import merge_calls
from tests.scripted_engine import ScriptedEngine

CALC_TOOL = {"type": "function", "function": {
    "name": "calculate", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


def _proxy(tokenizer, replies, **kw):
    engine = ScriptedEngine(tokenizer, replies)
    return ProxyServer(engine, tokenizer, SamplingParams(temperature=1.0, max_tokens=64), **kw).start(), engine


def test_tool_calls_are_parsed_and_five_turns_merge_into_one_sample(tokenizer):
    replies = [f'Let me compute.\n<tool_call>\n{{"name": "calculate", "arguments": {{"expression": "{i}+1"}}}}\n</tool_call>'
               for i in range(4)] + ["The answer is 5."]
    proxy, engine = _proxy(tokenizer, replies)
    try:
        ep = proxy.open_episode("ep-1")
        client = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        messages = [{"role": "system", "content": "You can call tools."}, {"role": "user", "content": "What is 4+1?"}]
        for turn in range(5):
            r = client.chat.completions.create(model="policy", messages=messages, tools=[CALC_TOOL])
            msg = r.choices[0].message
            if turn < 4:
                assert r.choices[0].finish_reason == "tool_calls"
                (tc,) = msg.tool_calls
                assert tc.function.name == "calculate"
                assert json.loads(tc.function.arguments) == {"expression": f"{turn}+1"}
                messages.append(msg.model_dump(exclude_none=True))
                messages.append({"role": "tool", "tool_call_id": tc.id, "content": str(turn + 1)})
            else:
                assert r.choices[0].finish_reason == "stop" and msg.content == "The answer is 5." and not msg.tool_calls
        calls = proxy.close_episode(ep)
    finally:
        proxy.stop()
    assert len(calls) == 5
    assert [c.prompt_parent for c in calls] == [None] + [c.call_id for c in calls[:-1]]
    assert calls[0].prompt_render_reason == "first_call"
    (sample,) = merge_calls(calls, group_id="g")
    # the merged sequence is exactly: first prompt, then each sampled reply followed by the rendered tool turn
    expected, mask = list(calls[0].prompt_ids), []
    for i, sampled in enumerate(engine.sampled):
        expected += sampled
        mask += [1] * len(sampled)
        if i + 1 < len(calls):
            bridge = calls[i + 1].prompt_ids[len(expected):]
            assert tokenizer.decode(bridge).startswith("\n<|im_start|>user\n<tool_response>")
            expected += bridge
            mask += [0] * len(bridge)
    assert sample.input_ids == expected and sample.loss_mask == mask
    assert sample.num_loss_tokens == sum(map(len, engine.sampled))
    # the prompt the engine saw for the last call is the merged sequence minus the last reply
    assert engine.prompts[-1] == expected[: -len(engine.sampled[-1])]


def test_edited_history_forks_with_reason(tokenizer):
    proxy, _ = _proxy(tokenizer, ["first reply", "second reply"])
    try:
        ep = proxy.open_episode("ep-2")
        client = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        msgs = [{"role": "user", "content": "hi"}]
        r = client.chat.completions.create(model="m", messages=msgs)
        assert r.choices[0].message.content == "first reply"
        edited = msgs + [{"role": "assistant", "content": "something I never said"}, {"role": "user", "content": "and?"}]
        client.chat.completions.create(model="m", messages=edited)
        calls = proxy.close_episode(ep)
    finally:
        proxy.stop()
    assert calls[1].prompt_parent is None and calls[1].prompt_render_reason == "history_differs"
    samples = merge_calls(calls, "g")
    assert len(samples) == 2 and samples[1].flags["fork_reason"] == "history_differs"


def test_errors_are_openai_style(tokenizer):
    proxy, _ = _proxy(tokenizer, ["ok"], max_model_len=64)
    try:
        ep = proxy.open_episode("ep-3")
        url = ep.base_url + "/chat/completions"
        with httpx.Client(timeout=10) as http:
            r = http.post(url, content=b"{not json")
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
            r = http.post(url, json={"model": "m", "messages": [{"role": "tool", "content": "x"}]})
            assert r.status_code == 400 and "tool_call_id" in r.json()["error"]["message"]
            r = http.post(url, json={"model": "m", "messages": [{"role": "user", "content": "x"}], "bogus": 1})
            assert r.status_code == 400 and r.json()["error"]["param"] == "bogus"
            r = http.post(url, json={"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 17})
            assert r.status_code == 400 and r.json()["error"]["param"] == "n"
            r = http.post(url, json={"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})
            assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
            r = http.post(url, json={"model": "m", "messages": [{"role": "user", "content": "word " * 200}]})
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
            r = http.post(proxy.url + "/ep/not-a-token/v1/chat/completions",
                          json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
            assert r.status_code == 404
            r = http.post(proxy.url + "/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
            assert r.status_code == 401
            r = http.post(ep.base_url + "/responses", json={})
            assert r.status_code == 400 and r.json()["error"]["param"] == "model"   # served: a bad body is a 400
            # the bearer-token route reaches the same episode
            r = http.post(proxy.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {ep.api_key}"},
                          json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok"
        calls = proxy.close_episode(ep)
        assert len(calls) == 1                        # rejected requests record nothing
    finally:
        proxy.stop()


def test_streaming_returns_chunks_and_records_the_call(tokenizer):
    proxy, engine = _proxy(tokenizer, ['<tool_call>\n{"name": "calculate", "arguments": {"expression": "2*3"}}\n</tool_call>'])
    try:
        ep = proxy.open_episode("ep-4")
        client = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "2*3?"}],
                                                tools=[CALC_TOOL], stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        calls = proxy.close_episode(ep)
    finally:
        proxy.stop()
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    tc_deltas = [d.tool_calls[0] for d in deltas if d.tool_calls]
    assert tc_deltas[0].id and tc_deltas[0].function.name == "calculate"   # id and name first, then arguments
    assert all(t.index == 0 for t in tc_deltas)
    assert json.loads("".join(t.function.arguments or "" for t in tc_deltas)) == {"expression": "2*3"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].usage.completion_tokens == len(engine.sampled[0])
    assert calls[0].completion_ids == engine.sampled[0]


def test_tool_choice_named_forces_the_call_opening_as_prompt_tokens(tokenizer):
    # the engine only writes the expression's end: the proxy fixed `<tool_call>... "expression": "`
    proxy, engine = _proxy(tokenizer, ['2*3"}}\n</tool_call>', "The answer is 6."])
    try:
        ep = proxy.open_episode("ep-5")
        client = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        messages = [{"role": "user", "content": "2*3?"}]
        r = client.chat.completions.create(model="m", messages=messages, tools=[CALC_TOOL],
                                           tool_choice={"type": "function", "function": {"name": "calculate"}})
        (tc,) = r.choices[0].message.tool_calls
        assert json.loads(tc.function.arguments) == {"expression": "2*3"}
        messages += [r.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": tc.id, "content": "6"}]
        client.chat.completions.create(model="m", messages=messages, tools=[CALC_TOOL])
        with pytest.raises(openai.BadRequestError, match="not in `tools`"):
            client.chat.completions.create(model="m", messages=messages, tools=[CALC_TOOL],
                                           tool_choice={"type": "function", "function": {"name": "nope"}})
        with pytest.raises(openai.BadRequestError, match="no `tools`"):
            client.chat.completions.create(model="m", messages=messages, tool_choice="required")
        calls = proxy.close_episode(ep)
    finally:
        proxy.stop()
    first, second = calls
    forced = tokenizer.encode(first.forced_text, add_special_tokens=False)
    assert first.forced_text.endswith('"arguments": {"expression": "')
    assert first.prompt_ids[-len(forced):] == forced and engine.prompts[0] == first.prompt_ids
    assert second.prompt_parent == first.call_id
    (sample,) = merge_calls(calls, "g")
    # forced tokens sit in the prompt (never trained); both sampled replies are trained
    assert sample.prompt_ids == first.prompt_ids
    assert sample.num_loss_tokens == len(engine.sampled[0]) + len(engine.sampled[1])


def test_tool_choice_required_forces_only_the_tag(tokenizer):
    proxy, _ = _proxy(tokenizer, ['calculate", "arguments": {"expression": "1+1"}}\n</tool_call>'])
    try:
        ep = proxy.open_episode("ep-6")
        client = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "1+1"}], tools=[CALC_TOOL],
                                           tool_choice="required")
        proxy.close_episode(ep)
    finally:
        proxy.stop()
    assert r.choices[0].message.tool_calls[0].function.name == "calculate"


def test_wire_messages_and_tools_are_each_items_model_dump_without_none():
    """`wire_messages` / `wire_tools` (one serializer call for the whole list) give exactly each item's
    `model_dump(exclude_none=True)`: the same keys in the same order, vendor fields kept, None-valued fields dropped
    (not None inside free-form values such as arguments or schemas)."""
    from ajet.proxy.schema import ChatCompletionRequest

    messages = [
        {"role": "user", "content": "hi", "name": None, "vendor": {"a": None}},
        {"role": "developer", "content": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}]},
        {"role": "assistant", "content": None, "reasoning_content": "r", "tool_calls": [
            {"id": None, "type": "function", "function": {"name": "f", "arguments": {"k": [1, None]}}},
            {"function": {"name": "g"}}]},
        {"role": "tool", "content": "o", "tool_call_id": "c", "name": None},
        {"role": "system", "content": None}]
    tools = [{"type": "function", "x": None, "function": {"name": "f", "description": None, "strict": None,
              "parameters": {"type": "object", "properties": {"a": {"type": "string", "default": None}}}}}]
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": messages, "tools": tools})
    want = [m.model_dump(exclude_none=True) for m in req.messages]
    assert json.dumps(req.wire_messages()) == json.dumps(want)
    assert want[0] == {"role": "user", "content": "hi", "vendor": {"a": None}} and want[4] == {"role": "system"}
    assert json.dumps(req.wire_tools()) == json.dumps([t.model_dump(exclude_none=True) for t in req.tools])
    assert ChatCompletionRequest.model_validate({"model": "m", "messages": messages}).wire_tools() is None
