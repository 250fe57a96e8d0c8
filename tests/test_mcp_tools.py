"""MCP tools from the config (issue 15): real MCP servers over stdio and streamable HTTP on 127.0.0.1, a
server killed mid-episode, one that never answers, per-episode limits, metrics, and the built-in ToolAgent
running an episode through the real proxy."""

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from ajet.config import ConfigError, ToolAgentConfig, ToolsConfig, load_config
from ajet.episode import Episode
from ajet.judges import answer_with_tool_use_judge
from ajet.llm_call import SamplingParams
from ajet.proxy.server import ProxyServer
from ajet.rollout.episodes import run_episode
from ajet.task import Task
from ajet.tool_agent import ToolAgent
from ajet.tools.episode_tools import tool_metrics
from ajet.tools.mcp_hub import McpHub, ToolServerError
from ajet.tracker import merge_calls
from tests.local_servers import free_port
from tests.scripted_engine import ScriptedEngine

SERVER = str(Path(__file__).resolve().parent / "mcp_test_server.py")


def _hub(call_timeout_s: float = 20.0, **kw) -> McpHub:
    servers = kw.pop("servers", {"test": {"command": "python", "args": [SERVER]}})
    return McpHub(ToolsConfig(mcp_servers=servers, call_timeout_s=call_timeout_s, **kw))


async def _calls(hub: McpHub, *calls):
    tools = await hub.open_episode()
    return [await tools.call(name, args) for name, args in calls], tools


@pytest.fixture(scope="module")
def stdio_hub():
    with _hub(call_timeout_s=1.5, max_result_chars=100) as hub:
        yield hub


def test_stdio_tools_as_openai_schemas_and_results(stdio_hub):
    names = [t["function"]["name"] for t in stdio_hub.schemas]
    assert names == ["add", "pid", "hang", "crash", "fail", "big"]
    add = stdio_hub.schemas[0]
    assert add["type"] == "function" and add["function"]["description"] == "Add two integers."
    assert set(add["function"]["parameters"]["properties"]) == {"a", "b"}
    results, tools = asyncio.run(_calls(stdio_hub, ("add", {"a": 2, "b": 3}), ("add", '{"a": 4, "b": 5}'),
                                        ("add", '{"a": 4'), ("nope", {}), ("fail", {}), ("big", {"n": 500})))
    ok, from_json, bad_json, unknown, failed, big = results
    assert (ok.text, ok.is_error, ok.server) == ("5", False, "test") and from_json.text == "9"
    assert bad_json.error_kind == "bad_arguments" and "not valid JSON" in bad_json.text
    assert unknown.error_kind == "unknown_tool" and "the tools are: add, big" in unknown.text
    assert failed.error_kind == "tool_error" and "the database is locked" in failed.text
    assert big.text.startswith("y" * 100) and "400 more characters" in big.text and not big.is_error
    assert [r.name for r in tools.records] == ["add", "add", "add", "nope", "fail", "big"]


def test_a_call_that_never_answers_times_out_and_the_server_stays_usable(stdio_hub):
    t0 = time.monotonic()
    (hung, after), _ = asyncio.run(_calls(stdio_hub, ("hang", {}), ("add", {"a": 1, "b": 1})))
    assert hung.error_kind == "timeout" and "did not answer within 1.5 s" in hung.text
    assert 1.4 < hung.duration_s < 4 and time.monotonic() - t0 < 8
    assert after.text == "2" and not after.is_error


def test_a_server_that_never_answers_fails_the_start_with_its_name():
    silent = {"silent": {"command": "python", "args": ["-c", "import time; time.sleep(60)"]}}
    t0 = time.monotonic()
    with pytest.raises(ToolServerError, match="MCP server 'silent'.*did not start"):
        _hub(servers=silent, startup_timeout_s=2.0).start()
    assert time.monotonic() - t0 < 20


def test_server_killed_mid_episode_is_an_error_result_then_restarted():
    with _hub(call_timeout_s=20.0, health_check_interval_s=0.0) as hub:
        async def episode_one():
            tools = await hub.open_episode()
            pid = int((await tools.call("pid")).text)
            in_flight = asyncio.create_task(tools.call("hang"))
            await asyncio.sleep(0.5)
            os.kill(pid, signal.SIGKILL)               # the server dies while a call is in flight
            hung = await asyncio.wait_for(in_flight, 10)
            after = await tools.call("add", {"a": 1, "b": 2})
            return pid, hung, after

        t0 = time.monotonic()
        pid, hung, after = asyncio.run(episode_one())
        assert time.monotonic() - t0 < 10              # not the 20 s call timeout
        assert hung.error_kind == "server_down" and after.error_kind == "server_down", (hung, after)
        assert "unavailable" in after.text

        (new_pid, added), _ = asyncio.run(_calls(hub, ("pid", {}), ("add", {"a": 1, "b": 2})))
        assert int(new_pid.text) != pid and added.text == "3"   # restarted before the next episode


def test_per_episode_call_limit_and_step_metrics():
    with _hub(max_calls_per_episode=2) as hub:
        (a, b, c), tools = asyncio.run(_calls(hub, ("add", {"a": 1, "b": 1}), ("fail", {}), ("add", {"a": 1, "b": 1})))
        (d,), tools2 = asyncio.run(_calls(hub, ("add", {"a": 2, "b": 2})))   # a new episode has its own budget
    assert not a.is_error and b.error_kind == "tool_error" and c.error_kind == "limit" and d.text == "4"
    episodes = [Episode("e1", Task("t", "q"), "g", 0, tool_calls=tools.records),
                Episode("e2", Task("t", "q"), "g", 1, tool_calls=tools2.records)]
    m = tool_metrics(episodes)
    assert (m["tools/calls"], m["tools/errors"], m["tools/timeouts"]) == (4, 2, 0)
    assert (m["tools/calls/add"], m["tools/errors/add"], m["tools/errors/fail"]) == (3, 1, 1)
    assert episodes[0].to_dict()["tool_calls"][1]["error_kind"] == "tool_error"


@pytest.fixture(scope="module")
def http_server_url():
    port = free_port()
    proc = subprocess.Popen([sys.executable, SERVER, "--http", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.2)
    yield f"http://127.0.0.1:{port}/mcp", proc
    proc.terminate()
    proc.wait(10)


def test_streamable_http_server(http_server_url):
    url, _ = http_server_url
    with _hub(call_timeout_s=1.0, servers={"remote": {"url": url}}) as hub:
        (added, hung, after), _ = asyncio.run(_calls(hub, ("add", {"a": 20, "b": 22}), ("hang", {}),
                                                     ("add", {"a": 1, "b": 1})))
    assert (added.text, added.server) == ("42", "remote")
    assert hung.error_kind == "timeout" and after.text == "2"


def test_tool_names_shared_by_two_servers_are_prefixed(http_server_url):
    url, _ = http_server_url
    with _hub(servers={"local": {"command": "python", "args": [SERVER]}, "remote": {"url": url}}) as hub:
        names = {t["function"]["name"] for t in hub.schemas}
        (a, b), _ = asyncio.run(_calls(hub, ("local__add", {"a": 1, "b": 1}), ("remote__add", {"a": 2, "b": 2})))
    assert {"local__add", "remote__add"} <= names and (a.server, b.server) == ("local", "remote")


def test_sandbox_mcp_server():
    servers = {"sandbox": {"command": "python", "args": ["-m", "ajet.tools.sandbox_server", "--timeout-s", "2"]}}
    with _hub(servers=servers) as hub:
        (ran, hung), _ = asyncio.run(_calls(hub, ("run_python", {"code": "import os; print(6 * 7, len(os.environ))"}),
                                            ("run_python", {"code": "while True: pass"})))
    assert ran.text.startswith("42 ") and not ran.is_error
    assert "[killed: the time limit was reached]" in hung.text


def test_config_section(tmp_path):
    conf = tmp_path / "c.yaml"
    conf.write_text("workflow: ajet.tool_agent:ToolAgent\ndata: {train_path: t.jsonl}\n"
                    "tools:\n  mcp_servers:\n    db: {command: python, args: [s.py]}\n    web: {url: 'http://127.0.0.1:1/mcp'}\n"
                    "  agent: {max_turns: 2, first_tool_choice: query}\n")
    cfg = load_config(conf)
    assert cfg.tools.mcp_servers["db"].args == ["s.py"] and cfg.tools.agent.max_turns == 2
    conf.write_text("workflow: w.py:W\ndata: {train_path: t.jsonl}\ntools:\n  mcp_servers:\n    db: {args: [s.py]}\n")
    with pytest.raises(ConfigError, match="exactly one of `command`"):
        load_config(conf)
    conf.write_text("workflow: w.py:W\ndata: {train_path: t.jsonl}\ntools:\n  mcp_server: {}\n")
    with pytest.raises(ConfigError, match="did you mean `tools.mcp_servers`"):
        load_config(conf)


def test_tool_agent_episode_through_the_proxy(tiny_model_dir, stdio_hub):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = ScriptedEngine(tok, ['<tool_call>\n{"name": "add", "arguments": {"a": 9, "b": 8}}\n</tool_call>',
                                  "The answer is 17."])
    proxy = ProxyServer(engine, tok, SamplingParams(max_tokens=64)).start()
    try:
        agent = ToolAgent(ToolAgentConfig(max_turns=3))
        ep = Episode("ep", Task("t1", "Omar has 9 coins and gets 8 more. How many?", answer="17"), "g", 0)
        asyncio.run(run_episode(agent, ep, proxy, answer_with_tool_use_judge, 60, tools=stdio_hub))
    finally:
        proxy.stop()
    assert ep.ok, ep.error
    assert ep.output.final_answer == "The answer is 17." and ep.reward == pytest.approx(1.2)
    assert ep.output.metrics == {"turns": 2, "tool_calls": 1, "valid_tool_calls": 1}
    assert [(t.name, t.arguments, t.text) for t in ep.tool_calls] == [("add", {"a": 9, "b": 8}, "17")]
    assert len(ep.calls) == 2 and len(merge_calls(ep.calls, "g")) == 1   # the two turns merge into one sample
    assert '"name": "add"' in tok.decode(ep.calls[0].prompt_ids)        # the schema reached the prompt
