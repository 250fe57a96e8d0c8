"""The math tutorial's client variants (AgentScope, LangChain, raw httpx): each Workflow runs one task against a
real ProxyServer + ScriptedEngine, and the httpx variant trains one step through the `ajet` CLI."""

import asyncio
import json
from pathlib import Path

import pytest
import yaml

from ajet.importing import load_object
from ajet.llm_call import SamplingParams
from ajet.proxy.server import ProxyServer
from ajet.task import Task
from ajet.tracker import merge_calls
from ajet.workflow import Tuner, WorkflowOutput
from tests.ajet_cli import train_one_step
from tests.scripted_engine import ScriptedEngine

TUTORIAL = Path(__file__).resolve().parent.parent / "tutorial" / "example_math_agent"
# variant -> (client library, workflow spec as written in the variant's YAML)
VARIANTS = {
    "agentscope": ("agentscope", "math_workflow_agentscope.py:MathAgentAgentScopeWorkflow"),
    "langchain": ("langchain_openai", "math_workflow_langchain.py:MathAgentLangChainWorkflow"),
    "httpx": ("httpx", "math_workflow_httpx.py:MathAgentHttpxWorkflow"),
}


def _first_task() -> Task:
    row = json.loads((TUTORIAL / "tasks" / "train.jsonl").read_text().splitlines()[0])
    return Task(task_id=row["task_id"], query=row["query"], answer=row["answer"])


def _variant_yaml(variant: str) -> dict:
    return yaml.safe_load((TUTORIAL / f"math_agent_{variant}.yaml").read_text())


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_yaml_matches_the_main_tutorial(variant):
    main, conf = yaml.safe_load((TUTORIAL / "math_agent.yaml").read_text()), _variant_yaml(variant)
    assert conf["workflow"] == VARIANTS[variant][1]
    # only the name and the workflow differ: same tasks, judge, model and hyperparameters
    assert {k: v for k, v in conf.items() if k not in ("workflow", "experiment_name")} == \
           {k: v for k, v in main.items() if k not in ("workflow", "experiment_name")}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_runs_one_task_through_the_proxy(variant, tokenizer):
    pytest.importorskip(VARIANTS[variant][0])
    task = _first_task()
    assert task.query.startswith("Omar has 9 coins and gets 8 more") and task.answer == "17"
    workflow = load_object(VARIANTS[variant][1], base_dir=TUTORIAL)()
    judge = load_object(_variant_yaml(variant)["judge"], base_dir=TUTORIAL)
    # the first call forces calculate: the proxy fixes `<tool_call>... "expression": "`, the model writes the rest
    engine = ScriptedEngine(tokenizer, ['9 + 8"}}\n</tool_call>', "The answer is 17."])
    proxy = ProxyServer(engine, tokenizer, SamplingParams(temperature=0.6, max_tokens=48)).start()
    try:
        ep = proxy.open_episode(f"ep-{variant}")
        tuner = Tuner(base_url=ep.base_url, api_key=ep.api_key, model="ajet-policy", episode_id=ep.episode_id)
        output = asyncio.run(asyncio.wait_for(workflow.execute(task, tuner), timeout=60))
        calls = proxy.close_episode(ep)
    finally:
        proxy.stop()

    assert isinstance(output, WorkflowOutput) and output.reward is None       # the judge scores it
    assert output.final_answer == "The answer is 17."
    # `9 + 8`: a valid call with the question's own numbers (grounded)
    assert output.metrics == {"turns": 2, "tool_calls": 1, "valid_tool_calls": 1, "grounded_tool_calls": 1}
    assert judge(task, output) == pytest.approx(1.2)
    json.dumps(output.metadata)

    first, second = calls
    assert first.forced_text.startswith('<tool_call>\n{"name": "calculate"')     # tool_choice reached the proxy
    (tc,) = first.response_message["tool_calls"]
    assert tc["function"]["name"] == "calculate" and json.loads(tc["function"]["arguments"]) == {"expression": "9 + 8"}
    tool_msgs = [m for m in second.messages if m["role"] == "tool"]
    assert [(m["tool_call_id"], m["content"]) for m in tool_msgs] == [(tc["id"], "17")]   # the tool really ran
    assert second.prompt_parent == first.call_id
    (sample,) = merge_calls(calls, "g")
    assert sample.prompt_ids == first.prompt_ids
    bridge = second.prompt_ids[len(first.prompt_ids) + len(engine.sampled[0]):]
    assert sample.response_ids == engine.sampled[0] + bridge + engine.sampled[1]
    assert sample.loss_mask == [1] * len(engine.sampled[0]) + [0] * len(bridge) + [1] * len(engine.sampled[1])


def test_httpx_variant_trains_one_step_with_the_cli(tiny_model_dir, tmp_path):
    conf = _variant_yaml("httpx")
    conf["model"]["path"] = tiny_model_dir
    for key in ("workflow", "judge"):
        file, _, name = conf[key].partition(":")
        conf[key] = f"{TUTORIAL / file}:{name}"
    conf["data"]["train_path"] = str(TUTORIAL / conf["data"]["train_path"])
    conf["data"].pop("test_path")                      # one training step: the held-out evaluations (validation,
    conf["trainer"]["val_freq"] = 0                    # test) have their own tests
    _, exp = train_one_step(conf, tmp_path)
    (metrics,) = [json.loads(line) for line in (exp / "metrics.jsonl").read_text().splitlines()]
    # the shipped config's dynamic sampling may roll out extra tasks to replace zero-signal groups
    extra = metrics.get("rollout/oversampled_tasks", 0)
    assert 0 <= extra <= conf["algorithm"]["dynamic_sampling"]["max_oversample"]
    n_episodes = (conf["trainer"]["tasks_per_step"] + extra) * conf["rollout"]["num_repeat"]
    assert metrics["step"] == 1 and metrics["rollout/episodes"] == n_episodes and metrics["rollout/failed"] == 0
    episodes = [json.loads(line) for line in (exp / "trajectories.jsonl").read_text().splitlines()]
    assert len(episodes) == n_episodes
    for ep in episodes:
        # every episode's first call forced the calculate tool's opening (as prompt tokens, never trained)
        assert ep["calls"][0]["forced_text"].startswith('<tool_call>\n{"name": "calculate"')
        assert ep["samples"] and all(sum(s["loss_mask"]) > 0 for s in ep["samples"])
