"""`kill -9` at every point of a step, `--resume` each time, to the end: ids and attempt numbers never
collide, every finished episode is trained on exactly once or belongs to an abandoned attempt; torn
jsonl lines and an interrupted checkpoint re-save never break a resume; a used experiment folder without
`--resume` is a clear error."""

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ajet import checkpoint
from ajet.trajectory_store import TrajectoryStore

WORKFLOW = '''
from ajet.workflow import Workflow, WorkflowOutput


class OneCall(Workflow):
    async def execute(self, task, tuner):
        r = await tuner.client.chat.completions.create(model=tuner.model, messages=[{"role": "user", "content": task.query}])
        text = r.choices[0].message.content or ""
        return WorkflowOutput(reward=float(len(text) % 3), final_answer=text)
'''


def _setup(tmp_path, tiny_model_dir, steps):
    (tmp_path / "wf.py").write_text(WORKFLOW)
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps({"task_id": f"t{i}", "query": f"q {i}"}) + "\n" for i in range(12)))
    (tmp_path / "conf.yaml").write_text(textwrap.dedent(f"""
        workflow: wf.py:OneCall
        model: {{path: "{tiny_model_dir}", max_model_len: 256}}
        data: {{train_path: tasks.jsonl}}
        rollout: {{num_repeat: 2, max_tokens: 4}}
        algorithm: {{lr: 1.0e-3}}
        trainer: {{total_steps: {steps}, tasks_per_step: 2, save_freq: 1, tensorboard: false}}
    """))
    return tmp_path / "conf.yaml"


def _ajet(conf, exp, *extra, kill_at=None):
    env = {k: v for k, v in os.environ.items() if k != "AJET_TEST_KILL_AT"}
    if kill_at:
        env["AJET_TEST_KILL_AT"] = kill_at
    return subprocess.run([sys.executable, "-m", "ajet", "--conf", str(conf), "--exp-dir", str(exp), *extra],
                          capture_output=True, text=True, timeout=120, env=env, cwd=conf.parent)


def test_kill_at_every_point_of_a_step_then_resume_to_the_end(tiny_model_dir, tmp_path):
    conf, exp = _setup(tmp_path, tiny_model_dir, steps=2), tmp_path / "exp"
    plan = [("rollout@1", False),      # during rollout, before the first checkpoint
            ("stored@1", True),        # again in the same step after a resume: attempt numbers must not repeat
            ("update@2", True),        # after the update, before the ledger commit
            ("checkpoint@2", True),    # mid-checkpoint write, after the ledger commit and the step's logs
            (None, True)]              # to the end
    for i, (kill_at, resume) in enumerate(plan):
        proc = _ajet(conf, exp, *(["--resume"] if resume else []), kill_at=kill_at)
        if kill_at is None:
            assert proc.returncode == 0, proc.stdout + proc.stderr
        else:
            assert proc.returncode == -signal.SIGKILL, f"{kill_at}: {proc.stdout}{proc.stderr}"
        if i == 3:   # (after the mid-checkpoint kill) a kill can tear the last line of either log; the resume must not care
            for name in ("metrics.jsonl", "trajectories.jsonl"):
                with open(exp / name, "a") as f:
                    f.write('{"step": 2, "torn')
    assert "resumed from" in proc.stdout and "next step 2" in proc.stdout

    store = TrajectoryStore(exp / "trajectories.sqlite")
    assert store.attempts() == [(0, 0), (1, 0), (2, 0), (3, 1), (4, 1)]
    ledger = store.ledger()
    store.close()
    assert len({e["episode_id"] for e in ledger}) == len(ledger)     # ids never collide across attempts
    assert all(e["ok"] for e in ledger)
    live = [e for e in ledger if not e["abandoned"]]
    for e in live:                                                    # every live episode: trained once, in its step
        assert e["trained_in"] == [(e["step"], e["attempt"])], e
    for step in (1, 2):                                            # each step trained by one attempt, 4 episodes
        attempts = {e["attempt"] for e in live if e["step"] == step}
        assert len(attempts) == 1 and sum(e["step"] == step for e in live) == 4
    # the attempts the kills cut short left their episodes behind, recorded as abandoned
    abandoned = {(e["attempt"], e["step"]) for e in ledger if e["abandoned"]}
    assert abandoned == {(0, 1), (1, 1), (2, 2), (3, 2)}
    assert [e["rolled_back"] for e in ledger if (e["attempt"], e["step"]) == (3, 2)] == [[(2, 3)]] * 4

    metrics = [json.loads(line) for line in (exp / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and metrics[-1]["policy_version"] == 2
    rows = [json.loads(line) for line in (exp / "trajectories.jsonl").read_text().splitlines()]
    assert sorted(r["episode_id"] for r in rows) == sorted(e["episode_id"] for e in live)
    assert not list((exp / "checkpoints").glob(".step_*"))


def test_a_used_experiment_folder_needs_resume(tiny_model_dir, tmp_path, capsys):
    from ajet.cli import main

    conf, exp = _setup(tmp_path, tiny_model_dir, steps=1), tmp_path / "exp"
    store = TrajectoryStore(exp / "trajectories.sqlite")   # a run that trained step 1 (no checkpoint: save_freq)
    store.mark_trained(1, store.begin_attempt(0), [("e0", 0)])
    store.close()
    (exp / "metrics.jsonl").write_text('{"step": 1}\n')
    assert main(["--conf", str(conf), "--exp-dir", str(exp)]) == 2
    err = capsys.readouterr().err
    assert f"the experiment folder {exp} already holds a run" in err and "--resume" in err and "--exp-dir" in err
    assert "Traceback" not in err


def test_truncate_jsonl_drops_later_steps_and_torn_lines_through_a_rename(tmp_path, monkeypatch):
    log = tmp_path / "metrics.jsonl"
    log.write_bytes(b'{"step": 1, "a": 1}\n{"step": 2}\n\n{"step": 3}\n{"step": 2, "x": "\xff\xfe')
    replaced = []
    real_replace = os.replace
    monkeypatch.setattr(checkpoint.os, "replace", lambda a, b: (replaced.append((Path(a).name, Path(b).name)),
                                                                 real_replace(a, b)))
    assert checkpoint.truncate_jsonl(log, 2) == 2
    assert log.read_text() == '{"step": 1, "a": 1}\n{"step": 2}\n'
    assert replaced == [("metrics.jsonl.tmp", "metrics.jsonl")]
    assert checkpoint.truncate_jsonl(log, 0) == 2 and log.read_text() == ""


class _FakeBackbone:
    def __init__(self, tag):
        self.tag = tag

    def save_checkpoint(self, path):
        path.mkdir(parents=True)
        (path / "weights").write_text(self.tag)


@pytest.mark.parametrize("point", ["checkpoint", "swap"])
def test_resaving_a_checkpoint_step_is_atomic(tmp_path, monkeypatch, point):
    checkpoint.save(tmp_path, 1, _FakeBackbone("old"), {"step": 1})

    class Killed(BaseException):
        pass

    def kill_point(name, step):
        if name == point:
            raise Killed   # the process dies here: nothing after this line of `save` runs

    monkeypatch.setattr(checkpoint, "kill_point", kill_point)
    with pytest.raises(Killed):
        checkpoint.save(tmp_path, 1, _FakeBackbone("new"), {"step": 1})
    found = checkpoint.latest(tmp_path)
    assert found == tmp_path / "checkpoints" / "step_1" and (found / "weights").read_text() == "old"
    assert checkpoint.load_trainer_state(found) == {"step": 1}
    monkeypatch.undo()
    checkpoint.save(tmp_path, 1, _FakeBackbone("new"), {"step": 1})
    assert (checkpoint.latest(tmp_path) / "weights").read_text() == "new"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_1"]


def test_ledger_tells_live_rolled_back_and_abandoned_apart(tmp_path):
    store = TrajectoryStore(tmp_path / "t.sqlite")

    def ep(eid, reward=1.0):
        return {"episode_id": eid, "task": {"task_id": "t"}, "reward": reward, "error": None, "calls": []}

    a0 = store.begin_attempt(0)
    store.add_episode(1, a0, ep("x1"))
    store.mark_trained(1, a0, [("x1", a0)])                 # step 1 checkpointed below (a1 resumes from 1)
    store.add_episode(2, a0, ep("x2"))
    store.add_episode(2, a0, ep("y2"))
    store.mark_trained(2, a0, [("x2", a0)])                 # update of step 2: killed before its checkpoint
    a1 = store.begin_attempt(1)
    assert (a0, a1) == (0, 1) and store.attempts() == [(0, 0), (1, 1)]
    store.add_episode(2, a1, ep("z2"))
    store.mark_trained(2, a1, [("z2", a1), ("y2", a0)])     # a resumed server adopts y2
    fates = {e["episode_id"]: e for e in store.ledger()}
    assert fates["x1"]["trained_in"] == [(1, 0)] and not fates["x1"]["abandoned"]
    assert fates["x2"]["trained_in"] == [] and fates["x2"]["rolled_back"] == [(2, 0)] and fates["x2"]["abandoned"]
    assert fates["y2"]["trained_in"] == [(2, 1)] and not fates["y2"]["abandoned"]
    assert fates["z2"]["trained_in"] == [(2, 1)]
    assert [r["episode_id"] for r in store.untrained()] == ["x2"]
    assert TrajectoryStore(tmp_path / "t.sqlite").begin_attempt(1) == 2     # numbers come from the store
    store.close()


BY_NAME = '''
from ajet.workflow import Workflow, WorkflowOutput


class ByName(Workflow):
    """One call; "flat*" tasks score 1 (no signal: dynamic sampling refills them), the others their repeat index."""

    async def execute(self, task, tuner):
        r = await tuner.client.chat.completions.create(model=tuner.model, messages=[{"role": "user", "content": task.query}])
        repeat = int(tuner.episode_id.rsplit("-r", 1)[1])
        return WorkflowOutput(reward=1.0 if task.task_id.startswith("flat") else float(repeat),
                              final_answer=r.choices[0].message.content or "")
'''


def test_a_resumed_step_gets_the_same_groups_and_samples_the_same_tokens(tiny_model_dir, tmp_path):
    """Three tasks (not shuffled), two per step, dynamic sampling with three extra: step 2 draws flat1, flat0,
    then var0, flat1 and flat0 again (the epoch wraps), five groups. Killed after step 2's episodes were stored
    and resumed from step 1's checkpoint, the new attempt's step 2 has the same groups, and each of its episodes
    sampled exactly the tokens of the killed attempt's episode of the same group and repeat: the sampling seeds
    name the group and repeat, not the attempt."""
    (tmp_path / "wf.py").write_text(BY_NAME)
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps({"task_id": t, "query": f"Say {t}."}) + "\n"
                                                  for t in ("flat0", "var0", "flat1")))
    conf, exp = tmp_path / "conf.yaml", tmp_path / "exp"
    conf.write_text(textwrap.dedent(f"""
        workflow: wf.py:ByName
        model: {{path: "{tiny_model_dir}", max_model_len: 256}}
        data: {{train_path: tasks.jsonl, shuffle: false}}
        rollout: {{num_repeat: 2, max_tokens: 4, temperature: 1.0}}
        algorithm: {{lr: 1.0e-3, dynamic_sampling: {{enabled: true, max_oversample: 3}}}}
        trainer: {{total_steps: 2, tasks_per_step: 2, save_freq: 1, tensorboard: false}}
    """))
    killed = _ajet(conf, exp, kill_at="stored@2")
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    done = _ajet(conf, exp, "--resume")
    assert done.returncode == 0, done.stdout + done.stderr

    store = TrajectoryStore(exp / "trajectories.sqlite")
    try:
        assert store.attempts() == [(0, 0), (1, 1)]
        step2 = {a: store.episodes(step=2, attempt=a) for a in (0, 1)}
    finally:
        store.close()

    def sampled(records):   # (group, repeat) -> (task, every call's sampled ids)
        return {(r["group_id"], r["repeat_index"]): (r["task"]["task_id"], [c["completion_ids"] for c in r["calls"]])
                for r in records}

    before, after = sampled(step2[0]), sampled(step2[1])
    assert {g for g, _ in after} == {"2:flat1", "2:flat0", "2:var0", "2:flat1#3", "2:flat0#4"}
    assert len(after) == 10 and after == before
    assert {r["episode_id"] for r in step2[0]}.isdisjoint(r["episode_id"] for r in step2[1])
