"""A judge that cannot score an episode (it raises, a package it needs is missing, it returns NaN or a non-number)
fails that episode, naming the judge, never a reward of 0; each distinct error is printed once and a run whose every
episode fails so stops as a run that trains nothing does. The harness's tests judge fails an episode whose test
command cannot run (no pytest), and `ajet init --kind harness` and a harness run say before they start that pytest
is missing. A real `python -m ajet` run on the tiny model, the harness project's episode on a scripted policy, the
tests judge's real test command."""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from ajet.cli import main
from ajet.config import load_config
from ajet.episode import Episode
from ajet.judges import JudgeError, call_judge, judge_name, load_judge, math_answer_judge
from ajet.judges.tests import run_tests
from ajet.llm_call import SamplingParams
from ajet.proxy.server import ProxyServer
from ajet.rollout.episode_queue import EpisodeQueue
from ajet.rollout.episodes import run_episode
from ajet.rollout.in_process import load_workflow
from ajet.task import Task
from ajet.task_sampler import MultiTaskSampler
from ajet.tasks import load_tasks
from ajet.tools.workdir_sandbox import WorkdirLimits
from ajet.workflow import WorkflowOutput
from tests.scripted_engine import ScriptedEngine
from tests.test_episode_queue import FakeProxy

REPO = Path(__file__).resolve().parents[1]
WORKFLOW = '''
from ajet.workflow import Workflow, WorkflowOutput


class Answer(Workflow):
    async def execute(self, task, tuner):
        r = await tuner.client.chat.completions.create(
            model=tuner.model, messages=[{"role": "user", "content": task.query}])
        return WorkflowOutput(final_answer=r.choices[0].message.content or "")
'''
JUDGE = '''import math


def score(task, output):
    if task.task_id in ("t0", "t2"):
        return {}["missing"]
    return math.nan
'''
RAISE_LINE = JUDGE.splitlines().index('        return {}["missing"]') + 1
NO_PYTEST = "No module named pytest"
# runs `ajet` without pytest importable: `-c CODE ARGS`
HIDE_PYTEST = "import sys; sys.modules['pytest'] = None; from ajet.cli import main; sys.exit(main(sys.argv[1:]))"


def test_a_run_whose_judge_fails_names_it_once_per_error_and_stops_as_a_run_that_trains_nothing(tiny_model_dir,
                                                                                                 tmp_path):
    (tmp_path / "wf.py").write_text(WORKFLOW)
    (tmp_path / "judge.py").write_text(JUDGE)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"task_id": f"t{i}", "query": f"Say {i}."}) + "\n"
                                                  for i in range(4)))
    (tmp_path / "conf.yaml").write_text(textwrap.dedent(f"""
        experiment_name: judged
        workflow: wf.py:Answer
        judge: judge.py:score
        model: {{path: "{tiny_model_dir}", max_model_len: 512}}
        data: {{train_path: train.jsonl, shuffle: false}}
        rollout: {{num_repeat: 2, max_tokens: 4, temperature: 1.0}}
        algorithm: {{lr: 1.0e-3}}
        trainer: {{total_steps: 4, tasks_per_step: 2, tensorboard: false, max_failed_steps: 2}}
    """))
    proc = subprocess.run([sys.executable, "-m", "ajet", "--conf", "conf.yaml", "--exp-dir", "exp"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    out, err = proc.stdout, proc.stderr
    raised = (f"JudgeError: judge judge.py:score failed: KeyError: 'missing' (at judge.py:{RAISE_LINE} in score; "
              f"2 episodes)")
    nan = "JudgeError: judge judge.py:score returned nan, not a finite reward (2 episodes)"
    assert proc.returncode == 2, out + err
    for said in (raised, nan):                  # each distinct error: once on the console, and in the error
        assert out.count(said) == 1 and said in err, out + err
    assert err.startswith("ajet: error: 2 steps in a row produced no usable episode"), err
    assert "Traceback" not in out + err
    episodes = [json.loads(line) for line in (tmp_path / "exp" / "trajectories.jsonl").read_text().splitlines()]
    assert len(episodes) >= 4                   # (at least step 1's) 2 tasks x 2 repeats, none scored 0
    for ep in episodes:
        assert ep["reward"] is None and ep["error"].splitlines()[-1].startswith("JudgeError: judge judge.py:score")
        assert ep["calls"]                      # the workflow ran: only the judge failed


def test_call_judge_names_the_judge_by_the_configs_name_and_says_what_to_install(tmp_path):
    task, output = Task("t", "q", answer="7"), WorkflowOutput(final_answer="7")

    async def needs_a_package(task, output):
        import reasoning_gym_x9   # noqa: F401

    with pytest.raises(JudgeError) as caught:
        asyncio.run(call_judge(needs_a_package, task, output))
    assert str(caught.value).startswith(f"judge {__name__}:{needs_a_package.__qualname__} failed: "
                                        "ModuleNotFoundError: No module named 'reasoning_gym_x9' (not installed")
    assert "needs_a_package" in caught.value.error_text() and "import reasoning_gym_x9" in caught.value.error_text()
    with pytest.raises(JudgeError, match=r"^judge .*<lambda> returned str 'high', not a number$"):
        asyncio.run(call_judge(lambda t, o: "high", task, output))
    with pytest.raises(JudgeError, match=r"returned inf, not a finite reward$"):
        asyncio.run(call_judge(lambda t, o: math.inf, task, output))
    assert asyncio.run(call_judge(math_answer_judge, task, output)) == 1.0

    (tmp_path / "conf.yaml").write_text("workflow: wf.py:W\njudge: ajet.judges:math_answer_judge\n"
                                        "data: {train_path: t.jsonl}\n")
    assert judge_name(load_judge(load_config(tmp_path / "conf.yaml"))) == "ajet.judges:math_answer_judge"


def test_the_serve_queue_fails_an_episode_whose_judge_returns_nan_naming_the_judge():
    def shaky(task, output):
        return math.nan

    stored = []
    q = EpisodeQueue(MultiTaskSampler({"train": [Task(f"t{i}", f"q{i}") for i in range(2)]}, None, False, 0),
                     num_repeat=1, tasks_per_step=1, total_steps=1, first_step=1, attempt=0,
                     record=lambda step, ep: stored.append(ep), judge=shaky)
    q.bind(FakeProxy())
    began = q.begin("c")
    assert q.finish(began["episode_id"], final_answer="7")["error"] is True
    (ep,) = stored
    assert ep.reward is None and ep.error == f"JudgeError: judge {__name__}:{shaky.__qualname__} returned nan, not a " \
                                             f"finite reward"


def _repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    (repo / "tests").mkdir(parents=True, exist_ok=True)
    (repo / "add.py").write_text("def add(a, b):\n    return a - b\n")
    (repo / "tests" / "test_add.py").write_text("from add import add\n\n\ndef test_add():\n    assert add(2, 2) == 4\n")
    return repo


def _run_tests(tmp_path: Path, command: str, path: str) -> object:
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    return asyncio.run(run_tests(command, _repo(tmp_path), home, ("tests/test_add.py::test_add",), path=path,
                                 limits=WorkdirLimits(timeout_s=120), isolation="none"))


def test_the_tests_judge_fails_when_its_command_cannot_run_and_scores_failing_tests_0(tmp_path):
    venv = tmp_path / "nopytest"                  # a Python without pytest
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    path = f"{venv / 'bin'}:/usr/bin:/bin"
    with pytest.raises(JudgeError) as caught:
        _run_tests(tmp_path, "python -m pytest -q -rA -p no:cacheprovider", path)
    assert str(caught.value) == ("judge ajet.judges.tests:run_tests cannot run the test command `python -m pytest -q "
                                 f"-rA -p no:cacheprovider`: {NO_PYTEST} (pip install pytest into the Python the "
                                 "command runs)")
    with pytest.raises(JudgeError, match=r"^judge ajet.judges.tests:run_tests cannot run the test command "
                                         r"`no-such-tool-x9 -rA`: .*no-such-tool-x9.*not found"):
        _run_tests(tmp_path, "no-such-tool-x9 -rA", path)
    # a Python with pytest: the test runs and fails, a reward of 0 (the agent's work, not the judge's)
    report = _run_tests(tmp_path, f"{sys.executable} -m pytest -q -rA -p no:cacheprovider", path)
    assert report.reward == 0.0 and report.results == {"tests/test_add.py::test_add": "failed"}


def test_a_harness_episode_whose_tests_cannot_run_is_a_failure_not_a_reward_of_0(tmp_path, tokenizer, capsys):
    project = tmp_path / "fix"
    assert main(["init", str(project), "--kind", "harness"]) == 0
    assert "Before training" not in capsys.readouterr().out     # pytest is installed here: nothing to say
    venv = tmp_path / "nopytest"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    conf = yaml.safe_load((project / "ajet.yaml").read_text())
    conf["workflow"]["sandbox"] = {"isolation": "none"}   # the test command's Python is outside a sandbox's view
    (project / "ajet.yaml").write_text(yaml.safe_dump(conf))
    rows = [json.loads(line) for line in (project / "tasks.jsonl").read_text().splitlines()]
    for row in rows:
        row["test_command"] = f"{venv / 'bin' / 'python'} -m pytest -q -rA -p no:cacheprovider"
    (project / "tasks.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))

    cfg = load_config(project / "ajet.yaml")
    task = load_tasks(cfg, "train")[0]
    proxy = ProxyServer(ScriptedEngine(tokenizer, ["```python\npass\n```"]), tokenizer,
                        SamplingParams(max_tokens=50)).start()
    try:
        episode = Episode("harness", task, "g", 0)
        asyncio.run(run_episode(load_workflow(cfg), episode, proxy, load_judge(cfg), 120))
    finally:
        proxy.stop()
    assert not episode.ok and episode.reward is None and episode.calls    # the harness ran, the judge could not
    assert episode.error.splitlines()[-1].startswith(
        "ajet.judges.calling.JudgeError: judge ajet.judges.tests:run_tests cannot run the test command"), episode.error
    assert NO_PYTEST in episode.error.splitlines()[-1]


def test_init_and_a_harness_run_without_pytest_say_what_to_install_before_they_start(tmp_path):
    def ajet(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", HIDE_PYTEST, *args], cwd=tmp_path, capture_output=True,
                              text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})

    install = f"runs pytest, which is not installed in the Python running ajet: {sys.executable} -m pip install pytest"
    written = ajet("init", "fix", "--kind", "harness")
    assert written.returncode == 0, written.stderr
    assert f"Before training: the tests judge (ajet.judges.tests:run_tests) {install}" in written.stdout.splitlines()
    run = ajet("--conf", "fix/ajet.yaml", "--backbone=debug", "--steps", "1", "--exp-dir", "exp")
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stderr == f"ajet: error: the tests judge (ajet.judges.tests:run_tests) {install}\n"
    assert not (tmp_path / "exp").exists()
