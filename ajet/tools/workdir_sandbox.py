"""Run a program (a coding-agent CLI, a test command) in a folder of its own inside the tool sandbox, with the
episode's proxy as its only network.

ajet/tools/sandbox.py runs one Python file; a coding agent is a whole program working on a repository copy, so
this file reuses that sandbox's bubblewrap layout (read-only system and Python folders, private /tmp and /proc,
new PID, network, IPC and UTS namespaces, an unprivileged uid when started by root, hard rlimits, a wall-clock
timeout that kills the whole PID namespace, bounded output) and adds:

- the working folder bound read-write at `/sandbox` (the program's cwd), a fresh HOME at `/home/agent`, and
  the harness's install folder read-only at its own path (a venv's scripts name their interpreter by path);
- **the proxy bridge.** A fresh network namespace has only its own loopback: the host's 127.0.0.1, where the
  episode's proxy listens, cannot be reached from it, and that is the point (no other network either). So
  the host side listens on a unix socket in a private folder bound into the sandbox at `/run/ajet`, and
  forwards each connection to the proxy's TCP port (`ProxyBridge`); inside, the launcher below listens on
  `127.0.0.1:BRIDGE_PORT` of the sandbox's own loopback and forwards each connection to that socket. The
  program is given `http://127.0.0.1:BRIDGE_PORT/...` as its base URL: every byte it sends goes to the
  episode's proxy and nowhere else. Without bubblewrap (isolation "none") there is no namespace and no bridge:
  the program gets the proxy's own URL, and the result says `isolation == "none"`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ajet.tools.sandbox import (DROP_ROOT_AND_LIMIT, NOBODY_UID, PROC_TREE, SANDBOX_DIR, SandboxResult, _bwrap_argv,
                                _choose_isolation, _Limits, _run, _setenv)

HOME_DIR = "/home/agent"          # the program's HOME inside the sandbox
BRIDGE_DIR = "/run/ajet"          # the bridge's socket folder inside the sandbox
BRIDGE_PORT = 18080               # the sandbox-loopback port the program's base URL names
SOCKET_NAME = "proxy.sock"

# Runs first inside the sandbox (python -I -S): drops root, sets hard limits, starts the loopback -> unix socket
# forwarder when a socket is given, then runs the program as a child subreaper (ajet/tools/proc_tree.py: what
# the program leaves running, also outside its process group, is killed when it exits) and exits with its status.
_LAUNCHER = r"""
import os, resource, socket, sys, threading
uid, nproc, fsize, mem, cpu = (int(v) for v in sys.argv[1:6])
sock_path, port, argv = sys.argv[6], int(sys.argv[7]), sys.argv[8:]
""" + DROP_ROOT_AND_LIMIT + PROC_TREE + r"""

def pump(src, dst):
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

def serve(listener):
    while True:
        client, _ = listener.accept()
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            upstream.connect(sock_path)
        except OSError:
            client.close(); upstream.close(); continue
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=pump, args=(a, b), daemon=True).start()

if sock_path:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port)); listener.listen(64)
    threading.Thread(target=serve, args=(listener,), daemon=True).start()
sys.exit(run_as_subreaper(argv))
"""


class ProxyBridge:
    """Host side of the bridge: a unix socket (in a private folder) whose every connection is forwarded to
    `host:port` (the episode's proxy). `async with ProxyBridge(host, port) as folder:` binds `folder` into the
    sandbox at BRIDGE_DIR."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.folder = tempfile.mkdtemp(prefix="ajet-bridge-")
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()

    async def __aenter__(self) -> str:
        path = os.path.join(self.folder, SOCKET_NAME)
        self._server = await asyncio.start_unix_server(self._forward, path=path)
        os.chmod(self.folder, 0o755)
        os.chmod(path, 0o777)       # the sandbox's unprivileged uid connects to it
        return self.folder

    async def __aexit__(self, *exc) -> None:
        self._server.close()
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)   # each closes its two ends as it stops
        with contextlib.suppress(Exception):
            await self._server.wait_closed()
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(self.folder, SOCKET_NAME))
            os.rmdir(self.folder)

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Forward one sandbox connection to the proxy until either side closes, or until the bridge closes
        (`__aexit__` cancels it). Cancellation ends it normally, both ends closed: asyncio (3.11) calls
        `task.exception()` on a cancelled connection task, which would print a CancelledError traceback."""
        task = asyncio.current_task()
        self._tasks.add(task)
        up_writer: asyncio.StreamWriter | None = None
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.port)
            await asyncio.gather(_pump(reader, up_writer), _pump(up_reader, writer))
        except (OSError, asyncio.CancelledError):   # the proxy is unreachable, or the bridge is closing
            pass
        finally:
            for w in (writer, up_writer):
                if w is not None:
                    w.close()
            self._tasks.discard(task)


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        pass


@dataclass(frozen=True)
class WorkdirLimits:
    """timeout_s: wall clock (also the CPU-seconds limit); memory_mb: RLIMIT_AS per process; max_processes:
    RLIMIT_NPROC (under bubblewrap only); max_file_mb: RLIMIT_FSIZE; max_output_bytes: kept of stdout/stderr."""

    timeout_s: float = 600.0
    memory_mb: int = 262144
    max_processes: int = 256
    max_file_mb: int = 256
    max_output_bytes: int = 256 * 1024


def uses_bwrap(isolation: str = "auto") -> tuple[bool, str]:
    """(bubblewrap will be used, why not). Raises SandboxUnavailable for isolation="bwrap" without it."""
    return _choose_isolation(isolation)


async def run_in_workdir(argv: list[str], workdir: str | Path, home: str | Path, *, env: dict[str, str],
                         limits: WorkdirLimits = WorkdirLimits(), isolation: str = "auto",
                         read_only: list[str] = (), bridge_folder: str | None = None) -> SandboxResult:
    """Run `argv` with `workdir` as its cwd and `home` as HOME, isolated and limited (see the module docstring).

    Args:
        argv: the program and its arguments (an absolute path, or a name on `env["PATH"]`).
        workdir, home: host folders, bound read-write at SANDBOX_DIR and HOME_DIR under bubblewrap (made
            writable for the unprivileged uid); used as they are without it.
        env: the program's whole environment besides HOME/TMPDIR/LANG (nothing of the trainer's is inherited).
        limits: time, memory, processes, file size, output.
        isolation: "auto", "bwrap" (required), or "none".
        read_only: host folders the program needs (its install), bound read-only at their own paths.
        bridge_folder: a `ProxyBridge` folder: the program's loopback port BRIDGE_PORT reaches the proxy.

    Returns:
        SandboxResult (never raises for what the program does).

    Raises:
        SandboxUnavailable: isolation="bwrap" and bubblewrap does not work here.
    """
    use_bwrap, note = await asyncio.to_thread(_choose_isolation, isolation)
    mib = 1024 * 1024
    lim = _Limits(limits.timeout_s, limits.memory_mb, limits.max_processes, limits.max_file_mb,
                  limits.max_output_bytes)
    base_env = {"TMPDIR": "/tmp", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8"}
    launch = [sys.executable, "-I", "-S", "-c", _LAUNCHER, str(NOBODY_UID if use_bwrap else -1),
              str(limits.max_processes if use_bwrap else 0), str(limits.max_file_mb * mib),
              str(limits.memory_mb * mib), str(int(limits.timeout_s) + 1),
              f"{BRIDGE_DIR}/{SOCKET_NAME}" if (use_bwrap and bridge_folder) else "", str(BRIDGE_PORT)]
    if not use_bwrap:
        child_env = {**base_env, **env, "HOME": str(home)}
        return await _run(launch + list(argv), child_env, str(workdir), asyncio.subprocess.DEVNULL, lim, "none",
                          note)
    if os.geteuid() == 0:
        for folder in (workdir, home):
            _chown_tree(str(folder), NOBODY_UID)
    bw = _bwrap_argv(str(workdir)) + ["--chmod", "1777", "/tmp"]   # a shared /tmp the sandbox uid can write
    for path in read_only:
        for parent in reversed(_parents(path)):
            bw += ["--perms", "0755", "--dir", parent]
        bw += ["--ro-bind", path, path]
    bw += ["--perms", "0755", "--dir", os.path.dirname(HOME_DIR), "--bind", str(home), HOME_DIR]
    if bridge_folder:   # (bwrap makes a mount point's missing parents 0700: unreadable for the sandbox uid)
        bw += ["--perms", "0755", "--dir", os.path.dirname(BRIDGE_DIR), "--ro-bind", bridge_folder, BRIDGE_DIR]
    child_env = {**base_env, **env, "HOME": HOME_DIR}
    full = bw + ["--clearenv"] + _setenv(child_env) + launch + list(argv)
    return await _run(full, {"PATH": "/usr/bin:/bin"}, str(workdir), asyncio.subprocess.DEVNULL, lim, "bwrap", note)


def _parents(path: str) -> list[str]:
    """'/a/b/c' -> ['/a/b', '/a'] (not '/')."""
    out, p = [], os.path.dirname(os.path.abspath(path))
    while p not in ("/", ""):
        out.append(p)
        p = os.path.dirname(p)
    return out


def _chown_tree(root: str, uid: int) -> None:
    os.chown(root, uid, uid)
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            with contextlib.suppress(OSError):
                os.chown(os.path.join(folder, name), uid, uid, follow_symlinks=False)
