"""Find and kill every descendant of a process without namespaces (Linux): a child subreaper plus a /proc walk.

A sandboxed program may start children that leave its process group (`setsid`, `start_new_session=True`)
and fork again so that their parent exits: killing the group misses them, and their parent pid becomes 1.
The sandbox's launcher therefore makes itself a *child subreaper* (`prctl(PR_SET_CHILD_SUBREAPER)`, Linux
>= 3.4, see prctl(2)): an orphan anywhere below it is re-parented to it instead of to init, so every
process the program started stays in the launcher's tree, where `kill_tree` finds it by its parent pids in
`/proc/<pid>/stat` (`/proc/<pid>/task/<tid>/children` needs CONFIG_PROC_CHILDREN, which not every kernel has).

`kill_tree` first stops (SIGSTOP) what it finds, rescanning until a scan finds nothing new, so that no
process forks or exits out of the tree between the scan and the kill, then sends SIGKILL. A program that
kills the launcher, or clears the subreaper flag, can still escape: that takes intent; bubblewrap's PID
namespace is the isolation against that.

This module imports only the standard library and has no `from __future__` import: the launchers
(ajet/tools/sandbox.py, ajet/tools/workdir_sandbox.py) run its source as the first part of their own
`python -I -S -c` program.
"""

import os
import signal
import sys
import time

PR_SET_CHILD_SUBREAPER = 36   # <linux/prctl.h>
MAX_SCANS = 200               # rescans while stopping a tree that keeps forking (each stops all it found)


def become_subreaper() -> bool:
    """Make this process a child subreaper (orphans below it re-parent to it). False where the call is not
    available (not Linux, or a kernel before 3.4)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def descendants(root: int) -> list:
    """The pids below `root` (children, their children, ...; zombies included), from one scan of /proc.
    Empty where /proc is not there."""
    children = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:        # gone meanwhile
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")"
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) > 1:
            children.setdefault(int(fields[1]), []).append(int(name))
    out, todo = [], [root]
    while todo:
        for pid in children.get(todo.pop(), ()):
            out.append(pid)
            todo.append(pid)
    return out


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_tree(root: int, stop_root: bool = True) -> int:
    """SIGKILL every descendant of `root` (not `root` itself). Returns how many processes were signalled.

    With `stop_root`, `root` is stopped first (so it cannot exit and hand its orphans to init while the tree
    is collected) and continued at the end (a launcher then reaps the dead and exits). A launcher cleaning up
    below itself passes `stop_root=False`. Never raises for processes that are gone or not ours.
    """
    if stop_root:
        try:
            os.kill(root, signal.SIGSTOP)
        except (ProcessLookupError, PermissionError):
            return 0
    stopped = set()
    try:
        for _ in range(MAX_SCANS):
            found = [pid for pid in descendants(root) if pid not in stopped]
            if not found:
                break
            for pid in found:
                _signal(pid, signal.SIGSTOP)
                stopped.add(pid)
        for pid in stopped:
            _signal(pid, signal.SIGKILL)
    finally:
        if stop_root:
            _signal(root, signal.SIGCONT)
    return len(stopped)


def run_as_subreaper(argv: list, reap_s: float = 5.0) -> int:
    """Run `argv` (found on PATH) as a child of this process, a child subreaper, until it exits; then kill
    whatever it left running below this process and reap it (at most `reap_s` seconds).

    Returns:
        the exit status for `sys.exit`: the program's own; 127 when it cannot be started (with a line on
        stderr). A program killed by a signal is mirrored: this process kills itself with the same signal.
    """
    become_subreaper()
    try:
        # SIGPIPE and SIGXFSZ back to their defaults, as subprocess does (Python ignores them)
        child = os.posix_spawnp(argv[0], argv, os.environ, setsigdef=(signal.SIGPIPE, signal.SIGXFSZ))
    except OSError as exc:
        print(f"ajet sandbox: cannot start {argv[0]!r}: {exc}", file=sys.stderr)
        return 127
    status = 0
    while True:                       # reap orphans re-parented here as they end, until the program ends
        try:
            pid, wstatus = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        if pid == child:
            status = os.waitstatus_to_exitcode(wstatus)
            break
    kill_tree(os.getpid(), stop_root=False)
    deadline = time.monotonic() + reap_s
    while time.monotonic() < deadline:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                time.sleep(0.01)
        except ChildProcessError:
            break
    if status < 0:                    # killed by a signal: end the same way, so the caller sees that signal
        try:
            signal.signal(-status, signal.SIG_DFL)
        except (OSError, ValueError):   # SIGKILL and SIGSTOP have no handler to reset
            pass
        os.kill(os.getpid(), -status)
        return 128 - status
    return status
