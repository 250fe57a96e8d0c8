"""The run's final model is its best validated checkpoint (`trainer.keep_best`, ajet/best.py), and the test set
(`data.test_path`) is measured on it.

Two real `ajet` runs of the tiny model (debug backbone). In the first the validation score moves as a schedule says
(the workflow scores the k-th validation by `SCHEDULE[k]`, counted in the run's process; every other episode by its
answer) and peaks at step 1 of 3: its final model must be step 1's checkpoint (written although `save_freq` is 0),
named on the run's last line and by `ajet eval --checkpoint EXP_DIR`, and the test set at the end must run on step
1's weights. The second degrades for real: a learning rate of 1.0 collapses the answers (the reward: an answer of at
least 6 distinct characters), so no step beats the initial model, which is then the final model, with no checkpoint.
Selection itself (ties, direction, invalid evaluations, a metric the validation lacks) is tested without a model.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ajet.best import BestTracker, final_model, is_better, read_best, score
from ajet.errors import ConfigError

WORKFLOW = '''
import itertools
import os

from ajet.workflow import Workflow, WorkflowOutput

SCHEDULE = [float(x) for x in os.environ["BEST_SCHEDULE"].split(",")]   # val pass@1 of the k-th validation
N_VAL = 2
_val_episodes = itertools.count()


class Scheduled(Workflow):
    async def execute(self, task, tuner):
        r = await tuner.client.chat.completions.create(model=tuner.model,
                                                       messages=[{"role": "user", "content": task.query}])
        text = r.choices[0].message.content or ""
        if task.task_id.startswith("v"):   # the validation set: the schedule's score
            return WorkflowOutput(reward=SCHEDULE[next(_val_episodes) // N_VAL], final_answer=text)
        return WorkflowOutput(reward=float(len(text) % 2), final_answer=text)   # train and test: the answer's


class Distinct(Workflow):
    async def execute(self, task, tuner):
        r = await tuner.client.chat.completions.create(model=tuner.model,
                                                       messages=[{"role": "user", "content": task.query}])
        text = r.choices[0].message.content or ""
        return WorkflowOutput(reward=float(len(set(text)) >= 6), final_answer=text)
'''
TOPICS = ["cats", "dogs", "rain", "sun", "sea", "trees", "bread", "music"]


def _experiment(root: Path, model_dir: str, schedule: str = "0", steps: int = 3, workflow: str = "Scheduled",
                lr: float = 5e-2) -> tuple[subprocess.CompletedProcess, Path]:
    """Run `ajet` in `root` for `steps` steps, validating every step; returns (the process, the experiment folder)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "wf.py").write_text(WORKFLOW)
    sizes = (("train", "t", 4), ("val", "v", 2), ("test", "x", 3)) if workflow == "Scheduled" else \
        (("train", "t", 8), ("val", "v", 8), ("test", "x", 3))
    for name, prefix, n in sizes:
        (root / f"{name}.jsonl").write_text("".join(
            json.dumps({"task_id": f"{prefix}{i}", "answer": "0",
                        "query": f"What is {i} plus {prefix}?" if workflow == "Scheduled"
                        else f"Say something about {TOPICS[i]} number {i}."}) + "\n"
            for i in range(n)))
    (root / "conf.yaml").write_text(textwrap.dedent(f"""
        experiment_name: best
        workflow: wf.py:{workflow}
        model: {{path: "{model_dir}", max_model_len: 512}}
        data: {{train_path: train.jsonl, val_path: val.jsonl, test_path: test.jsonl, shuffle: false}}
        rollout: {{num_repeat: 2, max_tokens: 8, temperature: 1.0}}
        algorithm: {{lr: {lr}}}
        trainer: {{total_steps: {steps}, tasks_per_step: 2, val_freq: 1, save_freq: 0, tensorboard: false}}
    """))
    proc = subprocess.run([sys.executable, "-m", "ajet", "--conf", "conf.yaml", "--backbone=debug", "--exp-dir", "exp"],
                          capture_output=True, text=True, timeout=300, cwd=root,
                          env={**os.environ, "BEST_SCHEDULE": schedule})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, root / "exp"


def _rows(exp: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (exp / "metrics.jsonl").read_text().splitlines())}


def _calls(folder: Path) -> list[dict]:
    """Every recorded call of an evaluation's episodes (eval_trajectories.jsonl), in order."""
    episodes = [json.loads(line) for line in (folder / "eval_trajectories.jsonl").read_text().splitlines()]
    return [c for e in sorted(episodes, key=lambda e: e["task"]["task_id"]) for c in e["calls"]]


def test_the_run_ends_with_its_best_checkpoint_and_tests_it(tiny_model_dir, tmp_path):
    # validation pass@1 by step: 0, 1 (the best), 1 (a tie: the earlier step stays the best), 0
    proc, exp = _experiment(tmp_path, tiny_model_dir, "0,1,1,0")
    rows = _rows(exp)
    assert [rows[s]["val/pass@1"] for s in range(4)] == [0.0, 1.0, 1.0, 0.0]

    best = read_best(exp)
    assert (best.step, best.metric, best.value, best.checkpoint) == (1, "val/pass@1", 1.0, "checkpoints/step_1")
    # save_freq 0 writes only the last step's checkpoint; the best's is written as it is found
    assert sorted(p.name for p in (exp / "checkpoints").iterdir()) == ["step_1", "step_3"]
    assert final_model(exp) == (str(exp / "checkpoints" / "step_1"), best)

    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("final model: step 1 (checkpoints/step_1), the best val/pass@1 100.0%"), last

    # the test set: before step 1 on the initial model, at the end on step 1's weights (the last row says so)
    assert rows[0]["test/step"] == 0 and rows[0]["test/tasks"] == 3
    assert rows[3]["test/step"] == 1 and (exp / "test" / "step_1" / "eval.jsonl").is_file()
    assert not (exp / "test" / "step_3").exists()
    final_calls = _calls(exp / "test" / "step_1")
    assert {c["policy_version"] for c in final_calls} == {1}       # step 1's restored engine served them
    # step 1's and step 3's weights differ (the updates moved them), so the comparison below can tell them apart
    from safetensors.torch import load_file

    w1, w3 = (load_file(str(exp / "checkpoints" / f"step_{s}" / "model.safetensors")) for s in (1, 3))
    assert any(not (w1[k] == w3[k]).all() for k in w1)

    # `ajet eval --checkpoint EXP_DIR` loads the final model: the same greedy tokens and logprobs as the run's test
    ev = subprocess.run([sys.executable, "-m", "ajet", "eval", "--conf", "conf.yaml", "--checkpoint", "exp",
                         "--split", "test", "--out", "eval_best", "--backbone=debug"],
                        capture_output=True, text=True, timeout=300, cwd=tmp_path,
                        env={**os.environ, "BEST_SCHEDULE": "0"})
    assert ev.returncode == 0, ev.stdout[-3000:] + ev.stderr[-3000:]
    assert "the run's final model, step 1 (checkpoints/step_1)" in ev.stdout
    # `ajet export` writes every step's samples and names the model the run kept
    ex = subprocess.run([sys.executable, "-m", "ajet", "export", "--format", "hf", "exp", "samples"],
                        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert ex.returncode == 0, ex.stderr[-3000:]
    assert "the run's final model: step 1 (checkpoints/step_1), the best val/pass@1 100.0%" in ex.stdout, ex.stdout
    again = _calls(tmp_path / "eval_best")
    assert [c["completion_ids"] for c in again] == [c["completion_ids"] for c in final_calls]
    for a, b in zip(again, final_calls):
        assert a["completion_logprobs"] == pytest.approx(b["completion_logprobs"], abs=1e-4)


def test_a_run_that_degrades_ends_with_the_initial_model(tiny_model_dir, tmp_path):
    proc, exp = _experiment(tmp_path, tiny_model_dir, steps=2, workflow="Distinct", lr=1.0)
    rows = _rows(exp)
    val = [rows[s]["val/pass@1"] for s in range(3)]
    assert val[2] < val[0], val                    # it degraded: the last step is worse than the initial policy
    assert max(val[1:]) <= val[0], val             # and no step beat the initial policy (a tie keeps step 0)
    best = read_best(exp)
    assert (best.step, best.checkpoint, best.model) == (0, None, tiny_model_dir)
    assert sorted(p.name for p in (exp / "checkpoints").iterdir()) == ["step_2"]   # no checkpoint for step 0
    assert final_model(exp) == (tiny_model_dir, best)
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith(f"final model: the initial model (step 0, {tiny_model_dir}), the best val/pass@1 "
                           f"{100 * val[0]:.1f}%"), last
    # the initial model's test figures are the ones measured before step 1: not evaluated again
    assert rows[2]["test/step"] == 0 and rows[2]["test/pass@1"] == rows[0]["test/pass@1"]
    assert not (exp / "test" / "step_2").exists()


# ---- selection, without a model --------------------------------------------------------------------------------

def _val(pass_at_1: float | None, valid: bool = True) -> dict[str, float]:
    m = {"val/valid": 1.0 if valid else 0.0, "val/tasks": 4.0, "val/reward_mean": 0.5}
    if pass_at_1 is not None and valid:
        m["val/pass@1"] = pass_at_1
    return m


def _select(tmp_path: Path, by_step: dict[int, dict], mode: str = "max") -> BestTracker:
    tmp_path.mkdir(parents=True, exist_ok=True)
    tracker = BestTracker(tmp_path, "val/pass@1", mode, "base-model")
    for step, metrics in by_step.items():
        if tracker.observe(step, metrics):
            tracker.keep()
    return tracker


def test_a_tie_keeps_the_earlier_step_and_min_picks_the_lowest(tmp_path):
    t = _select(tmp_path / "a", {0: _val(0.25), 2: _val(0.5), 4: _val(0.5), 6: _val(0.375)})
    assert (t.best.step, t.best.value) == (2, 0.5)
    t = _select(tmp_path / "b", {0: _val(0.25), 2: _val(0.5), 4: _val(0.125), 6: _val(0.125)}, mode="min")
    assert (t.best.step, t.best.value) == (4, 0.125)
    assert not is_better(math.nan, None, "max") and is_better(0.0, None, "min")


def test_step_0_can_be_the_best_and_needs_no_checkpoint(tmp_path):
    t = _select(tmp_path, {0: _val(0.5), 1: _val(0.25), 2: _val(0.5)})
    assert t.best.step == 0 and t.best.checkpoint is None
    assert t.best.name() == "the initial model (step 0, base-model)"
    assert read_best(tmp_path) == t.best


def test_steps_without_a_valid_validation_are_no_candidates(tmp_path):
    # step 1 ran no validation, step 2's was invalid (no score): neither is chosen, even over a low step 0
    t = _select(tmp_path, {0: _val(0.0), 1: {}, 2: _val(None, valid=False), 3: _val(0.0)})
    assert t.best.step == 0


def test_best_json_is_written_only_once_its_checkpoint_is(tmp_path):
    tracker = BestTracker(tmp_path, "val/pass@1", "max", "base-model")
    assert tracker.observe(4, _val(0.5))
    assert read_best(tmp_path) is None            # observed, its checkpoint not yet written: nothing recorded
    tracker.keep()
    assert read_best(tmp_path).step == 4
    # a resumed run starts from it: a lower score later is not a new best
    resumed = BestTracker(tmp_path, "val/pass@1", "max", "base-model")
    assert resumed.best.step == 4 and not resumed.observe(6, _val(0.25))


def test_a_metric_the_validation_lacks_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError) as e:
        score(8, _val(0.5), "val/pass@4")
    assert "trainer.best_metric 'val/pass@4' is not a metric of the validation at step 8" in str(e.value)
    assert "val/pass@1" in str(e.value) and "val/reward_mean" in str(e.value)


def test_final_model_without_best_is_the_newest_checkpoint_and_errors_say_what_is_missing(tmp_path):
    for step in (2, 4):
        (tmp_path / "checkpoints" / f"step_{step}").mkdir(parents=True)
        (tmp_path / "checkpoints" / f"step_{step}" / "trainer_state.pt").write_bytes(b"")
    assert final_model(tmp_path) == (str(tmp_path / "checkpoints" / "step_4"), None)
    with pytest.raises(ConfigError, match="no checkpoints/step_N folder and no best.json"):
        final_model(tmp_path / "nothing")
    t = BestTracker(tmp_path, "val/pass@1", "max", "m")
    t.observe(3, _val(1.0))
    t.keep()
    with pytest.raises(ConfigError, match="best checkpoint .*step_3 .* is missing"):
        final_model(tmp_path)


@pytest.mark.parametrize(("trainer", "says"), [
    ("{keep_best: true}", "trainer.keep_best picks the run's final model by its validation score"),
    ("{best_metric: pass@1}", "must name a validation metric, a val/* key"),
])
def test_keep_best_settings_that_cannot_work_are_refused_in_one_line(tmp_path, trainer, says):
    (tmp_path / "t.jsonl").write_text(json.dumps({"task_id": "a", "query": "q", "answer": "1"}) + "\n")
    (tmp_path / "c.yaml").write_text(f"workflow: w.py:W\ndata: {{train_path: t.jsonl}}\ntrainer: {trainer}\n")
    proc = subprocess.run([sys.executable, "-m", "ajet", "--conf", "c.yaml"], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode == 2 and says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_keep_best_is_on_where_the_run_validates_except_in_the_gateway(tmp_path):
    from ajet.best import keeps_best
    from ajet.config import load_config

    (tmp_path / "v.jsonl").write_text(json.dumps({"task_id": "a", "query": "q", "answer": "1"}) + "\n")
    (tmp_path / "c.yaml").write_text("workflow: w.py:W\ndata: {train_path: v.jsonl, val_path: v.jsonl}\n")

    def kept(mode: str = "train", **trainer) -> bool:
        return keeps_best(load_config(tmp_path / "c.yaml", {f"trainer.{k}": v for k, v in trainer.items()}, mode=mode))

    assert kept(val_freq=2) and not kept() and not kept(val_freq=2, keep_best=False)
    assert not kept("gateway", val_freq=2)          # the gateway's gate picks the policy it serves
    with pytest.raises(ConfigError, match="the gateway chooses the policy it serves with gateway.gate"):
        kept("gateway", val_freq=2, keep_best=True)
