"""Checkpoints that a killed run resumes from: `exp_dir/checkpoints/step_N/`, and the per-step logs'
rollback to a checkpoint.

A checkpoint holds the backbone's state (Hugging Face weights, optimizer, RNG, policy version; see
`Backbone.save_checkpoint`) and `trainer_state.pt` (step, data position, Python and torch RNG, attempt).
It is written into a temporary folder and renamed into place, so a `kill -9` mid-write leaves either the
previous checkpoint or the new one, never half of one. Re-saving a step that exists moves the old folder
aside to `.step_N.old` first; if the process dies between the two renames, `latest` (and the next `save`)
put the old folder back, so some complete `step_N` is always found.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from ajet import progress
from ajet.faults import kill_point

TRAINER_STATE = "trainer_state.pt"


def save(exp_dir: Path, step: int, backbone, trainer_state: dict[str, Any]) -> Path:
    """Write checkpoint `step_<step>` atomically (also when it exists already); returns its folder."""
    import torch

    root = exp_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    _recover(root)
    tmp, final, old = root / f".step_{step}.tmp", root / f"step_{step}", root / f".step_{step}.old"
    shutil.rmtree(tmp, ignore_errors=True)
    with progress.phase(f"checkpoint step {step}"):   # the weights may take minutes to write
        backbone.save_checkpoint(tmp)
        torch.save(trainer_state, tmp / TRAINER_STATE)
    kill_point("checkpoint", step)
    if final.exists():
        os.replace(final, old)
        kill_point("swap", step)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def _recover(root: Path) -> None:
    """Undo a re-save cut between its two renames: `.step_N.old` without `step_N` becomes `step_N` again."""
    for old in root.glob(".step_*.old"):
        final = root / old.name[1:-len(".old")]
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(old, final)


def latest(exp_dir: Path) -> Path | None:
    """The newest complete checkpoint folder, or None."""
    root = exp_dir / "checkpoints"
    if not root.is_dir():
        return None
    _recover(root)
    found = []
    for d in root.glob("step_*"):
        m = re.fullmatch(r"step_(\d+)", d.name)
        if m and (d / TRAINER_STATE).is_file():
            found.append((int(m.group(1)), d))
    return max(found)[1] if found else None


def load_trainer_state(path: Path) -> dict[str, Any]:
    import torch

    return torch.load(path / TRAINER_STATE, weights_only=False)


def truncate_jsonl(path: Path, last_step: int) -> int:
    """Keep only the lines of steps <= `last_step` of a per-step log (drops what an interrupted attempt
    wrote after its last checkpoint, and a torn last line cut by `kill -9`). Rewrites through a temporary
    file and an atomic rename, so a kill during the rewrite leaves the old file whole. Returns the number
    of lines dropped."""
    if not path.exists():
        return 0
    keep, dropped = [], 0
    for line in path.read_bytes().split(b"\n"):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            ok = isinstance(row, dict) and int(row["step"]) <= last_step
        except (ValueError, KeyError, TypeError):   # a torn line (UnicodeDecodeError is a ValueError)
            ok = False
        if ok:
            keep.append(line + b"\n")
        else:
            dropped += 1
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.writelines(keep)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return dropped
