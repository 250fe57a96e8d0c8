"""Issue 21 item 7: a whole epoch of mixed long and short episodes, trained asynchronously
(`trainer.async.max_staleness: 1`), killed with SIGKILL at points of the step (including while the next step's
episodes run during an update) and at random moments, resumed each time: the store proves that every task of
the epoch was trained in exactly one live update, none skipped, none twice."""

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
from collections import Counter

from ajet.trajectory_store import TrajectoryStore

from tests.test_async_training import LONG_TAIL   # a call, a 1 s tool on tasks named slow*, a call

TASKS = [f"slow{i}" if i % 3 == 0 else f"fast{i}" for i in range(12)]
STEPS, TASKS_PER_STEP, REPEAT = 6, 2, 2          # one epoch: 6 steps x 2 tasks = the 12 tasks


def _ajet(conf, exp, resume, kill_at=None, kill_after_s=None):
    """Run `ajet` to the end, or until the kill point (`AJET_TEST_KILL_AT`) or a SIGKILL `kill_after_s` in.
    Returns the exit code (-SIGKILL when killed)."""
    env = {k: v for k, v in os.environ.items() if k != "AJET_TEST_KILL_AT"}
    if kill_at:
        env["AJET_TEST_KILL_AT"] = kill_at
    proc = subprocess.Popen([sys.executable, "-m", "ajet", "--conf", str(conf), "--exp-dir", str(exp),
                             *(["--resume"] if resume else [])], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=env, cwd=conf.parent, text=True)
    try:
        out, _ = proc.communicate(timeout=kill_after_s or 240)
    except subprocess.TimeoutExpired:
        if kill_after_s is None:
            raise
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode in (0, -signal.SIGKILL), out[-3000:]
    return proc.returncode


def test_an_epoch_killed_at_random_points_trains_every_task_exactly_once(tiny_model_dir, tmp_path):
    (tmp_path / "wf.py").write_text(LONG_TAIL)
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps({"task_id": t, "query": f"q {t}"}) + "\n" for t in TASKS))
    conf, exp = tmp_path / "conf.yaml", tmp_path / "exp"
    conf.write_text(textwrap.dedent(f"""
        workflow: wf.py:LongTail
        model: {{path: "{tiny_model_dir}", max_model_len: 256}}
        data: {{train_path: tasks.jsonl}}
        rollout: {{num_repeat: {REPEAT}, max_tokens: 4}}
        algorithm: {{lr: 1.0e-3}}
        trainer: {{total_steps: {STEPS}, tasks_per_step: {TASKS_PER_STEP}, save_freq: 1, tensorboard: false,
                   loggers: [jsonl], async: {{max_staleness: 1}}}}
    """))
    # kill points in step order, at points of the step drawn at random (a run already past one simply goes on),
    # and one SIGKILL at a random moment; the draws come from the OS, not a seed: each run kills somewhere else
    rng = random.Random(os.urandom(8))
    points = ["rollout", "stored", "update", "trained", "checkpoint"]
    plan = [("rollout@2", None),                 # step 2's episodes run while step 1 rolls out and updates
            (f"{rng.choice(['update', 'trained'])}@2", None),   # after the update, before / after the ledger
            (f"{rng.choice(points)}@3", None),
            (None, rng.uniform(2, 5)),           # anywhere (on a fast machine the run may finish first)
            (f"{rng.choice(['stored', 'rollout', 'checkpoint'])}@{rng.choice([5, 6])}", None),
            (None, None)]                        # to the end
    codes = [_ajet(conf, exp, i > 0, kill_at, after) for i, (kill_at, after) in enumerate(plan)]
    # the three kills at points of steps 2-3 always land; then the timed kill or the last point does, unless
    # the timed run finished the epoch
    assert codes[:3] == [-signal.SIGKILL] * 3 and codes[-1] == 0, codes
    assert sum(c == -signal.SIGKILL for c in codes) >= 4 or codes[3] == 0, codes

    store = TrajectoryStore(exp / "trajectories.sqlite")
    try:
        ledger = store.ledger()
        records = {r["episode_id"]: r for r in store.episodes()}      # ids are unique across attempts
        assert 3 <= len(store.attempts()) <= len(codes)     # (a timed kill may land before the store opens)
    finally:
        store.close()
    assert all(e["ok"] for e in ledger)
    trained = [e for e in ledger if e["trained_in"]]
    for e in ledger:                             # every episode: trained by exactly one live update, or abandoned
        assert len(e["trained_in"]) == 1 or (e["abandoned"] and not e["trained_in"]), e
    steps = Counter(e["trained_in"][0][0] for e in trained)
    assert steps == {s: TASKS_PER_STEP * REPEAT for s in range(1, STEPS + 1)}
    groups = {}                                  # group -> (task, its episodes' repeat indices)
    for e in trained:
        r = records[e["episode_id"]]
        assert e["trained_in"][0][0] == e["step"]
        groups.setdefault(r["group_id"], (r["task"]["task_id"], []))[1].append(r["repeat_index"])
    assert all(sorted(reps) == list(range(REPEAT)) for _, reps in groups.values())
    per_task = Counter(task for task, _ in groups.values())
    assert sorted(per_task) == sorted(TASKS)     # 0 skipped
    assert set(per_task.values()) == {1}         # 0 duplicated
    metrics = [json.loads(line) for line in (exp / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1)) and metrics[-1]["policy_version"] == STEPS
