"""benchmarks/main_job_engines.py's figures: tokens/s and pass@1 from a run's metrics.jsonl and evaluation files, the
side-by-side table with its ratio, and the memory of a real process tree. Expected values worked out by hand."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from benchmarks.main_job_engines import TreeMemory, job_figures, table


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


def test_the_table_prints_each_engine_and_the_ratio():
    jobs = [{"engine": "vllm", "wall_s": 600.0, "rollout_tokens_per_s": 90.0, "peak_rss_gb": 9.0},
            {"engine": "in_process", "wall_s": 1200.0, "rollout_tokens_per_s": 30.0, "peak_rss_gb": 6.0}]
    text = "\n".join(table(jobs))
    assert "| wall time, s (evaluations included) | 600 | 1200 | 0.50 |" in text
    assert "| rollout tokens/s | 90.0 | 30.0 | 3.00 |" in text
    assert "| peak RSS of all processes, GB | 9.00 | 6.00 | 1.50 |" in text
    assert "| held-out pass@1 after | - | - | - |" in text                       # not measured: no ratio
    assert "vllm / in_process" not in "\n".join(table(jobs[:1]))                 # one engine: no ratio column


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
