"""An evaluation that lost more than `eval.max_failed_frac` of its episodes is reported as invalid, not as a
score: `val/valid` 0 and no `val/pass@1` in metrics.jsonl, the console says why, `ajet eval` exits 1; a
training step that lost most of its episodes says why on the console. Real runs of the tiny model."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from ajet.episode import Episode
from ajet.eval import apply_validity, summarize
from ajet.failures import failure_counts, failure_kind, failure_summary
from ajet.task import Task
from ajet.workflow import WorkflowOutput

WORKFLOW = '''
from ajet.workflow import Workflow, WorkflowOutput


class Flaky(Workflow):
    """Raises before any call for a task whose query says "fail"; else one call, reward 1."""

    async def execute(self, task, tuner):
        if "fail" in task.query:
            raise RuntimeError("this task always fails")
        r = await tuner.client.chat.completions.create(
            model=tuner.model, messages=[{"role": "user", "content": task.query}])
        return WorkflowOutput(reward=1.0, final_answer=r.choices[0].message.content or "")
'''


def _episode(task: Task, error: str | None) -> Episode:
    e = Episode(f"e-{task.task_id}", task, task.task_id, 0)
    e.reward, e.error = (None, error) if error else (1.0, None)
    e.output = None if error else WorkflowOutput(final_answer="x", metrics={"turns": 1})
    return e


def test_the_failed_share_decides_validity_and_an_invalid_evaluation_has_no_score():
    tasks = [Task(f"t{i}", "q", "1") for i in range(20)]
    timeout = "TimeoutError: the workflow ran longer than episode_timeout_s=600.0 (not counting 0.0 s ...)"
    trace = 'Traceback (most recent call last):\n  File "x.py", line 1\nValueError: bad'
    one_failed = [_episode(t, timeout if i == 0 else None) for i, t in enumerate(tasks)]        # 1/20 = 5%
    metrics, _ = summarize(one_failed, 1, 1.0)
    assert apply_validity(metrics, one_failed, 0.05) is True        # at the bound: still a score
    assert metrics["valid"] == 1.0 and metrics["pass@1"] == pytest.approx(19 / 20)
    assert metrics["failed_frac"] == pytest.approx(0.05) and metrics["failed/TimeoutError"] == 1

    three_failed = [_episode(t, (timeout, trace, timeout)[i] if i < 3 else None) for i, t in enumerate(tasks)]
    metrics, _ = summarize(three_failed, 1, 1.0)
    assert apply_validity(metrics, three_failed, 0.05) is False     # 15% > 5%
    assert metrics["valid"] == 0.0 and metrics["failed_frac"] == pytest.approx(0.15)
    assert not any(k in metrics for k in ("pass@1", "reward_mean", "workflow/turns"))
    assert metrics["failed/TimeoutError"] == 2 and metrics["failed/ValueError"] == 1
    assert failure_counts(three_failed) == {"TimeoutError": 2, "ValueError": 1}
    assert failure_summary(three_failed) == ("3 of 20 episodes failed: TimeoutError 2 (2 with no call answered), "
                                             "ValueError 1 (1 with no call answered)")
    assert failure_summary(three_failed, more_than=0.5) == ""      # not most of them
    assert failure_kind("abandoned: no call or heartbeat for 300s") == "abandoned"


def test_an_evaluation_with_too_many_failures_is_invalid_in_metrics_jsonl_and_ajet_eval(tiny_model_dir, tmp_path):
    (tmp_path / "wf.py").write_text(WORKFLOW)
    train = [{"task_id": f"t{i}", "query": f"Say {i}." if i == 0 else f"fail {i}"} for i in range(4)]
    val = [{"task_id": f"v{i}", "query": f"fail {i}" if i % 2 else f"Say {i}."} for i in range(4)]   # half fail
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train))
    (tmp_path / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in val))
    (tmp_path / "conf.yaml").write_text(textwrap.dedent(f"""
        experiment_name: invalid_eval
        workflow: wf.py:Flaky
        model: {{path: "{tiny_model_dir}", max_model_len: 512}}
        data: {{train_path: train.jsonl, val_path: val.jsonl, shuffle: false}}
        rollout: {{num_repeat: 2, max_tokens: 4, temperature: 1.0}}
        trainer: {{total_steps: 1, tasks_per_step: 4, val_freq: 1, tensorboard: false, stop_on_invalid_eval: false}}
    """))
    exp = tmp_path / "exp"
    run = dict(capture_output=True, text=True, timeout=600, cwd=tmp_path,
               env={**os.environ, "COLUMNS": "250", "AJET_PLOTS": "1"})     # val.png is checked
    proc = subprocess.run([sys.executable, "-m", "ajet", "--conf", "conf.yaml", "--exp-dir", str(exp)], **run)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = " ".join(proc.stdout.split())
    metrics = {m["step"]: m for m in map(json.loads, (exp / "metrics.jsonl").read_text().splitlines())}
    for step in (0, 1):                       # before training and after the last step: 2 of 4 failed, 50% > 5%
        m = metrics[step]
        assert m["val/valid"] == 0 and m["val/failed_frac"] == 0.5 and m["val/failed/RuntimeError"] == 2
        assert not any(k in m for k in ("val/pass@1", "val/reward_mean")), sorted(m)
        assert f"held-out evaluation at step {step} INVALID: 2 of 4 episodes failed: RuntimeError 2 (2 with no " \
               f"call answered) (50% > eval.max_failed_frac 5%)" in out
    assert (exp / "plots" / "val.png").is_file()     # the invalid evaluations drawn as such (no point to draw)
    # the step lost 6 of its 8 episodes (3 of 4 tasks x 2): the console says why
    assert metrics[1]["rollout/failed"] == 6 and metrics[1]["rollout/failed/RuntimeError"] == 6
    assert "step 1: 6 of 8 episodes failed: RuntimeError 6 (6 with no call answered)" in out

    # ajet eval: the same verdict, exit status 1
    eval_out = tmp_path / "eval"
    proc = subprocess.run([sys.executable, "-m", "ajet", "eval", "--conf", "conf.yaml", "--out", str(eval_out)], **run)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "INVALID: 2 of 4 episodes failed" in " ".join(proc.stdout.split())
    result = json.loads((eval_out / "eval_metrics.json").read_text())
    assert result["valid"] == 0 and "pass@1" not in result and result["failed"] == 2
