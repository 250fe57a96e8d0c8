"""An episode's timeout counts the episode's own time, not the time its calls wait in the engine's queue.

A slow engine (the debug engine over the tiny model, every forward pass, i.e. every sampled token, held up by
a fixed delay; one row, so calls queue one behind the other) serves more concurrent episodes than it can
answer within the timeout. Episodes that only waited in the queue finish; an agent that takes too long itself
still times out. Once for in-process workflows (`rollout.episode_timeout_s`), once for command workflows
(`workflow.timeout_s`).

The figures leave wide margins for a loaded machine: each call holds the engine DELAY_S * TOKENS = 3.2 s (sleeps,
a lower bound whatever the load), so the fifth call waits at least 12.8 s, beyond TIMEOUT_S = 8 s, while an
episode's own time is one call (3.2 s plus the tiny model's forward passes and the HTTP round trip).
"""

from __future__ import annotations

import asyncio
import sys
import time
import textwrap

import openai  # noqa: F401 - imported here, not inside the first episode's own time
import pytest

from ajet.engines.in_process import HFEngine
from ajet.config import CommandWorkflowConfig
from ajet.llm_call import SamplingParams
from ajet.proxy.server import ProxyServer
from ajet.rollout.command import CommandWorkflow
from ajet.rollout.episodes import rollout
from ajet.task import Task
from ajet.workflow import Workflow, WorkflowOutput

DELAY_S = 0.4        # per forward pass (one sampled token per row)
TOKENS = 8           # every call samples exactly this many (no end-of-turn id: it runs to max_tokens)
TIMEOUT_S = 8.0      # the episode's limit
EPISODES = 5         # calls queue one behind the other: the last waits >= 4 * 3.2 s = 12.8 s
STALL = "stall"      # a task whose agent, once answered, never returns: it must still time out


class OneCall(Workflow):
    """One chat call; for the STALL task, then waits forever (its own time, which the timeout must count)."""

    async def execute(self, task, tuner):
        r = await tuner.client.chat.completions.create(model=tuner.model,
                                                       messages=[{"role": "user", "content": task.query}])
        if task.query == STALL:
            await asyncio.Event().wait()
        return WorkflowOutput(reward=1.0, final_answer=r.choices[0].message.content or "")


COMMAND = textwrap.dedent('''
    import json, os, sys, time, urllib.request

    task = json.loads(os.environ["AJET_TASK"])
    body = json.dumps({"model": os.environ["AJET_MODEL"], "messages": [{"role": "user", "content": task["query"]}]})
    req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", data=body.encode(),
                                 headers={"Content-Type": "application/json",
                                          "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
    with urllib.request.urlopen(req, timeout=600) as r:
        json.load(r)
    if task["query"] == "stall":
        time.sleep(600)
    print(json.dumps({"reward": 1.0}))
''')


@pytest.fixture(scope="module")
def slow_proxy(tiny_model_dir):
    """A started proxy over a one-row debug engine whose every forward pass takes DELAY_S longer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.register_forward_hook(lambda *_: time.sleep(DELAY_S))
    engine = HFEngine(model, eos_token_ids=[], pad_token_id=tok.pad_token_id, max_batch_size=1, max_model_len=512,
                      prefix_cache_bytes=0)
    proxy = ProxyServer(engine, tok, SamplingParams(temperature=1.0, max_tokens=TOKENS), seed=0).start()
    try:
        yield proxy
    finally:
        proxy.stop()
        engine.close()


def _tasks() -> list[Task]:
    return [Task(f"t{i}", f"say {i}") for i in range(EPISODES - 1)] + [Task("stall", STALL)]


def _check(episodes, timeout_field: str) -> None:
    by_id = {e.task.task_id: e for e in episodes}
    stalled = by_id.pop("stall")
    for e in by_id.values():      # only queued: none timed out
        assert e.error is None and e.reward == 1.0, (e.task.task_id, e.error)
        assert len(e.calls) == 1 and len(e.calls[0].completion_ids) == TOKENS
    # the scenario: some call waited in the queue longer than the whole limit (the sleeps alone make it so)
    queued = [c.timings["queued_s"] for e in episodes for c in e.calls]
    assert max(queued) > TIMEOUT_S, queued
    # the agent that takes too long itself still times out, after its call was answered
    assert stalled.error is not None and f"ran longer than {timeout_field}={TIMEOUT_S}" in stalled.error
    assert "its calls waited in the engine's queue" in stalled.error
    assert len(stalled.calls) == 1


def test_episodes_only_queued_behind_the_engine_do_not_time_out_in_process(slow_proxy):
    episodes = asyncio.run(rollout(OneCall(), _tasks(), 1, slow_proxy, None, step=1, max_concurrency=EPISODES,
                                   timeout_s=TIMEOUT_S))
    _check(episodes, "episode_timeout_s")


def test_episodes_only_queued_behind_the_engine_do_not_time_out_as_commands(slow_proxy, tmp_path):
    (tmp_path / "agent.py").write_text(COMMAND)
    workflow = CommandWorkflow(CommandWorkflowConfig(command=[sys.executable, "agent.py"], timeout_s=TIMEOUT_S),
                               tmp_path)
    # the command's own limit is the one that applies (the episode's is far away)
    episodes = asyncio.run(rollout(workflow, _tasks(), 1, slow_proxy, None, step=1, max_concurrency=EPISODES,
                                   timeout_s=600.0))
    _check(episodes, "workflow.timeout_s")
