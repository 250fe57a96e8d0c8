"""A store that only holds valid JSON: a NaN or infinity in an episode record is written as null (SQLite's
json_valid accepts every row), and a folder that holds a row an older ajet wrote with a NaN is still read by
`ajet export` (a real subprocess): the bad row is skipped and named on stderr, every other row exported as stored."""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
import sys

from ajet.trajectory_store import TrajectoryStore


def test_non_finite_numbers_are_stored_as_null(tmp_path):
    store = TrajectoryStore(tmp_path / "trajectories.sqlite")
    record = {"episode_id": "e1", "task": {"task_id": "t"}, "reward": float("nan"), "duration_s": float("inf"),
              "calls": [{"call_id": "c", "index": 0, "completion_logprobs": [-0.5, float("-inf")]}]}
    store.add_episode(step=1, attempt=0, record=record)
    store.add_samples(1, 0, [{"episode_id": "e1", "advantage": 0.0, "old_logprobs": [float("nan")]}])
    store.close()
    db = sqlite3.connect(tmp_path / "trajectories.sqlite")
    for table in ("episodes", "calls", "samples"):
        rows = db.execute(f"SELECT json_valid(record), record FROM {table}").fetchall()
        assert rows and all(ok == 1 for ok, _ in rows), (table, rows)
    episode = json.loads(db.execute("SELECT record FROM episodes").fetchone()[0])
    assert (episode["reward"], episode["duration_s"], episode["calls"][0]["completion_logprobs"]) == (None, None,
                                                                                                     [-0.5, None])
    db.close()


def test_export_skips_and_names_a_row_that_is_not_valid_json(tiny_experiment, tmp_path):
    exp = tmp_path / "exp"
    shutil.copytree(tiny_experiment, exp)
    db = sqlite3.connect(exp / "trajectories.sqlite")
    eid, att, record = db.execute("SELECT episode_id, attempt, record FROM episodes WHERE error IS NULL AND reward "
                                  "IS NOT NULL ORDER BY rowid LIMIT 1").fetchone()
    bad = json.loads(record)
    bad["duration_s"] = float("nan")               # what json.dumps wrote before: NaN, not JSON
    db.execute("UPDATE episodes SET record = ? WHERE episode_id = ? AND attempt = ?", (json.dumps(bad), eid, att))
    db.commit()
    expected = db.execute("SELECT COUNT(*) FROM samples s JOIN episodes e ON s.episode_id = e.episode_id AND "
                          "s.attempt = e.attempt WHERE e.error IS NULL AND e.reward IS NOT NULL AND NOT "
                          "(e.episode_id = ? AND e.attempt = ?)", (eid, att)).fetchone()[0]
    db.close()
    out, log = tmp_path / "hf", tmp_path / "export.log"
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, "-m", "ajet", "export", "--format", "hf", str(exp), str(out)],
                              stdout=f, stderr=subprocess.STDOUT, timeout=600)
    text = log.read_text()
    assert proc.returncode == 0, text
    assert "Traceback" not in text and "skipped 1 stored row(s)" in text and f"episode {eid} (attempt {att})" in text
    import datasets

    ds = datasets.load_from_disk(str(out))
    assert len(ds) == expected > 0 and eid not in set(ds["episode_id"])
