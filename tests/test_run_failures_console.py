"""What a newcomer's mistakes look like from a real `python -m ajet` run (stdout and stderr to files, so rich sees no
terminal): a workflow that raises is named by its message and its own frame, once, and the run exits non-zero
without a traceback; a run that cannot start leaves nothing behind; an invalid held-out evaluation before step 1
stops the run; a log holds whole lines, the held-out scores before -> after and no library's loading bars;
`ajet show` into a pipe prints whole episode ids. The tiny random model, the debug backbone; nothing is timed."""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

from ajet.progress import Phase, Reporter, RunEta

WORKFLOW = '''
from ajet.workflow import Workflow, WorkflowOutput


class Broken(Workflow):
    async def execute(self, task, tuner):
        await tuner.client.chat.completions.create(model=tuner.model, messages=[{"role": "user", "content": "hi"}])
        raise RuntimeError("no tool named calc")


class Flaky(Workflow):
    """Raises for a task whose query says "fail"; else one call, reward 1 for t0 and v0, a valid tool call reported
    for v0 and v1, a grounded one for v0 (as the tutorial's math agent reports its calls)."""

    async def execute(self, task, tuner):
        if "fail" in task.query:
            raise ValueError("the answer field is missing")
        r = await tuner.client.chat.completions.create(
            model=tuner.model, messages=[{"role": "user", "content": task.query}])
        return WorkflowOutput(reward=1.0 if task.task_id in ("t0", "v0") else 0.0,
                              final_answer=r.choices[0].message.content or "",
                              metrics={"valid_tool_calls": int(task.task_id in ("v0", "v1")),
                                       "grounded_tool_calls": int(task.task_id == "v0")})
'''
RAISE_LINE = WORKFLOW.splitlines().index('        raise RuntimeError("no tool named calc")') + 1
STEP_LINE = re.compile(r"^step (\d+)/(\d+) \| episodes \d+ \(\d+ failed\) \| .* \| step [\d.]+s( \| ETA \S+)?$")


def _project(tmp_path: Path, tiny_model_dir: str, workflow: str, trainer: str = "", val: list[dict] | None = None,
             train: list[dict] | None = None) -> Path:
    (tmp_path / "wf.py").write_text(WORKFLOW)
    train = train or [{"task_id": f"t{i}", "query": f"Say {i}."} for i in range(4)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(t) + "\n" for t in train))
    (tmp_path / "val.jsonl").write_text("".join(json.dumps(t) + "\n" for t in val or train))
    (tmp_path / "conf.yaml").write_text(textwrap.dedent(f"""
        experiment_name: newcomer
        workflow: {workflow}
        model: {{path: "{tiny_model_dir}", max_model_len: 512}}
        data: {{train_path: train.jsonl, val_path: val.jsonl, shuffle: false}}
        rollout: {{num_repeat: 2, max_tokens: 4, temperature: 1.0}}
        algorithm: {{lr: 1.0e-3}}
        trainer: {{total_steps: 5, tasks_per_step: 2, tensorboard: false{trainer}}}
    """))
    return tmp_path / "conf.yaml"


def _ajet(tmp_path: Path, *args: str, name: str = "run", **env_vars: str) -> tuple[int, str, str]:
    """`python -m ajet ARGS` in tmp_path, stdout and stderr to files (no terminal; no COLUMNS unless `env_vars` sets
    it): (status, out, err)."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "FORCE_COLOR", "HF_HUB_DISABLE_PROGRESS_BARS",
                                                            "TQDM_DISABLE")} | env_vars
    out, err = tmp_path / f"{name}.out", tmp_path / f"{name}.err"
    with open(out, "w") as o, open(err, "w") as e:
        rc = subprocess.run([sys.executable, "-m", "ajet", *args], stdout=o, stderr=e, cwd=tmp_path, env=env,
                            timeout=600).returncode
    return rc, out.read_text(), err.read_text()


def test_a_workflow_that_raises_is_named_once_by_its_message_and_frame_and_the_run_exits_non_zero(tiny_model_dir,
                                                                                                 tmp_path):
    conf = _project(tmp_path, tiny_model_dir, "wf.py:Broken")
    said = f"RuntimeError: no tool named calc (at wf.py:{RAISE_LINE} in execute; 4 episodes)"

    rc, out, err = _ajet(tmp_path, "--conf", str(conf), "--exp-dir", "one", "--steps", "1", name="one")
    assert rc == 2, out + err
    step = [line for line in out.splitlines() if STEP_LINE.match(line)]
    assert len(step) == 1 and "no episode succeeded: nothing to train on" in step[0], out
    assert "nan" not in out.lower()
    assert out.count(said) == 1, out                                  # the console: once
    assert err.startswith("ajet: error: the run trained nothing: no episode of its 1 step was usable") and said in err
    assert "Traceback" not in out + err and 'File "' not in out + err
    assert not (tmp_path / "one" / "checkpoints").exists()           # nothing trained: nothing saved

    # the default steps: stops after trainer.max_failed_steps (3) failed steps, one message, no traceback
    rc, out, err = _ajet(tmp_path, "--conf", str(conf), "--exp-dir", "all", name="all")
    assert rc == 2, out + err
    assert [m.group(1) for m in map(STEP_LINE.match, out.splitlines()) if m] == ["1", "2"], out
    assert [line.split(":")[0] for line in out.splitlines() if re.match(r"step \d: \d of", line)] == \
        ["step 1", "step 2", "step 3"]                                # each lost step counted ...
    assert out.count(said) == 1, out                                  # ... its error spelt out once
    assert err.startswith("ajet: error: 3 steps in a row produced no usable episode") and said in err, err
    assert "Traceback" not in out + err and 'File "' not in out + err


def test_a_run_that_cannot_start_leaves_nothing_and_the_corrected_command_needs_no_resume(tiny_model_dir, tmp_path):
    exp = tmp_path / "exp"
    for mistake, says in ((dict(workflow="wf.py:Misspelt"), "Misspelt"),
                          (dict(workflow="wf.py:Flaky", trainer=", val_freq: 5", val=None), None)):
        if says is None:   # a held-out task file that is not there
            conf = _project(tmp_path, tiny_model_dir, **mistake)
            (tmp_path / "val.jsonl").unlink()
            says = "val.jsonl"
        else:
            conf = _project(tmp_path, tiny_model_dir, **mistake)
        rc, out, err = _ajet(tmp_path, "--conf", str(conf), "--exp-dir", str(exp), "--steps", "1")
        assert rc == 2 and says in err and "Traceback" not in err, out + err
        assert not exp.exists() or not any(exp.iterdir()), sorted(p.name for p in exp.iterdir())

    conf = _project(tmp_path, tiny_model_dir, "wf.py:Flaky")               # corrected: trains, no --resume
    rc, out, err = _ajet(tmp_path, "--conf", str(conf), "--exp-dir", str(exp), "--steps", "1")
    assert rc == 0, out + err
    assert [json.loads(x)["step"] for x in (exp / "metrics.jsonl").read_text().splitlines()] == [1]


def test_an_invalid_held_out_evaluation_before_step_1_stops_the_run_and_is_said_without_the_console_logger(
        tiny_model_dir, tmp_path):
    val = [{"task_id": f"v{i}", "query": f"fail {i}" if i % 2 else f"Say {i}."} for i in range(4)]   # half fail
    quiet_loggers = ", val_freq: 5, loggers: [jsonl]"
    conf = _project(tmp_path, tiny_model_dir, "wf.py:Flaky", quiet_loggers, val=val)
    rc, out, err = _ajet(tmp_path, "--conf", str(conf), "--exp-dir", "exp")
    assert rc == 2, out + err
    said = " ".join((out + err).split())
    assert "held-out evaluation at step 0 INVALID: 2 of 4 episodes failed: ValueError 2" in said, said
    assert "ValueError: the answer field is missing (at wf.py:" in said
    assert "ajet: error: the held-out evaluation before step 1 is invalid" in err
    assert "trainer.stop_on_invalid_eval: false" in err and "Traceback" not in err
    assert [json.loads(x)["step"] for x in (tmp_path / "exp" / "metrics.jsonl").read_text().splitlines()] == [0]

    # the switch: the run trains on, the INVALID line still said (no console logger), exit 0
    conf = _project(tmp_path, tiny_model_dir, "wf.py:Flaky", quiet_loggers + ", stop_on_invalid_eval: false", val=val)
    rc, out, err = _ajet(tmp_path, "--conf", str(conf), "--exp-dir", "on", "--steps", "1")
    assert rc == 0, out + err
    assert "held-out evaluation at step 0 INVALID" in " ".join((out + err).split())
    assert [json.loads(x)["step"] for x in (tmp_path / "on" / "metrics.jsonl").read_text().splitlines()] == [0, 1]


def test_a_log_has_whole_lines_held_out_before_after_and_no_loading_bars_and_show_prints_whole_ids(
        tiny_model_dir, tmp_path):
    deep = "a_folder_name_long_enough_that_every_line_naming_it_is_wider_than_eighty_columns"
    train = [{"task_id": f"t{i}", "query": f"fail {i}" if i == 3 else f"Say {i}."} for i in range(4)]   # t3 raises
    val = [{"task_id": f"v{i}", "query": f"Say {i}."} for i in range(4)]
    conf = _project(tmp_path, tiny_model_dir, "wf.py:Flaky", ", val_freq: 2", val=val, train=train)
    exp = tmp_path / deep / "exp"
    rc, out, err = _ajet(tmp_path, "--conf", str(conf), "--exp-dir", str(exp), "--steps", "2")
    assert rc == 0, out + err
    lines = out.splitlines()
    steps = [line for line in lines if STEP_LINE.match(line)]
    assert [STEP_LINE.match(s).group(1) for s in steps] == ["1", "2"], out   # each step line whole, on one line
    assert all(len(s) > 80 for s in steps)
    assert any(line.startswith("ajet newcomer: ") and line.endswith(f"-> {exp}") for line in lines), out
    m = [json.loads(x) for x in (exp / "metrics.jsonl").read_text().splitlines()]
    before, after = m[0]["val/pass@1"], m[-1]["val/pass@1"]
    # pass@1 as the docs write it: a percentage, then the passed episodes of the 4 (one episode per task); the
    # workflow's valid / grounded calls per episode as the benchmarks give them (v0, v1 valid; v0 grounded)
    passed = [round(4 * x) for x in (before, after)]
    assert f"held-out at step 0: pass@1 {25 * passed[0]:.1f}% ({passed[0]}/4) | reward_mean " \
           f"{m[0]['val/reward_mean']:.3f} | valid / grounded calls 0.50 / 0.25 | failed 0/4" in lines, out
    assert f"held-out at step 2 (vs step 0): pass@1 {25 * passed[0]:.1f}% -> {25 * passed[1]:.1f}% " \
           f"({25 * (passed[1] - passed[0]):+.1f} points, {passed[1]}/4) | reward_mean " \
           f"{m[0]['val/reward_mean']:.3f} -> {m[-1]['val/reward_mean']:.3f} | valid / grounded calls " \
           f"0.50 / 0.25 -> 0.50 / 0.25 | failed 0/4" in lines, out
    assert "Loading weights" not in out + err and "\r" not in out + err

    # `ajet show` into a file: the ids as the store has them (step 2 holds t3's failures: a long failure column),
    # each one usable with --episode; also when COLUMNS narrows the table to 80 columns
    db = sqlite3.connect(exp / "trajectories.sqlite")
    ids = sorted(r[0] for r in db.execute("SELECT episode_id FROM episodes WHERE step = 2"))
    db.close()
    for columns in ({}, {"COLUMNS": "80"}):
        rc, shown, err = _ajet(tmp_path, "show", str(exp), name="show", **columns)
        assert rc == 0, shown + err
        assert len(ids) == 4 and sorted(set(re.findall(r"\ba\d+-s\d+-t\d+-r\d+\b", shown))) == ids, shown
        if not columns:   # nothing cut at all
            assert "ValueError: the answer field is missing" in shown and "…" not in shown, shown
    rc, one, err = _ajet(tmp_path, "show", str(exp), "--episode", ids[-1], name="episode")
    assert rc == 0 and f"episode {ids[-1]} · step 2" in one, one + err


def test_the_held_out_line_shows_only_the_calls_the_workflow_reports():
    """A workflow reporting valid calls only (ajet.tool_agent) shows them alone; one reporting neither, nothing."""
    from ajet.eval import result_line

    first = {"episodes": 160.0, "failed": 0.0, "pass@1": 0.1, "workflow/valid_tool_calls": 0.35, "workflow/turns": 2.0}
    later = {**first, "pass@1": 0.25, "workflow/valid_tool_calls": 0.9}
    assert result_line(0, first, 0, first) == "held-out at step 0: pass@1 10.0% (16/160) | valid calls 0.35 | failed 0/160"
    assert result_line(4, later, 0, first) == ("held-out at step 4 (vs step 0): pass@1 10.0% -> 25.0% (+15.0 points, "
                                               "40/160) | valid calls 0.35 -> 0.90 | failed 0/160")
    plain = {"episodes": 8.0, "failed": 1.0, "pass@1": 0.5, "workflow/turns": 2.0}
    assert result_line(0, plain, 0, plain, what="test") == "test at step 0: pass@1 50.0% (4/8) | failed 1/8"


def test_the_eta_of_a_phase_is_the_throughput_since_the_first_unit(monkeypatch):
    """16 episodes run at once, each about 10 s: the first ends at 10 s, the rest within 0.1 s each. Measured from
    the phase's start (10 s per episode done) the time left read 150 s after the first one; the throughput since
    the first (one per 0.1 s) says 1.2 s after the third, and nothing is said before a second one ended."""
    now = [100.0]
    monkeypatch.setattr("ajet.progress.time.monotonic", lambda: now[0])
    p = Phase(Reporter(None, enabled=False), "rollout", 16, {})
    assert p.eta() is None
    now[0] = 110.0
    p.advance(1)
    assert p.eta() is None                   # one point is no rate
    now[0] = 110.2
    p.advance(2)                             # 3 done: 2 more in 0.2 s since the first
    assert abs(p.eta() - 13 * 0.1) < 1e-9
    now[0] = 111.5
    p.advance(13)
    assert p.eta() == 0.0


def test_the_run_eta_leaves_out_the_first_steps_warm_up(monkeypatch):
    """Steps of 8 s (the first: warm-up), then 1 s, 1 s: after step 1 of 10 the only figure, 9 x 8 s; after step 2,
    8 x 1 s (not the mean with the warm-up, 8 x 4.5 s); after step 3, 7 x 1 s."""
    clock = iter([100.0, 108.0, 109.0, 110.0])
    monkeypatch.setattr("ajet.progress.time.monotonic", lambda: next(clock))
    eta = RunEta(total_steps=10, window=5)
    assert eta.step_done(1) == 9 * 8.0
    assert eta.step_done(2) == 8 * 1.0
    assert eta.step_done(3) == 7 * 1.0
