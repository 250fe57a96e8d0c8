"""What `ajet view` shows of a gateway's experiment folder (`ajet gateway`, docs/gateway.md): the policy versions
it served, the evaluation gate's decisions, rollbacks, and the feedback its sessions got over time, read from
`EXP_DIR/gateway.sqlite` (ajet/gateway/store.py's tables).

The file is opened with `mode=ro`, one connection per thread, as `RunReader` opens trajectories.sqlite: the
viewer never writes and never blocks the running gateway. Every figure is computed inside SQLite, so a gateway
with a million feedback rows costs one pass per request, never a list of them in memory.
"""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path
from typing import Any

RECENT_FEEDBACK = 50   # the latest feedback rows listed with their comments


class GatewayReader:
    """Read-only views of one gateway.sqlite.

    Args:
        exp_dir: the experiment folder (`gateway.sqlite` in it may be missing: `present` is then False).
    """

    def __init__(self, exp_dir: str | Path):
        self.path = Path(exp_dir).resolve() / "gateway.sqlite"
        self._local = threading.local()

    @property
    def present(self) -> bool:
        return self.path.is_file()

    @property
    def db(self) -> sqlite3.Connection:
        conn = getattr(self._local, "db", None)
        if conn is None:
            conn = sqlite3.connect(self.path.as_uri() + "?mode=ro", uri=True)
            self._local.db = conn
        return conn

    def _rows(self, sql: str, keys: tuple[str, ...], *args) -> list[dict[str, Any]]:
        return [dict(zip(keys, r)) for r in self.db.execute(sql, args)]

    def overview(self, windows: int) -> dict[str, Any]:
        """Everything the gateway page shows.

        Args:
            windows: how many equal time windows the feedback series has (between the first and the last
                feedback; fewer when there are fewer distinct times).

        Returns:
            versions: every served version, oldest first (version, step, how, figure, at: unix seconds);
            gate: every gate decision (step, candidate_version, serving_version, metric, serving_figure,
                candidate_figure, max_drop, served: bool, reason, at); rollbacks: (id, to_version, requested_at,
                done_at, ok, message); sessions: counts (total, closed, dropped, rated);
            feedback: {count, by_source: {client, judge}, reward_mean, windows: [{start, end: unix seconds,
                count, reward_mean, client, judge}] (empty windows left out), recent: the latest RECENT_FEEDBACK
                rows (session_id, response_id, reward, comment, source, received_at, key_name: the api key that
                sent it, None for the judge's and in a file written before `gateway.keys`), newest first};
            policy_version: the version served last (None before any).
        """
        tables = {r[0] for r in self.db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if "versions" not in tables:               # a gateway.sqlite written before the gate existed
            versions, gate, rollbacks = [], [], []
        else:
            versions = self._rows("SELECT version, step, how, figure, at FROM versions ORDER BY serve_id",
                                  ("version", "step", "how", "figure", "at"))
            gate_keys = ("step", "candidate_version", "serving_version", "metric", "serving_figure",
                         "candidate_figure", "max_drop", "served", "reason", "at")
            gate = [{**g, "served": bool(g["served"])} for g in
                    self._rows(f"SELECT {', '.join(gate_keys)} FROM gate ORDER BY rowid", gate_keys)]
            rollbacks = self._rows("SELECT id, to_version, requested_at, done_at, ok, message FROM rollbacks "
                                   "ORDER BY id", ("id", "to_version", "requested_at", "done_at", "ok", "message"))
        sessions = dict(zip(("total", "closed", "dropped", "rated"), self.db.execute(
            "SELECT (SELECT COUNT(*) FROM sessions), (SELECT COUNT(*) FROM closes), (SELECT COUNT(*) FROM drops), "
            "(SELECT COUNT(DISTINCT session_id) FROM feedback)").fetchone()))
        return {"versions": versions, "gate": gate, "rollbacks": rollbacks, "sessions": sessions,
                "feedback": self._feedback(windows),
                "policy_version": versions[-1]["version"] if versions else None}

    def _feedback(self, windows: int) -> dict[str, Any]:
        count, mean, first, last = self.db.execute(
            "SELECT COUNT(*), AVG(reward), MIN(received_at), MAX(received_at) FROM feedback").fetchone()
        by_source = dict(self.db.execute("SELECT source, COUNT(*) FROM feedback GROUP BY source").fetchall())
        series = []
        if count:
            width = (last - first) / windows if last > first else 1.0
            for k, n, m, client, judge in self.db.execute(
                    "SELECT MIN(CAST((received_at - ?) / ? AS INTEGER), ? - 1) AS k, COUNT(*), AVG(reward), "
                    "SUM(source = 'client'), SUM(source = 'judge') FROM feedback GROUP BY k ORDER BY k",
                    (first, width, windows)):
                series.append({"start": first + k * width, "end": first + (k + 1) * width, "count": n,
                               "reward_mean": m, "client": client, "judge": judge})
        has_key = "key_name" in {r[1] for r in self.db.execute("PRAGMA table_info(feedback)")}
        recent = self._rows("SELECT session_id, response_id, reward, comment, source, received_at, "
                            f"{'key_name' if has_key else 'NULL'} FROM feedback ORDER BY rowid DESC LIMIT ?",
                            ("session_id", "response_id", "reward", "comment", "source", "received_at", "key_name"),
                            RECENT_FEEDBACK)
        return {"count": count, "by_source": {"client": by_source.get("client", 0), "judge": by_source.get("judge", 0)},
                "reward_mean": mean, "windows": series, "recent": recent}
