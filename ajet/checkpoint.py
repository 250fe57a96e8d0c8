"""Checkpoints that a killed run resumes from: `exp_dir/checkpoints/step_N/`.

A checkpoint holds the backbone's state (Hugging Face weights, optimizer, RNG, policy version; see
`Backbone.save_checkpoint`) and `trainer_state.pt` (step, data position, Python and torch RNG, attempt).
It is written into a temporary folder and renamed into place, so a `kill -9` mid-write leaves either the
previous checkpoint or the new one, never half of one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

TRAINER_STATE = "trainer_state.pt"


def save(exp_dir: Path, step: int, backbone, trainer_state: dict[str, Any]) -> Path:
    """Write checkpoint `step_<step>` atomically; returns its folder."""
    import torch

    root = exp_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    tmp, final = root / f".step_{step}.tmp", root / f"step_{step}"
    shutil.rmtree(tmp, ignore_errors=True)
    backbone.save_checkpoint(tmp)
    torch.save(trainer_state, tmp / TRAINER_STATE)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    return final


def latest(exp_dir: Path) -> Path | None:
    """The newest complete checkpoint folder, or None."""
    found = []
    for d in (exp_dir / "checkpoints").glob("step_*"):
        m = re.fullmatch(r"step_(\d+)", d.name)
        if m and (d / TRAINER_STATE).is_file():
            found.append((int(m.group(1)), d))
    return max(found)[1] if found else None


def load_trainer_state(path: Path) -> dict[str, Any]:
    import torch

    return torch.load(path / TRAINER_STATE, weights_only=False)


def truncate_jsonl(path: Path, last_step: int) -> None:
    """Drop lines of steps after `last_step` (written by the interrupted attempt) from a per-step log."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= last_step]
    path.write_text("".join(line + "\n" for line in keep))
