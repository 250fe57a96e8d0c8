"""End-of-run plots (EXP_DIR/plots/*.png) and the `trainer.loggers` choice (console, tensorboard, jsonl, wandb)."""

import json
import math
import os
import subprocess
import sys
import textwrap
import time

import pytest

from ajet.config import trainer as config_module
from ajet.config import load_config
from ajet.errors import ConfigError
from ajet.metrics_log import MetricsLogger
from ajet.viewer.plots import moving_average, plots_wanted, write_plots, write_plots_safely
from tests.tiny_experiment import WORKFLOW

PNG = b"\x89PNG\r\n\x1a\n"


def test_a_real_run_ends_with_plots(tiny_experiment):
    plots = tiny_experiment / "plots"
    names = {p.name for p in plots.glob("*.png")}
    assert {"reward.png", "ratios.png", "time.png", "train.png", "workflow_turns.png", "workflow_length.png"} <= names
    for p in plots.glob("*.png"):
        data = p.read_bytes()
        assert data.startswith(PNG) and len(data) > 5_000, p


@pytest.mark.parametrize("env, configured, wanted", [
    (None, True, True), (None, False, False), ("", False, False),      # unset or empty: trainer.plots decides
    ("0", True, False), ("Off", True, False), ("no", True, False), ("false", True, False),
    ("1", False, True), ("ON", False, True), (" yes ", False, True), ("true", False, True)])
def test_ajet_plots_overrides_trainer_plots_either_way(monkeypatch, env, configured, wanted):
    monkeypatch.delenv("AJET_PLOTS", raising=False)
    if env is not None:
        monkeypatch.setenv("AJET_PLOTS", env)
    assert plots_wanted(configured) is wanted


def test_a_run_with_plots_off_draws_none_and_a_bad_ajet_plots_stops_it_before_it_starts(tiny_model_dir, tmp_path):
    (tmp_path / "wf.py").write_text(WORKFLOW)
    (tmp_path / "tasks.jsonl").write_text(json.dumps({"task_id": "t0", "query": "What is 1 plus 1?", "answer": "2"}))
    (tmp_path / "conf.yaml").write_text(textwrap.dedent(f"""
        workflow: wf.py:ToolLoopWorkflow
        model: {{path: "{tiny_model_dir}", max_model_len: 1024}}
        data: {{train_path: tasks.jsonl}}
        rollout: {{num_repeat: 2, max_tokens: 4}}
        trainer: {{total_steps: 1, tasks_per_step: 1, tensorboard: false}}
    """))
    env = {k: v for k, v in os.environ.items() if k != "AJET_PLOTS"}      # the config alone decides

    def ajet(*extra, **more_env):
        return subprocess.run([sys.executable, "-m", "ajet", "--conf", "conf.yaml", "--exp-dir", "exp", *extra],
                              capture_output=True, text=True, timeout=300, cwd=tmp_path, env={**env, **more_env})

    bad = ajet(AJET_PLOTS="maybe")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr[-2000:]
    assert "AJET_PLOTS='maybe': use 0 (no plots at the end of a run) or 1 (plots)" in bad.stderr
    assert not (tmp_path / "exp").exists()                                 # refused before anything was written
    run = ajet("trainer.plots=false")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert (tmp_path / "exp" / "metrics.jsonl").is_file() and not (tmp_path / "exp" / "plots").exists()


def test_moving_average_is_trailing_and_skips_nan():
    assert moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    got = moving_average([1.0, float("nan"), 3.0], 3)
    assert got[0] == 1.0 and math.isnan(got[1]) and got[2] == 2.0


def test_plots_survive_a_torn_line_a_resumed_step_and_missing_keys(tmp_path):
    rows = [{"step": 1, "reward/mean": 0.1, "reward/std": 0.0}, {"step": 2, "reward/mean": 0.5, "reward/std": 0.1},
            {"step": 2, "reward/mean": 0.4, "reward/std": 0.1}]   # step 2 again: a resumed attempt
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "rew')
    files = write_plots(tmp_path)
    assert {f.name for f in files} == {"reward.png", "ratios.png", "time.png"}
    assert write_plots(tmp_path / "empty") == []


def test_held_out_evaluations_get_their_own_plot(tmp_path):
    rows = [{"step": 0, "val/pass@1": 0.14, "val/reward_mean": 0.26},
            {"step": 1, "reward/mean": 0.2, "reward/std": 0.1},
            {"step": 2, "reward/mean": 0.4, "reward/std": 0.1, "val/pass@1": 0.42, "val/reward_mean": 0.62}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    files = {f.name: f for f in write_plots(tmp_path)}
    assert "val.png" in files and files["val.png"].read_bytes().startswith(PNG)


def test_a_plotting_problem_never_fails_the_run(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 1.0}) + "\n")
    (tmp_path / "plots").write_text("a file where the folder should be")
    assert write_plots_safely(tmp_path) == []
    assert "plots not written" in capsys.readouterr().err


def _conf(tmp_path, loggers):
    (tmp_path / "c.yaml").write_text(textwrap.dedent(f"""
        workflow: wf.py:W
        data: {{train_path: t.jsonl}}
        trainer: {{loggers: {loggers}}}
    """))
    return tmp_path / "c.yaml"


def test_loggers_config_names_the_missing_extra_and_the_allowed_names(tmp_path, monkeypatch):
    assert load_config(_conf(tmp_path, "[console, jsonl]")).trainer.active_loggers() == ["console", "jsonl"]
    with pytest.raises(ConfigError, match="mlflow"):
        load_config(_conf(tmp_path, "[console, mlflow]"))
    monkeypatch.setattr(config_module, "_package_missing", lambda name: True)
    with pytest.raises(ConfigError, match=r"logger 'wandb' needs its package: pip install 'ajet\[wandb\]'"):
        load_config(_conf(tmp_path, "[console, wandb]"))
    cfg = load_config(_conf(tmp_path, "[console, tensorboard, jsonl]"))
    cfg.trainer.tensorboard = False
    assert cfg.trainer.active_loggers() == ["console", "jsonl"]


def test_jsonl_and_console_loggers_can_be_left_out(tmp_path, capsys):
    log = MetricsLogger(tmp_path, loggers=[])
    log.log(1, {"reward/mean": 1.0})
    log.console.print("step 1/1 | reward 1.0")
    log.close()
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "tensorboard").exists()
    assert "step 1/1" not in capsys.readouterr().out
    log = MetricsLogger(tmp_path, loggers=["console", "jsonl"])
    log.log(1, {"reward/mean": 1.0})
    log.console.print("step 1/1 | reward 1.0")
    log.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 1, "reward/mean": 1.0}
    assert "step 1/1" in capsys.readouterr().out


def test_wandb_logger_writes_an_offline_run_with_an_episode_table(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is not installed (pip install 'ajet[wandb]')")
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR", "WANDB_PROJECT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    log = MetricsLogger(tmp_path, loggers=["wandb"])
    log.log(1, {"reward/mean": 0.75, "rollout/first_error": "not a number: left out"})
    log.write_episode(1, {"episode_id": "ep-wandb-1", "group_id": "1:t0", "reward": 0.75, "calls": [{}, {}],
                          "samples": [{"advantage": 0.5}], "output": {"final_answer": "42"}, "error": None})
    log.flush()
    log.close()
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    (run_file,) = run_dir.glob("run-*.wandb")
    deadline = time.monotonic() + 60   # wandb's core process may still be writing the run file after finish()
    while b"reward/mean" not in run_file.read_bytes() and time.monotonic() < deadline:
        time.sleep(0.5)
    data = run_file.read_bytes()
    assert b"reward/mean" in data and b"0.75" in data   # the step's history record (key, JSON value)
    (table,) = run_dir.glob("files/media/table/episodes_1_*.table.json")
    data = json.loads(table.read_text())
    assert data["columns"][:3] == ["episode_id", "group_id", "reward"]
    assert data["data"] == [["ep-wandb-1", "1:t0", 0.75, 0.5, 2, 1, "42", None]]
