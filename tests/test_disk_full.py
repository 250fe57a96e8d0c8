"""A disk that fills up during a run: one line naming what did not fit, the disk's free space and what to do, exit
status 2, no traceback; a checkpoint that did not fit leaves no partial folder behind.

The experiment folder is a real tmpfs of a few hundred KB (bubblewrap's `--size BYTES --tmpfs DIR`, no root needed
where bubblewrap can create its namespaces: CI installs it and sets AJET_REQUIRE_BWRAP=1, where a missing bubblewrap
fails these tests instead of skipping them). The tiny model's weights alone (`model.safetensors`, 566 KB) do not fit
in 300 KB; 60 KB do not even hold the trajectory store's first writes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ajet.tools.sandbox import bwrap_status
from tests.tiny_experiment import WORKFLOW

BWRAP, WHY_NOT = bwrap_status()
if not BWRAP and os.environ.get("AJET_REQUIRE_BWRAP") == "1":
    raise RuntimeError(f"AJET_REQUIRE_BWRAP=1 but bubblewrap does not work here: {WHY_NOT}")
pytestmark = pytest.mark.skipif(not BWRAP, reason=f"bubblewrap unavailable: {WHY_NOT}")


def _run_on_a_small_disk(tmp_path: Path, model_dir: str, size_bytes: int) -> tuple[subprocess.CompletedProcess, list]:
    """`ajet` (debug backbone, tiny model, 2 steps, a checkpoint every step) with its experiment folder on a tmpfs of
    `size_bytes`; returns the run and what its checkpoints folder held when it ended (the tmpfs is gone after)."""
    (tmp_path / "wf.py").write_text(WORKFLOW)
    tasks = [{"task_id": f"t{i}", "query": f"What is {i} plus {i}?", "answer": str(2 * i)} for i in range(3)]
    (tmp_path / "tasks.jsonl").write_text("\n".join(json.dumps(t) for t in tasks) + "\n")
    (tmp_path / "conf.yaml").write_text(textwrap.dedent(f"""
        workflow: wf.py:ToolLoopWorkflow
        model: {{path: "{model_dir}", max_model_len: 1024}}
        data: {{train_path: tasks.jsonl, shuffle: false}}
        rollout: {{num_repeat: 2, max_tokens: 8}}
        trainer: {{total_steps: 2, tasks_per_step: 1, val_freq: 0, save_freq: 1}}
    """))
    exp = tmp_path / "small" / "exp"
    script = (f"{sys.executable} -m ajet --conf conf.yaml --backbone=debug --exp-dir {exp} -q; status=$?; "
              f"echo LISTING; ls -A {exp}/checkpoints 2>/dev/null; exit $status")
    proc = subprocess.run(["bwrap", "--dev-bind", "/", "/", "--size", str(size_bytes), "--tmpfs", str(exp),
                           "--chdir", str(tmp_path), "sh", "-c", script],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "AJET_PLOTS": "0"})
    return proc, proc.stdout.split("LISTING", 1)[-1].split()


def test_a_checkpoint_that_does_not_fit_is_one_line_and_leaves_no_partial_folder(tiny_model_dir, tmp_path):
    proc, checkpoints = _run_on_a_small_disk(tmp_path, tiny_model_dir, 300_000)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [x for x in proc.stderr.splitlines() if x.startswith("ajet: error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "checkpoint step_1 did not fit in" in lines[0] and "the disk is full" in lines[0]
    assert "free of 0.3 MB" in lines[0]                                   # the disk's size, as df says it
    assert "no earlier checkpoint" in lines[0] and "--exp-dir" in lines[0]
    assert checkpoints == []                # the partial .step_1.tmp was removed: its space is free again
    assert "step 1/2" in proc.stdout        # step 1 trained; its checkpoint is what failed


def test_a_store_write_that_does_not_fit_is_one_line(tiny_model_dir, tmp_path):
    proc, _ = _run_on_a_small_disk(tmp_path, tiny_model_dir, 60_000)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [x for x in proc.stderr.splitlines() if x.startswith("ajet: error:")]
    assert len(lines) == 1 and "the disk is full in" in lines[0], proc.stderr[-3000:]
    assert "database or disk is full" in lines[0] and "--resume" in lines[0]
