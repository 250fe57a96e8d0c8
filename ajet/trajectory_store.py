"""Durable, append-only record of every finished episode and its calls (SQLite in WAL mode).

Each episode is committed in one transaction as soon as it finishes, before training uses it, so a crash
(even `kill -9`) loses no finished episode. Rows are only ever inserted; a resumed run adds rows under a
new `attempt` number, so what an interrupted step produced stays readable.

    store = TrajectoryStore(exp_dir / "trajectories.sqlite")
    store.add_episode(step=3, attempt=0, episode=ep)
    store.episodes(step=3)   # -> list of dicts (the same JSON as trajectories.jsonl)
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

_SCHEMA = """
CREATE TABLE IF NOT EXISTS episodes (
    episode_id TEXT NOT NULL, step INTEGER NOT NULL, attempt INTEGER NOT NULL, task_id TEXT NOT NULL,
    reward REAL, error TEXT, record TEXT NOT NULL, PRIMARY KEY (episode_id, attempt));
CREATE TABLE IF NOT EXISTS calls (
    call_id TEXT NOT NULL, episode_id TEXT NOT NULL, attempt INTEGER NOT NULL, idx INTEGER NOT NULL,
    record TEXT NOT NULL, PRIMARY KEY (call_id, attempt));
CREATE INDEX IF NOT EXISTS episodes_by_step ON episodes (step, attempt);
"""


class TrajectoryStore:
    """Append-only SQLite store of episodes and calls.

    Args:
        path: the database file (created with its folder if missing).
    Raises:
        sqlite3.Error: the file cannot be opened or written.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")   # WAL + NORMAL: durable across process crashes
        self._db.executescript(_SCHEMA)

    def add_episode(self, step: int, attempt: int, record: dict[str, Any]) -> None:
        """Commit one finished episode (its `Episode.to_dict()` record) and its calls atomically."""
        calls = record.get("calls", [])
        with self._db:  # one transaction
            self._db.execute("BEGIN")
            self._db.execute("INSERT INTO episodes VALUES (?, ?, ?, ?, ?, ?, ?)",
                             (record["episode_id"], step, attempt, record["task"]["task_id"], record.get("reward"),
                              record.get("error"), json.dumps(record)))
            self._db.executemany("INSERT INTO calls VALUES (?, ?, ?, ?, ?)",
                                 [(c["call_id"], record["episode_id"], attempt, c["index"], json.dumps(c)) for c in calls])

    def episodes(self, step: int | None = None, attempt: int | None = None) -> list[dict[str, Any]]:
        """Stored episode records, in insertion order, optionally of one step and/or attempt."""
        sql, args = "SELECT record FROM episodes", []
        where = [(c, v) for c, v in (("step", step), ("attempt", attempt)) if v is not None]
        if where:
            sql += " WHERE " + " AND ".join(f"{c} = ?" for c, _ in where)
            args = [v for _, v in where]
        return [json.loads(r[0]) for r in self._db.execute(sql + " ORDER BY rowid", args)]

    def count(self) -> tuple[int, int]:
        """(episodes, calls) stored."""
        return (self._db.execute("SELECT COUNT(*) FROM episodes").fetchone()[0],
                self._db.execute("SELECT COUNT(*) FROM calls").fetchone()[0])

    def close(self) -> None:
        self._db.close()
