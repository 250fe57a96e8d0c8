"""Durable, append-only record of every finished episode, its calls, and which update trained on it
(SQLite in WAL mode).

Each episode is committed in one transaction as soon as it finishes, before training uses it, so a crash
(even `kill -9`) loses no finished episode. Rows are only ever inserted:

    attempts   one row per start of the trainer (`attempt` numbers come from here, so a process killed
               before it committed anything still used up its number: ids never repeat across attempts);
               `resumed_from_step` is the checkpoint step it continued from (0: from scratch)
    episodes   one row per finished episode, keyed (episode_id, attempt)
    calls      one row per recorded LLM call
    trained    one row per episode that went into an update: (episode_id, attempt, step)

An update of step S in attempt A is *live* (its weights are in the run's lineage) unless a later attempt
resumed from a checkpoint before S; then the update, and every episode of (S, A), belongs to an
abandoned attempt. `ledger()` applies that rule, so "every finished episode is trained on exactly once,
or is from an abandoned attempt" is a query.

    store = TrajectoryStore(exp_dir / "trajectories.sqlite")
    attempt = store.begin_attempt(resumed_from_step=0)
    store.add_episode(step=3, attempt=attempt, record=ep.to_dict())
    store.mark_trained(step=3, attempt=attempt, episode_ids=[...])
    store.episodes(step=3)   # -> list of dicts (the same JSON as trajectories.jsonl)
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path
from typing import Any, Iterable

_SCHEMA = """
CREATE TABLE IF NOT EXISTS episodes (
    episode_id TEXT NOT NULL, step INTEGER NOT NULL, attempt INTEGER NOT NULL, task_id TEXT NOT NULL,
    reward REAL, error TEXT, record TEXT NOT NULL, PRIMARY KEY (episode_id, attempt));
CREATE TABLE IF NOT EXISTS calls (
    call_id TEXT NOT NULL, episode_id TEXT NOT NULL, attempt INTEGER NOT NULL, idx INTEGER NOT NULL,
    record TEXT NOT NULL, PRIMARY KEY (call_id, attempt));
CREATE INDEX IF NOT EXISTS episodes_by_step ON episodes (step, attempt);
CREATE TABLE IF NOT EXISTS attempts (
    attempt INTEGER PRIMARY KEY, resumed_from_step INTEGER NOT NULL, started_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS trained (
    episode_id TEXT NOT NULL, attempt INTEGER NOT NULL, step INTEGER NOT NULL, PRIMARY KEY (episode_id, attempt));
"""


class TrajectoryStore:
    """Append-only SQLite store of episodes, calls, attempts and the trained-on ledger.

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

    def begin_attempt(self, resumed_from_step: int) -> int:
        """Register a new start of the trainer and return its attempt number (0, 1, 2, ...: one more than
        any attempt this store has seen, whether or not that attempt committed an episode)."""
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            row = self._db.execute("SELECT MAX(m) FROM (SELECT MAX(attempt) AS m FROM attempts "
                                   "UNION ALL SELECT MAX(attempt) FROM episodes)").fetchone()
            attempt = 0 if row[0] is None else row[0] + 1
            self._db.execute("INSERT INTO attempts VALUES (?, ?, ?)", (attempt, resumed_from_step, time.time()))
        return attempt

    def add_episode(self, step: int, attempt: int, record: dict[str, Any]) -> None:
        """Commit one finished episode (its `Episode.to_dict()` record) and its calls atomically.

        Raises:
            sqlite3.IntegrityError: the same (episode_id, attempt) was stored before.
        """
        calls = record.get("calls", [])
        with self._db:  # one transaction
            self._db.execute("BEGIN")
            self._db.execute("INSERT INTO episodes VALUES (?, ?, ?, ?, ?, ?, ?)",
                             (record["episode_id"], step, attempt, record["task"]["task_id"], record.get("reward"),
                              record.get("error"), json.dumps(record)))
            self._db.executemany("INSERT INTO calls VALUES (?, ?, ?, ?, ?)",
                                 [(c["call_id"], record["episode_id"], attempt, c["index"], json.dumps(c)) for c in calls])

    def mark_trained(self, step: int, attempt: int, episode_ids: Iterable[str]) -> None:
        """Record, in one transaction, that the update of `step` in `attempt` trained on `episode_ids`."""
        with self._db:
            self._db.execute("BEGIN")
            self._db.executemany("INSERT INTO trained VALUES (?, ?, ?)", [(e, attempt, step) for e in episode_ids])

    def episodes(self, step: int | None = None, attempt: int | None = None) -> list[dict[str, Any]]:
        """Stored episode records, in insertion order, optionally of one step and/or attempt."""
        sql, args = "SELECT record FROM episodes", []
        where = [(c, v) for c, v in (("step", step), ("attempt", attempt)) if v is not None]
        if where:
            sql += " WHERE " + " AND ".join(f"{c} = ?" for c, _ in where)
            args = [v for _, v in where]
        return [json.loads(r[0]) for r in self._db.execute(sql + " ORDER BY rowid", args)]

    def attempts(self) -> list[tuple[int, int]]:
        """[(attempt, resumed_from_step)] in order."""
        return list(self._db.execute("SELECT attempt, resumed_from_step FROM attempts ORDER BY attempt"))

    def ledger(self) -> list[dict[str, Any]]:
        """The fate of every stored episode, in insertion order: dicts with `episode_id`, `attempt`, `step`,
        `ok` (finished with a finite reward), `abandoned` (a later attempt resumed from a checkpoint before
        this step, so this attempt's work on the step is not in the run's lineage) and `trained_in`: the
        steps of this attempt whose update used the episode (normally [] or [step])."""
        resumes = self.attempts()
        trained: dict[tuple[str, int], list[int]] = {}
        for eid, att, st in self._db.execute("SELECT episode_id, attempt, step FROM trained ORDER BY rowid"):
            trained.setdefault((eid, att), []).append(st)
        out = []
        for eid, att, st, reward, error in self._db.execute(
                "SELECT episode_id, attempt, step, reward, error FROM episodes ORDER BY rowid"):
            out.append({"episode_id": eid, "attempt": att, "step": st, "ok": error is None and reward is not None,
                        "abandoned": any(b > att and resumed < st for b, resumed in resumes),
                        "trained_in": trained.get((eid, att), [])})
        return out

    def count(self) -> tuple[int, int]:
        """(episodes, calls) stored."""
        return (self._db.execute("SELECT COUNT(*) FROM episodes").fetchone()[0],
                self._db.execute("SELECT COUNT(*) FROM calls").fetchone()[0])

    def close(self) -> None:
        self._db.close()
