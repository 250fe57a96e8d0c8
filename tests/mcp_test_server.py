"""A small real MCP server for the tests: stdio by default, streamable HTTP on 127.0.0.1 with `--http PORT`.

Tools: add (a + b), pid (this server's process id), hang (never answers), crash (the process exits at once),
fail (the tool raises: an error result), big (a long text).
"""

import argparse
import asyncio
import os

from mcp.server.fastmcp import FastMCP
from mcp.types import ToolAnnotations

app = FastMCP("ajet-test", log_level="WARNING")


@app.tool(annotations=ToolAnnotations(readOnlyHint=True))   # agents with their own MCP client may run it unasked
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@app.tool()
def pid() -> int:
    """This server's process id."""
    return os.getpid()


@app.tool()
async def hang() -> str:
    """Never answers."""
    await asyncio.sleep(3600)
    return "unreachable"


@app.tool()
def crash() -> str:
    """The server process exits at once."""
    os._exit(1)


@app.tool()
def fail() -> str:
    """Raises: the client gets an error result."""
    raise ValueError("the database is locked")


@app.tool()
def big(n: int) -> str:
    """n characters of text."""
    return "y" * n


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--http", type=int, default=None)
    args = ap.parse_args()
    if args.http is not None:
        app.settings.port = args.http
        app.run("streamable-http")
    else:
        app.run("stdio")
