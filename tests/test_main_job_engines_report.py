"""benchmarks/main_job_engines.py's figures: tokens/s and pass@1 from a run's metrics.jsonl and evaluation files, the
side-by-side table of backbone x engine runs with their ratios to debug+in_process, the runs a command asks for, and
the memory of real processes (a tree, and the processes outside it that carry the run's environment marker).
Expected values worked out by hand."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from benchmarks.engines import process_tree_memory
from benchmarks.main_job_engines import (
    TreeMemory,
    backbone_python,
    job_config,
    job_environment,
    job_figures,
    main,
    plan_runs,
    table,
)


def test_a_jobs_figures_come_from_its_metrics_and_evaluations(tmp_path):
    rows = [{"step": 0, "val/pass@1": 0.125, "val/time_s": 100.0},
            {"step": 1, "rollout/generated_tokens": 300, "time/rollout_s": 10.0, "train/update_s": 50.0,
             "train/weight_sync_s": 2.5},
            {"step": 2, "rollout/generated_tokens": 500, "time/rollout_s": 30.0, "train/update_s": 70.0,
             "train/weight_sync_s": 1.5, "val/pass@1": 0.5, "val/time_s": 60.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for step, calls in ((0, [[1, 2, 3], [4]]), (2, [[5, 6], [7, 8, 9, 10]])):
        folder = tmp_path / "val" / f"step_{step}"
        folder.mkdir(parents=True)
        episodes = [{"calls": [{"completion_ids": ids}]} for ids in calls] + [{"calls": []}]
        (folder / "eval_trajectories.jsonl").write_text("".join(json.dumps(e) + "\n" for e in episodes))
    f = job_figures(tmp_path)
    assert (f["steps"], f["before"], f["after"]) == (2, 0.125, 0.5)
    assert f["rollout_tokens_per_s"] == pytest.approx(800 / 40)                  # 20 tokens/s
    assert (f["update_s"], f["weight_sync_s"]) == (120.0, 4.0)
    assert (f["eval_tokens"], f["eval_s"]) == (4 + 6, 160.0)
    assert f["eval_tokens_per_s"] == pytest.approx(10 / 160)
    assert job_figures(tmp_path / "missing")["before"] is None


def test_with_a_test_set_the_reported_figure_is_the_test_sets(tmp_path):
    """The main job validates on 64 problems (selection) and reports the 160 of its test set: before/after are the
    test set's pass@1 (step 0 and the final model, here step 1's), and its evaluations count in the eval tokens/s."""
    rows = [{"step": 0, "val/pass@1": 0.125, "val/time_s": 40.0, "test/pass@1": 0.1, "test/time_s": 100.0,
             "test/step": 0.0},
            {"step": 1, "rollout/generated_tokens": 300, "time/rollout_s": 10.0, "val/pass@1": 0.3, "val/time_s": 30.0},
            {"step": 2, "rollout/generated_tokens": 100, "time/rollout_s": 10.0, "val/pass@1": 0.2, "val/time_s": 30.0,
             "test/pass@1": 0.45, "test/time_s": 90.0, "test/step": 1.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for split, step, ids in (("val", 0, [1]), ("test", 0, [1, 2]), ("test", 1, [1, 2, 3, 4])):
        folder = tmp_path / split / f"step_{step}"
        folder.mkdir(parents=True)
        (folder / "eval_trajectories.jsonl").write_text(json.dumps({"calls": [{"completion_ids": ids}]}) + "\n")
    f = job_figures(tmp_path)
    assert (f["held_out"], f["before"], f["after"]) == ("test", 0.1, 0.45)
    assert (f["eval_tokens"], f["eval_s"]) == (1 + 2 + 4, 40.0 + 100.0 + 30.0 + 30.0 + 90.0)


def test_the_table_prints_each_engine_and_the_ratio():
    jobs = [{"engine": "vllm", "wall_s": 600.0, "rollout_tokens_per_s": 90.0, "peak_rss_gb": 9.0},
            {"engine": "in_process", "wall_s": 1200.0, "rollout_tokens_per_s": 30.0, "peak_rss_gb": 6.0}]
    text = "\n".join(table(jobs))
    assert "| wall time, s (evaluations included) | 600 | 1200 | 0.50 |" in text
    assert "| rollout tokens/s | 90.0 | 30.0 | 3.00 |" in text
    assert "| peak RSS of all processes, GB | 9.00 | 6.00 | 1.50 |" in text
    assert "| held-out pass@1 after | - | - | - |" in text                       # not measured: no ratio
    assert text.startswith("| figure | debug+vllm | debug+in_process | debug+vllm / debug+in_process |\n|---|---|---|---|\n")
    assert "vllm / in_process" not in "\n".join(table(jobs[:1]))                 # one engine: no ratio column


def test_the_table_puts_four_runs_side_by_side_with_each_ratio_to_debug_in_process():
    jobs = [{"run": "debug+in_process", "backbone": "debug", "engine": "in_process", "wall_s": 900.0,
             "peak_rss_gb": 5.0, "processes": 1, "weight_sync_s": 0.0},
            {"run": "debug+vllm", "backbone": "debug", "engine": "vllm", "wall_s": 1080.0, "peak_rss_gb": 10.0,
             "processes": 5, "weight_sync_s": 25.0},
            {"run": "verl+vllm", "backbone": "verl", "engine": "vllm", "wall_s": 1800.0, "peak_rss_gb": 16.0,
             "processes": 20, "weight_sync_s": 40.0},
            {"run": "trinity+vllm", "backbone": "trinity", "engine": "vllm", "wall_s": 2250.0, "peak_rss_gb": 19.0,
             "processes": 24, "weight_sync_s": 30.0}]
    lines = table(jobs)
    assert lines[0] == ("| figure | debug+in_process | debug+vllm | verl+vllm | trinity+vllm | debug+vllm / "
                        "debug+in_process | verl+vllm / debug+in_process | trinity+vllm / debug+in_process |")
    assert lines[1] == "|---" * 8 + "|"
    assert all(line.count("|") == 9 for line in lines)                          # 8 cells in every row
    text = "\n".join(lines)
    assert "| wall time, s (evaluations included) | 900 | 1080 | 1800 | 2250 | 1.20 | 2.00 | 2.50 |" in text
    assert "| peak RSS of all processes, GB | 5.00 | 10.00 | 16.00 | 19.00 | 2.00 | 3.20 | 3.80 |" in text
    assert "| processes, most at once | 1 | 5 | 20 | 24 | 5.00 | 20.00 | 24.00 |" in text
    assert "| weight sync s | 0.0 | 25.0 | 40.0 | 30.0 | - | - | - |" in text    # over a baseline of 0: no ratio
    # the baseline need not come first; without it there is no ratio column
    reordered = table(jobs[2:] + jobs[:2])
    assert reordered[0].endswith("| verl+vllm / debug+in_process | trinity+vllm / debug+in_process | "
                                 "debug+vllm / debug+in_process |")
    assert "| wall time, s (evaluations included) | 1800 | 2250 | 900 | 1080 | 2.00 | 2.50 | 1.20 |" in reordered
    assert " / " not in table(jobs[1:])[0]


def test_the_runs_a_command_asks_for():
    assert plan_runs(None, None, None) == [("debug", "vllm"), ("debug", "in_process")]      # as before --backbones
    assert plan_runs(None, None, "in_process") == [("debug", "in_process")]
    assert plan_runs("debug:in_process,debug:vllm,verl:vllm,trinity:vllm", None, None) == [
        ("debug", "in_process"), ("debug", "vllm"), ("verl", "vllm"), ("trinity", "vllm")]
    assert plan_runs(None, "debug,verl", "in_process,vllm") == [
        ("debug", "in_process"), ("debug", "vllm"), ("verl", "in_process"), ("verl", "vllm")]
    for bad in ("verl", "verl:vllm:x", "sglang:vllm", "verl:sglang", "verl:vllm,verl:vllm", ","):
        with pytest.raises(ValueError, match="--runs: comma-separated distinct BACKBONE:ENGINE pairs"):
            plan_runs(bad, None, None)
    with pytest.raises(ValueError, match="leave out --backbones and --engines"):
        plan_runs("verl:vllm", "verl", None)
    with pytest.raises(ValueError, match="--backbones: .* among debug, verl, trinity"):
        plan_runs(None, "debug,megatron", None)
    with pytest.raises(SystemExit) as exc:                                      # a user error: exit 2, nothing run
        main(["--runs", "verl:vllm,verl:vllm", "--out", "unused"])
    assert exc.value.code == 2


def test_a_scale_out_backbone_runs_from_its_own_venv_with_its_own_ray_cluster(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"absent or unfinished: build it with `ajet backbone-env verl`"):
        backbone_python("verl", root=tmp_path)
    venv = tmp_path / ".venvs" / "verl"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").touch()
    with pytest.raises(ValueError, match="unfinished"):                        # no .complete: still being built
        backbone_python("verl", root=tmp_path)
    (venv / ".complete").touch()
    assert backbone_python("verl", root=tmp_path) == str(tmp_path / ".venvs" / "verl" / "bin" / "python")
    assert backbone_python("debug", root=tmp_path) == sys.executable

    monkeypatch.delenv("RAY_memory_usage_threshold", raising=False)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")          # a cluster on the machine: not joined
    env = job_environment("trinity", "AJET_BENCHMARK_RUN=trinity_vllm@1")
    assert (env["RAY_ADDRESS"], env["RAY_memory_usage_threshold"]) == ("local", "0.98")
    assert env["AJET_BENCHMARK_RUN"] == "trinity_vllm@1" and env["PYTHONUNBUFFERED"] == "1"
    monkeypatch.setenv("RAY_memory_usage_threshold", "0.9")
    assert job_environment("verl", "AJET_BENCHMARK_RUN=x")["RAY_memory_usage_threshold"] == "0.9"   # the user's
    assert job_environment("debug", "AJET_BENCHMARK_RUN=x")["RAY_ADDRESS"] == "10.0.0.1:6379"       # no Ray


def test_a_runs_config_sets_its_engine_and_the_set_fields(tmp_path):
    import yaml

    conf = yaml.safe_load(job_config("verl", "vllm", 2, tmp_path, {"trainer.val_freq": 0}).read_text())
    assert conf["engine"]["kind"] == "vllm" and conf["engine"]["kv_cache_gb"] == 2
    assert conf["engine"].get("python", "").endswith(os.path.join(".venvs", "vllm", "bin", "python")) or \
        "python" not in conf["engine"]
    assert conf["trainer"]["val_freq"] == 0 and conf["trainer"]["total_steps"] == 16        # the rest as shipped
    assert os.path.isabs(conf["data"]["train_path"])
    conf = yaml.safe_load(job_config("debug", "in_process", 2, tmp_path).read_text())
    assert conf["engine"] == {"kind": "in_process"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["debug_in_process.yaml", "verl_vllm.yaml"]


def test_tree_memory_sums_a_process_and_its_children(tmp_path):
    """A parent holding 30 MB with two children holding 30 MB each: the tree's peak RSS is at least 90 MB and counts
    3 processes; the ready line is found in the log once written."""
    import psutil

    hold = "b = bytearray(30 * 2**20); import time; time.sleep(60)"
    parent = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys; cs = [subprocess.Popen([sys.executable, "
                               f"'-c', {hold!r}]) for _ in range(2)]; {hold}"])
    log = tmp_path / "vllm.log"
    log.write_text("starting\n")
    try:
        mem = TreeMemory(parent.pid, time.monotonic(), interval_s=0.2, ready_log=log)
        deadline = time.monotonic() + 60
        while (mem.max_processes < 3 or mem.peak_rss < 3 * 30 * 2**20) and time.monotonic() < deadline:
            time.sleep(0.2)
        log.write_text("starting\nINFO:     Application startup complete.\n")
        while mem.ready_s is None and time.monotonic() < deadline:
            time.sleep(0.2)
        mem.stop()
    finally:
        for child in psutil.Process(parent.pid).children():
            child.kill()
        parent.kill()
        parent.wait()
    assert mem.max_processes == 3 and mem.peak_rss >= 3 * 30 * 2**20
    assert mem.ready_s is not None


def test_the_memory_counts_the_processes_outside_the_tree_that_carry_the_runs_marker():
    """A parent and its two children (started with the marker, which the children inherit), one process outside
    the tree with the marker (as Ray's workers are: they hang off the raylet) and one with another run's marker,
    each holding 30 MB: with the marker 4 processes are counted, each once; without it the tree's 3."""
    import psutil

    hold = "b = bytearray(30 * 2**20); import time; time.sleep(60)"
    marker = f"AJET_BENCHMARK_RUN=test@{os.getpid()}"
    ours = {**os.environ, "AJET_BENCHMARK_RUN": f"test@{os.getpid()}"}
    parent = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys; cs = [subprocess.Popen([sys.executable, "
                               f"'-c', {hold!r}]) for _ in range(2)]; {hold}"], env=ours)
    outsider = subprocess.Popen([sys.executable, "-c", hold], env=ours)
    stranger = subprocess.Popen([sys.executable, "-c", hold],
                                env={**os.environ, "AJET_BENCHMARK_RUN": f"other@{os.getpid()}"})
    try:
        mem = TreeMemory(parent.pid, time.monotonic(), interval_s=0.2, marker=marker)
        deadline = time.monotonic() + 60
        while (mem.max_processes < 4 or mem.peak_rss < 4 * 30 * 2**20) and time.monotonic() < deadline:
            time.sleep(0.2)
        mem.stop()
        tree = process_tree_memory(parent.pid)
    finally:
        for child in psutil.Process(parent.pid).children():
            child.kill()
        for proc in (parent, outsider, stranger):
            proc.kill()
            proc.wait()
    assert mem.max_processes == 4 and mem.peak_rss >= 4 * 30 * 2**20
    assert tree[2] == 3
