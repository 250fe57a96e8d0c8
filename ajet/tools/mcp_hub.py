"""The run's MCP servers: started once, health-checked, restarted when dead, stopped at the end.

`McpHub` keeps one `mcp.ClientSession` per configured server (stdio: ajet starts the command; streamable HTTP:
ajet connects to the url) on its own event loop in a background thread, so the sessions outlive each training
step's `asyncio.run(...)` and a slow server never blocks the rollout's loop. Any loop may `await hub.call(...)`;
the call runs on the hub's loop and its result comes back as a `ToolResult`.

Robustness (every failure is an error result for that episode, never a stalled or crashed run):
- a call past `call_timeout_s` is cancelled ("timeout"); the server is then pinged, and one that does not answer
  is marked dead;
- a server whose connection closes (crashed, killed) fails its in-flight calls at once ("server_down") and is
  restarted by the next `ensure_ready()` (run before each episode);
- an idle server is pinged by `ensure_ready()` every `health_check_interval_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import threading
import time
from collections.abc import Awaitable
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

from ajet.config import McpServerConfig, ToolsConfig
from ajet.errors import AjetError
from ajet.tool_types import ToolResult
from ajet.tools.episode_tools import EpisodeTools
from ajet.tools.sandbox import isolation_warning

log = logging.getLogger(__name__)
T = TypeVar("T")
PING_TIMEOUT_S = 3.0


class ToolServerError(AjetError):
    """An MCP server could not be started or listed at the start of the run (the message names it and why)."""


class _Server:
    """One MCP server's connection, held open by a task on the hub's loop."""

    def __init__(self, name: str, cfg: McpServerConfig, base_dir: Path, errlog):
        self.name, self.cfg, self.base_dir, self.errlog = name, cfg, base_dir, errlog
        self.session = None
        self.tools: list[Any] = []            # mcp.types.Tool
        self.last_ok = 0.0                    # monotonic time of the last successful exchange
        self.restarts = 0
        self._holder: asyncio.Task | None = None
        self._stop: asyncio.Event | None = None
        self.lock = asyncio.Lock()

    @property
    def alive(self) -> bool:
        return self.session is not None and self._holder is not None and not self._holder.done()

    async def start(self, timeout_s: float) -> None:
        """Start (stdio) or connect (HTTP), initialize, list tools. Raises what the connection raised."""
        ready: asyncio.Future = asyncio.get_running_loop().create_future()
        self._stop = asyncio.Event()
        self._holder = asyncio.create_task(self._hold(ready), name=f"mcp:{self.name}")
        try:
            await asyncio.wait_for(asyncio.shield(ready), timeout_s)
        except BaseException:
            await self.close()
            raise
        self.last_ok = time.monotonic()

    async def _hold(self, ready: asyncio.Future) -> None:
        from mcp import ClientSession

        try:
            async with contextlib.AsyncExitStack() as stack:
                read, write = await stack.enter_async_context(self._transport())
                session = await stack.enter_async_context(ClientSession(read, write))
                await session.initialize()
                self.tools = (await session.list_tools()).tools
                self.session = session
                ready.set_result(None)
                await self._stop.wait()
        except BaseException as exc:  # noqa: BLE001 - reported through `ready` or as a dead server
            if not ready.done():
                ready.set_exception(exc if isinstance(exc, Exception) else RuntimeError(repr(exc)))
            elif not isinstance(exc, asyncio.CancelledError):
                log.warning("MCP server %r: connection ended: %r", self.name, exc)
        finally:
            self.session = None

    @contextlib.asynccontextmanager
    async def _transport(self):
        if self.cfg.url is not None:
            import httpx
            from mcp.client.streamable_http import streamable_http_client

            http = httpx.AsyncClient(headers=self.cfg.headers, follow_redirects=True,
                                     timeout=httpx.Timeout(30.0, read=300.0))
            async with http, streamable_http_client(self.cfg.url, http_client=http) as (read, write, _):
                yield read, write
        else:
            from mcp import StdioServerParameters
            from mcp.client.stdio import stdio_client

            command = sys.executable if self.cfg.command in ("python", "python3") else self.cfg.command
            cwd = Path(self.cfg.cwd).expanduser() if self.cfg.cwd else self.base_dir
            if not cwd.is_absolute():
                cwd = self.base_dir / cwd
            params = StdioServerParameters(command=command, args=self.cfg.args, env=self.cfg.env or None, cwd=cwd)
            async with stdio_client(params, errlog=self.errlog) as (read, write):
                yield read, write

    async def close(self) -> None:
        """End the connection (a stdio server's process is terminated by the mcp client)."""
        if self._stop is not None:
            self._stop.set()
        if self._holder is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._holder), 5.0)
            except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - closing a broken connection
                self._holder.cancel()
                with contextlib.suppress(BaseException):
                    await self._holder
        self.session = None

    async def ping_ok(self) -> bool:
        session = self.session
        if session is None or not self.alive:
            return False
        try:
            await asyncio.wait_for(session.send_ping(), PING_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - any failure means unhealthy
            return False
        self.last_ok = time.monotonic()
        return True


class McpHub:
    """The run's MCP servers and their tools.

    Args:
        cfg: the `tools` config section (servers, per-call timeout, per-episode call limit, ...).
        base_dir: folder that relative stdio `cwd`s (and, by default, the servers' working directory) resolve
            against: the config file's folder.
        log_dir: where each stdio server's stderr goes (`mcp_<name>.log`); None: this process's stderr.
    Raises (from start):
        ToolServerError: a server failed to start, initialize or list its tools within startup_timeout_s.
    """

    def __init__(self, cfg: ToolsConfig, base_dir: Path | None = None, log_dir: Path | None = None):
        self.cfg = cfg
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="ajet-mcp-hub", daemon=True)
        self._logs = []
        servers = {}
        for name, scfg in cfg.mcp_servers.items():
            errlog = sys.stderr
            if log_dir is not None and scfg.command is not None:
                Path(log_dir).mkdir(parents=True, exist_ok=True)
                errlog = open(Path(log_dir) / f"mcp_{name}.log", "a")  # noqa: SIM115 - closed in stop()
                self._logs.append(errlog)
            servers[name] = _Server(name, scfg, Path(base_dir or Path.cwd()), errlog)
        self._servers = servers
        self._owner: dict[str, tuple[_Server, str]] = {}   # exposed tool name -> (server, the tool's own name there)
        self.schemas: list[dict[str, Any]] = []
        self._tasks: set[asyncio.Task] = set()

    # ---- lifecycle (call from any thread without a running hub loop) --------------------------------
    def start(self) -> McpHub:
        """Start every server and list its tools; raises ToolServerError naming the first that fails. Logs a
        warning first when a server is ajet's code sandbox and bubblewrap does not work here (its own
        warning would only reach its log file)."""
        for name, srv in self._servers.items():
            argv = [srv.cfg.command or "", *srv.cfg.args]
            if srv.cfg.command is not None and any("ajet.tools.sandbox_server" in a for a in argv):
                if (warning := isolation_warning()) is not None:
                    log.warning("MCP server %r (ajet's code sandbox): %s", name, warning)
        self._thread.start()
        try:
            self._run(self._start_all())
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop every server and the hub's loop (idempotent)."""
        if self._thread.is_alive():
            with contextlib.suppress(Exception):
                self._run(self._close_all(), timeout_s=30)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            if not self._thread.is_alive():
                self._loop.close()
        for f in self._logs:
            f.close()
        self._logs = []

    def __enter__(self) -> McpHub:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- per episode ------------------------------------------------------------------------------
    async def open_episode(self) -> EpisodeTools:
        """Restart dead servers and ping idle ones, then the episode's tools (never raises: a server that
        cannot come back is reported by its calls as "server_down")."""
        await self._bridge(self._ensure_ready())
        return EpisodeTools(self, self.cfg.max_calls_per_episode)

    async def call(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        """Call tool `name` on its server with the per-call timeout; from any event loop."""
        return await self._bridge(self._call(name, arguments))

    # ---- on the hub's loop ------------------------------------------------------------------------
    async def _start_all(self) -> None:
        servers = list(self._servers.values())
        outcomes = await asyncio.gather(*(srv.start(self.cfg.startup_timeout_s) for srv in servers),
                                        return_exceptions=True)
        for srv, exc in zip(servers, outcomes):
            if isinstance(exc, BaseException):
                where = srv.cfg.url or " ".join([srv.cfg.command or "", *srv.cfg.args])
                raise ToolServerError(f"MCP server {srv.name!r} ({where}) did not start: {exc!r}. Check "
                                      f"tools.mcp_servers.{srv.name} in the config") from exc
        self._index_tools()

    async def _close_all(self) -> None:
        await asyncio.gather(*(srv.close() for srv in self._servers.values()))

    def _index_tools(self) -> None:
        """Expose each tool by its own name; names two servers share become `<server>__<tool>`."""
        counts: dict[str, int] = {}
        for srv in self._servers.values():
            for tool in srv.tools:
                counts[tool.name] = counts.get(tool.name, 0) + 1
        self._owner, self.schemas = {}, []
        for srv in self._servers.values():
            for tool in srv.tools:
                exposed = tool.name if counts[tool.name] == 1 else f"{srv.name}__{tool.name}"
                self._owner[exposed] = (srv, tool.name)
                self.schemas.append({"type": "function", "function": {
                    "name": exposed, "description": tool.description or "",
                    "parameters": tool.inputSchema or {"type": "object", "properties": {}}}})

    async def _ensure_ready(self) -> None:
        for srv in self._servers.values():
            async with srv.lock:
                idle = time.monotonic() - srv.last_ok >= self.cfg.health_check_interval_s
                if srv.alive and (not idle or await srv.ping_ok()):
                    continue
                await self._restart(srv)

    async def _restart(self, srv: _Server) -> None:
        await srv.close()
        try:
            await srv.start(self.cfg.startup_timeout_s)
            srv.restarts += 1
            log.warning("MCP server %r restarted (restart %d)", srv.name, srv.restarts)
        except Exception as exc:  # noqa: BLE001 - the episode goes on; its calls report the server down
            log.error("MCP server %r could not be restarted: %r", srv.name, exc)

    async def _call(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        t0 = time.monotonic()
        owner = self._owner.get(name)
        if owner is None:
            known = ", ".join(sorted(self._owner)) or "(none)"
            return ToolResult(name, arguments, f"error: there is no tool named {name!r}; the tools are: {known}",
                              True, "unknown_tool")
        srv, tool = owner
        session = srv.session
        if session is None or not srv.alive:
            return ToolResult(name, arguments, f"error: the {name} tool is unavailable (its server is down)", True,
                              "server_down", srv.name, time.monotonic() - t0)
        timeout = self.cfg.call_timeout_s
        try:
            out = await asyncio.wait_for(session.call_tool(tool, arguments,
                                                           read_timeout_seconds=timedelta(seconds=timeout + 1)),
                                         timeout)
        except asyncio.TimeoutError:
            if not await srv.ping_ok():        # a hung server is restarted before the next episode
                self._background(self._mark_dead(srv))
            return ToolResult(name, arguments, f"error: the {name} tool did not answer within {timeout:g} s", True,
                              "timeout", srv.name, time.monotonic() - t0)
        except Exception as exc:  # noqa: BLE001 - connection closed, protocol garbage, ...
            healthy = await srv.ping_ok()
            if not healthy:
                self._background(self._mark_dead(srv))
            if healthy:
                return ToolResult(name, arguments, f"error: the {name} tool failed: {_short(exc)}", True,
                                  "tool_error", srv.name, time.monotonic() - t0)
            return ToolResult(name, arguments, f"error: the {name} tool is unavailable: its server stopped "
                              f"({_short(exc)})", True, "server_down", srv.name, time.monotonic() - t0)
        srv.last_ok = time.monotonic()
        text = _result_text(out, self.cfg.max_result_chars)
        return ToolResult(name, arguments, text, bool(out.isError), "tool_error" if out.isError else None, srv.name,
                          time.monotonic() - t0)

    def _background(self, coro) -> None:
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _mark_dead(self, srv: _Server) -> None:
        async with srv.lock:
            await srv.close()

    # ---- bridging ---------------------------------------------------------------------------------
    def _run(self, coro: Awaitable[T], timeout_s: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    async def _bridge(self, coro: Awaitable[T]) -> T:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))


def _result_text(out: Any, max_chars: int) -> str:
    """A CallToolResult as text: its text parts joined, else its structured content as JSON; cut at max_chars."""
    import json

    parts = []
    for item in out.content or []:
        kind = getattr(item, "type", "")
        parts.append(item.text if kind == "text" else f"[{kind} content omitted]")
    text = "\n".join(parts)
    if not text and out.structuredContent is not None:
        text = json.dumps(out.structuredContent, ensure_ascii=False)
    if len(text) > max_chars:
        text = text[:max_chars] + f"\n[... result truncated: {len(text) - max_chars} more characters ...]"
    return text


def _short(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) < 300 else text[:300] + "..."

