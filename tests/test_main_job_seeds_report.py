"""benchmarks/main_job_seeds.py's report: per-seed figures read from a run's metrics.jsonl, a config's mean / minimum
/ seeds at +10 points, its table, config overrides, and a bad override refused in one line. The expected values are
worked out by hand from the synthetic metrics below."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import main_job_seeds
from benchmarks.main_job_seeds import (MAIN_JOB, Run, call_form, config_data, config_summary, config_table,
                                      dynamics, eval_before, held_out, parse_seeds)

ROOT = Path(__file__).resolve().parents[1]


def write_run(folder: Path, evals: list[tuple[int, float, float, float]], rewards: list[float]) -> Path:
    """A run folder whose metrics.jsonl has a step-0 evaluation row, one row per training step (reward/mean,
    time/step_s 10 s) and the last evaluation merged into the last step's row, as the trainer logs them.
    `evals`: (step, val/pass@1, val/workflow/valid_tool_calls, val/workflow/grounded_tool_calls)."""
    folder.mkdir(parents=True)
    val = {s: {"val/pass@1": p, "val/tasks": 160.0, "val/workflow/valid_tool_calls": v,
               "val/workflow/grounded_tool_calls": g} for s, p, v, g in evals}
    rows = [{"step": 0, **val[0]}] if 0 in val else []
    for step, reward in enumerate(rewards, start=1):
        rows.append({"step": step, "reward/mean": reward, "time/step_s": 10.0, **val.get(step, {})})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


@pytest.fixture
def runs(tmp_path) -> dict[str, dict]:
    """Four seeds of one config: a learner (22/160 -> 80/160), a collapse (22/160 -> 3/160), exactly +10 points
    (40/160 -> 56/160: 0.35 - 0.25 is 0.0999... in floating point) and one stopped after its first evaluation."""
    return {
        "seed_0": held_out(write_run(tmp_path / "s0", [(0, 22 / 160, 0.35, 0.21), (2, 80 / 160, 1.0, 0.96)], [0.5, 0.7])),
        "seed_1": held_out(write_run(tmp_path / "s1", [(0, 22 / 160, 0.35, 0.21), (2, 3 / 160, 1.0, 0.18)], [0.1, 0.2])),
        "seed_2": held_out(write_run(tmp_path / "s2", [(0, 40 / 160, 0.5, 0.25), (2, 56 / 160, 0.75, 0.5)], [0.3, 0.4])),
        "seed_3": held_out(write_run(tmp_path / "s3", [(0, 22 / 160, 0.35, 0.21)], [0.2])),
    }


def test_a_runs_figures_come_from_its_first_and_last_evaluation(runs):
    s0 = runs["seed_0"]
    assert (s0["before"], s0["after"], s0["before_step"], s0["after_step"]) == (0.1375, 0.5, 0, 2)
    assert s0["gain_points"] == pytest.approx(36.25)
    assert (s0["valid_calls_before"], s0["grounded_calls_before"]) == (0.35, 0.21)
    assert (s0["valid_calls_after"], s0["grounded_calls_after"]) == (1.0, 0.96)
    assert s0["train_reward_mean"] == pytest.approx(0.6) and s0["steps_time_s"] == 20.0 and s0["last_step"] == 2
    assert runs["seed_1"]["gain_points"] == pytest.approx(-11.875)
    stopped = runs["seed_3"]                     # one evaluation: a before, no after and no gain
    assert stopped["before"] == 0.1375 and stopped["after"] is None and "gain_points" not in stopped
    assert stopped["valid_calls_after"] is None


def test_a_config_reports_mean_minimum_and_seeds_at_ten_points(runs):
    c = config_summary(list(runs.values()))
    # gains +36.25, -11.875, +10 (16 of 160 more: counts as +10), seed 3 not finished
    assert (c["seeds"], c["finished"], c["seeds_10"]) == (4, 3, 2)
    assert c["mean_gain"] == pytest.approx((36.25 - 11.875 + 10) / 3)            # 11.458...
    assert c["min_gain"] == pytest.approx(-11.875)
    assert config_summary([runs["seed_3"]]) == {"seeds": 1, "finished": 0, "mean_gain": None, "min_gain": None,
                                                "seeds_10": 0}


def test_the_table_has_a_row_per_seed_and_the_configs_line(runs):
    runs = {n: {**r, "rc": 0, "wall_s": 600.0} for n, r in runs.items()}
    runs["seed_3"].update(rc=-15, wall_s=None)
    runs["seed_0"].update(peak_rss_gb=5.1, peak_pss_gb=4.25)
    text = "\n".join(config_table("shipped", runs))
    assert "| seed_0 | 0 | 13.8% -> 50.0% | +36.2 | 0.35 / 0.21 -> 1.00 / 0.96 | 2 | 600 s | 5.10 / 4.25 GB |" in text
    assert "| seed_1 | 0 | 13.8% -> 1.9% | -11.9 | 0.35 / 0.21 -> 1.00 / 0.18 | 2 | 600 s | - |" in text
    assert "| seed_2 | 0 | 25.0% -> 35.0% | +10.0 | 0.50 / 0.25 -> 0.75 / 0.50 | 2 | 600 s | - |" in text
    assert "| seed_3 | -15 | 13.8% -> - | - | 0.35 / 0.21 -> - | 1 | not finished | - |" in text
    assert "shipped: mean gain +11.5 points, minimum -11.9, 2 of 3 seeds +10 points or more (1 not finished)" in text


def test_before_once_the_shared_evaluation_is_every_runs_before(tmp_path):
    """`--before-once`: `ajet eval`'s eval_metrics.json of the initial policy (22/160, calls 0.35 / 0.21) is the
    before of a run that logged only its last evaluation (step 2: 80/160)."""
    (tmp_path / "before").mkdir()
    (tmp_path / "before" / "eval_metrics.json").write_text(json.dumps({
        "pass@1": 22 / 160, "tasks": 160.0, "valid": 1.0, "workflow/valid_tool_calls": 0.35,
        "workflow/grounded_tool_calls": 0.21}))
    before = eval_before(tmp_path / "before")
    assert before == {"step": 0, "val/pass@1": 0.1375, "val/tasks": 160.0, "val/valid": 1.0,
                      "val/workflow/valid_tool_calls": 0.35, "val/workflow/grounded_tool_calls": 0.21}
    run = write_run(tmp_path / "s0", [(2, 80 / 160, 1.0, 0.96)], [0.5, 0.7])
    r = held_out(run, before)
    assert (r["before"], r["after"], r["before_step"], r["after_step"]) == (0.1375, 0.5, 0, 2)
    assert r["gain_points"] == pytest.approx(36.25) and r["val_tasks"] == 160.0
    assert (r["valid_calls_before"], r["grounded_calls_before"], r["grounded_calls_after"]) == (0.35, 0.21, 0.96)
    alone = held_out(run)                                      # without it, the run's one evaluation is an after
    assert (alone["before"], alone["after"], alone["after_step"]) == (None, 0.5, 2) and "gain_points" not in alone
    (tmp_path / "before" / "eval_metrics.json").write_text(json.dumps({"valid": 0.0, "failed": 40.0}))
    assert eval_before(tmp_path / "before") is None            # an invalid evaluation is no before
    assert eval_before(tmp_path / "missing") is None


def test_overrides_set_nested_fields_and_seed_ranges_expand():
    data = config_data(MAIN_JOB, {"engine.kind": "vllm", "algorithm.lr": 1e-5, "trainer.seed": 3})
    assert data["engine"] == {"kind": "vllm"} and data["algorithm"]["lr"] == 1e-5 and data["trainer"]["seed"] == 3
    assert data["algorithm"]["micro_batch_tokens"] == 1024                     # the rest of the section is kept
    assert Path(data["data"]["train_path"]).is_absolute() and Path(data["data"]["train_path"]).exists()
    with pytest.raises(ValueError, match="not a section"):
        config_data(MAIN_JOB, {"algorithm.lr.x": 1})
    assert parse_seeds("0-3,7,2") == [0, 1, 2, 3, 7]


@pytest.mark.parametrize("args, says", [(["--set", "algorithm.lr"], "'algorithm.lr' is not KEY=VALUE"),
                                        (["--candidate", "lr"], "then one or more KEY=VALUE fields"),
                                        (["--before-once", "--candidate", "j", "judge=x.py:f"], "every run must share"),
                                        (["--before-once", "--set", "model.path=m"], "every run must share")])
def test_a_bad_override_is_one_line_naming_it(tmp_path, args, says):
    out = tmp_path / "stderr.txt"
    with open(out, "w") as err:
        # a config that does not exist: should the check under test let the arguments through, the run is refused
        # for it before anything starts (a different message: the test fails, and no job runs)
        rc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "main_job_seeds.py"), "--no-sft", *args,
                             "--conf", str(tmp_path / "missing.yaml"), "--out", str(tmp_path / "o")],
                            stdout=err, stderr=err, timeout=120).returncode
    text = out.read_text()
    assert rc == 2 and says in text and "Traceback" not in text
    assert not (tmp_path / "o").exists()                                          # nothing started


def test_call_forms_keep_the_numbers_the_question_does_not_give():
    q = "Mia has 8 pens and buys 8 more and 12 pencils. How many pens?"
    assert call_form("3 * 8", q) == "3*N"
    assert call_form("8 + 8", q) == "N+N"
    assert call_form("(12 - 8) * 2.5", q) == "(N-N)*2.5"


def test_dynamics_per_step_from_metrics_and_the_store(tmp_path):
    """Step 1: 2 groups x 2 episodes logged, one group without signal; first calls `3 * 5` / `3 * 7` (a number the
    question does not give) and `5 + 7` (the question's), advantages written per sample; step 2: one untrained."""
    import sqlite3

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"rollout": {"num_repeat": 2}}))
    metrics = [{"step": 0, "val/pass@1": 0.1},
               {"step": 1, "reward/mean": 0.3, "train/entropy": 1.25, "rollout/episodes": 4,
                "rollout/zero_std_groups": 1, "rollout/oversampled_tasks": 0, "workflow/valid_tool_calls": 1.0,
                "workflow/grounded_tool_calls": 0.5},
               {"step": 2, "reward/mean": 0.5, "train/entropy": 0.5, "rollout/episodes": 6,
                "rollout/zero_std_groups": 0, "rollout/oversampled_tasks": 1}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    con = sqlite3.connect(run / "trajectories.sqlite")
    con.executescript("create table episodes (episode_id, step, attempt, task_id, reward, error, record);"
                      "create table calls (call_id, episode_id, attempt, idx, record);"
                      "create table samples (episode_id, attempt, idx, step, advantage, record);")
    q = "Ann has 5 apples and gets 7 more."

    def call(expression):
        return json.dumps({"response_message": {"tool_calls": [{"function": {
            "name": "calculate", "arguments": json.dumps({"expression": expression})}}]}})

    episodes = [("e1", 1, "3 * 5", 0.5, 0.1), ("e2", 1, "3 * 7", 1.5, 1.1), ("e3", 1, "5 + 7", -1.0, 0.2),
                ("e4", 1, "5 + 7", -1.0, 0.0),
                ("e0", 1, "3*5", None, 0.1),               # a dropped group's episode: a form, no advantage
                ("e5", 2, "3 * 5", None, 0.1)]
    for eid, step, expression, advantage, reward in episodes:
        con.execute("insert into episodes values (?, ?, 0, 't', ?, null, ?)",
                    (eid, step, reward, json.dumps({"task": {"query": q}})))
        con.execute("insert into calls values (?, ?, 0, 0, ?)", (eid + "c", eid, call(expression)))
        if advantage is not None:
            con.execute("insert into samples values (?, 0, 0, ?, ?, '{}')", (eid, step, advantage))
    con.commit()
    con.close()
    s1, s2 = dynamics(run)
    assert (s1["step"], s1["reward_mean"], s1["entropy"], s1["no_signal_share"]) == (1, 0.3, 1.25, 0.5)  # 1 of 4/2
    assert (s1["valid_calls"], s1["grounded_calls"]) == (1.0, 0.5)
    assert (s1["top_form"], s1["top_form_share"]) == ("3*N", 0.6)           # 3*N 3 of 5 episodes, N+N 2
    assert s1["adv_foreign"] == pytest.approx(1.0) and s1["n_foreign"] == 2    # (0.5 + 1.5) / 2
    assert s1["adv_own"] == pytest.approx(-1.0) and s1["n_own"] == 2
    assert s1["wrong_answer_adv_share"] == pytest.approx(2.5 / 4.0)          # |0.5| + |-1| + |-1| of 0.5 + 1.5 + 1 + 1
    assert s2["no_signal_share"] == 0.0 and s2["adv_foreign"] is None and s2["top_form"] == "3*N"
    assert s2["wrong_answer_adv_share"] is None
    assert s2["top_form_share"] == 1.0 and s2["valid_calls"] is None


def test_a_run_measures_its_process_trees_peak_memory(tmp_path, monkeypatch):
    """A child that starts a grandchild holding 300 MiB of written pages for 3 s: the run's peak counts the
    grandchild's memory (its process tree), and is kept after both exit."""
    monkeypatch.setattr(main_job_seeds, "MEMORY_EVERY_S", 0.5)
    code = ("import subprocess, sys; subprocess.run([sys.executable, '-c', "
            "'import time; x = bytearray(300 * 2**20); x[::4096] = b\"1\" * len(x[::4096]); time.sleep(3)'])")
    run = Run("mem", [sys.executable, "-c", code], tmp_path, dict(os.environ), time.monotonic())
    deadline = time.monotonic() + 60
    while not run.poll(0.0) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert run.rc == 0
    mem = run.memory
    assert 0.28 * 2**30 <= mem.peak_pss <= mem.peak_rss < 2**30, (mem.peak_pss, mem.peak_rss)
