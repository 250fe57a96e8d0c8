"""A slow tool in one episode does not stall the others (issue 17, item 2): the sandbox is awaited, so the
rollout's event loop keeps sending the other episodes' model calls while the tool's child process runs."""

import asyncio
import time

import pytest
from transformers import AutoTokenizer

from ajet.llm_call import SamplingParams
from ajet.proxy.server import ProxyServer
from ajet.rollout.episodes import rollout
from ajet.task import Task
from ajet.tools.sandbox import run_python_async
from ajet.workflow import Tuner, Workflow, WorkflowOutput
from tests.scripted_engine import ScriptedEngine

TOOL_S = 2.0


class SlowToolWorkflow(Workflow):
    """Task "slow": one model call, then a sandboxed tool that takes TOOL_S seconds, then one more call.
    Task "fast": five model calls in a row. Each episode reports when (monotonic seconds) things happened."""

    async def execute(self, task: Task, tuner: Tuner) -> WorkflowOutput:
        messages = [{"role": "user", "content": task.query}]
        times: dict[str, float] = {}
        if task.task_id == "slow":
            await tuner.client.chat.completions.create(model=tuner.model, messages=messages)
            times["tool_start"] = time.monotonic()
            result = await run_python_async(f"import time; time.sleep({TOOL_S}); print('slept')", timeout_s=10)
            times["tool_end"] = time.monotonic()
            assert result.ok and result.stdout == "slept\n", result
            await tuner.client.chat.completions.create(model=tuner.model, messages=messages)
        else:
            await asyncio.sleep(0.3)    # start while the slow episode's tool runs
            for k in range(5):
                await tuner.client.chat.completions.create(model=tuner.model, messages=messages)
                times[f"call_{k}"] = time.monotonic()
        return WorkflowOutput(reward=1.0, metadata=times)


@pytest.fixture()
def proxy(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    p = ProxyServer(ScriptedEngine(tok, ["ok"]), tok, SamplingParams(max_tokens=8)).start()
    yield p
    p.stop()


def test_other_episodes_calls_proceed_while_a_2s_tool_runs(proxy):
    tasks = [Task(task_id="slow", query="q"), Task(task_id="fast", query="q")]
    episodes = asyncio.run(rollout(SlowToolWorkflow(), tasks, num_repeat=2, proxy=proxy, judge=None, step=0,
                                   max_concurrency=4, timeout_s=60))
    assert all(ep.ok for ep in episodes), [ep.error for ep in episodes]
    slow = [ep.output.metadata for ep in episodes if ep.task.task_id == "slow"]
    fast = [ep.output.metadata for ep in episodes if ep.task.task_id == "fast"]
    tools_end = min(s["tool_end"] for s in slow)
    assert all(s["tool_end"] - s["tool_start"] >= TOOL_S for s in slow)
    # every call of both fast episodes finished while the slow episodes' tools were still running
    assert all(f["call_4"] < tools_end for f in fast), (fast, slow)
    assert len(proxy.engine.prompts) == 2 * 2 + 2 * 5
