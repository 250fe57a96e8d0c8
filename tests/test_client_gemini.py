"""The Gemini API against a real proxy with the real `google-genai` SDK (base URL through `HttpOptions`):
`generate_content` and `generate_content_stream` with function declarations, the SDK's automatic function
calling, `count_tokens`, Google's error shape, and an episode that mixes Gemini with Chat Completions. A
ScriptedEngine calls a tool, then answers; every multi-turn episode merges into one exact sample."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.exact_sample import assert_one_exact_sample
from tests.scripted_engine import scripted_proxy

genai = pytest.importorskip("google.genai")
from google.genai import errors, types  # noqa: E402

REPLIES = ['Let me compute.<tool_call>\n{"name": "calculate", "arguments": {"expression": "2*3"}}\n</tool_call>',
           "The answer is 6."]
CALC = types.FunctionDeclaration(name="calculate", description="Evaluate an arithmetic expression.",
                                 parameters=types.Schema(type="OBJECT", properties={"expression": types.Schema(
                                     type="STRING")}, required=["expression"]))


@pytest.fixture
def proxy(tokenizer):
    with scripted_proxy(tokenizer, REPLIES) as proxy_and_engine:
        yield proxy_and_engine


def _client(ep) -> genai.Client:
    return genai.Client(api_key=ep.api_key, http_options=types.HttpOptions(base_url=ep.gemini_base_url))


def _config(**kw) -> types.GenerateContentConfig:
    return types.GenerateContentConfig(system_instruction="You are a calculator.", tools=[types.Tool(
        function_declarations=[CALC])], max_output_tokens=64, **kw)


@pytest.mark.parametrize("stream", [False, True], ids=["generate", "stream"])
def test_genai_sdk_tool_episode_is_one_exact_sample(proxy, stream):
    server, engine = proxy
    ep = server.open_episode("ep")
    client = _client(ep)
    contents = [types.Content(role="user", parts=[types.Part(text="What is 2*3?")])]

    def ask():
        if not stream:
            return client.models.generate_content(model="gemini-2.5-pro", contents=contents, config=_config())
        chunks = list(client.models.generate_content_stream(model="gemini-2.5-pro", contents=contents,
                                                            config=_config()))
        assert len(chunks) >= 2
        parts = [p for c in chunks for p in (c.candidates[0].content.parts or [])]
        texts = "".join(p.text for p in parts if p.text)
        calls = [p for p in parts if p.function_call]
        return chunks[-1], texts, calls

    if stream:
        last, text, fc_parts = ask()
        assert text == "Let me compute." and last.candidates[0].finish_reason == "STOP"
        usage = last.usage_metadata
    else:
        r = ask()
        fc_parts = [p for p in r.candidates[0].content.parts if p.function_call]
        assert r.text == "Let me compute." if not r.function_calls else r.candidates[0].content.parts[0].text == \
            "Let me compute."
        usage = r.usage_metadata
    (fc,) = [p.function_call for p in fc_parts]
    assert fc.name == "calculate" and fc.args == {"expression": "2*3"} and fc.id.startswith("call_")
    assert usage.candidates_token_count == len(engine.sampled[0])
    contents += [types.Content(role="model", parts=[types.Part(text="Let me compute."), *fc_parts]),
                 types.Content(role="user", parts=[types.Part(function_response=types.FunctionResponse(
                     id=fc.id, name="calculate", response={"output": "6"}))])]
    final = client.models.generate_content(model="gemini-2.5-pro", contents=contents, config=_config())
    assert final.text == "The answer is 6." and final.candidates[0].finish_reason == "STOP"
    n = client.models.count_tokens(model="gemini-2.5-pro", contents=contents).total_tokens
    calls = server.close_episode(ep)
    assert n > 0 and [c.api for c in calls] == ["gemini", "gemini"]
    assert calls[1].prompt_parent_by == "id"
    assert_one_exact_sample(calls, engine)


def test_automatic_function_calling_runs_the_tool_and_merges(proxy):
    """The SDK runs a Python function itself and sends the result back: two calls, one sample."""
    server, engine = proxy
    ep = server.open_episode("ep")
    ran = []

    def calculate(expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: e.g. 2*3
        """
        ran.append(expression)
        a, _, b = expression.partition("*")
        return str(int(a) * int(b))

    client = _client(ep)   # kept: a Client closes its connection when collected
    r = client.models.generate_content(model="m", contents="What is 2*3?", config=types.GenerateContentConfig(
        system_instruction="You are a calculator.", tools=[calculate], max_output_tokens=64))
    calls = server.close_episode(ep)
    assert r.text == "The answer is 6." and ran == ["2*3"]
    assert_one_exact_sample(calls, engine)


def test_an_episode_may_mix_gemini_with_chat_completions(proxy):
    server, engine = proxy
    ep = server.open_episode("ep")
    oa = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
    # the schema's keys in the order the genai SDK sends them: the template renders the tools as sent
    tools = [{"type": "function", "function": {"name": "calculate", "description": "Evaluate an arithmetic "
              "expression.", "parameters": {"properties": {"expression": {"type": "string"}},
                                            "required": ["expression"], "type": "object"}}}]
    r = oa.chat.completions.create(model="m", tools=tools, messages=[
        {"role": "system", "content": "You are a calculator."}, {"role": "user", "content": "What is 2*3?"}])
    tc = r.choices[0].message.tool_calls[0]
    client = _client(ep)
    client.models.generate_content(model="m", config=_config(), contents=[
        types.Content(role="user", parts=[types.Part(text="What is 2*3?")]),
        types.Content(role="model", parts=[types.Part(text=r.choices[0].message.content), types.Part(
            function_call=types.FunctionCall(id=tc.id, name="calculate", args={"expression": "2*3"}))]),
        types.Content(role="user", parts=[types.Part(function_response=types.FunctionResponse(
            id=tc.id, name="calculate", response={"output": "6"}))])])
    calls = server.close_episode(ep)
    assert [c.api for c in calls] == ["chat", "gemini"]
    assert_one_exact_sample(calls, engine)


def test_errors_have_googles_shape(proxy):
    server, _ = proxy
    ep = server.open_episode("ep")
    client = _client(ep)
    with pytest.raises(errors.ClientError) as exc:
        client.models.generate_content(model="m", contents="x", config=types.GenerateContentConfig(presence_penalty=1))
    assert exc.value.code == 400 and exc.value.status == "INVALID_ARGUMENT" and "penalties" in exc.value.message
    # topK (Gemini CLI sends 64): the config's sampling replaces the client's, unless the client's is to win
    assert client.models.generate_content(model="m", contents="x", config=types.GenerateContentConfig(top_k=5)).text
    server.sampling_policy = "client"
    with pytest.raises(errors.ClientError) as exc:
        client.models.generate_content(model="m", contents="x", config=types.GenerateContentConfig(top_k=5))
    assert exc.value.code == 400 and "topK" in exc.value.message
    server.sampling_policy = "config"
    stranger = genai.Client(api_key="x", http_options=types.HttpOptions(base_url=server.url + "/ep/nope"))
    with pytest.raises(errors.ClientError) as exc:
        stranger.models.generate_content(model="m", contents="x")
    assert exc.value.code == 404 and exc.value.status == "NOT_FOUND"
    with httpx.Client(timeout=30) as http:   # bare path, x-goog-api-key auth; a bad body
        url = server.url + "/v1beta/models/m:generateContent"
        r = http.post(url, headers={"x-goog-api-key": ep.api_key}, json={"contents": [{"parts": [{"text": "x"}]}]})
        assert r.status_code == 200 and r.json()["candidates"][0]["content"]["role"] == "model"
        r = http.post(url, headers={"x-goog-api-key": ep.api_key}, json={"contents": [], "bogus": 1})
        assert r.status_code == 400 and r.json()["error"]["status"] == "INVALID_ARGUMENT"
        r = http.post(url + "?key=" + ep.api_key, content=b"{oops")
        assert r.status_code == 400 and r.json()["error"]["code"] == 400
    server.close_episode(ep)
