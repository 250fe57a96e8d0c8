"""LangChain (`ChatOpenAI` + `bind_tools`, and langgraph's prebuilt ReAct agent) and raw `httpx` as clients of a real
ProxyServer whose ScriptedEngine emits tool calls, then answers: every multi-turn episode merges into one sample whose
loss mask is 1 exactly on the engine's sampled tokens."""

import json
import warnings

import httpx
import pytest

from ajet.llm_call import SamplingParams
from ajet.proxy.server import ProxyServer
from tests.exact_sample import assert_one_exact_sample
from tests.scripted_engine import ScriptedEngine

CALC_TOOL = {"type": "function", "function": {
    "name": "calculate", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


def _tool_call(expression: str, text: str = "") -> str:
    return text + '<tool_call>\n{"name": "calculate", "arguments": {"expression": "' + expression + '"}}\n</tool_call>'


def _evaluate(expression: str) -> str:
    a, op, b = expression.partition("+") if "+" in expression else expression.partition("*")
    return str(int(a) + int(b) if op == "+" else int(a) * int(b))


@pytest.fixture
def proxy_factory(tokenizer):
    started = []

    def make(replies):
        engine = ScriptedEngine(tokenizer, replies)
        proxy = ProxyServer(engine, tokenizer, SamplingParams(temperature=1.0, max_tokens=128)).start()
        started.append(proxy)
        return proxy, engine

    yield make
    for proxy in started:
        proxy.stop()


def _exact_bridges(calls, engine, tokenizer) -> list[str]:
    """`assert_one_exact_sample`, returning the decoded bridges (tool results, user turns; loss mask 0)."""
    return [tokenizer.decode(b) for b in assert_one_exact_sample(calls, engine)[1]]


@pytest.mark.parametrize("streaming", [False, True], ids=["plain", "streaming"])
def test_chat_openai_bind_tools_manual_loop(streaming, proxy_factory, tokenizer):
    pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def calculate(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        return _evaluate(expression)

    replies = [_tool_call("2+3", "Let me compute.\n"), _tool_call("5*2"), "The answer is 10.", "You are welcome."]
    proxy, engine = proxy_factory(replies)
    ep = proxy.open_episode("ep-lc")
    llm = ChatOpenAI(base_url=ep.base_url, api_key=ep.api_key, model="ajet-policy", max_retries=0,
                     streaming=streaming, use_responses_api=False)
    bound = llm.bind_tools([calculate])
    messages = [SystemMessage("You are a math assistant."), HumanMessage("What is (2+3)*2?")]
    ran, answers = [], []
    for question in (None, "Thanks!"):
        if question:
            messages.append(HumanMessage(question))
        for _ in range(4):   # bounded tool loop: invoke -> tool messages -> invoke
            ai = bound.invoke(messages)
            messages.append(ai)
            if not ai.tool_calls:
                answers.append(ai.content)
                break
            for tc in ai.tool_calls:
                assert tc["name"] == "calculate"
                ran.append(tc["args"]["expression"])
                messages.append(ToolMessage(calculate.invoke(tc["args"]), tool_call_id=tc["id"]))
    calls = proxy.close_episode(ep)

    assert ran == ["2+3", "5*2"] and answers == ["The answer is 10.", "You are welcome."]
    assert len(calls) == 4
    assert all([(t["function"]["name"], list(t["function"]["parameters"]["properties"])) for t in c.tools]
               == [("calculate", ["expression"])] for c in calls)
    assert calls[0].response_message["content"] == "Let me compute."
    bridges = _exact_bridges(calls, engine, tokenizer)
    assert "<tool_response>\n5\n</tool_response>" in bridges[0]
    assert "<tool_response>\n10\n</tool_response>" in bridges[1]
    assert "Thanks!" in bridges[2]


def test_langgraph_prebuilt_react_agent(proxy_factory, tokenizer):
    pytest.importorskip("langchain_openai")
    prebuilt = pytest.importorskip("langgraph.prebuilt")
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    ran = []

    @tool
    def calculate(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        ran.append(expression)
        return _evaluate(expression)

    proxy, engine = proxy_factory([_tool_call("2+3"), _tool_call("5*2"), "The answer is 10."])
    ep = proxy.open_episode("ep-lg")
    llm = ChatOpenAI(base_url=ep.base_url, api_key=ep.api_key, model="ajet-policy", max_retries=0,
                     use_responses_api=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # create_react_agent is deprecated in langgraph 1.x, still shipped
        agent = prebuilt.create_react_agent(llm, [calculate], prompt="You are a math assistant.")
    out = agent.invoke({"messages": [("user", "What is (2+3)*2?")]}, {"recursion_limit": 10})
    calls = proxy.close_episode(ep)

    assert ran == ["2+3", "5*2"]
    assert [type(m).__name__ for m in out["messages"]] == ["HumanMessage", "AIMessage", "ToolMessage", "AIMessage",
                                                           "ToolMessage", "AIMessage"]
    assert out["messages"][-1].content == "The answer is 10."
    assert len(calls) == 3 and calls[0].messages[0] == {"role": "system", "content": "You are a math assistant."}
    bridges = _exact_bridges(calls, engine, tokenizer)
    assert "<tool_response>\n5\n</tool_response>" in bridges[0] and "<tool_response>\n10\n</tool_response>" in bridges[1]


def test_raw_httpx_multi_turn_with_tools(proxy_factory, tokenizer):
    proxy, engine = proxy_factory([_tool_call("2+3"), _tool_call("5*2", "Now double.\n"), "The answer is 10.",
                                   "Bye."])
    ep = proxy.open_episode("ep-httpx")
    messages = [{"role": "system", "content": "You are a math assistant."},
                {"role": "user", "content": "What is (2+3)*2?"}]
    ran, answers = [], []
    with httpx.Client(base_url=ep.base_url, headers={"Authorization": f"Bearer {ep.api_key}"}, timeout=30) as http:
        for question in (None, "Thanks, bye!"):
            if question:
                messages.append({"role": "user", "content": question})
            for _ in range(4):
                r = http.post("/chat/completions", json={"model": "ajet-policy", "messages": messages,
                                                          "tools": [CALC_TOOL]})
                assert r.status_code == 200, r.text
                choice = r.json()["choices"][0]
                message = choice["message"]
                messages.append({k: v for k, v in message.items() if v is not None})
                if not message.get("tool_calls"):
                    assert choice["finish_reason"] == "stop"
                    answers.append(message["content"])
                    break
                assert choice["finish_reason"] == "tool_calls"
                for tc in message["tool_calls"]:
                    expression = json.loads(tc["function"]["arguments"])["expression"]
                    ran.append(expression)
                    messages.append({"role": "tool", "tool_call_id": tc["id"], "content": _evaluate(expression)})
    calls = proxy.close_episode(ep)

    assert ran == ["2+3", "5*2"] and answers == ["The answer is 10.", "Bye."]
    assert calls[1].response_message["content"] == "Now double."
    bridges = _exact_bridges(calls, engine, tokenizer)
    assert len(calls) == 4 and "Thanks, bye!" in bridges[2]
