"""Issue 21 item 7: a whole epoch of mixed long and short episodes, trained asynchronously
(`trainer.async.max_staleness: 1`), killed with SIGKILL at points of the step (including while the next step's
episodes run during an update) and at random moments, resumed each time: the store proves that every task of
the epoch was trained in exactly one live update, none skipped, none twice. The same with dynamic sampling's
extra tasks (drawn after the next step's) under either failed-episode policy."""

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
from collections import Counter

import pytest

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


# ---- asynchronous training x dynamic sampling x failed-episode policy ----------------------------------
BY_NAME = '''
from ajet.workflow import Workflow, WorkflowOutput


class ByName(Workflow):
    """One call; "var*" tasks score their repeat index (a group with signal), "flat*" tasks score 1 (no
    signal: dynamic sampling refills it), and on "fail*" tasks repeat 0 scores 0 and repeat 1 raises."""

    async def execute(self, task, tuner):
        r = await tuner.client.chat.completions.create(model=tuner.model, messages=[{"role": "user", "content": task.query}])
        repeat = int(tuner.episode_id.rsplit("-r", 1)[1])
        if task.task_id.startswith("fail") and repeat == 1:
            raise RuntimeError("a fail* task's second repeat always fails")
        return WorkflowOutput(reward=1.0 if task.task_id.startswith("flat") else float(repeat),
                              final_answer=r.choices[0].message.content or "")
'''
DS_TASKS = ["var0", "flat0", "fail0", "var1", "var2", "flat1", "var3", "fail1", "var4", "var5"]
DS_STEPS = 6


@pytest.mark.parametrize("policy", ["drop_episode", "drop_group"])
def test_async_dynamic_sampling_killed_and_resumed_trains_every_draw_once(tiny_model_dir, tmp_path, policy):
    """`max_staleness: 1` runs step t + 1's episodes while step t rolls out; dynamic sampling draws step t's extra
    tasks (for its "flat*" and "fail*" groups) after step t + 1's tasks were drawn. Killed after step 2's and step
    4's episodes were stored and while step 5 rolled out, resumed each time: the steps' groups, over all live
    attempts, are exactly the task sequence's first draws, each once (the tasks are not shuffled: draw k is task
    k mod 10), so every task is trained once per epoch; a resumed step gets the tasks (and group ids) the
    killed attempt had drawn for it."""
    (tmp_path / "wf.py").write_text(BY_NAME)
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps({"task_id": t, "query": f"q {t}"}) + "\n" for t in DS_TASKS))
    conf, exp = tmp_path / "conf.yaml", tmp_path / "exp"
    conf.write_text(textwrap.dedent(f"""
        workflow: wf.py:ByName
        model: {{path: "{tiny_model_dir}", max_model_len: 256}}
        data: {{train_path: tasks.jsonl, shuffle: false}}
        rollout: {{num_repeat: 2, max_tokens: 4, failed_episode_policy: {policy}}}
        algorithm: {{lr: 1.0e-3, dynamic_sampling: {{enabled: true, max_oversample: 2}}}}
        trainer: {{total_steps: {DS_STEPS}, tasks_per_step: 2, save_freq: 1, tensorboard: false, loggers: [jsonl],
                   async: {{max_staleness: 1}}}}
    """))
    plan = ["stored@2", "stored@4", "rollout@5", None]
    codes = [_ajet(conf, exp, i > 0, kill_at) for i, kill_at in enumerate(plan)]
    assert codes == [-signal.SIGKILL] * 3 + [0], codes

    store = TrajectoryStore(exp / "trajectories.sqlite")
    try:
        ledger, attempts = store.ledger(), store.attempts()
        records = {r["episode_id"]: r for r in store.episodes()}
    finally:
        store.close()
    assert len(attempts) == 4
    live = [e for e in ledger if not e["abandoned"]]
    groups: dict[str, list[dict]] = {}           # live group id -> its episodes' records
    for e in live:
        groups.setdefault(records[e["episode_id"]]["group_id"], []).append(records[e["episode_id"]])
    assert all(sorted(r["repeat_index"] for r in g) == [0, 1] for g in groups.values())   # whole groups
    # every draw of the sequence in one live step, none twice, none skipped: draw k is DS_TASKS[k % 10]
    drawn = Counter(g[0]["task"]["task_id"] for g in groups.values())
    assert drawn == Counter(DS_TASKS[k % len(DS_TASKS)] for k in range(len(groups))), drawn
    assert len(groups) >= DS_STEPS * 2
    # each step trained once, by one live attempt; its groups with signal are the var* ones
    metrics = [json.loads(line) for line in (exp / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, DS_STEPS + 1))
    for e in live:
        task = records[e["episode_id"]]["task"]["task_id"]
        if task.startswith("var"):
            assert len(e["trained_in"]) == 1 and e["trained_in"][0][0] == e["step"], e
        elif e["ok"]:
            # flat*: equal rewards; fail*: one success in the group, nothing to compare it with (dynamic sampling
            # names that reason before drop_group would name "failed_group")
            assert not e["trained_in"] and e["not_trained"] == "zero_std_group", (task, e)
        else:
            assert task.startswith("fail") and not e["trained_in"]
    # a resumed step gets the tasks the killed attempt drew for it: its first two (t0, t1) groups are the same
    # (where the killed attempt had stored a whole group of that slot, the resumed one adopts it and runs no
    # episode of its own there: nothing to compare; the every-draw-once check above covers it)
    by_slot: dict[tuple[int, int, str], str] = {}   # (attempt, step, t<k>) -> group id
    for e in ledger:
        _, s, t, _ = e["episode_id"].split("-")
        by_slot[(e["attempt"], e["step"], t)] = records[e["episode_id"]]["group_id"]
    for attempt, resumed_from in attempts[1:]:
        for t in ("t0", "t1"):
            before = by_slot.get((attempt - 1, resumed_from + 1, t))
            after = by_slot.get((attempt, resumed_from + 1, t))
            if before is not None and after is not None:
                assert after == before, (attempt, resumed_from, t)
