"""kill -9 mid-run, --resume, and the same data order and step count as an uninterrupted run; a broken
workflow is recorded and skipped; failing every step stops the run with a clear error."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

from ajet.trajectory_store import TrajectoryStore

WORKFLOW = '''
import asyncio, math, os
from ajet.workflow import Workflow, WorkflowOutput


class SlowWorkflow(Workflow):
    async def execute(self, task, tuner):
        mode = os.environ.get("WF_MODE", "")
        n = int(task.task_id[1:])
        # the broken modes fail before the model call, so a slow call on a loaded machine cannot turn them
        # into timeouts
        if mode == "mixed" and n % 4 == 0:
            raise RuntimeError(f"tool crashed on {task.task_id}")
        if mode == "mixed" and n % 4 == 1:
            return WorkflowOutput(reward=math.nan)
        if mode == "all_fail":
            raise ValueError("always broken")
        r = await tuner.client.chat.completions.create(model=tuner.model, messages=[{"role": "user", "content": task.query}])
        await asyncio.sleep(float(os.environ.get("WF_SLEEP", "0")))
        text = r.choices[0].message.content or ""
        if mode == "mixed" and n % 4 == 2:
            await asyncio.sleep(120)          # hangs past episode_timeout_s
        return WorkflowOutput(reward=float(len(text) % 3), final_answer=text)
'''


def _setup(tmp_path, tiny_model_dir, steps=4, extra="", episode_timeout_s=10):
    (tmp_path / "wf.py").write_text(WORKFLOW)
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps({"task_id": f"t{i}", "query": f"q {i}"}) + "\n" for i in range(12)))
    (tmp_path / "conf.yaml").write_text(textwrap.dedent(f"""
        workflow: wf.py:SlowWorkflow
        model: {{path: "{tiny_model_dir}", max_model_len: 512}}
        data: {{train_path: tasks.jsonl}}
        rollout: {{num_repeat: 2, max_tokens: 6, episode_timeout_s: {episode_timeout_s}}}
        algorithm: {{lr: 1.0e-3}}
        trainer: {{total_steps: {steps}, tasks_per_step: 2, save_freq: 1, tensorboard: false}}
    """) + extra)
    return tmp_path / "conf.yaml"


def _ajet(conf, exp, *extra, env=None, popen=False):
    cmd = [sys.executable, "-m", "ajet", "--conf", str(conf), "--exp-dir", str(exp), *extra]
    env = {**os.environ, **(env or {})}
    if popen:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=conf.parent)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=conf.parent)


def _task_order(exp):
    rows = [json.loads(line) for line in (exp / "trajectories.jsonl").read_text().splitlines()]
    return [(r["step"], r["task"]["task_id"], r["repeat_index"]) for r in rows]


def test_kill_9_then_resume_matches_an_uninterrupted_run(tiny_model_dir, tmp_path):
    conf = _setup(tmp_path, tiny_model_dir, episode_timeout_s=30)   # WF_SLEEP must never time out here
    straight = tmp_path / "straight"
    assert _ajet(conf, straight).returncode == 0

    killed = tmp_path / "killed"
    proc = _ajet(conf, killed, env={"WF_SLEEP": "1.0"}, popen=True)
    deadline = time.monotonic() + 180
    while not (killed / "checkpoints" / "step_2" / "trainer_state.pt").exists():   # step 3 is running now
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    store = TrajectoryStore(killed / "trajectories.sqlite")
    assert len(store.episodes(step=1)) == 4 and len(store.episodes(step=2)) == 4   # nothing finished was lost
    store.close()

    resumed = _ajet(conf, killed, "--resume")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed from" in resumed.stdout and "next step 3" in resumed.stdout
    assert _task_order(killed) == _task_order(straight)
    steps = [json.loads(line)["step"] for line in (killed / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    last = json.loads((killed / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["policy_version"] == json.loads((straight / "metrics.jsonl").read_text().splitlines()[-1])["policy_version"] == 4
    store = TrajectoryStore(killed / "trajectories.sqlite")
    assert len(store.episodes(step=4, attempt=1)) == 4
    store.close()


def test_broken_workflows_are_recorded_and_skipped(tiny_model_dir, tmp_path):
    conf = _setup(tmp_path, tiny_model_dir, steps=2, extra="")
    exp = tmp_path / "exp"
    proc = _ajet(conf, exp, env={"WF_MODE": "mixed"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    store = TrajectoryStore(exp / "trajectories.sqlite")
    episodes = store.episodes()
    store.close()
    errors = [e["error"] for e in episodes if e["error"]]
    assert any("RuntimeError: tool crashed" in e for e in errors)
    assert any("reward is not finite" in e for e in errors)
    assert any("TimeoutError" in e for e in errors)
    metrics = [json.loads(line) for line in (exp / "metrics.jsonl").read_text().splitlines()]
    assert sum(m["rollout/failed"] for m in metrics) == len(errors) > 0
    assert all(m["rollout/trained_episodes"] == m["rollout/episodes"] - m["rollout/failed"] for m in metrics)


def test_steps_without_usable_episodes_stop_the_run(tiny_model_dir, tmp_path):
    conf = _setup(tmp_path, tiny_model_dir, steps=5)
    proc = _ajet(conf, tmp_path / "exp", env={"WF_MODE": "all_fail"})
    assert proc.returncode == 2
    assert "3 steps in a row produced no usable episode" in proc.stderr and "always broken" in proc.stderr
