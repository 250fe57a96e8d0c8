"""`ajet init`: each kind of project is written, its config loads as written, and one training step of it completes
through the real CLI with the tiny model (only the model, the step's size and the experiment folder are
overridden); its reward can be earned (a scripted competent reply scores what the task's answer says, a wrong one
less); a folder that holds anything is refused without --force."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ajet.cli import main
from ajet.config import load_config
from ajet.episode import Episode
from ajet.commands.init import InitError, init_project
from ajet.judges import load_judge
from ajet.llm_call import SamplingParams
from ajet.proxy.server import ProxyServer
from ajet.rollout.episodes import run_episode
from ajet.rollout.in_process import load_workflow
from ajet.tasks import load_tasks
from tests.scripted_engine import ScriptedEngine

KINDS = ["chat", "command", "harness", "mcp"]


def _init(tmp_path: Path, kind: str, capsys) -> Path:
    project = tmp_path / f"my-{kind}"
    assert main(["init", str(project), "--kind", kind]) == 0
    out = capsys.readouterr().out
    assert f"cd {project} && ajet --conf ajet.yaml --backbone=debug" in out, out
    assert f"ajet view experiments/my-{kind}" in out, out
    return project


def _train_one_step(project: Path, tiny_model_dir: str) -> tuple[list[dict], list[dict]]:
    """The project's own config with the tiny model and a 2 tasks x 2 episodes step, written beside it (so its
    relative paths resolve as they do for ajet.yaml), trained one step by the `ajet` CLI from the project folder."""
    conf = yaml.safe_load((project / "ajet.yaml").read_text())
    conf["model"]["path"] = tiny_model_dir
    conf["rollout"].update(num_repeat=2, max_tokens=16)
    conf["trainer"].update(tasks_per_step=2, tensorboard=False)
    (project / "tiny.yaml").write_text(yaml.safe_dump(conf))
    ajet = [shutil.which("ajet")] if shutil.which("ajet") else [sys.executable, "-m", "ajet"]
    proc = subprocess.run(ajet + ["--conf", "tiny.yaml", "--backbone=debug", "--steps", "1", "--exp-dir", "exp"],
                          cwd=project, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (project / "exp" / "metrics.jsonl").read_text().splitlines()]
    episodes = [json.loads(line) for line in (project / "exp" / "trajectories.jsonl").read_text().splitlines()]
    return metrics, episodes


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_loads_as_written_and_trains_one_step(kind, tiny_model_dir, tmp_path, capsys):
    project = _init(tmp_path, kind, capsys)
    cfg = load_config(project / "ajet.yaml")          # as written: the bundled model, its own tasks
    assert cfg.model.path == "smollm2-135m-instruct" and cfg.experiment_name == f"my-{kind}"
    tasks = load_tasks(cfg, "train")
    assert len(tasks) >= 3 and len({t.task_id for t in tasks}) == len(tasks)

    metrics, episodes = _train_one_step(project, tiny_model_dir)
    (step,) = [m for m in metrics if "rollout/episodes" in m]
    assert step["rollout/episodes"] == 4 and step["rollout/failed"] == 0, step
    assert len(episodes) == 4
    for ep in episodes:
        assert ep["error"] is None and ep["reward"] is not None and len(ep["calls"]) >= 1, ep.get("error")
    if kind == "chat":        # its held-out tasks were evaluated before the step and after it
        assert sum("val/reward_mean" in m for m in metrics) == 2, metrics
    if kind == "command":     # the program's stderr is kept in the episode record
        assert all(ep["task"]["task_id"] in ep["output"]["metadata"]["stderr"] for ep in episodes)
    if kind == "harness":     # every named test of the task was run and reported
        for ep in episodes:
            assert set(ep["output"]["metadata"]["tests"]) == set(ep["task"]["metadata"]["tests"]), ep["output"]
    if kind == "mcp":         # the first turn called the project's server's tool
        assert all('"name": "stock"' in ep["calls"][0]["forced_text"] for ep in episodes)
        assert step.get("tools/calls", 0) == sum(len(ep["tool_calls"]) for ep in episodes)


def _episode(project: Path, tokenizer, task_id: str, replies: list[str], tools=None) -> Episode:
    """The project's workflow and judge on one of its tasks (ajet.yaml as written), the policy replaced by
    scripted `replies` (the proxy, the tool-call parser and the tracker stay real)."""
    cfg = load_config(project / "ajet.yaml")
    task = next(t for t in load_tasks(cfg, "train") if t.task_id == task_id)
    proxy = ProxyServer(ScriptedEngine(tokenizer, replies), tokenizer, SamplingParams(max_tokens=400)).start()
    try:
        episode = Episode("init", task, "g", 0)
        asyncio.run(run_episode(load_workflow(cfg), episode, proxy, load_judge(cfg), 120, tools=tools))
    finally:
        proxy.stop()
    assert episode.ok, episode.error
    return episode


def _reward(project: Path, tokenizer, task_id: str, reply: str) -> float:
    return _episode(project, tokenizer, task_id, [reply]).reward


def test_chat_reward_is_earned_by_the_right_number(tmp_path, tokenizer, capsys):
    project = _init(tmp_path, "chat", capsys)
    assert _reward(project, tokenizer, "apples", "3 + 4 = 7. The answer is 7.") == 1.0
    assert _reward(project, tokenizer, "apples", "The answer is 12.") == 0.1
    assert _reward(project, tokenizer, "apples", "Seven, I think.") == 0.0


def test_command_reward_is_earned_by_the_capital_alone(tmp_path, tokenizer, capsys):
    project = _init(tmp_path, "command", capsys)
    assert _reward(project, tokenizer, "france", "Paris") == 1.0
    assert _reward(project, tokenizer, "france", "The capital of France is Paris.") == 0.5
    assert _reward(project, tokenizer, "france", "Lyon") == 0.0


def test_harness_reward_is_the_share_of_named_tests_the_fix_passes(tmp_path, tokenizer, capsys):
    project = _init(tmp_path, "harness", capsys)
    fixed = "```python\ndef clamp(x, low, high):\n    return max(low, min(x, high))\n```"
    episode = _episode(project, tokenizer, "clamp", [fixed])
    assert episode.reward == 1.0 and "+    return max(low, min(x, high))" in episode.output.metadata["diff"]
    assert "clamp(15, 0, 10) returns 0" in episode.calls[0].messages[0]["content"]     # the task reached the model
    # the module left as it was: of test_inside, test_above and test_below only test_below passes
    unchanged = "```python\n" + (project / "repos/clamp/clamp.py").read_text() + "```"
    assert _reward(project, tokenizer, "clamp", unchanged) == pytest.approx(1 / 3)
    assert _reward(project, tokenizer, "clamp", "I cannot help with that.") == pytest.approx(1 / 3)


def test_mcp_tool_agent_earns_the_reward_through_the_projects_server(tmp_path, tokenizer, capsys):
    from ajet.tools.mcp_hub import McpHub

    project = _init(tmp_path, "mcp", capsys)
    cfg = load_config(project / "ajet.yaml")
    task = next(t for t in load_tasks(cfg, "train") if t.query == "How many lamps are in the warehouse?")
    with capsys.disabled(), McpHub(cfg.tools, base_dir=project) as hub:   # the server's stderr needs a real fd
        assert [t["function"]["name"] for t in hub.schemas] == ["stock"]
        # the first turn's opening up to the item is forced by the config (first_tool_choice: stock)
        right = _episode(project, tokenizer, task.task_id, ['lamps"}}\n</tool_call>', f"The answer is {task.answer}."],
                         tools=hub)
        unknown = _episode(project, tokenizer, task.task_id, ['unicorns"}}\n</tool_call>', "The answer is 3."],
                           tools=hub)
        singular = _episode(project, tokenizer, task.task_id, ['Lamp"}}\n</tool_call>', "The answer is 2."], tools=hub)
    (call,) = right.tool_calls
    assert (call.name, call.arguments, call.text) == ("stock", {"item": "lamps"}, task.answer)   # the server's count
    assert right.reward == pytest.approx(1.2)                     # the right number + a tool call that ran
    (bad,) = unknown.tool_calls
    assert bad.is_error and "unknown item" in bad.text and unknown.reward == 0.0
    assert singular.tool_calls[0].text == task.answer and singular.reward == pytest.approx(0.2)   # a call that ran


def test_a_folder_that_holds_anything_is_refused_without_force(tmp_path, capsys):
    project = tmp_path / "busy"
    project.mkdir()
    (project / "notes.txt").write_text("mine\n")
    assert main(["init", str(project), "--kind", "command"]) == 2
    err = capsys.readouterr().err
    assert "is not empty (it holds notes.txt)" in err and "--force" in err
    assert sorted(p.name for p in project.iterdir()) == ["notes.txt"]
    assert main(["init", str(project), "--kind", "command", "--force"]) == 0
    assert (project / "notes.txt").read_text() == "mine\n" and (project / "agent.py").is_file()
    with pytest.raises(InitError, match="is a file"):
        init_project(project / "notes.txt", "chat")
    with pytest.raises(SystemExit):    # argparse: an unknown kind names the choices
        main(["init", str(tmp_path / "new"), "--kind", "nope"])
    assert "choose from 'chat', 'command', 'harness', 'mcp'" in capsys.readouterr().err
