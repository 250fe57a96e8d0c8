"""`ajet.Job`: an experiment of Python objects (an async episode function, a lambda judge, a list of task dicts)
trains the tiny model through the real proxy and trainer, inside a running event loop as in a notebook; its config
keys are checked as a YAML file's are; `to_yaml` refuses what cannot be imported by path and writes a config the
`ajet` command runs to the same result as `await job.arun()`."""

from __future__ import annotations

import asyncio
import importlib
import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

import ajet
from ajet import WorkflowOutput
from ajet.config import load_config
from ajet.errors import ConfigError

TASKS = [{"task_id": "add", "query": "What is 2 plus 3?", "answer": "5"},
         {"task_id": "sub", "query": "What is 9 minus 4?", "answer": "5", "level": 2}]


def _small(tiny_model_dir: str, exp_dir: Path) -> dict:
    """The config keys of a one-step run on the tiny model."""
    return {"model": {"path": tiny_model_dir, "max_model_len": 512},
            "rollout": {"num_repeat": 2, "max_tokens": 8},
            "trainer": {"total_steps": 1, "tasks_per_step": 2, "tensorboard": False, "exp_dir": str(exp_dir)},
            "data": {"shuffle": False}}


def test_a_job_of_python_objects_trains_one_step_inside_a_running_event_loop(tiny_model_dir, tmp_path):
    seen: list[tuple[str, str]] = []   # (task id, the model's answer) of every episode, as the episodes saw them

    async def episode(task, tuner):
        r = await tuner.client.chat.completions.create(model=tuner.model,
                                                       messages=[{"role": "user", "content": task.query}])
        text = r.choices[0].message.content or ""
        seen.append((task.task_id, text))
        return WorkflowOutput(final_answer=text)

    job = ajet.Job(episode, judge=lambda task, output: float(len(output.final_answer) % 3), tasks=TASKS,
                   **_small(tiny_model_dir, tmp_path / "exp"))
    handler = signal.getsignal(signal.SIGINT)

    async def notebook_cell():   # an event loop is running, as in Jupyter: run() must not use it
        return job.run()

    result = asyncio.run(notebook_cell())
    assert signal.getsignal(signal.SIGINT) is handler   # no signal handler installed
    assert result.exp_dir == tmp_path / "exp"
    assert [row["step"] for row in result.steps] == [1]
    step = result.steps[0]
    assert len(seen) == 4 and sorted({t for t, _ in seen}) == ["add", "sub"]
    assert step["rollout/episodes"] == 4 and step["rollout/failed"] == 0 and step["rollout/calls"] == 4
    rewards = [float(len(text) % 3) for _, text in seen]
    assert step["reward/mean"] == pytest.approx(sum(rewards) / 4)
    assert step["policy_version"] == 1
    assert result.checkpoint == str(tmp_path / "exp" / "checkpoints" / "step_1")
    assert (Path(result.checkpoint) / "trainer_state.pt").is_file()
    # the tasks as the run read them: written into the experiment folder, named by its config.json
    rows = [json.loads(line) for line in (tmp_path / "exp" / "tasks" / "train.jsonl").read_text().splitlines()]
    assert rows == TASKS
    assert json.loads((tmp_path / "exp" / "config.json").read_text())["data"]["train_path"] == \
        str(tmp_path / "exp" / "tasks" / "train.jsonl")


def test_a_config_typo_as_a_keyword_is_the_error_the_yaml_gets(tmp_path):
    async def episode(task, tuner):
        return WorkflowOutput(reward=0.0)

    (tmp_path / "t.jsonl").write_text(json.dumps(TASKS[0]) + "\n")
    conf = tmp_path / "conf.yaml"
    conf.write_text("workflow: wf.py:W\ndata: {train_path: t.jsonl}\ntrainer: {total_step: 2}\n")
    with pytest.raises(ConfigError) as from_yaml:
        load_config(conf)
    for typo in ({"trainer": {"total_step": 2}}, {"trainer.total_step": 2}):
        with pytest.raises(ConfigError) as from_job:
            ajet.Job(episode, tasks=TASKS, **typo)
        said = str(from_job.value)
        assert said.startswith("Job(...): unknown key `trainer.total_step`. did you mean `trainer.total_steps`?")
        assert said.removeprefix("Job(...)") == str(from_yaml.value).removeprefix(str(conf))
    with pytest.raises(ConfigError) as bad_value:
        ajet.Job(episode, tasks=TASKS, rollout={"num_repeat": 0})
    assert str(bad_value.value) == "Job(...):\n`rollout.num_repeat`: Input should be greater than or equal to 1 (got 0)"
    with pytest.raises(ConfigError, match=r"tasks\[1\]: a task row needs `query`"):
        ajet.Job(episode, tasks=[TASKS[0], {"qeury": "x"}])


def test_to_yaml_refuses_objects_defined_in_main_naming_them(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import ajet
        from ajet import WorkflowOutput
        from ajet.errors import ConfigError

        async def my_episode(task, tuner):
            return WorkflowOutput(reward=1.0)

        def my_judge(task, output):
            return 1.0

        job = ajet.Job(my_episode, judge=my_judge, tasks=[{"query": "q"}])
        try:
            job.to_yaml("job.yaml")
        except ConfigError as exc:
            print(exc)
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == (
        "Job.to_yaml: workflow my_episode is defined in __main__ (a script or a notebook), which cannot be imported "
        "by path; judge my_judge is defined in __main__ (a script or a notebook), which cannot be imported by path: "
        "a config names what it runs by an importable path; move it into a .py file and import it from there")
    assert not (tmp_path / "job.yaml").exists() and not list(tmp_path.glob("*.jsonl"))


AGENT = '''
from ajet import WorkflowOutput


async def episode(task, tuner):
    r = await tuner.client.chat.completions.create(model=tuner.model, messages=[{"role": "user", "content": task.query}])
    return WorkflowOutput(final_answer=r.choices[0].message.content or "")


def judge(task, output):
    return float(len(output.final_answer) % 3)
'''


def test_to_yaml_of_importable_objects_runs_under_the_cli_as_the_job_runs(tiny_model_dir, tmp_path, monkeypatch):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "job_agent_mod.py").write_text(AGENT)
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    monkeypatch.chdir(tmp_path)
    agent = importlib.import_module("job_agent_mod")
    try:
        job = ajet.Job(agent.episode, judge=agent.judge, tasks=TASKS, **_small(tiny_model_dir, Path("exp")))
        with pytest.raises(ConfigError, match=r"judge <lambda> is a lambda, which cannot be imported by path"):
            ajet.Job(agent.episode, judge=lambda t, o: 1.0, tasks=TASKS).to_yaml(tmp_path / "conf" / "no.yaml")
        written = job.to_yaml(tmp_path / "conf" / "job.yaml")
        from_job = asyncio.run(job.arun())
    finally:
        sys.modules.pop("job_agent_mod", None)
    conf = yaml.safe_load(written.read_text())
    assert conf["workflow"] == "../src/job_agent_mod.py:episode" and conf["judge"] == "../src/job_agent_mod.py:judge"
    assert conf["data"]["train_path"] == "job.train.jsonl"
    assert [json.loads(line) for line in (tmp_path / "conf" / "job.train.jsonl").read_text().splitlines()] == TASKS
    # the same experiment from the command line, in another folder: the same tasks, episodes and update
    proc = subprocess.run([sys.executable, "-m", "ajet", "--conf", "conf/job.yaml", "--exp-dir", "cli_exp"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cli_steps = [json.loads(line) for line in (tmp_path / "cli_exp" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in cli_steps] == [1]
    same = ("rollout/episodes", "rollout/failed", "reward/mean", "rollout/generated_tokens", "tracker/loss_tokens")
    assert {k: cli_steps[0][k] for k in same} == {k: from_job.steps[0][k] for k in same}
    assert from_job.steps[0]["rollout/failed"] == 0 and from_job.checkpoint is not None


def test_from_yaml_applies_keywords_as_the_command_lines_overrides(tmp_path):
    (tmp_path / "t.jsonl").write_text(json.dumps(TASKS[0]) + "\n")
    conf = tmp_path / "conf.yaml"
    conf.write_text("workflow: wf.py:W\ndata: {train_path: t.jsonl}\ntrainer: {total_steps: 5, seed: 7}\n")
    job = ajet.Job.from_yaml(conf, trainer={"total_steps": 2}, **{"rollout.num_repeat": 3})
    # a section's dict merges into the file's section (seed kept), as `trainer.total_steps=2` on the command line
    assert (job.config.trainer.total_steps, job.config.trainer.seed, job.config.rollout.num_repeat) == (2, 7, 3)
    assert job.config == load_config(conf, {"trainer.total_steps": 2, "rollout.num_repeat": 3})
    with pytest.raises(ConfigError, match=r"^Job.from_yaml keywords: unknown key `trainer.total_step`. did you mean"):
        ajet.Job.from_yaml(conf, trainer={"total_step": 2})
    with pytest.raises(ConfigError, match=r"read from .*, whose relative paths resolve against that folder"):
        job.to_yaml(tmp_path / "elsewhere" / "conf.yaml")
    assert job.to_yaml(tmp_path / "again.yaml") and load_config(tmp_path / "again.yaml").trainer.total_steps == 2


def test_tasks_as_task_objects_and_a_dataset_are_the_rows_the_reader_reads_back(tmp_path):
    import datasets

    from ajet.task import Task
    from ajet.tasks import read_jsonl_tasks

    async def episode(task, tuner):
        return WorkflowOutput(reward=0.0)

    given = [Task("a", "What is 1 plus 1?", "2", {"level": 1}), Task("b", "Say hi.")]
    job = ajet.Job(episode, tasks=given, val_tasks=datasets.Dataset.from_list(TASKS),
                   trainer={"exp_dir": str(tmp_path / "exp")})
    read = job._mode().read_datasets(job.config)   # what the run reads, after the trainer's folder check
    assert read == {"train": given}
    assert job.config.data.val_path == str(tmp_path / "exp" / "tasks" / "val.jsonl")
    assert [t.query for t in read_jsonl_tasks(job.config.data.val_path)] == [t["query"] for t in TASKS]
    with pytest.raises(ConfigError, match=r"the train tasks are given twice, as tasks= and data.train_path"):
        ajet.Job(episode, tasks=given, data={"train_path": "t.jsonl"})
    with pytest.raises(ConfigError, match=r"tasks= is a mapping \(a DatasetDict\?\)"):
        ajet.Job(episode, tasks=datasets.DatasetDict({"train": datasets.Dataset.from_list(TASKS)}))


def test_without_the_training_dependencies_a_job_says_what_to_install(monkeypatch):
    import importlib.util

    from ajet.errors import AjetError

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else find_spec(name, *a))
    with pytest.raises(AjetError) as missing:
        ajet.Job(None, tasks=TASKS)
    assert str(missing.value) == "ajet.Job needs the training dependencies: pip install 'ajet[train]' (not installed: torch)"
