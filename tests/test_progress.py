"""Progress you can see (ajet/progress.py): plain progress lines in a log while an evaluation runs, a live display
on a terminal that leaves the step lines and the logger's lines whole, and `--quiet` printing only the step lines.
Real runs of the debug backbone on the tiny model; the waits are bounded, nothing is timed."""

from __future__ import annotations

import io
import json
import os
import queue
import re
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from rich.console import Console

from ajet.config import load_config
from ajet.progress import RunEta

# t0 answers at once; every other task waits for the test to create `release` (bounded: 500 s), so the evaluation
# cannot end before the test has seen its progress lines
WORKFLOW = '''
import asyncio, logging, pathlib, time
from ajet.workflow import Workflow, WorkflowOutput

RELEASE = pathlib.Path(__file__).with_name("release")


class GatedWorkflow(Workflow):
    async def execute(self, task, tuner):
        r = await tuner.client.chat.completions.create(
            model=tuner.model, messages=[{"role": "user", "content": task.query}])
        deadline = time.monotonic() + 500
        while task.task_id != "t0" and not RELEASE.exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        logging.getLogger("user.workflow").warning("a workflow warning for %s", task.task_id)
        return WorkflowOutput(reward=1.0 if task.task_id in ("t0", "t1") else 0.0,
                              final_answer=r.choices[0].message.content or "")
'''

TASKS = [{"task_id": f"t{i}", "query": f"Say {i}.", "answer": str(i)} for i in range(4)]
STEP_LINE = re.compile(r"^step (\d+)/2 \| episodes \d+ \(\d+ failed\) \| reward .* \| step [\d.]+s( \| ETA \S+)?$")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _project(tmp_path: Path, tiny_model_dir: str, steps: int = 2, val_freq: int = 2) -> Path:
    (tmp_path / "wf.py").write_text(WORKFLOW)
    (tmp_path / "tasks.jsonl").write_text("\n".join(json.dumps(t) for t in TASKS) + "\n")
    (tmp_path / "conf.yaml").write_text(textwrap.dedent(f"""
        experiment_name: progress
        workflow: wf.py:GatedWorkflow
        model: {{path: "{tiny_model_dir}", max_model_len: 512}}
        data: {{train_path: tasks.jsonl, val_path: tasks.jsonl, shuffle: false}}
        rollout: {{num_repeat: 2, max_tokens: 6, temperature: 1.0}}
        algorithm: {{lr: 1.0e-3}}
        eval: {{n: 2, temperature: 1.0}}
        trainer: {{total_steps: {steps}, tasks_per_step: 2, val_freq: {val_freq}, tensorboard: false}}
    """))
    return tmp_path / "conf.yaml"


def _lines_of(proc: subprocess.Popen) -> queue.Queue:
    """Each line of `proc.stdout` as it is written (None at the end)."""
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    return lines


def test_a_log_shows_progress_lines_while_an_evaluation_runs(tiny_model_dir, tmp_path):
    """`ajet eval` into a pipe (not a terminal): plain progress lines of the evaluation appear while it is still
    running (the gated episodes cannot finish before the test releases them), then the result."""
    conf = _project(tmp_path, tiny_model_dir)
    env = {**os.environ, "AJET_PROGRESS_INTERVAL_S": "0.2"}
    err_file = open(tmp_path / "stderr.txt", "w")
    proc = subprocess.Popen([sys.executable, "-m", "ajet", "eval", "--conf", str(conf), "--out", str(tmp_path / "out")],
                            stdout=subprocess.PIPE, stderr=err_file, text=True, cwd=tmp_path, env=env)
    lines, seen, ended = _lines_of(proc), [], False
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:   # until a line says t0's episodes are done (the others still wait)
            try:
                line = lines.get(timeout=5)
            except queue.Empty:
                continue
            if line is None:
                ended = True
                break
            seen.append(line)
            if re.match(r"^eval: [1-8]/8 \(\d+%\) \| pass@1 [\d.]+ \| failed 0 \| timeouts 0 \| .*elapsed", line):
                break
        during = list(seen)
    finally:
        (tmp_path / "release").write_text("go")
    rest = []
    while not ended and (line := lines.get(timeout=400)) is not None:
        rest.append(line)
    proc.wait(timeout=60)
    err_file.close()
    out, err = "\n".join(rest), (tmp_path / "stderr.txt").read_text()
    assert proc.returncode == 0, "\n".join(seen) + out + err
    assert any(line.startswith("eval: ") for line in during), "no progress line before the evaluation ended:\n" + \
        "\n".join(seen) + out + err
    assert "per-task table" not in "\n".join(during)              # it had not ended
    assert "pass@1" in out and "per-task table" in out          # then the result, as before
    result = json.loads((tmp_path / "out" / "eval_metrics.json").read_text())
    assert result["episodes"] == 8 and result["failed"] == 0


def test_the_live_display_leaves_step_lines_and_log_lines_whole(tiny_model_dir, tmp_path, monkeypatch):
    """A real 2-step run whose console is a terminal (rich forced into a buffer): the live display draws, and each
    step line and each logging line still stands whole on a line of its own; the step lines carry the run's ETA,
    which is told the validation due at step 2 (4 tasks x 2 episodes) and the time each evaluation took."""
    import logging

    import ajet.metrics_log
    import ajet.progress
    from ajet.trainer import run

    # the CLI configures no logging handler: a warning goes to Python's last-resort handler (stderr at the time)
    monkeypatch.setattr(logging.getLogger("user.workflow"), "handlers", [logging.lastResort])

    buf = io.StringIO()
    monkeypatch.setattr(ajet.metrics_log, "Console",
                        lambda **kw: Console(file=buf, force_terminal=True, width=400, highlight=False))
    (tmp_path / "release").write_text("go")
    monkeypatch.chdir(tmp_path)
    seen: list[tuple] = []

    class RecordedEta(RunEta):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            seen.append(("plan", self.evals, self.after))

        def evaluated(self, seconds, episodes):
            seen.append(("evaluated", seconds, episodes))
            super().evaluated(seconds, episodes)

        def step_done(self, step, eval_s=0.0):
            seen.append(("step", step, eval_s))
            return super().step_done(step, eval_s)

    monkeypatch.setattr("ajet.trainer.RunEta", RecordedEta)
    cfg = load_config(_project(tmp_path, tiny_model_dir), {"trainer.exp_dir": str(tmp_path / "exp")})
    run(cfg)
    rows = {r["step"]: r for r in map(json.loads, (tmp_path / "exp" / "metrics.jsonl").read_text().splitlines())}
    val0, val2 = rows[0]["val/time_s"], rows[2]["val/time_s"]
    assert seen == [("plan", {2: 8}, 0), ("evaluated", val0, 8.0), ("step", 1, 0.0), ("evaluated", val2, 8.0),
                    ("step", 2, val2)], seen
    text = buf.getvalue()
    assert "\x1b[" in text and "rollout" in text and "eval (step 2)" in text, text   # the live display drew
    segments = [ANSI.sub("", s).strip() for s in re.split(r"[\r\n]", text)]
    steps = [s for s in segments if STEP_LINE.match(s)]
    assert [STEP_LINE.match(s).group(1) for s in steps] == ["1", "2"], text
    assert " | ETA " in steps[0] and " | ETA " not in steps[1]   # time left after step 1; none after the last
    assert sum("step 1/2 | episodes" in s for s in segments) == 1   # not also glued to a bar
    warnings = [s for s in segments if "a workflow warning for" in s]
    assert warnings and all(re.fullmatch(r"a workflow warning for t\d", s) for s in warnings), warnings
    # what runs after the run in this process draws no live display on its console (which would hold sys.stderr
    # while it draws: a later update's NON-FINITE line went into this buffer)
    drawn, stderr = len(buf.getvalue()), sys.stderr
    with ajet.progress.phase("after the run", total=1):
        assert sys.stderr is stderr
    assert len(buf.getvalue()) == drawn


def test_quiet_prints_only_the_step_lines(tiny_model_dir, tmp_path):
    """`ajet --quiet` with progress lines due every 0.05 s and a held-out evaluation: stdout is the two step lines and
    the run's last line, its final model (a validated run's result, docs/evaluation.md)."""
    conf = _project(tmp_path, tiny_model_dir)
    (tmp_path / "release").write_text("go")
    env = {**os.environ, "AJET_PROGRESS_INTERVAL_S": "0.05", "COLUMNS": "400"}   # (rich wraps a log at 80)
    proc = subprocess.run([sys.executable, "-m", "ajet", "--conf", str(conf), "--backbone=debug", "--quiet",
                           "--exp-dir", str(tmp_path / "exp")], capture_output=True, text=True, timeout=600,
                          cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 3 and all(STEP_LINE.match(line) for line in lines[:2]), proc.stdout
    assert lines[2].startswith("final model: "), proc.stdout
    assert [json.loads(x)["step"] for x in (tmp_path / "exp" / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]


def test_run_eta_is_steps_left_times_the_recent_step_time(monkeypatch):
    """Steps of 10 s, 20 s, 30 s (an evaluation in the third) with a window of 2: after step 3 of 10, 7 x 25 s; the
    first step (its warm-up) counts only until a second one is in."""
    clock = iter([100.0, 110.0, 130.0, 160.0, 170.0])
    monkeypatch.setattr("ajet.progress.time.monotonic", lambda: next(clock))
    eta = RunEta(total_steps=10, window=2)
    assert eta.step_done(1) == 9 * 10.0
    assert eta.step_done(2) == 8 * 20.0
    assert eta.step_done(3) == 7 * 25.0
    assert RunEta.step_done(eta, 10) is None   # the last step: nothing left


def test_run_eta_adds_the_evaluations_still_to_come_the_one_after_the_last_step_included(monkeypatch):
    """4 steps of 10 s, validations of 8 episodes after steps 2 and 4, a test set of 24 episodes after the last step,
    and a step-0 evaluation of 16 episodes that took 32 s (2 s an episode). Step 2's 12 s validation is not step
    time. After step 1: 3 x 10 s + (8 + 8 + 24) x 2 s; after step 2 (its validation 12 s of 8 episodes: 1.5 s an
    episode from now on): 2 x 10 s + (8 + 24) x 1.5 s; after step 3: 10 s + (8 + 24) x 1.5 s."""
    clock = iter([100.0, 110.0, 120.0 + 12.0, 142.0, 152.0 + 12.0])
    monkeypatch.setattr("ajet.progress.time.monotonic", lambda: next(clock))
    eta = RunEta(total_steps=4, window=5, evals={2: 8, 4: 8}, after=24)
    eta.evaluated(32.0, 16)
    assert eta.step_done(1) == 3 * 10.0 + 40 * 2.0
    eta.evaluated(12.0, 8)
    assert eta.step_done(2, eval_s=12.0) == 2 * 10.0 + 32 * 1.5
    assert eta.step_done(3) == 10.0 + 32 * 1.5
    assert eta.step_done(4, eval_s=12.0) is None
