"""Durable record of the gateway's live sessions (SQLite in WAL mode, `EXP_DIR/gateway.sqlite`), with the
conventions of `ajet/trajectory_store.py`: rows are only ever inserted (but for `gateway.retention_days`, which
deletes a trained or dropped session's rows), each write is one transaction under one
lock, records are JSON. What training used lives in trajectories.sqlite (its ledger); this file holds what the
trainer has not seen yet, so that `kill -9` loses no acknowledged feedback and no recorded call:

    sessions   one row per session with a recorded answer or a reward (written with the first of them; a session
               whose requests never reached the engine has none): (session_id, opened_at, query: the first user
               message, by: how it was found: "header" or "new", key_name: the name of the api key that opened
               it, `gateway.keys`; "secret" for gateway.secret, NULL without a secret or in a file older than keys)
    calls      one row per recorded LLM call of a session (its `LLMCall.to_dict()`), committed once the
               response that made it is recorded, before its last byte reaches the client
    responses  one row per answered request: (response_id: the body's `id`, session_id, policy_version)
    closes     one row per closed session: (session_id, closed_at, reason)
    feedback   one row per acknowledged reward, in arrival order: (session_id, response_id named or NULL,
               reward, comment, source: "client" | "judge", received_at, key_name: the key that sent it, NULL
               for the judge), committed before the 200
    drops      one row per session given up: (session_id, reason, at)
    candidates best-of-N: one row per unchosen candidate (episode_id "<session>~<k>", session_id, response_id it
               competed with, index among the N, score: its judge score or NULL, record: its call), committed
               with its response
    picks      best-of-N: one row per judged request (response_id, session_id, chosen index, scores: JSON list)

The evaluation gate and rollback (ajet/gateway/gate.py) keep three more tables:

    versions   one row each time a policy version begins to be served (serve_id, version, step, how: "start" |
               "gate" | "ungated" | "rollback", figure: its gate metric when known, at); `figure` is filled in
               place once the serving policy is evaluated
    gate       one row per gated update: (step, candidate_version, serving_version, metric, serving_figure,
               candidate_figure: NULL when its evaluation was invalid, max_drop, served 0/1, reason, at)
    rollbacks  one row per rollback asked for (`ajet gateway rollback`, `POST /v1/admin/rollback`): (id,
               to_version or NULL: the version served before the current one, requested_at, done_at, ok, message);
               done_at, ok and message are filled in place when the gateway has done (or refused) it

A session's reward is its latest feedback row. Times are `time.time()` seconds. Records are strict JSON: a NaN or
+-inf in a call (an engine logprob) is stored as null (`ajet.trajectory_store.dumps`); rewards outside
`gateway.reward_range`, NaN included, never get here.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from ajet.sqlite_wal import WalStore
from ajet.trajectory_store import dumps

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    session_id TEXT PRIMARY KEY, opened_at REAL NOT NULL, query TEXT NOT NULL, found_by TEXT NOT NULL,
    key_name TEXT);
CREATE TABLE IF NOT EXISTS calls (
    call_id TEXT PRIMARY KEY, session_id TEXT NOT NULL, idx INTEGER NOT NULL, record TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS calls_by_session ON calls (session_id, idx);
CREATE TABLE IF NOT EXISTS responses (
    response_id TEXT PRIMARY KEY, session_id TEXT NOT NULL, policy_version INTEGER NOT NULL, at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS closes (
    session_id TEXT PRIMARY KEY, closed_at REAL NOT NULL, reason TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS feedback (
    session_id TEXT NOT NULL, response_id TEXT, reward REAL NOT NULL, comment TEXT, source TEXT NOT NULL,
    received_at REAL NOT NULL, key_name TEXT);
CREATE TABLE IF NOT EXISTS drops (
    session_id TEXT PRIMARY KEY, reason TEXT NOT NULL, at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS candidates (
    episode_id TEXT PRIMARY KEY, session_id TEXT NOT NULL, response_id TEXT NOT NULL, idx INTEGER NOT NULL,
    score REAL, record TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS picks (
    response_id TEXT PRIMARY KEY, session_id TEXT NOT NULL, chosen INTEGER NOT NULL, scores TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS versions (
    serve_id INTEGER PRIMARY KEY AUTOINCREMENT, version INTEGER NOT NULL, step INTEGER NOT NULL, how TEXT NOT NULL,
    figure REAL, at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS gate (
    step INTEGER NOT NULL, candidate_version INTEGER NOT NULL, serving_version INTEGER NOT NULL, metric TEXT NOT NULL,
    serving_figure REAL, candidate_figure REAL, max_drop REAL NOT NULL, served INTEGER NOT NULL, reason TEXT NOT NULL,
    at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS rollbacks (
    id INTEGER PRIMARY KEY AUTOINCREMENT, to_version INTEGER, requested_at REAL NOT NULL, done_at REAL,
    ok INTEGER, message TEXT);
"""


@dataclass
class StoredSession:
    """One session as `GatewayStore.sessions()` reads it back (calls as `LLMCall.to_dict()` records, in order).

    Attributes:
        feedback: every feedback row, oldest first: dicts with response_id, reward, comment, source, received_at.
        responses: response_id -> the policy version that produced it.
    """

    session_id: str
    opened_at: float
    query: str
    found_by: str
    key_name: str | None = None
    calls: list[dict[str, Any]] = field(default_factory=list)
    responses: dict[str, int] = field(default_factory=dict)
    closed_at: float | None = None
    close_reason: str | None = None
    feedback: list[dict[str, Any]] = field(default_factory=list)
    dropped: str | None = None
    candidates: list[dict[str, Any]] = field(default_factory=list)   # episode_id, response_id, index, score, call
    picks: dict[str, dict[str, Any]] = field(default_factory=dict)   # response_id -> {"chosen", "scores"}


class GatewayStore(WalStore):
    """Append-only SQLite store of sessions, their calls and responses, closes, feedback and drops (the
    connection, write lock and transactions: `ajet.sqlite_wal.WalStore`, as the trajectory store's).

    Args:
        path: the database file (created with its folder if missing).

    Raises:
        sqlite3.Error: the file cannot be opened or written.
    """

    SCHEMA = _SCHEMA
    ADDED_COLUMNS = (("sessions", "key_name"), ("feedback", "key_name"))   # added to files written before them

    def __init__(self, path):
        super().__init__(path)
        with self._write, self._db:
            for table, column in self.ADDED_COLUMNS:
                if column not in {r[1] for r in self._db.execute(f"PRAGMA table_info({table})")}:
                    self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} TEXT")

    def open_session(self, session_id: str, query: str, found_by: str, at: float | None = None,
                     key_name: str | None = None) -> None:
        """Record a new session (opened by the api key named `key_name`). Raises sqlite3.IntegrityError for an id
        stored before."""
        self._tx(("INSERT INTO sessions VALUES (?, ?, ?, ?, ?)",
                  [(session_id, at or time.time(), query, found_by, key_name)]))

    def add_response(self, session_id: str, response_id: str, policy_version: int, calls: list[dict[str, Any]],
                     candidates: list[tuple[str, int, float | None, dict[str, Any]]] = (),
                     pick: dict[str, Any] | None = None,
                     opened: tuple[float, str, str, str | None] | None = None) -> None:
        """Commit one answered request atomically: its response id, policy version and recorded calls; with
        best-of-N also its unchosen candidates `(episode_id, index, score, call record)` and its `pick`
        (`{"chosen": index, "scores": [score | None] * N}`); with `opened` (opened_at, query, found_by, key_name) the
        session's own row too (its first answer: a session is written with it, ajet/gateway/sessions.py)."""
        self._tx(("INSERT OR IGNORE INTO sessions VALUES (?, ?, ?, ?, ?)",
                  [(session_id, *opened)] if opened is not None else []),
                 ("INSERT OR IGNORE INTO responses VALUES (?, ?, ?, ?)",
                  [(response_id, session_id, policy_version, time.time())]),
                 ("INSERT OR IGNORE INTO calls VALUES (?, ?, ?, ?)",
                  [(c["call_id"], session_id, c["index"], dumps(c)) for c in calls]),
                 ("INSERT OR IGNORE INTO candidates VALUES (?, ?, ?, ?, ?, ?)",
                  [(eid, session_id, response_id, idx, score, dumps(rec)) for eid, idx, score, rec in candidates]),
                 ("INSERT OR IGNORE INTO picks VALUES (?, ?, ?, ?)",
                  [(response_id, session_id, pick["chosen"], dumps(pick["scores"]))] if pick else []))

    def close_session(self, session_id: str, reason: str, at: float | None = None) -> None:
        self._tx(("INSERT OR IGNORE INTO closes VALUES (?, ?, ?)", [(session_id, at or time.time(), reason)]))

    def add_feedback(self, session_id: str, reward: float, comment: str | None, source: str,
                     response_id: str | None = None, at: float | None = None, key_name: str | None = None) -> None:
        """Commit one reward for `session_id`, sent with the api key named `key_name` (durable when this returns)."""
        self._tx(("INSERT INTO feedback VALUES (?, ?, ?, ?, ?, ?, ?)",
                  [(session_id, response_id, reward, comment, source, at or time.time(), key_name)]))

    def drop_session(self, session_id: str, reason: str) -> None:
        self._tx(("INSERT OR IGNORE INTO drops VALUES (?, ?, ?)", [(session_id, reason, time.time())]))

    def delete_sessions(self, session_ids: list[str]) -> None:
        """Delete every row of these sessions (`gateway.retention_days`: the one exception to insert-only)."""
        rows = [(sid,) for sid in session_ids]
        self._tx(*((f"DELETE FROM {table} WHERE session_id = ?", rows)
                   for table in ("sessions", "calls", "responses", "closes", "feedback", "drops", "candidates",
                                 "picks")))

    def sessions(self) -> dict[str, StoredSession]:
        """Every stored session with its calls, responses, close, feedback and drop, in opening order."""
        out = {sid: StoredSession(sid, at, q, by, key) for sid, at, q, by, key in self._db.execute(
               "SELECT session_id, opened_at, query, found_by, key_name FROM sessions ORDER BY rowid")}
        for sid, record in self._db.execute("SELECT session_id, record FROM calls ORDER BY session_id, idx"):
            out[sid].calls.append(json.loads(record))
        for rid, sid, version in self._db.execute("SELECT response_id, session_id, policy_version FROM responses"):
            out[sid].responses[rid] = version
        for sid, at, reason in self._db.execute("SELECT session_id, closed_at, reason FROM closes"):
            out[sid].closed_at, out[sid].close_reason = at, reason
        for sid, rid, reward, comment, source, at, key in self._db.execute(
                "SELECT session_id, response_id, reward, comment, source, received_at, key_name FROM feedback "
                "ORDER BY rowid"):
            out[sid].feedback.append({"response_id": rid, "reward": reward, "comment": comment, "source": source,
                                      "received_at": at, "key_name": key})
        for sid, reason in self._db.execute("SELECT session_id, reason FROM drops"):
            out[sid].dropped = reason
        for eid, sid, rid, idx, score, record in self._db.execute(
                "SELECT episode_id, session_id, response_id, idx, score, record FROM candidates ORDER BY rowid"):
            out[sid].candidates.append({"episode_id": eid, "response_id": rid, "index": idx, "score": score,
                                        "call": json.loads(record)})
        for rid, sid, chosen, scores in self._db.execute("SELECT response_id, session_id, chosen, scores FROM picks"):
            out[sid].picks[rid] = {"chosen": chosen, "scores": json.loads(scores)}
        return out

    def replay_set(self, n: int, exclude: set[str] = frozenset()) -> list[tuple[str, float, dict[str, Any]]]:
        """(session_id, its latest reward, its first recorded call) of the `n` sessions whose latest feedback
        arrived last, among those with a recorded call and not in `exclude`, newest first (the replay gate,
        ajet/gateway/replay.py)."""
        with self._write:
            rows = self._db.execute(
                "SELECT f.session_id, f.reward, c.record FROM feedback f "
                "JOIN (SELECT session_id, MAX(rowid) AS last FROM feedback GROUP BY session_id) l "
                "ON f.rowid = l.last "
                "JOIN calls c ON c.session_id = f.session_id "
                "AND c.idx = (SELECT MIN(idx) FROM calls WHERE session_id = f.session_id) "
                "ORDER BY f.rowid DESC LIMIT ?", (n + len(exclude),)).fetchall()
        return [(sid, reward, json.loads(record)) for sid, reward, record in rows if sid not in exclude][:n]

    # ---- policy versions, the evaluation gate, rollbacks (ajet/gateway/gate.py) ------------------------------
    def add_version(self, version: int, step: int, how: str, figure: float | None, durable: bool = False) -> None:
        """Record that `version` begins to be served now (`how`: start, gate, ungated, rollback). `durable`: commit
        with `synchronous=FULL` (on disk when this returns, also across a power loss; the other writes are durable
        across a process crash): an update's row is the commit point of its version (ajet/gateway/gate.py)."""
        row = (version, step, how, figure, time.time())
        with self._write:
            if durable:
                self._db.execute("PRAGMA synchronous=FULL")
            try:
                with self._db:
                    self._db.execute("BEGIN")
                    self._db.execute("INSERT INTO versions (version, step, how, figure, at) VALUES (?, ?, ?, ?, ?)",
                                     row)
            finally:
                if durable:
                    self._db.execute("PRAGMA synchronous=NORMAL")

    def set_serving_figure(self, figure: float) -> None:
        """Fill in the gate figure of the version served now (its latest `versions` row)."""
        self._tx(("UPDATE versions SET figure = ? WHERE serve_id = (SELECT MAX(serve_id) FROM versions)", [(figure,)]))

    def versions(self) -> list[dict[str, Any]]:
        """Every `versions` row, oldest first: dicts with version, step, how, figure, at."""
        with self._write:
            rows = self._db.execute("SELECT version, step, how, figure, at FROM versions ORDER BY serve_id").fetchall()
        return [dict(zip(("version", "step", "how", "figure", "at"), r)) for r in rows]

    def add_gate(self, step: int, candidate: int, serving: int, metric: str, serving_figure: float | None,
                 candidate_figure: float | None, max_drop: float, served: bool, reason: str) -> None:
        """Record one gate decision (durable when this returns)."""
        self._tx(("INSERT INTO gate VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                  [(step, candidate, serving, metric, serving_figure, candidate_figure, max_drop, int(served), reason,
                    time.time())]))

    def gate_results(self) -> list[dict[str, Any]]:
        """Every gate decision, oldest first (dicts named as the `gate` table's columns; `served` a bool)."""
        keys = ("step", "candidate_version", "serving_version", "metric", "serving_figure", "candidate_figure",
                "max_drop", "served", "reason", "at")
        with self._write:
            rows = self._db.execute(f"SELECT {', '.join(keys)} FROM gate ORDER BY rowid").fetchall()
        return [{**dict(zip(keys, r)), "served": bool(r[7])} for r in rows]

    def request_rollback(self, to_version: int | None) -> int:
        """Record a rollback to ask the gateway for (None: the version served before the current one); returns
        its id."""
        with self._write, self._db:
            cur = self._db.execute("INSERT INTO rollbacks (to_version, requested_at) VALUES (?, ?)",
                                   (to_version, time.time()))
            return int(cur.lastrowid)

    def pending_rollbacks(self) -> list[tuple[int, int | None]]:
        """(id, to_version) of every rollback not yet done, oldest first."""
        with self._write:
            return self._db.execute("SELECT id, to_version FROM rollbacks WHERE done_at IS NULL ORDER BY id").fetchall()

    def finish_rollback(self, rollback_id: int, ok: bool, message: str) -> None:
        self._tx(("UPDATE rollbacks SET done_at = ?, ok = ?, message = ? WHERE id = ?",
                  [(time.time(), int(ok), message, rollback_id)]))

    def rollback(self, rollback_id: int) -> dict[str, Any] | None:
        """One rollback's row (id, to_version, requested_at, done_at, ok, message), None when unknown."""
        keys = ("id", "to_version", "requested_at", "done_at", "ok", "message")
        with self._write:
            row = self._db.execute(f"SELECT {', '.join(keys)} FROM rollbacks WHERE id = ?", (rollback_id,)).fetchone()
        return None if row is None else dict(zip(keys, row))
