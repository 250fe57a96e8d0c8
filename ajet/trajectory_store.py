"""Durable, append-only record of every finished episode, its calls, and which update trained on it
(SQLite in WAL mode).

Each episode is committed in one transaction as soon as it finishes, before training uses it, so a crash
(even `kill -9`) loses no finished episode. Rows are only ever inserted:

    attempts   one row per start of the trainer (`attempt` numbers come from here, so a process killed
               before it committed anything still used up its number: ids never repeat across attempts);
               `resumed_from_step` is the checkpoint step it continued from (0: from scratch)
    episodes   one row per finished episode, keyed (episode_id, attempt)
    calls      one row per recorded LLM call
    samples    the training samples the tracker built from an episode's calls, with their advantages (for
               `ajet view`), keyed (episode_id, attempt of the episode, index)
    trained    one row per episode that went into an update: (episode_id, attempt, step, trained_attempt);
               `attempt` is the episode's, `trained_attempt` the one that ran the update of `step` (they
               differ when a resumed `ajet serve` trains episodes its killed predecessor had finished)
    not_trained  one row per successful episode the update of a step left out on purpose, with the reason
               (e.g. "zero_std_group" under dynamic sampling, "failed_group", a guard's reason)

Records are strict JSON: a NaN or +-inf anywhere in a record (a reward, a metric, an engine logprob) is stored as
null (`dumps`), so SQLite's JSON functions (the viewer's queries) and any JSON reader can read every row.

An update of step S in attempt A is *live* (its weights are in the run's lineage) unless a later attempt
resumed from a checkpoint before S. An episode stored by attempt A under step S that no live update
used is *abandoned* when a later attempt resumed from before S. `ledger()` applies these rules, so
"every finished episode is trained on exactly once, or is from an abandoned attempt" is a query.

    store = TrajectoryStore(exp_dir / "trajectories.sqlite")
    attempt = store.begin_attempt(resumed_from_step=0)
    store.add_episode(step=3, attempt=attempt, record=ep.to_dict())
    store.mark_trained(step=3, attempt=attempt, episodes=[(episode_id, episode_attempt), ...])
    store.episodes(step=3)   # -> list of dicts (the same JSON as trajectories.jsonl)
"""

from __future__ import annotations

import json
import math
import time
from typing import Any, Iterable

from ajet.sqlite_wal import WalStore


def finite_json(value: Any) -> Any:
    """`value` (JSON-like: dicts, lists, tuples, numbers, strings) with every NaN and +-inf float replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    return value


def dumps(value: Any) -> str:
    """`value` as strict JSON text: a NaN or +-inf is written as null (see `finite_json`); one pass when there is
    none (the common case)."""
    try:
        return json.dumps(value, allow_nan=False)
    except ValueError:
        return json.dumps(finite_json(value), allow_nan=False)

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
    episode_id TEXT NOT NULL, attempt INTEGER NOT NULL, step INTEGER NOT NULL, trained_attempt INTEGER NOT NULL,
    PRIMARY KEY (episode_id, attempt, trained_attempt));
CREATE TABLE IF NOT EXISTS samples (
    episode_id TEXT NOT NULL, attempt INTEGER NOT NULL, idx INTEGER NOT NULL, step INTEGER NOT NULL,
    advantage REAL, record TEXT NOT NULL, PRIMARY KEY (episode_id, attempt, idx));
CREATE TABLE IF NOT EXISTS not_trained (
    episode_id TEXT NOT NULL, attempt INTEGER NOT NULL, step INTEGER NOT NULL, trained_attempt INTEGER NOT NULL,
    reason TEXT NOT NULL, PRIMARY KEY (episode_id, attempt, trained_attempt));
"""


class TrajectoryStore(WalStore):
    """Append-only SQLite store of episodes, calls, attempts and the trained-on ledger (the connection, write lock
    and transactions: `ajet.sqlite_wal.WalStore`).

    Args:
        path: the database file (created with its folder if missing).

    Raises:
        sqlite3.Error: the file cannot be opened or written.
    """

    SCHEMA = _SCHEMA

    def begin_attempt(self, resumed_from_step: int) -> int:
        """Register a new start of the trainer and return its attempt number (0, 1, 2, ...: one more than
        any attempt this store has seen, whether or not that attempt committed an episode)."""
        with self._write, self._db:
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
        self._tx(("INSERT INTO episodes VALUES (?, ?, ?, ?, ?, ?, ?)",
                  [(record["episode_id"], step, attempt, record["task"]["task_id"], record.get("reward"),
                    record.get("error"), dumps(record))]),
                 ("INSERT INTO calls VALUES (?, ?, ?, ?, ?)",
                  [(c["call_id"], record["episode_id"], attempt, c["index"], dumps(c)) for c in calls]))

    def mark_trained(self, step: int, attempt: int, episodes: Iterable[tuple[str, int]],
                     not_trained: Iterable[tuple[str, int, str]] = ()) -> None:
        """Record, in one transaction, that the update of `step` run by `attempt` trained on `episodes`,
        given as (episode_id, the attempt that stored the episode), and left out `not_trained`, given as
        (episode_id, its attempt, reason)."""
        self._tx(("INSERT INTO trained VALUES (?, ?, ?, ?)",
                  [(eid, ep_attempt, step, attempt) for eid, ep_attempt in episodes]),
                 ("INSERT INTO not_trained VALUES (?, ?, ?, ?, ?)",
                  [(eid, ep_attempt, step, attempt, why) for eid, ep_attempt, why in not_trained]))

    def add_samples(self, step: int, attempt: int, samples: list[dict[str, Any]]) -> None:
        """Commit the training samples built for `step` (each a `Sample.to_dict()` plus `trained`: whether the
        update used it), after their advantages are set, in one transaction. Samples are derived data (the
        tracker rebuilds them from the calls), so a re-commit of the same (episode, attempt, index) replaces it."""
        rows, index = [], {}
        for s in samples:
            i = index[s["episode_id"]] = index.get(s["episode_id"], -1) + 1
            rows.append((s["episode_id"], attempt, i, step, s.get("advantage"), dumps(s)))
        self._tx(("INSERT OR REPLACE INTO samples VALUES (?, ?, ?, ?, ?, ?)", rows))

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
        `ok` (finished with a finite reward), `trained_in`: the (step, trained_attempt) of every *live*
        update that used it (normally [] or one), `rolled_back`: the same for updates a later resume
        discarded, `not_trained`: the reason a live update left it out on purpose (None otherwise), and
        `abandoned`: no live update used or left it out and a later attempt resumed from a checkpoint
        before its step."""
        resumes = self.attempts()

        def discarded(step: int, attempt: int) -> bool:   # a later attempt resumed from before `step`
            return any(b > attempt and resumed < step for b, resumed in resumes)

        live: dict[tuple[str, int], list[tuple[int, int]]] = {}
        dead: dict[tuple[str, int], list[tuple[int, int]]] = {}
        for eid, att, st, by in self._db.execute("SELECT episode_id, attempt, step, trained_attempt FROM trained "
                                                 "ORDER BY rowid"):
            (dead if discarded(st, by) else live).setdefault((eid, att), []).append((st, by))
        left_out = {(eid, att): why for eid, att, st, by, why in self._db.execute(
            "SELECT episode_id, attempt, step, trained_attempt, reason FROM not_trained ORDER BY rowid")
            if not discarded(st, by)}
        out = []
        for eid, att, st, reward, error in self._db.execute(
                "SELECT episode_id, attempt, step, reward, error FROM episodes ORDER BY rowid"):
            trained_in, why = live.get((eid, att), []), left_out.get((eid, att))
            out.append({"episode_id": eid, "attempt": att, "step": st, "ok": error is None and reward is not None,
                        "trained_in": trained_in, "rolled_back": dead.get((eid, att), []), "not_trained": why,
                        "abandoned": not trained_in and why is None and discarded(st, att)})
        return out

    def untrained(self) -> list[dict[str, Any]]:
        """Records (with their `attempt`) of the ok episodes that no live update used or left out on purpose,
        oldest first: what a resumed `ajet serve` adopts instead of asking clients to run them again."""
        fates = {(e["episode_id"], e["attempt"]): e for e in self.ledger()}
        rows = self._db.execute("SELECT episode_id, attempt, record FROM episodes ORDER BY rowid")
        out = []
        for eid, att, record in rows:
            fate = fates[(eid, att)]
            if fate["ok"] and not fate["trained_in"] and fate["not_trained"] is None:
                out.append({**json.loads(record), "attempt": att})
        return out

    def count(self) -> tuple[int, int]:
        """(episodes, calls) stored."""
        return (self._db.execute("SELECT COUNT(*) FROM episodes").fetchone()[0],
                self._db.execute("SELECT COUNT(*) FROM calls").fetchone()[0])
