"""A run that trained nothing never blocks the corrected command: after a Ctrl-C before step 1 and after a run whose
workflow raised in every episode, the same command in the same folder starts afresh without --resume (the old
files moved to a dated folder, said in one line); a folder with trained steps, a gateway's sessions, a server's
finished episodes, or a store another process has open is still refused. Real `ajet` subprocesses on the tiny
model, and `check_exp_dir` on real stores."""

from __future__ import annotations

import signal

import pytest

from ajet.errors import ConfigError
from ajet.run_folder import check_exp_dir
from ajet.trajectory_store import TrajectoryStore
from tests.test_ctrl_c_train import ajet, stop_when, write_project

ARGS = ["--conf", "conf.yaml", "--backbone=debug", "--exp-dir", "exp"]


def _moved_aside(exp, stdout: str) -> list:
    aside = sorted(exp.glob("untrained-*"))
    assert len(aside) == 1 and f"its files moved to {aside[0].relative_to(exp.parent)}" in stdout, stdout[-2000:]
    return sorted(p.name for p in aside[0].iterdir())


def test_ctrl_c_before_step_1_then_the_same_command_starts_afresh(tiny_model_dir, tmp_path):
    write_project(tmp_path, tiny_model_dir, steps=1)
    # while the episodes wait: cancelled, each says so on stderr and in a log warning, all of it muted
    rc, lines, everything = stop_when(tmp_path, ARGS, r"episode started", signal.SIGINT, slow_s=60)
    assert rc == 130 and len(lines) == 1, everything[-3000:]
    assert "Traceback" not in everything and "cancelled" not in everything, everything[-3000:]
    assert "nothing trained to keep: the same command starts afresh: ajet " + " ".join(ARGS) in lines[0], lines
    assert (tmp_path / "exp" / "trajectories.sqlite").exists()   # the stopped attempt wrote its folder
    again = ajet(tmp_path, ARGS)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "step 1/1 |" in again.stdout and "already holds a run" not in again.stderr
    assert "trajectories.sqlite" in _moved_aside(tmp_path / "exp", again.stdout)


def test_after_a_workflow_that_raised_in_every_episode_the_corrected_command_needs_no_resume(tiny_model_dir,
                                                                                              tmp_path):
    conf = write_project(tmp_path, tiny_model_dir, steps=1, workflow="Boom")
    failed = ajet(tmp_path, ARGS)
    assert failed.returncode == 2 and "the run trained nothing" in failed.stderr, failed.stderr[-3000:]
    conf.write_text(conf.read_text().replace("wf.py:Boom", "wf.py:Slow"))   # the fix
    fixed = ajet(tmp_path, ARGS)
    assert fixed.returncode == 0, fixed.stdout[-3000:] + fixed.stderr[-3000:]
    assert "step 1/1 | episodes 4 (0 failed)" in fixed.stdout
    assert {"trajectories.sqlite", "metrics.jsonl", "config.json"} <= set(_moved_aside(tmp_path / "exp",
                                                                                       fixed.stdout))
    assert (tmp_path / "exp" / "checkpoints" / "step_1").is_dir()
    # now the folder holds a trained step: the same command without --resume is refused, as before
    refused = ajet(tmp_path, ARGS)
    assert refused.returncode == 2 and "already holds a run" in refused.stderr, refused.stderr[-2000:]
    assert "--resume" in refused.stderr and "Traceback" not in refused.stderr


def _store_with(exp, trained: bool = False, finished: bool = False) -> None:
    store = TrajectoryStore(exp / "trajectories.sqlite")
    attempt = store.begin_attempt(0)
    store.add_episode(1, attempt, {"episode_id": "e0", "task": {"task_id": "t0"}, "reward": 1.0 if finished else None,
                                   "error": None if finished else "RuntimeError: boom", "calls": []})
    if trained:
        store.mark_trained(1, attempt, [("e0", attempt)])
    store.close()


def test_what_a_fresh_start_keeps_and_what_it_moves(tmp_path):
    nothing = tmp_path / "nothing"
    _store_with(nothing)
    (nothing / "metrics.jsonl").write_text('{"step": 1}\n')
    (nothing / "eval").mkdir()                                    # `ajet eval`'s output is not the run's
    line = check_exp_dir(nothing, resume=False)
    assert line and "trained nothing" in line
    assert sorted(p.name for p in nothing.iterdir())[0] == "eval" and len(list(nothing.iterdir())) == 2
    assert check_exp_dir(tmp_path / "empty", resume=False) is None

    for name, make in (("trained", lambda d: _store_with(d, trained=True)),
                       ("gateway", lambda d: (_store_with(d), (d / "gateway.sqlite").write_text(""))),
                       ("checkpoint", lambda d: ((d / "checkpoints" / "step_2").mkdir(parents=True),
                                                 (d / "checkpoints" / "step_2" / "trainer_state.pt").write_text("")))):
        folder = tmp_path / name
        folder.mkdir()
        make(folder)
        (folder / "config.json").write_text("{}")
        with pytest.raises(ConfigError, match="already holds a run"):
            check_exp_dir(folder, resume=False)
        assert check_exp_dir(folder, resume=True) is None and not list(folder.glob("untrained-*"))

    served = tmp_path / "served"                                  # a server's finished episodes: kept for --resume
    _store_with(served, finished=True)
    with pytest.raises(ConfigError, match="finished episodes"):
        check_exp_dir(served, resume=False, server=True)
    assert check_exp_dir(served, resume=False) is not None        # in-process training runs them again anyway

    busy = tmp_path / "busy"                                      # a run still writing there
    _store_with(busy)
    writer = TrajectoryStore(busy / "trajectories.sqlite")         # (as the running trainer's: WAL, written)
    writer.begin_attempt(1)
    try:
        with pytest.raises(ConfigError, match="cannot be checked"):
            check_exp_dir(busy, resume=False)
    finally:
        writer.close()
    assert check_exp_dir(busy, resume=False) is not None         # once it is closed
