"""AgentScope 2.x as the client: a ReAct `Agent` with a streaming `OpenAIChatModel` and one registered tool, against a
real ProxyServer whose ScriptedEngine emits a tool call, then a final answer.

What AgentScope 2.0.10 sends: its runtime-state reminder (`<current-time>`) is a HintBlock appended to the context,
formatted as a user message *after* the turns already there; it is injected before the first reasoning step and
again only when `InjectionConfig.time_interval` hours have passed. Appended, never rewritten, so the calls still
extend one another token for token and merge into one sample. What does fork is context compression: the summary
call has other tools (`tools_changed`) and the calls after it replace the history with the summary
(`history_differs`).
"""

import asyncio
import json

import pytest

pytest.importorskip("agentscope")

from agentscope.agent import Agent, ContextConfig, InjectionConfig, ReActConfig  # noqa: E402
from agentscope.credential import OpenAICredential  # noqa: E402
from agentscope.message import UserMsg  # noqa: E402
from agentscope.model import OpenAIChatModel  # noqa: E402
from agentscope.permission import PermissionBehavior, PermissionDecision  # noqa: E402
from agentscope.tool import FunctionTool, Toolkit  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from ajet.llm_call import SamplingParams  # noqa: E402
from ajet.proxy.server import ProxyServer  # noqa: E402
from ajet.tracker import merge_calls  # noqa: E402
from tests.exact_sample import assert_one_exact_sample  # noqa: E402
from tests.scripted_engine import ScriptedEngine  # noqa: E402

CALL_2_PLUS_3 = 'Let me compute.\n<tool_call>\n{"name": "calculate", "arguments": {"expression": "2+3"}}\n</tool_call>'
CALL_5_TIMES_2 = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "5*2"}}\n</tool_call>'
REMINDER = "<current-time>"


def _run(tokenizer, replies, injection, steps):
    """Run `steps(agent)` for an agent on a fresh proxy episode. Returns (calls, engine, agent, tool inputs)."""
    engine = ScriptedEngine(tokenizer, replies)
    proxy = ProxyServer(engine, tokenizer, SamplingParams(temperature=1.0, max_tokens=256)).start()
    ran: list[str] = []

    def calculate(expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression (`str`):
                The expression, e.g. '3 + 4'.
        """
        ran.append(expression)
        a, op, b = expression.partition("+") if "+" in expression else expression.partition("*")
        return str(int(a) + int(b) if op == "+" else int(a) * int(b))

    async def main():
        ep = proxy.open_episode("ep-as")
        model = OpenAIChatModel(credential=OpenAICredential(api_key=ep.api_key, base_url=ep.base_url),
                                model="ajet-policy", max_retries=0)
        assert model.stream is True                     # AgentScope's default: streaming chat completions
        tool = FunctionTool(calculate, permission=PermissionDecision(behavior=PermissionBehavior.ALLOW, message="ok"))
        agent = Agent(name="math", system_prompt="You are a math assistant.", model=model,
                      toolkit=Toolkit(tools=[tool]), react_config=ReActConfig(max_iters=4), injection_config=injection)
        try:
            await asyncio.wait_for(steps(agent), timeout=60)
        finally:
            await model.client.close()
        return proxy.close_episode(ep), agent

    try:
        calls, agent = asyncio.run(main())
    finally:
        proxy.stop()
    return calls, engine, agent, ran


def _reminders(call) -> int:
    return sum(REMINDER in json.dumps(m["content"]) for m in call.messages if m["role"] == "user")


@pytest.mark.parametrize("injection", [None, InjectionConfig(time_interval=0.0)], ids=["default", "every_step"])
def test_runtime_state_injection_is_appended_so_the_calls_still_merge(tokenizer, injection):
    async def steps(agent):
        reply = await agent.reply(UserMsg(name="user", content="What is 2+3?"))
        assert reply.get_text_content() == "The answer is 5."

    calls, engine, agent, ran = _run(tokenizer, [CALL_2_PLUS_3, "The answer is 5."], injection, steps)
    assert ran == ["2+3"] and len(calls) == 2
    first, second = calls
    assert [m["role"] for m in first.messages] == ["system", "user", "user"]     # question, then the reminder
    assert first.response_message["tool_calls"][0]["function"]["name"] == "calculate"
    assert [m["content"] for m in second.messages if m["role"] == "tool"] == ["5"]
    sample, (bridge,) = assert_one_exact_sample(calls, engine)
    bridge_text = tokenizer.decode(bridge)
    assert "<tool_response>\n5\n</tool_response>" in bridge_text
    if injection is None:
        # default (time_interval 0.5 h): one reminder, before the first call, kept verbatim in the second
        assert _reminders(first) == 1 and _reminders(second) == 1 and REMINDER not in bridge_text
    else:
        # injected before every reasoning step: the second one arrives after the tool result, in the bridge
        assert _reminders(first) == 1 and _reminders(second) == 2 and REMINDER in bridge_text
    assert REMINDER in tokenizer.decode(sample.prompt_ids)       # never trained on (loss mask 0)


def test_without_injection_two_replies_merge_into_one_exact_sample(tokenizer):
    async def steps(agent):
        first = await agent.reply(UserMsg(name="user", content="What is 2+3?"))
        second = await agent.reply(UserMsg(name="user", content="Now double it."))
        assert (first.get_text_content(), second.get_text_content()) == ("The answer is 5.", "It is 10.")

    replies = [CALL_2_PLUS_3, "The answer is 5.", CALL_5_TIMES_2, "It is 10."]
    calls, engine, _, ran = _run(tokenizer, replies, InjectionConfig(inject_runtime_state=False), steps)
    assert ran == ["2+3", "5*2"] and len(calls) == 4
    assert all(_reminders(c) == 0 for c in calls)
    assert [m["role"] for m in calls[0].messages] == ["system", "user"]
    assert [m["role"] for m in calls[3].messages] == ["system", "user", "assistant", "tool", "assistant", "user",
                                                       "assistant", "tool"]
    assert calls[2].messages[-1]["content"] in ("Now double it.", [{"type": "text", "text": "Now double it."}])
    _, bridges = assert_one_exact_sample(calls, engine)
    assert "Now double it." in tokenizer.decode(bridges[1])      # the user's second turn: loss mask 0


def test_context_compression_forks_with_recorded_reasons(tokenizer):
    summary = ('"task_overview": "add 2+3", "current_state": "answered 5", "important_discoveries": "none", '
               '"next_steps": "double it", "context_to_preserve": "none"}}\n</tool_call>')

    async def steps(agent):
        await agent.reply(UserMsg(name="user", content="What is 2+3?"))
        # thresholds far below the context: compression summarises everything said so far
        await agent.compress_context(ContextConfig(trigger_ratio=0.001, reserve_ratio=0.0005, context_buffer_ratio=0.0))
        assert "add 2+3" in agent.state.summary and "double it" in agent.state.summary
        reply = await agent.reply(UserMsg(name="user", content="Now double it."))
        assert reply.get_text_content() == "It is 10."

    # the summary call forces its tool: the proxy writes `<tool_call>... "arguments": {`, the engine the rest
    calls, engine, _, _ = _run(tokenizer, [CALL_2_PLUS_3, "The answer is 5.", summary, "It is 10."], None, steps)
    assert len(calls) == 4
    assert [c.prompt_render_reason for c in calls] == ["first_call", None, "tools_changed", "history_differs"]
    assert calls[1].prompt_parent == calls[0].call_id and calls[2].prompt_parent is calls[3].prompt_parent is None
    assert [t["function"]["name"] for t in calls[2].tools] == ["generate_structured_output"]
    assert calls[2].forced_text.startswith('<tool_call>\n{"name": "generate_structured_output"')
    after = json.dumps(calls[3].messages)
    assert "What is 2+3?" not in after and "Now double it." in after     # the history is gone
    samples = merge_calls(calls, "g")
    assert [s.call_ids for s in samples if "fork_reason" not in s.flags] == [[calls[0].call_id, calls[1].call_id]]
    assert sorted(s.flags["fork_reason"] for s in samples if "fork_reason" in s.flags) == \
           ["history_differs", "tools_changed"]
    # every sampled token is trained exactly once across the samples
    assert sum(s.num_loss_tokens for s in samples) == sum(map(len, engine.sampled))
