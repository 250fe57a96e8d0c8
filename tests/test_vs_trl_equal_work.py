"""benchmarks/vs_trl.py's equal work: the agent ajet runs there has TRL's turns (first turn free, at most two model
calls), and the benchmark flags per-episode work that differs from TRL's."""

import asyncio
import json
from pathlib import Path

from ajet.importing import load_object
from ajet.llm_call import SamplingParams
from ajet.proxy.server import ProxyServer
from ajet.task import Task
from ajet.workflow import Tuner
from benchmarks.vs_trl import EQUAL_WORK, equal_work
from tests.scripted_engine import ScriptedEngine

TUTORIAL = Path(__file__).resolve().parent.parent / "tutorial" / "example_math_agent"
CALL = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "9 + 8"}}\n</tool_call>'


def test_the_equal_work_agent_has_a_free_first_turn_and_at_most_two_calls(tokenizer):
    row = json.loads((TUTORIAL / "tasks" / "train.jsonl").read_text().splitlines()[0])
    task = Task(task_id=row["task_id"], query=row["query"], answer=row["answer"])
    workflow = load_object(EQUAL_WORK)()
    engine = ScriptedEngine(tokenizer, [CALL])            # the model calls the tool on every turn
    proxy = ProxyServer(engine, tokenizer, SamplingParams(temperature=0.8, max_tokens=48)).start()
    try:
        ep = proxy.open_episode("ep-equal-work")
        tuner = Tuner(base_url=ep.base_url, api_key=ep.api_key, model="ajet-policy", episode_id=ep.episode_id)
        output = asyncio.run(asyncio.wait_for(workflow.execute(task, tuner), timeout=60))
        calls = proxy.close_episode(ep)
    finally:
        proxy.stop()
    assert len(calls) == 2 and output.metrics["turns"] == 2          # TRL: one tool round, then one more generation
    assert not any(c.forced_text for c in calls)                     # nothing forced: the model chose each call
    assert output.metrics["tool_calls"] == 2                         # both calls were made as tool calls


def _steps(calls: int, tokens: int, episodes: int = 16) -> list[dict]:
    return [{"calls": calls, "generated_tokens": tokens, "episodes": episodes}]


def test_equal_work_flags_a_side_that_does_more_per_episode(capsys):
    assert equal_work(_steps(16, 736), _steps(16, 700))              # 46 vs 43.75 tokens an episode: within 10%
    assert not equal_work(_steps(32, 736), _steps(16, 700))          # two calls an episode against one
    assert not equal_work(_steps(16, 1100), _steps(16, 700))         # ~1.6x the tokens
    assert "NOT EQUAL WORK" in capsys.readouterr().out
