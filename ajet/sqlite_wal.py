"""Opening an append-only SQLite store: the one connection setup the trajectory store and the gateway store share."""
from __future__ import annotations

import sqlite3
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
