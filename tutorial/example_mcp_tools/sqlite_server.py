"""The tutorial's MCP server (stdio): one tool, `query(sql)`, a read-only SQL query over the shop database.

The database is `shop.sql` loaded into memory at start, with `PRAGMA query_only` on (no statement can change
it, so every episode sees the same data) and a step budget per query (a runaway join is stopped, not waited
for). Results: a header line and up to MAX_ROWS rows, columns separated by " | ".

    python sqlite_server.py          # what `tools.mcp_servers.shop` in mcp_tools.yaml starts
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from mcp.server.fastmcp import FastMCP

MAX_ROWS = 20
MAX_VM_STEPS = 2_000_000          # SQLite virtual-machine steps per query (~tens of ms)
SCHEMA_SQL = Path(__file__).resolve().parent / "shop.sql"


def open_database() -> sqlite3.Connection:
    """The shop database in memory, read-only from here on."""
    db = sqlite3.connect(":memory:", check_same_thread=False)
    db.executescript(SCHEMA_SQL.read_text())
    db.execute("PRAGMA query_only = ON")
    return db


def run_query(db: sqlite3.Connection, sql: str) -> str:
    """Rows of `sql` as text. Raises sqlite3.Error (bad SQL, a write, too many steps): an error result."""
    steps = 0

    def budget() -> int:     # called every 1000 VM steps; non-zero aborts the query
        nonlocal steps
        steps += 1000
        return int(steps > MAX_VM_STEPS)

    db.set_progress_handler(budget, 1000)
    cur = db.execute(sql)
    rows = cur.fetchmany(MAX_ROWS + 1)
    header = " | ".join(d[0] for d in cur.description or [])
    lines = [header] + [" | ".join(str(v) for v in row) for row in rows[:MAX_ROWS]]
    if len(rows) > MAX_ROWS:
        lines.append(f"... (more than {MAX_ROWS} rows)")
    return "\n".join(lines) if rows else header + "\n(no rows)"


app = FastMCP("shop", log_level="WARNING")
DB = open_database()


@app.tool()
def query(sql: str) -> str:
    """Run one read-only SQLite query on the shop database and return the rows."""
    return run_query(DB, sql)


if __name__ == "__main__":
    app.run("stdio")
