"""`ajet eval` and validation during training: pass@k by hand, then the real CLI with the tiny model."""

import json
import subprocess
import sys
import textwrap
from math import comb
from pathlib import Path

import pytest

from ajet.episode import Episode
from ajet.eval import pass_at_k, summarize
from ajet.task import Task
from ajet.workflow import WorkflowOutput

WORKFLOW = '''
from ajet.workflow import Workflow, WorkflowOutput


class EchoWorkflow(Workflow):
    async def execute(self, task, tuner):
        r = await tuner.client.chat.completions.create(
            model=tuner.model, messages=[{"role": "user", "content": task.query}])
        text = r.choices[0].message.content or ""
        return WorkflowOutput(final_answer=text, metrics={"chars": len(text)})


def judge(task, output):
    return float(len(output.final_answer) % 2)     # pass (>= 1.0) on odd-length answers
'''


def test_pass_at_k_matches_hand_computed_example():
    # n=5 episodes, c=2 correct. pass@1 = 2/5. pass@2 = 1 - C(3,2)/C(5,2) = 1 - 3/10 = 0.7.
    # pass@3 = 1 - C(3,3)/C(5,3) = 1 - 1/10 = 0.9; pass@4: n - c = 3 < 4, so 1.
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert pass_at_k(5, 2, 3) == pytest.approx(0.9)
    assert pass_at_k(5, 2, 4) == 1.0
    assert pass_at_k(5, 0, 5) == 0.0
    for n in range(1, 12):   # the stable product equals the binomial formula everywhere
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1.0 if n - c < k else 1 - comb(n - c, k) / comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12)
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)


def test_summarize_counts_failures_as_not_passed():
    def ep(task, reward, err=None):
        e = Episode(f"e{id(object())}", task, task.task_id, 0)
        e.reward, e.error = (None, err) if err else (reward, None)
        e.output = None if err else WorkflowOutput(final_answer="x", metrics={"turns": 2})
        return e

    a, b = Task("a", "qa", "1"), Task("b", "qb", "2")
    eps = [ep(a, 1.2), ep(a, 0.2), ep(a, 1.0), ep(b, 0.0), ep(b, None, "boom"), ep(b, 0.2)]
    metrics, rows = summarize(eps, 3, pass_threshold=1.0)
    assert [r["correct"] for r in rows] == [2, 0]
    assert rows[0]["pass@3"] == 1.0 and rows[1]["pass@3"] == 0.0
    assert metrics["pass@1"] == pytest.approx((2 / 3 + 0) / 2)
    assert metrics["pass@3"] == pytest.approx(0.5)
    assert metrics["failed"] == 1 and rows[1]["failed"] == 1
    assert metrics["reward_mean"] == pytest.approx((2.4 / 3 + 0.2 / 3) / 2)
    assert metrics["workflow/turns"] == 2


def write_echo_project(folder: Path, model_dir: str, trainer: str) -> None:
    """wf.py (EchoWorkflow, judge), 6 training tasks t0-t5, 4 held-out tasks t6-t9 and conf.yaml with `trainer`
    (a YAML flow mapping's body) in `folder`."""
    (folder / "wf.py").write_text(WORKFLOW)
    rows = [{"task_id": f"t{i}", "query": f"Say {i}.", "answer": str(i)} for i in range(10)]
    (folder / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows[:6]) + "\n")
    (folder / "val.jsonl").write_text("\n".join(json.dumps(r) for r in rows[6:]) + "\n")
    (folder / "conf.yaml").write_text(textwrap.dedent(f"""
        experiment_name: tiny_eval
        workflow: wf.py:EchoWorkflow
        judge: wf.py:judge
        model: {{path: "{model_dir}", max_model_len: 512}}
        data: {{train_path: train.jsonl, val_path: val.jsonl}}
        rollout: {{num_repeat: 2, max_tokens: 8, temperature: 1.0}}
        algorithm: {{lr: 1.0e-3}}
        trainer: {{{trainer}}}
    """))


def test_val_during_training_then_ajet_eval_on_base_and_checkpoint(tiny_model_dir, tmp_path):
    write_echo_project(tmp_path, tiny_model_dir, "total_steps: 2, tasks_per_step: 2, val_freq: 2, tensorboard: false")
    exp = tmp_path / "exp"
    run = dict(capture_output=True, text=True, timeout=600, cwd=tmp_path)
    proc = subprocess.run([sys.executable, "-m", "ajet", "--conf", "conf.yaml", "--exp-dir", str(exp)], **run)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    metrics = [json.loads(line) for line in (exp / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2]
    val = {m["step"]: m for m in metrics if "val/pass@1" in m}
    assert sorted(val) == [0, 2]                                    # step 0 and every val_freq=2 steps
    assert val[0]["val/tasks"] == 4 and val[0]["val/episodes"] == 4  # greedy: n=1 per task
    assert "val/reward_mean" in val[2] and "val/workflow/chars" in val[2]
    assert "val/pass@1" not in metrics[1]
    step0 = [json.loads(line) for line in (exp / "val" / "step_0" / "eval.jsonl").read_text().splitlines()]
    assert sorted(r["task_id"] for r in step0) == ["t6", "t7", "t8", "t9"]   # never a training task
    trained = {json.loads(line)["task"]["task_id"] for line in (exp / "trajectories.jsonl").read_text().splitlines()}
    assert trained <= {f"t{i}" for i in range(6)}

    outs = {}
    for name, who in (("base", ["--model", tiny_model_dir]), ("ckpt", ["--checkpoint", str(exp)])):
        out = tmp_path / f"eval_{name}"
        proc = subprocess.run([sys.executable, "-m", "ajet", "eval", "--conf", "conf.yaml", *who, "--n", "3",
                               "--temperature", "1.0", "--out", str(out)], **run)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "pass@3" in proc.stdout
        outs[name] = json.loads((out / "eval_metrics.json").read_text())
        table = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
        assert len(table) == 4 and all(r["n"] == 3 and len(r["rewards"]) == 3 for r in table)
        for r in table:   # the per-task table agrees with the judge's rewards
            assert r["correct"] == sum(x >= 1.0 for x in r["rewards"])
        episodes = (out / "eval_trajectories.jsonl").read_text().splitlines()
        assert len(episodes) == 12 and all(json.loads(e)["calls"] for e in episodes)   # recorded through the proxy
    assert outs["base"]["episodes"] == outs["ckpt"]["episodes"] == 12


def test_val_before_train_false_evaluates_only_after_training(tiny_model_dir, tmp_path):
    write_echo_project(tmp_path, tiny_model_dir, "total_steps: 2, tasks_per_step: 1, val_freq: 2, "
                                                 "val_before_train: false, tensorboard: false")
    exp = tmp_path / "exp"
    proc = subprocess.run([sys.executable, "-m", "ajet", "--conf", "conf.yaml", "--exp-dir", str(exp)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    metrics = [json.loads(line) for line in (exp / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]                   # nothing logged at step 0
    assert [m["step"] for m in metrics if "val/pass@1" in m] == [2]
    assert not (exp / "val" / "step_0").exists() and (exp / "val" / "step_2" / "eval.jsonl").exists()


def test_ajet_eval_user_errors(tiny_model_dir, tmp_path):
    (tmp_path / "wf.py").write_text(WORKFLOW)
    (tmp_path / "train.jsonl").write_text(json.dumps({"query": "hi"}) + "\n")
    (tmp_path / "conf.yaml").write_text(f"workflow: wf.py:EchoWorkflow\nmodel: {{path: '{tiny_model_dir}'}}\n"
                                        f"data: {{train_path: train.jsonl}}\n")
    run = dict(capture_output=True, text=True, timeout=60, cwd=tmp_path)
    proc = subprocess.run([sys.executable, "-m", "ajet", "eval", "--conf", "conf.yaml"], **run)
    assert proc.returncode == 2 and "data.val_path" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "ajet", "eval", "--conf", "conf.yaml", "--checkpoint", str(tmp_path)], **run)
    assert proc.returncode == 2 and "not a checkpoint folder" in proc.stderr
