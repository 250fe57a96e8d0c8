"""The code sandbox as an MCP server (stdio): one tool, `run_python(code, stdin)`.

    tools:
      mcp_servers:
        sandbox: {command: python, args: [-m, ajet.tools.sandbox_server, --timeout-s, "5"]}

Each call runs in `ajet.tools.sandbox` (bubblewrap namespaces where they work, limits always); the result text
is the program's stdout, then its stderr, then a line with the exit status when it is not 0, and the isolation
when it is not bubblewrap (so a reader of the trajectory knows what the code could reach). Without a
working bubblewrap the server logs a warning at start, and the tool's description, which the model reads,
promises no isolation it does not give.
"""

from __future__ import annotations

import argparse
import logging

from ajet.tools.sandbox import SandboxResult, isolation_warning, run_python_async

log = logging.getLogger(__name__)
DESCRIPTION = "Run a Python 3 program and return what it printed. Files do not persist between calls."
ISOLATED = " No network."       # added only where bubblewrap gives it


def format_result(r: SandboxResult) -> str:
    """The text an agent reads for one run (stdout, stderr, exit status, isolation caveat)."""
    parts = [r.stdout]
    if r.stderr:
        parts.append(f"[stderr]\n{r.stderr}")
    if r.timed_out:
        parts.append("[killed: the time limit was reached]")
    elif r.returncode != 0:
        parts.append(f"[exit status {r.returncode}]")
    if r.isolation != "bwrap":
        parts.append(f"[isolation: {r.isolation}: {r.isolation_note}]")
    return "\n".join(p for p in parts if p) or "[no output]"


def build_server(timeout_s: float = 5.0, memory_mb: int = 512, max_output_bytes: int = 16 * 1024):
    """A FastMCP server with the `run_python` tool (limits fixed by the server, not by the model)."""
    from mcp.server.fastmcp import FastMCP

    app = FastMCP("ajet-sandbox", log_level="WARNING")
    warning = isolation_warning()
    if warning is not None:
        log.warning("ajet sandbox server: %s", warning)

    @app.tool(description=DESCRIPTION + ("" if warning else ISOLATED))
    async def run_python(code: str, stdin: str = "") -> str:
        r = await run_python_async(code, timeout_s=timeout_s, memory_mb=memory_mb, stdin=stdin,
                                   max_output_bytes=max_output_bytes)
        return format_result(r)

    return app


def main(argv: list[str] | None = None) -> None:
    """`python -m ajet.tools.sandbox_server [--timeout-s S] [--memory-mb M] [--http PORT]` (stdio by default)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--timeout-s", type=float, default=5.0)
    ap.add_argument("--memory-mb", type=int, default=512)
    ap.add_argument("--http", type=int, default=None, help="serve streamable HTTP on 127.0.0.1:PORT/mcp")
    args = ap.parse_args(argv)
    app = build_server(args.timeout_s, args.memory_mb)
    if args.http is not None:
        app.settings.port = args.http
        app.run("streamable-http")
    else:
        app.run("stdio")


if __name__ == "__main__":
    main()
