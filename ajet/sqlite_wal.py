"""Append-only SQLite stores: the one connection setup (`open_wal`) and the one base (`WalStore`: a connection,
a write lock, one transaction per write) that the trajectory store (ajet/trajectory_store.py) and the gateway's
store (ajet/gateway/store.py) share."""
from __future__ import annotations

import sqlite3
import threading
from pathlib import Path


def open_wal(path: Path, schema: str) -> sqlite3.Connection:
    """Open (creating it and its folder if missing) the SQLite database at `path` for use from many threads.

    The connection is in autocommit mode (`isolation_level=None`: callers issue BEGIN themselves), in WAL journal
    mode with synchronous=NORMAL (durable across process crashes; a power loss can drop the last commits), and
    `schema` (a script of `CREATE ... IF NOT EXISTS` statements) has been run on it.

    Args:
        path: the database file.
        schema: SQL script run once after opening.

    Returns:
        The open connection; the caller serialises writes (sqlite3 objects are not locked for it).

    Raises:
        sqlite3.Error: the file cannot be opened or written, or `schema` fails.
        OSError: the folder cannot be created.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")   # WAL + NORMAL: durable across process crashes
    db.executescript(schema)
    return db


class WalStore:
    """Base of an append-only SQLite store used from many threads: `open_wal(path, SCHEMA)`, one write lock, and
    `_tx` committing a write as one transaction (durable when it returns). Reads take the lock only where they
    must see a consistent set of rows.

    Args:
        path: the database file (created with its folder if missing).

    Raises:
        sqlite3.Error: the file cannot be opened or written.
    """

    SCHEMA = ""
    """The subclass's `CREATE ... IF NOT EXISTS` script, run at every open."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._db = open_wal(self.path, self.SCHEMA)
        self._write = threading.Lock()   # one transaction at a time: `ajet serve` and the gateway commit from
        # many threads

    def _tx(self, *statements: tuple[str, list[tuple]]) -> None:
        """Run each (sql, rows) with `executemany`, all in one transaction under the write lock."""
        with self._write, self._db:
            self._db.execute("BEGIN")
            for sql, rows in statements:
                self._db.executemany(sql, rows)

    def close(self) -> None:
        """Close the connection (the store is unusable afterwards), leaving only the database file: the WAL is
        checkpointed into it and the file is switched back to rollback-journal mode, so neither this close nor a
        later read-only reader (the plots, `ajet view`) leaves `-wal`/`-shm` files beside it. While another
        connection has it open (a viewer) the switch is skipped: that reader's files stay until it closes.
        The next `open_wal` switches the file to WAL again. Closing twice is harmless."""
        try:
            with self._write:
                self._db.execute("PRAGMA busy_timeout=0")   # a reader holding it: skip the switch, never wait
                self._db.execute("PRAGMA journal_mode=DELETE")
        except sqlite3.Error:   # busy (another connection reads it) or already closed
            pass
        self._db.close()
