"""Whether a training command may start in its experiment folder: one that holds trained steps needs `--resume`;
one whose run trained nothing (a workflow that raised in every episode, a judge that gave no reward, Ctrl-C before
the first update) never blocks the corrected command: that run's files are moved aside under a dated name and the
command starts afresh.

    note = check_exp_dir(exp_dir, resume=cfg.trainer.resume, server=mode.server)   # ajet.trainer.run
    # None: nothing was there (or resuming); else the line that says where the untrained run's files went
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

from ajet import checkpoint
from ajet.errors import ConfigError

MARKERS = ("trajectories.sqlite", "metrics.jsonl", "checkpoints", "config.json")
"""A folder holding one of these holds a run."""

RUN_OUTPUTS = MARKERS + ("trajectories.sqlite-wal", "trajectories.sqlite-shm", "trajectories.sqlite-journal",
                         "trajectories.jsonl", "plots", "tensorboard", "val", "test", "engine", "trinity", "wandb")
"""What a run writes into its folder (moved aside together); anything else there (`ajet eval`'s eval/, a user's
files) stays."""

GATEWAY_DATA = ("gateway.sqlite", "gate")
"""A gateway's recorded sessions, feedback and served versions: a folder with them is never moved aside."""


def check_exp_dir(exp_dir: Path, resume: bool, server: bool = False) -> str | None:
    """Let a training command start in `exp_dir`: with `resume`, or when it holds no run, nothing happens; a run
    that trained nothing is moved into `exp_dir/untrained-YYYYMMDD-HHMMSS/`; any other run refuses.

    Args:
        exp_dir: the experiment folder (`cfg.exp_path()`).
        resume: `trainer.resume` (--resume).
        server: the command is a server (`ajet serve`, `ajet gateway`): finished episodes its clients ran count as
            work to keep (a resumed server trains them), so a folder with one is not moved aside.

    Returns:
        None, or the one line saying where the untrained run's files went.

    Raises:
        ConfigError: `exp_dir` holds a run with trained steps (or one that cannot be told apart from it: its
            trajectory store is open in another process, or unreadable) and `resume` is False.
    """
    found = [n for n in MARKERS if (exp_dir / n).exists()]
    if not found or resume:
        return None
    kept = kept_work(exp_dir, server)
    if kept:
        raise ConfigError(f"the experiment folder {exp_dir} already holds a run ({kept}): add --resume to continue "
                          f"it, or choose another folder with --exp-dir (or trainer.exp_dir / experiment_name in "
                          f"the config)")
    dest = _aside_folder(exp_dir)
    dest.mkdir()
    for name in RUN_OUTPUTS:
        if (exp_dir / name).exists():
            (exp_dir / name).rename(dest / name)
    return (f"{exp_dir} held a run that trained nothing (no update, no checkpoint): its files moved to {dest}; "
            f"starting afresh")


def kept_work(exp_dir: Path, server: bool = False) -> str:
    """What in `exp_dir` a fresh start must not move aside, in words ("" when nothing): a checkpoint, an update
    in the trajectory store's ledger, a gateway's data, (for a server: `ajet serve`, `ajet gateway`) finished
    episodes, or a store that is open elsewhere or unreadable. `check_exp_dir` refuses a folder with any of them
    without --resume."""
    done = checkpoint.complete(exp_dir)
    if done:
        return f"a checkpoint of step {done[-1][0]}"
    if any((exp_dir / n).exists() for n in GATEWAY_DATA):
        return "a gateway's sessions"
    path = exp_dir / "trajectories.sqlite"
    if not path.is_file():
        return ""
    try:
        db = sqlite3.connect(str(path), isolation_level=None, timeout=0)
        try:
            # fails while another connection has the store open: a run (or `ajet view`) still using the folder;
            # otherwise it folds a killed run's WAL in and leaves only the database file
            db.execute("PRAGMA journal_mode=DELETE")
            trained = db.execute("SELECT COUNT(*) FROM trained").fetchone()[0]
            finished = db.execute("SELECT COUNT(*) FROM episodes WHERE error IS NULL AND reward IS NOT NULL"
                                  ).fetchone()[0] if server else 0
        finally:
            db.close()
    except sqlite3.Error as exc:
        return f"trajectories.sqlite, which cannot be checked ({exc}): a run may still be using it"
    if trained:
        return f"trained steps in trajectories.sqlite ({trained} episodes trained on)"
    if finished:
        return f"{finished} finished episodes in trajectories.sqlite that a resumed server trains on"
    return ""


def _aside_folder(exp_dir: Path) -> Path:
    """`exp_dir/untrained-<local date and time>` (with -2, -3, ... when that exists)."""
    base = exp_dir / f"untrained-{time.strftime('%Y%m%d-%H%M%S')}"
    dest, n = base, 1
    while dest.exists():
        n += 1
        dest = base.with_name(f"{base.name}-{n}")
    return dest
