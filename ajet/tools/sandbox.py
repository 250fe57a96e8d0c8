"""Run untrusted Python (a tool that executes model-written code) in an isolated, limited child process.

Model-written code must not reach what the training process has. Each run gets:

- **an empty environment**: only an allow-list of variables (`PATH`, `HOME`, `LANG`, `TMPDIR`, ...), never the
  trainer's API keys or tokens;
- **its own working directory** (a fresh temporary folder, removed afterwards), with `files` written into it;
- **limits** set before the model's interpreter starts, as hard rlimits it cannot raise: processes
  (`RLIMIT_NPROC`), file size (`RLIMIT_FSIZE`), address space (`RLIMIT_AS`), CPU seconds (`RLIMIT_CPU`), no core
  dumps;
- **a wall-clock timeout** after which every process the code started is killed: under bubblewrap the whole
  PID namespace; without it, every descendant of the sandbox's launcher, also one that left the process group
  (`setsid`, `start_new_session`) and whose parent exited: the launcher is a child subreaper, so such orphans
  stay below it and are found in /proc (ajet/tools/proc_tree.py). Without bubblewrap the launcher also kills
  what the code left running when it exits by itself;
- **bounded output**: stdout and stderr keep their first `max_output_bytes` each, the rest is counted and dropped
  and a marker says so.

Isolation comes from bubblewrap (`bwrap`, Debian package `bubblewrap`) when it works on this machine: new PID,
network, IPC and UTS namespaces (no network at all: not even 127.0.0.1 of the host), a read-only view of only
the system and Python folders, a private `/tmp`, `/proc` of its own PID namespace (the trainer's
`/proc/<pid>/environ` is not there), and, when the trainer runs as root, an unprivileged uid (65534) for the
code (root is exempt from `RLIMIT_NPROC`). Without a working bwrap the code still runs with the environment,
directory, rlimits, timeout and output bound above, but it shares the host's network, PID space and file system,
and the result says so: `SandboxResult.isolation == "none"` with the reason in `isolation_note`. Pass
`isolation="bwrap"` to refuse to run without it.

Processes are started with `asyncio.create_subprocess_exec` (a `vfork` + `exec` in CPython 3.11 on Linux: the
multi-GB trainer's memory is never copied), so `run_python_async` never blocks the event loop and many episodes'
tools run at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ajet.tools import proc_tree
from ajet.tools.proc_tree import kill_tree

Isolation = Literal["bwrap", "none"]
log = logging.getLogger(__name__)

SANDBOX_DIR = "/sandbox"          # the working directory as the code sees it under bwrap
NOBODY_UID = 65534                # the uid the code runs as when bwrap is started by root
READ_CHUNK = 64 * 1024            # bytes per pipe read
KILL_GRACE_S = 1.0                # after a kill, how long to wait for the pipes to close

# Runs first inside the sandbox (python -I -S): drops root, sets hard limits, then execs the model's program,
# so the limits are in place before any model-written byte runs and cannot be raised by it.
# (the part every launcher shares: given uid, nproc, fsize, mem, cpu, with os and resource imported)
DROP_ROOT_AND_LIMIT = r"""
if uid >= 0 and os.geteuid() == 0:
    os.setgroups([]); os.setgid(uid); os.setuid(uid)
limits = [(resource.RLIMIT_FSIZE, fsize), (resource.RLIMIT_AS, mem), (resource.RLIMIT_CPU, cpu),
          (resource.RLIMIT_CORE, 0)]
if nproc > 0:
    limits.append((resource.RLIMIT_NPROC, nproc))
for kind, value in limits:
    resource.setrlimit(kind, (value, value))
"""
_PRELUDE = r"""
import os, resource, sys
uid, nproc, fsize, mem, cpu = (int(v) for v in sys.argv[1:6])
""" + DROP_ROOT_AND_LIMIT + r"""
os.execv(sys.executable, [sys.executable, "-I", "main.py"])
"""
# Without bubblewrap (no PID namespace to kill) the launcher stays, as a child subreaper, the parent of the
# program: at the timeout `_run` kills every process below it (`kill_tree`), and when the program exits the
# launcher kills and reaps whatever it left running (`run_as_subreaper`).
PROC_TREE = Path(proc_tree.__file__).read_text(encoding="utf-8")
_PRELUDE_NO_NAMESPACES = r"""
import os, resource, sys
uid, nproc, fsize, mem, cpu = (int(v) for v in sys.argv[1:6])
""" + DROP_ROOT_AND_LIMIT + PROC_TREE + r"""
sys.exit(run_as_subreaper([sys.executable, "-I", "main.py"]))
"""


@dataclass(frozen=True)
class SandboxResult:
    """What a sandboxed run produced.

    Attributes:
        stdout, stderr: decoded text (invalid UTF-8 replaced), each at most `max_output_bytes` bytes plus a
            truncation marker.
        returncode: the exit status; negative for a signal (-9 killed); None when killed at the timeout.
        timed_out: the wall-clock timeout hit and the process group was killed.
        isolation: "bwrap" (namespaces, see the module docstring) or "none" (limits only).
        isolation_note: why isolation is "none" ("" under bwrap).
        truncated: stdout or stderr was cut at `max_output_bytes`.
        wall_s: seconds from start to the end of the run, kill included.
    """

    stdout: str
    stderr: str
    returncode: int | None
    timed_out: bool
    isolation: Isolation = "none"
    isolation_note: str = ""
    truncated: bool = False
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        """The code exited with status 0 before the timeout."""
        return self.returncode == 0 and not self.timed_out


class SandboxUnavailable(RuntimeError):
    """`isolation="bwrap"` was asked for and bubblewrap does not work here (the message says why)."""


@dataclass(frozen=True)
class _Limits:
    timeout_s: float
    memory_mb: int
    max_processes: int
    max_file_mb: int
    max_output_bytes: int


async def run_python_async(code: str, timeout_s: float = 5.0, memory_mb: int = 512, stdin: str = "", *,
                           files: Mapping[str, str] | None = None, max_processes: int = 32, max_file_mb: int = 16,
                           max_output_bytes: int = 64 * 1024, isolation: Literal["auto", "bwrap", "none"] = "auto",
                           env: Mapping[str, str] | None = None) -> SandboxResult:
    """Execute `code` as `main.py` in a fresh working directory, isolated and limited; never blocks the loop.

    Args:
        code: Python source of the program (run as `python -I main.py`).
        timeout_s: wall-clock limit, seconds; the CPU limit is the same, rounded up.
        memory_mb: address-space limit per process, MiB (allocations beyond it raise MemoryError).
        stdin: text on the program's standard input.
        files: extra files written into the working directory first, {relative path: text}.
        max_processes: RLIMIT_NPROC (processes and threads of the sandbox uid; not applied under isolation
            "none" as its count would include the trainer's own threads).
        max_file_mb: largest file the code may write, MiB (RLIMIT_FSIZE; beyond it the write fails).
        max_output_bytes: bytes kept of stdout and of stderr each; the rest is dropped with a marker.
        isolation: "auto" (bwrap when it works, else "none" and the result says so), "bwrap" (required),
            or "none" (limits only).
        env: extra environment variables for the code (added to the allow-list; nothing is inherited).

    Returns:
        SandboxResult; never raises for anything the code does.

    Raises:
        SandboxUnavailable: isolation="bwrap" and bubblewrap does not work here.
        ValueError: a `files` path that leaves the working directory.
    """
    limits = _Limits(timeout_s, memory_mb, max_processes, max_file_mb, max_output_bytes)
    use_bwrap, note = await asyncio.to_thread(_choose_isolation, isolation)   # probes bwrap once
    workdir = tempfile.mkdtemp(prefix="ajet-sandbox-")
    try:
        _write_files(workdir, {"main.py": code, **dict(files or {})})
        with open(os.path.join(workdir, ".stdin"), "w", encoding="utf-8") as f:
            f.write(stdin)
        stdin_file = open(os.path.join(workdir, ".stdin"), "rb")  # noqa: SIM115 - closed below
        os.unlink(os.path.join(workdir, ".stdin"))                # the code cannot see or change it
        if use_bwrap and os.geteuid() == 0:
            os.chown(workdir, NOBODY_UID, NOBODY_UID)
        argv, child_env = _command(workdir, limits, use_bwrap, dict(env or {}))
        with stdin_file:
            return await _run(argv, child_env, workdir, stdin_file, limits, "bwrap" if use_bwrap else "none", note)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def run_python(code: str, timeout_s: float = 5.0, memory_mb: int = 512, stdin: str = "", **options) -> SandboxResult:
    """Blocking form of `run_python_async` (same arguments, same result) for code without an event loop.

    Inside a running event loop use `await run_python_async(...)`: this form then runs the child on a helper
    thread's own loop, which is safe but blocks the calling coroutine (and its loop) until the child ends.
    """
    coro = functools.partial(run_python_async, code, timeout_s, memory_mb, stdin, **options)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(lambda: asyncio.run(coro())).result()


_ONCE = threading.Lock()     # sandboxed calls start from several threads at once: probe and warn in one of them


def bwrap_status() -> tuple[bool, str]:
    """Whether bubblewrap runs a sandbox here, probed once per process (the first caller probes, callers from
    other threads meanwhile wait for its answer): (works, reason when it does not)."""
    with _ONCE:
        return _probe_bwrap()


@functools.lru_cache(maxsize=1)
def _probe_bwrap() -> tuple[bool, str]:
    exe = shutil.which("bwrap")
    if exe is None:
        return False, "bubblewrap (bwrap) is not installed: apt-get install bubblewrap"
    probe_dir = tempfile.mkdtemp(prefix="ajet-sandbox-probe-")
    try:
        argv = _bwrap_argv(probe_dir) + [sys.executable, "-I", "-S", "-c", "pass"]
        p = subprocess.run(argv, capture_output=True, timeout=30, env=_allowed_env(SANDBOX_DIR, {}))
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"bwrap failed to start: {exc}"
    finally:
        shutil.rmtree(probe_dir, ignore_errors=True)
    if p.returncode != 0:
        return False, f"bwrap cannot create namespaces here: {p.stderr.decode(errors='replace').strip()[:300]}"
    return True, ""


bwrap_status.cache_clear = _probe_bwrap.cache_clear     # probe again (a test that changed PATH)


def isolation_warning() -> str | None:
    """What a person starting a run must read when model-written code would run without isolation
    (bubblewrap does not work here), else None. Said at start by the sandbox's MCP server and by the MCP hub
    of a run that configures it, and once per process by the first `isolation="auto"` run that falls back."""
    works, why = bwrap_status()
    if works:
        return None
    return (f"the code sandbox runs WITHOUT isolation: {why}. Model-written code then shares this machine's "
            "network (the proxy's port included), sees its processes and can read what this user can read "
            "(a process's /proc/<pid>/environ), with only the environment allow-list, rlimits and timeout "
            "between it and the run. Install bubblewrap, or pass isolation='bwrap' to refuse to run without it.")


_warned = False


def _warn_no_isolation_once() -> None:
    global _warned
    warning = isolation_warning()
    with _ONCE:       # (functools.lru_cache runs a function once per thread that calls it before it returns)
        if _warned or warning is None:
            return
        _warned = True
    log.warning("%s", warning)


def _choose_isolation(isolation: str) -> tuple[bool, str]:
    if isolation == "none":
        return False, "isolation='none' was asked for"
    works, why = bwrap_status()
    if isolation == "bwrap" and not works:
        raise SandboxUnavailable(why + "; or pass isolation='auto' to run with limits only")
    if isolation not in ("auto", "bwrap"):
        raise ValueError(f"isolation must be 'auto', 'bwrap' or 'none', got {isolation!r}")
    if not works:
        _warn_no_isolation_once()
    return works, ("" if works else why + " (no network, PID or file-system isolation)")


def _write_files(workdir: str, files: Mapping[str, str]) -> None:
    root = os.path.realpath(workdir)
    for rel, text in files.items():
        path = os.path.realpath(os.path.join(root, rel))
        if not path.startswith(root + os.sep):
            raise ValueError(f"sandbox file {rel!r} is outside the working directory; use a relative path")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(path, 0o644)


def _allowed_env(home: str, extra: Mapping[str, str]) -> dict[str, str]:
    """The only variables the code sees: an allow-list, plus what the caller passes explicitly."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "TMPDIR": "/tmp", "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8", **extra}


def _python_roots() -> list[str]:
    """Folders the interpreter needs (its prefix, the venv, the real executable's install), read-only."""
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
             os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))}
    return sorted(r for r in roots if r and r != "/" and os.path.isdir(r))


def _ancestors(path: str) -> list[str]:
    """'/a/b/c' -> ['/a/b/c', '/a/b', '/a']."""
    out = []
    while path not in ("/", ""):
        out.append(path)
        path = os.path.dirname(path)
    return out


def _bwrap_argv(workdir: str) -> list[str]:
    argv = ["bwrap", "--die-with-parent", "--new-session", "--unshare-pid", "--unshare-net", "--unshare-ipc",
            "--unshare-uts", "--unshare-cgroup-try"]
    if os.geteuid() == 0:     # keep only what the prelude needs to drop to NOBODY_UID; it loses them on setuid
        argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        argv += ["--unshare-user"]
    for path in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/etc"):
        argv += ["--ro-bind-try", path, path]
    # bwrap applies mounts in order, a later one over an earlier one: the private /tmp (and /proc, /dev)
    # first, then the interpreter's folders, so a venv under /tmp is mounted onto the private /tmp, not hidden
    argv += ["--proc", "/proc", "--dev", "/dev", "--perms", "01777", "--tmpfs", "/tmp"]   # /tmp writable, as usual
    roots = _python_roots()
    parents = sorted({os.path.dirname(p) for r in roots for p in _ancestors(r)} - {"/"})
    for path in parents:   # bwrap would create a mount point's parents with mode 0700: unreadable for uid 65534
        argv += ["--perms", "0755", "--dir", path]
    for path in roots:
        argv += ["--ro-bind", path, path]
    argv += ["--bind", workdir, SANDBOX_DIR, "--chdir", SANDBOX_DIR]
    return argv


def _command(workdir: str, limits: _Limits, use_bwrap: bool, extra_env: dict[str, str]) -> tuple[list[str], dict]:
    mib = 1024 * 1024
    uid = NOBODY_UID if use_bwrap else -1
    nproc = limits.max_processes if use_bwrap else 0
    launcher = _PRELUDE if use_bwrap else _PRELUDE_NO_NAMESPACES
    prelude = [sys.executable, "-I", "-S", "-c", launcher, str(uid), str(nproc), str(limits.max_file_mb * mib),
               str(limits.memory_mb * mib), str(int(limits.timeout_s) + 1)]
    if use_bwrap:
        return _bwrap_argv(workdir) + ["--clearenv"] + _setenv(_allowed_env(SANDBOX_DIR, extra_env)) + prelude, \
            _allowed_env(SANDBOX_DIR, {})
    return prelude, _allowed_env(workdir, extra_env)


def _setenv(env: Mapping[str, str]) -> list[str]:
    return [a for k, v in env.items() for a in ("--setenv", k, v)]


class _BoundedCapture:
    """Keeps the first `limit` bytes of a stream and counts the rest."""

    def __init__(self, limit: int):
        self.limit, self.kept, self.dropped = limit, bytearray(), 0

    def add(self, chunk: bytes) -> None:
        room = self.limit - len(self.kept)
        self.kept += chunk[:max(room, 0)]
        self.dropped += max(len(chunk) - max(room, 0), 0)

    def text(self) -> str:
        out = self.kept.decode("utf-8", errors="replace")
        return out + (f"\n[... output truncated: {self.dropped} more bytes dropped ...]" if self.dropped else "")


async def _drain(stream: asyncio.StreamReader, capture: _BoundedCapture) -> None:
    while chunk := await stream.read(READ_CHUNK):
        capture.add(chunk)


async def _run(argv: list[str], env: dict, cwd: str, stdin_file, limits: _Limits, isolation: Isolation,
               note: str) -> SandboxResult:
    start = time.monotonic()
    out, err = _BoundedCapture(limits.max_output_bytes), _BoundedCapture(limits.max_output_bytes)
    proc = await asyncio.create_subprocess_exec(*argv, stdin=stdin_file, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE, env=env, cwd=cwd,
                                                start_new_session=True, close_fds=True)
    everything = asyncio.ensure_future(asyncio.gather(_drain(proc.stdout, out), _drain(proc.stderr, err),
                                                      proc.wait()))
    everything.add_done_callback(lambda f: f.cancelled() or f.exception())   # a cancel below is expected
    timed_out = False
    try:
        await asyncio.wait_for(asyncio.shield(everything), limits.timeout_s)
    except asyncio.TimeoutError:
        timed_out = True
        if isolation == "none":    # everything below the launcher, also what left its group; it reaps them and exits
            await asyncio.to_thread(kill_tree, proc.pid)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(proc.wait()), KILL_GRACE_S)
        _kill_group(proc.pid)
        await _reap(proc, everything)
    except BaseException:          # cancelled by the caller: leave nothing running, nor unreaped
        if isolation == "none":
            kill_tree(proc.pid)
        _kill_group(proc.pid)
        await _reap(proc, everything)
        raise
    finally:
        _kill_group(proc.pid)      # anything the code left behind in its group
    return SandboxResult(out.text(), err.text(), None if timed_out else proc.returncode, timed_out, isolation,
                         note, bool(out.dropped or err.dropped), time.monotonic() - start)


async def _reap(proc: asyncio.subprocess.Process, everything: asyncio.Future) -> None:
    """After a kill: wait for the child's pipes to close (at most `KILL_GRACE_S`; a descendant that escaped the
    kill may hold them: then our ends are closed) and for its exit status, so that its transport is closed on
    this loop. Left to the garbage collector instead, a transport found open after the loop closed raises
    "RuntimeError: Event loop is closed" (a caller cancelled, then its loop ended)."""
    try:   # the pipes close once every holder is dead
        await asyncio.wait_for(asyncio.shield(everything), KILL_GRACE_S)
    except asyncio.TimeoutError:
        everything.cancel()
        proc._transport.close()   # noqa: SLF001 - close our pipe ends; asyncio has no public handle for it
    await proc.wait()


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
