"""An agent that brings its own MCP client keeps working unmodified (issue 15, item 3): AgentScope's ReAct agent
with its own `MCPClient` on the test stdio server, its model calls through the real proxy; the tool runs in the
agent's process (ajet only sees the model calls), and the episode's calls merge into one sample."""

import asyncio
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from ajet.llm_call import SamplingParams
from ajet.proxy.server import ProxyServer
from ajet.tracker import merge_calls
from tests.scripted_engine import ScriptedEngine

agentscope = pytest.importorskip("agentscope")
from agentscope.agent import Agent, InjectionConfig, ReActConfig  # noqa: E402
from agentscope.credential import OpenAICredential  # noqa: E402
from agentscope.mcp import MCPClient, StdioMCPConfig  # noqa: E402
from agentscope.message import UserMsg  # noqa: E402
from agentscope.model import OpenAIChatModel  # noqa: E402
from agentscope.tool import Toolkit  # noqa: E402

SERVER = str(Path(__file__).resolve().parent / "mcp_test_server.py")


async def _episode(base_url: str, api_key: str) -> str:
    mcp = MCPClient(name="test", is_stateful=True, mcp_config=StdioMCPConfig(command=sys.executable, args=[SERVER]))
    await mcp.connect()
    model = OpenAIChatModel(credential=OpenAICredential(api_key=api_key, base_url=base_url), model="m",
                            max_retries=0, client_kwargs={"timeout": 60})
    try:
        tools = [t for t in await mcp.list_tools() if t.name == "mcp__test__add"]
        agent = Agent(name="a", system_prompt="Use the tools.", model=model, toolkit=Toolkit(tools=tools),
                      react_config=ReActConfig(max_iters=3), injection_config=InjectionConfig(inject_runtime_state=False))
        reply = await agent.reply(UserMsg(name="user", content="What is 9 + 8?"))
        return reply.get_text_content() or ""
    finally:
        await model.client.close()
        await mcp.close()


def test_agentscope_with_its_own_mcp_client_merges_into_one_sample(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = ScriptedEngine(tok, ['<tool_call>\n{"name": "mcp__test__add", "arguments": {"a": 9, "b": 8}}\n</tool_call>',
                                  "The answer is 17."])
    proxy = ProxyServer(engine, tok, SamplingParams(max_tokens=64)).start()
    try:
        ep = proxy.open_episode("own-mcp")
        answer = asyncio.run(asyncio.wait_for(_episode(ep.base_url, ep.api_key), 120))
        calls = proxy.close_episode(ep)
    finally:
        proxy.stop()
    assert answer == "The answer is 17."
    assert len(calls) == 2
    second_prompt = tok.decode(calls[1].prompt_ids)
    assert "17" in second_prompt.split("</tool_call>")[-1]      # the MCP server's result reached the model
    (sample,) = merge_calls(calls, "g")                          # one sample: the calls extend each other
    assert sum(sample.loss_mask) == len(engine.sampled[0]) + len(engine.sampled[1])
