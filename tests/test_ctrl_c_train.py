"""Ctrl-C (SIGINT) and SIGTERM during a real `ajet` training run on the tiny model: the process ends with exit status
130 / 143 and exactly one line after the signal (the step reached, the checkpoint kept, the command that continues
with --resume), no traceback and no noise from the proxy or asyncio; the trajectory store is closed (no -wal/-shm);
the printed command continues the run to its end, and that clean run leaves no -wal/-shm either. Real `ajet`
subprocesses, their stdout and stderr written to files."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

WORKFLOW = '''
import asyncio
import logging
import os
import sys

from ajet.workflow import Workflow, WorkflowOutput


class Slow(Workflow):
    """One policy call after AJET_TEST_SLOW_S seconds (a step takes at least that long). Cancelled meanwhile (the
    run stopping), it says so on stderr and in a log warning, as a library being torn down may."""

    async def execute(self, task, tuner):
        print("episode started", file=sys.stderr, flush=True)
        try:
            await asyncio.sleep(float(os.environ.get("AJET_TEST_SLOW_S", "0")))
        except asyncio.CancelledError:
            print("episode cancelled", file=sys.stderr, flush=True)
            logging.getLogger("some.library").warning("connection closed while the episode was cancelled")
            raise
        r = await tuner.client.chat.completions.create(model=tuner.model,
                                                       messages=[{"role": "user", "content": task.query}])
        text = r.choices[0].message.content or ""
        return WorkflowOutput(reward=float(len(text) % 3), final_answer=text)


class Stuck(Workflow):
    """Says it started, then waits; cancelled (the run stopping), it blocks the event loop for a minute."""

    async def execute(self, task, tuner):
        import time

        print("episode started", file=sys.stderr, flush=True)
        try:
            await asyncio.sleep(600)
        except asyncio.CancelledError:
            time.sleep(60)
            raise


class Boom(Workflow):
    """Raises in every episode."""

    async def execute(self, task, tuner):
        raise RuntimeError("the lookup service is down")
'''


def write_project(root: Path, model_dir: str, steps: int, workflow: str = "Slow") -> Path:
    """A config (`steps` steps, a checkpoint every step), its workflow file and tasks in `root`; returns the config."""
    (root / "wf.py").write_text(WORKFLOW)
    (root / "tasks.jsonl").write_text("".join(json.dumps({"task_id": f"t{i}", "query": f"What is {i} plus 1?"}) + "\n"
                                              for i in range(8)))
    (root / "conf.yaml").write_text(textwrap.dedent(f"""
        workflow: wf.py:{workflow}
        model: {{path: "{model_dir}", max_model_len: 256}}
        data: {{train_path: tasks.jsonl}}
        rollout: {{num_repeat: 2, max_tokens: 4}}
        trainer: {{total_steps: {steps}, tasks_per_step: 2, save_freq: 1, tensorboard: false}}
    """))
    return root / "conf.yaml"


def ajet(root: Path, args: list[str], slow_s: float = 0, timeout_s: float = 240) -> subprocess.CompletedProcess:
    """`python -m ajet ARGS` in `root`, to its end (its plots drawn: they read the store after it closed)."""
    return subprocess.run([sys.executable, "-m", "ajet", *args], cwd=root, capture_output=True, text=True,
                          timeout=timeout_s, env={**os.environ, "AJET_TEST_SLOW_S": str(slow_s), "AJET_PLOTS": "1"})


def stop_when(root: Path, args: list[str], pattern: str, signum: int, slow_s: float,
              again_after_s: float | None = None) -> tuple[int, list[str], str]:
    """Run `ajet ARGS` in `root` with each episode `slow_s` seconds long, send `signum` once `pattern` is in its
    output (and again `again_after_s` seconds later, asserting it has not ended by then), wait for it to end.
    Returns (exit status, the lines it wrote after the signal (stdout and stderr), everything it wrote)."""
    out, err = root / "stdout.txt", root / "stderr.txt"
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen([sys.executable, "-m", "ajet", *args], stdout=o, stderr=e, cwd=root,
                                env={**os.environ, "AJET_TEST_SLOW_S": str(slow_s)})
    try:
        deadline = time.monotonic() + 240
        while not re.search(pattern, out.read_text() + err.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, out.read_text() + err.read_text()
            time.sleep(0.05)
        seen = (len(out.read_text()), len(err.read_text()))
        proc.send_signal(signum)
        if again_after_s is not None:
            time.sleep(again_after_s)
            assert proc.poll() is None, out.read_text() + err.read_text()   # still stopping
            proc.send_signal(signum)
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    after = out.read_text()[seen[0]:] + err.read_text()[seen[1]:]
    # a step line, or an episode saying it started, printed between reading the output and the signal is not the
    # stop's
    lines = [line for line in after.splitlines()
             if line.strip() and not re.match(r"step \d+/\d+ \|", line) and line != "episode started"]
    return rc, lines, out.read_text() + err.read_text()


def sqlite_leftovers(exp: Path) -> list[str]:
    return sorted(p.name for p in exp.glob("*.sqlite-*"))


def test_ctrl_c_mid_run_says_one_line_and_its_command_continues_the_run(tiny_model_dir, tmp_path):
    write_project(tmp_path, tiny_model_dir, steps=4)
    args = ["--conf", "conf.yaml", "--backbone=debug", "--exp-dir", "exp"]
    rc, lines, everything = stop_when(tmp_path, args, r"step 2/4 \|", signal.SIGINT, slow_s=2)
    assert rc == 130, everything[-3000:]
    assert len(lines) == 1, lines
    line = lines[0]
    assert "Traceback" not in everything and "KeyboardInterrupt" not in everything, everything[-3000:]
    m = re.fullmatch(r"ajet: stopped by Ctrl-C at step (\d) of 4; checkpoint of step (\d) kept in exp; "
                     r"continue with: (ajet .* --resume)", line)
    # the signal may land while step 2's checkpoint is written: then step 1's is the one kept
    assert m and m.group(1) == "3" and m.group(2) in "12", line
    assert sqlite_leftovers(tmp_path / "exp") == []          # the store was closed
    # the printed command continues the run, from the checkpoint it names, to its end
    cont = ajet(tmp_path, shlex.split(m.group(3))[1:])
    assert cont.returncode == 0, cont.stdout[-3000:] + cont.stderr[-3000:]
    assert f"resumed from exp/checkpoints/step_{m.group(2)}" in cont.stdout, cont.stdout[-3000:]
    assert "step 4/4 |" in cont.stdout
    # a clean run leaves the database file alone (the plots read it after the store closed)
    assert sqlite_leftovers(tmp_path / "exp") == [], cont.stdout[-2000:]


@pytest.mark.parametrize("extra", [[], ["--with-ray", "1"]], ids=["in-process", "with-ray"])
def test_sigterm_mid_step_exits_143_in_one_line(tiny_model_dir, tmp_path, extra):
    """SIGTERM mid-step: 143 and the one line. With `--with-ray`, ray.init has set the driver's SIGTERM handler to
    `sys.exit` (ray/_private/worker.py); ajet puts its own back after it (ajet.interrupt.reinstall), where Ray's
    handler ended the run in Ray's crash dump (134)."""
    if extra:
        pytest.importorskip("ray", reason="--with-ray needs `ray` (pip install 'ajet[ray]')")
    write_project(tmp_path, tiny_model_dir, steps=4)
    args = ["--conf", "conf.yaml", "--backbone=debug", "--exp-dir", "exp", *extra]
    rc, lines, everything = stop_when(tmp_path, args, r"step 1/4 \|", signal.SIGTERM, slow_s=3)
    assert rc == 143, everything[-3000:]
    assert len(lines) == 1 and lines[0].startswith("ajet: stopped by SIGTERM at step "), lines
    assert lines[0].endswith("--resume") and "Traceback" not in everything, everything[-3000:]
    assert sqlite_leftovers(tmp_path / "exp") == []


def test_a_closed_store_leaves_no_wal_files_even_after_a_read_only_reader(tmp_path):
    from ajet.trajectory_store import TrajectoryStore

    store = TrajectoryStore(tmp_path / "trajectories.sqlite")
    store.add_episode(1, store.begin_attempt(0), {"episode_id": "e0", "task": {"task_id": "t0"}, "reward": 1.0,
                                                  "calls": []})
    store.close()
    # as the plots read it after the run: a read-only connection of a WAL file would leave -wal and -shm behind
    reader = sqlite3.connect((tmp_path / "trajectories.sqlite").as_uri() + "?mode=ro", uri=True)
    assert reader.execute("SELECT COUNT(*) FROM episodes").fetchone() == (1,)
    reader.close()
    assert sqlite_leftovers(tmp_path) == []


def test_a_second_ctrl_c_exits_at_once_while_the_first_one_cleans_up(tiny_model_dir, tmp_path):
    write_project(tmp_path, tiny_model_dir, steps=1, workflow="Stuck")
    args = ["--conf", "conf.yaml", "--backbone=debug", "--exp-dir", "exp"]
    # the first Ctrl-C cancels the episodes, and one blocks for a minute while it is cancelled
    rc, lines, everything = stop_when(tmp_path, args, "episode started", signal.SIGINT, slow_s=0, again_after_s=2)
    assert rc == 130, everything[-3000:]
    assert lines == ["ajet: second Ctrl-C: exiting now"], lines


def test_outside_the_main_thread_no_handler_is_installed():
    from ajet.interrupt import StopSignals

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    seen: list = []

    def in_thread():
        with StopSignals() as stop:   # Python refuses signal handlers outside the main thread: nothing to refuse
            seen.append(({s: signal.getsignal(s) for s in before}, stop.signum))

    t = threading.Thread(target=in_thread)
    t.start()
    t.join(30)
    assert seen == [(before, None)]
    with StopSignals() as stop:      # in the main thread: its handler, and the old one back afterwards
        assert signal.getsignal(signal.SIGTERM) == stop._handle
    assert {s: signal.getsignal(s) for s in before} == before


def test_reinstall_puts_the_commands_handlers_back_after_a_library_replaced_them():
    from ajet.interrupt import StopSignals, reinstall

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    reinstall()                      # no command running: nothing to put back
    assert {s: signal.getsignal(s) for s in before} == before
    with StopSignals() as outer, StopSignals() as inner:
        signal.signal(signal.SIGTERM, lambda *_: None)       # as ray.init does
        reinstall()
        assert signal.getsignal(signal.SIGTERM) == inner._handle != outer._handle
        assert signal.getsignal(signal.SIGINT) == inner._handle
    assert {s: signal.getsignal(s) for s in before} == before

