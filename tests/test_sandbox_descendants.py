"""Without bubblewrap (no PID namespace), the sandboxes still leave nothing running: at the timeout, and when the
program exits by itself, every process it started is killed, also one that left its process group (`setsid`)
and one whose parent exited after starting it with `start_new_session` (re-parented to init, before the
launcher became a child subreaper). Real processes, found by the pid files they write."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import pytest

from ajet.tools.sandbox import run_python
from ajet.tools.workdir_sandbox import WorkdirLimits, run_in_workdir

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="child subreapers and /proc are Linux's")

# Starts two sleepers that leave the process group, each writing its pid into $PID_DIR: `setsid python`, and a
# child that starts a `start_new_session` grandchild and exits at once (a double fork: the grandchild is
# orphaned). Then prints "ready" and sleeps (or exits when $THEN_EXIT is set).
PROGRAM = r"""
import os, subprocess, sys, time
pid_dir = os.environ["PID_DIR"]
def sleeper(name):
    return ("import os, time; open(os.path.join(%r, %r + '.tmp'), 'w').write(str(os.getpid())); "
            "os.rename(os.path.join(%r, %r + '.tmp'), os.path.join(%r, %r)); time.sleep(600)"
            % (pid_dir, name, pid_dir, name, pid_dir, name))
subprocess.Popen(["setsid", sys.executable, "-c", sleeper("setsid.pid")])
subprocess.run([sys.executable, "-c", "import subprocess, sys; subprocess.Popen([sys.executable, '-c', %r], "
                "start_new_session=True)" % sleeper("new_session.pid")], check=True)
while not all(os.path.exists(os.path.join(pid_dir, n)) for n in ("setsid.pid", "new_session.pid")):
    time.sleep(0.05)
print("ready", flush=True)
if not os.environ.get("THEN_EXIT"):
    time.sleep(600)
"""


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:].split()[0] != b"Z"


def _assert_all_gone(pid_dir: Path) -> None:
    pids = [int((pid_dir / n).read_text()) for n in ("setsid.pid", "new_session.pid")]
    try:
        deadline = time.monotonic() + 30          # SIGKILL is immediate; the bound only covers a loaded machine
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [p for p in pids if _alive(p)] == [], "descendants outside the process group survived"
    finally:
        for p in pids:                           # leave nothing behind when the assertion failed
            if _alive(p):
                os.kill(p, 9)


@pytest.mark.parametrize("then_exit", [False, True], ids=["at-the-timeout", "after-a-normal-exit"])
def test_run_python_kills_descendants_outside_its_process_group(tmp_path, then_exit):
    env = {"PID_DIR": str(tmp_path), **({"THEN_EXIT": "1"} if then_exit else {})}
    r = run_python(PROGRAM, timeout_s=20, isolation="none", env=env)
    assert r.isolation == "none" and "ready" in r.stdout, r
    assert r.timed_out != then_exit and (r.returncode == 0) == then_exit, r
    _assert_all_gone(tmp_path)


@pytest.mark.parametrize("then_exit", [False, True], ids=["at-the-timeout", "after-a-normal-exit"])
def test_run_in_workdir_kills_descendants_outside_its_process_group(tmp_path, then_exit):
    work, home, pid_dir = tmp_path / "work", tmp_path / "home", tmp_path / "pids"
    for d in (work, home, pid_dir):
        d.mkdir()
    (work / "program.py").write_text(PROGRAM)
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "PID_DIR": str(pid_dir), **({"THEN_EXIT": "1"} if then_exit else {})}
    r = asyncio.run(run_in_workdir([sys.executable, "program.py"], work, home, env=env, isolation="none",
                                   limits=WorkdirLimits(timeout_s=20)))
    assert r.isolation == "none" and "ready" in r.stdout, r
    assert r.timed_out != then_exit and (r.returncode == 0) == then_exit, r
    _assert_all_gone(pid_dir)


def test_a_program_that_cannot_start_and_one_killed_by_a_signal_keep_their_exit_status(tmp_path):
    r = asyncio.run(run_in_workdir(["no-such-program-ajet"], tmp_path, tmp_path, env={"PATH": "/usr/bin:/bin"},
                                   isolation="none"))
    assert r.returncode == 127 and "cannot start 'no-such-program-ajet'" in r.stderr, r
    assert run_python("import os; os.kill(os.getpid(), 9)", isolation="none").returncode == -9
    assert run_python("raise SystemExit(3)", isolation="none").returncode == 3
