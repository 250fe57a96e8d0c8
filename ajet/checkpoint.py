"""Checkpoints that a killed run resumes from: `exp_dir/checkpoints/step_N/`, and the per-step logs'
rollback to a checkpoint.

A checkpoint holds the backbone's state (Hugging Face weights, optimizer, RNG, policy version; see
`Backbone.save_checkpoint`) and `trainer_state.pt` (step, data position, Python and torch RNG, attempt).
It is written into a temporary folder and renamed into place, so a `kill -9` mid-write leaves either the
previous checkpoint or the new one, never half of one; a disk that fills up mid-write leaves the same, and
`DiskFull` (one line: where, how much is free, the checkpoint to resume from). Re-saving a step that exists moves
the old folder aside to `.step_N.old` first; if the process dies between the two renames, `latest` (and the next
`save`) put the old folder back, so some complete `step_N` is always found.

`ajet gateway` writes one such checkpoint per served policy version (ajet/gateway/versions.py); with a LoRA
adapter it leaves the merged weights out (`adapter_only`): the adapter and the optimizer state restore the policy.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from ajet import progress
from ajet.errors import DiskFull, disk_free, first_line, is_disk_full
from ajet.faults import kill_point

TRAINER_STATE = "trainer_state.pt"
NEARLY_FULL_BYTES = 64 * 2**20    # a write that failed with less than this free on its disk ran out of space (bytes)


# the merged full weights a backbone writes beside its LoRA adapter (`adapter/`), left out by `adapter_only`
MERGED_WEIGHTS = ("model*.safetensors", "model.safetensors.index.json", "pytorch_model*.bin",
                  "pytorch_model.bin.index.json")


def save(exp_dir: Path, step: int, backbone, trainer_state: dict[str, Any], adapter_only: bool = False) -> Path:
    """Write checkpoint `step_<step>` atomically (also when it exists already); returns its folder.

    Args:
        exp_dir: the experiment folder (the checkpoint is `exp_dir/checkpoints/step_<step>`).
        step: the trainer step the checkpoint ends.
        backbone: writes its state with `save_checkpoint(folder)`.
        trainer_state: what the trainer resumes from (`trainer_state.pt`: step, attempt, rollout, RNG states).
        adapter_only: when the backbone wrote a LoRA adapter (`adapter/adapter_model.safetensors`), remove the
            merged full weights beside it (`MERGED_WEIGHTS`) before the rename: the folder then holds the adapter,
            the optimizer state and the tokenizer (what `load_checkpoint` reads with `model.lora`), not a loadable
            full model. Without an adapter it changes nothing.

    Raises:
        DiskFull: the disk filled up while the checkpoint was written (`is_disk_full`, or under NEARLY_FULL_BYTES
            left free); the partial folder is removed.
        OSError: the folder cannot be written.
    """
    import torch

    root = exp_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    _recover(root)
    tmp, final, old = root / f".step_{step}.tmp", root / f"step_{step}", root / f".step_{step}.old"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with progress.phase(f"checkpoint step {step}"):   # the weights may take minutes to write
            backbone.save_checkpoint(tmp)
            if adapter_only and (tmp / "adapter" / "adapter_model.safetensors").is_file():
                for pattern in MERGED_WEIGHTS:
                    for f in tmp.glob(pattern):
                        f.unlink()
            torch.save(trainer_state, tmp / TRAINER_STATE)
    except Exception as exc:
        # torch's zip writer says "file write failed" (or "unexpected pos ...") without the OS's reason: a disk left
        # with almost nothing free says it
        if not (is_disk_full(exc) or shutil.disk_usage(root).free < NEARLY_FULL_BYTES):
            raise
        shutil.rmtree(tmp, ignore_errors=True)          # the partial folder: space back, nothing half-written left
        raise DiskFull(_disk_full_message(root, step, exc)) from exc
    kill_point("checkpoint", step)
    if final.exists():
        os.replace(final, old)
        kill_point("swap", step)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def _disk_full_message(root: Path, step: int, exc: BaseException) -> str:
    """`DiskFull`'s line: the checkpoint, its disk's free space, the error's first line, what to do."""
    first = first_line(exc)[:300]
    before = latest(root.parent)
    then = (f"then the same command with --resume continues from {before.name}" if before is not None else
            "then run the same command again (no earlier checkpoint)")
    return (f"checkpoint step_{step} did not fit in {root}: the disk is full ({disk_free(root)} once the partial "
            f"checkpoint was removed; {type(exc).__name__}: {first}). "
            f"Free space there or give --exp-dir on a larger disk; {then}")


def _recover(root: Path) -> None:
    """Undo a re-save cut between its two renames: `.step_N.old` without `step_N` becomes `step_N` again."""
    for old in root.glob(".step_*.old"):
        final = root / old.name[1:-len(".old")]
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(old, final)


def complete(exp_dir: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint (with its trainer_state.pt), oldest step first."""
    root = exp_dir / "checkpoints"
    if not root.is_dir():
        return []
    _recover(root)
    found = []
    for d in root.glob("step_*"):
        m = re.fullmatch(r"step_(\d+)", d.name)
        if m and (d / TRAINER_STATE).is_file():
            found.append((int(m.group(1)), d))
    return sorted(found)


def latest(exp_dir: Path) -> Path | None:
    """The newest complete checkpoint folder, or None."""
    found = complete(exp_dir)
    return found[-1][1] if found else None


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
