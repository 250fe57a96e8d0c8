"""The README's run, as a user types it: from the project folder, a relative config and a relative
experiment folder, leaves every output the README lists.

Every run in the tests used an absolute folder until the tiny experiment (tests/tiny_experiment.py) was
started this way, so `Path.as_uri()` on the relative store path ("relative path can't be expressed as a
file URI") went unseen: the main job ended with "plots not written" and `reward.png` alone.
"""

from __future__ import annotations

import subprocess
import sys


def test_a_run_from_a_relative_experiment_folder_leaves_every_listed_output(tiny_experiment):
    root, exp = tiny_experiment.parent, tiny_experiment
    assert "plots not written" not in (root / "run.log").read_text()
    # docs/getting-started.md "What a run leaves": metrics.jsonl, tensorboard/, trajectories.jsonl,
    # trajectories.sqlite, checkpoints/step_N/, plots/; docs/evaluation.md: val/step_N/eval.jsonl
    for name in ("metrics.jsonl", "trajectories.jsonl", "trajectories.sqlite", "config.json"):
        assert (exp / name).is_file() and (exp / name).stat().st_size > 0, name
    assert any((exp / "tensorboard").iterdir())
    assert any((exp / "checkpoints" / "step_2").iterdir())
    n_tasks = len((root / "tasks.jsonl").read_text().splitlines())
    for step in (0, 2):                                  # val_freq 2: before the first step and after the last
        assert len((exp / "val" / f"step_{step}" / "eval.jsonl").read_text().splitlines()) == n_tasks
    plots = {p.name for p in (exp / "plots").glob("*.png")}
    # the plots that read the store (workflow_*) raised on the relative path and took the rest with them
    assert {"reward.png", "ratios.png", "time.png", "val.png", "workflow_turns.png", "workflow_length.png"} <= plots
    # redrawing from the same relative folder, as the README says
    proc = subprocess.run([sys.executable, "-m", "ajet.viewer.plots", "exp"], capture_output=True, text=True,
                          timeout=120, cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
