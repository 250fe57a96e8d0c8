"""The gateway's served policy versions on disk: each one is a trainer checkpoint (`exp_dir/checkpoints/step_<S>`,
written by `ajet.checkpoint.save`: into a temporary folder, then renamed), so that `--resume` continues from the
version that was being served, at the step that served it.

    checkpoints/step_<S>/   the backbone's state (weights, optimizer, RNG, policy version; with `model.lora`
                            the adapter without the merged weights) + trainer_state.pt, whose `rollout` is
                            {"gateway": {"version": V, "step": S, "attempt": A, "trained": [[session, attempt], ...]}}

A version's folder is written when it is served, before it answers a request (with `gateway.gate.mode` eval or
replay, while live calls are held; with `off`, right after the update, while requests already decode on it).
`trained` lists the episodes the update of step S trained on: the trainer writes its ledger (`mark_trained`)
only after the update, so a `kill -9` in between would otherwise train those sessions again after `--resume`.
The trainer's own checkpoints (`trainer.save_freq`, and the last step) carry `{"gateway": {"version": V}}`.

Kept: for each of the `gateway.gate.keep_versions` versions served last, its newest folder, and always the newest
folder of all (where `--resume` starts); every other folder that names a gateway version is removed. A version
number that comes back (the next update after a rollback to V is V + 1 again) is the newest folder holding it.

Crash consistency: an update's version is committed by its `versions` row in gateway.sqlite, written after its
folder is in place and fsynced, and it is switched in (answers anything) only after that row. A folder written
by an update whose row is missing was never served: `discard_uncommitted` removes it before `--resume` picks
its checkpoint, so the restart serves the last committed version and its number is free again (no client saw
it). A version number that some answer carries always names one set of weights.

Thread model: the trainer thread only (the gate's update, rollbacks and the trainer's own saves);
`discard_uncommitted` before the trainer starts.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any, Iterable

from ajet import checkpoint

log = logging.getLogger(__name__)
KEY = "gateway"   # the key of the gateway's part of a checkpoint's `rollout` state


def rollout_state(version: int, step: int | None = None, attempt: int | None = None,
                  trained: Iterable[tuple[str, int]] | None = None) -> dict[str, Any]:
    """The gateway's part of a checkpoint's `rollout` state (see the module docstring)."""
    out: dict[str, Any] = {"version": version}
    if trained is not None:
        out.update(step=step, attempt=attempt, trained=[[eid, att] for eid, att in trained])
    return {KEY: out}


class VersionStore:
    """The served versions' checkpoints of one experiment folder.

    Args:
        exp_dir: the experiment folder (`checkpoints/` is under it).
        keep: how many of the versions served last keep their checkpoint (`gateway.gate.keep_versions`, >= 1).
        adapter_only: write a LoRA adapter without the merged weights (`model.lora` set; see `checkpoint.save`).
    """

    def __init__(self, exp_dir: Path, keep: int, adapter_only: bool = False):
        self.exp_dir, self.keep, self.adapter_only = Path(exp_dir), keep, adapter_only
        self._versions: dict[Path, tuple[float, int | None]] = {}   # folder -> (mtime of its trainer state, version)

    def write(self, backbone, version: int, step: int, attempt: int,
              trained: Iterable[tuple[str, int]] = ()) -> Path:
        """Write the backbone's state as `version`, served at `step` by `attempt` after training on `trained`
        ((episode_id, its attempt) pairs); returns the folder. Raises OSError when it cannot be written."""
        import torch

        state = {"step": step, "attempt": attempt, "rollout": rollout_state(version, step, attempt, trained),
                 "python_rng": random.getstate(), "torch_rng": torch.get_rng_state()}
        folder = checkpoint.save(self.exp_dir, step, backbone, state, adapter_only=self.adapter_only)
        fsync_tree(folder)
        return folder

    def discard_uncommitted(self, served: list[dict[str, Any]]) -> list[Path]:
        """Remove every folder an update wrote for a version that has no `versions` row of its step (`served`:
        `GatewayStore.versions()`): the gateway stopped between the folder and its row, so the version was never
        switched in (module docstring). Folders without an update's `trained` list (the serving version's, the
        trainer's own) are never removed. Returns the folders removed."""
        rows = {(v["version"], v["step"]) for v in served}
        removed = []
        for step, path in checkpoint.complete(self.exp_dir):
            try:
                mine = (checkpoint.load_trainer_state(path).get("rollout") or {}).get(KEY) or {}
            except Exception:  # noqa: BLE001 - an unreadable state: not this store's to remove
                continue
            if "trained" in mine and (mine.get("version"), step) not in rows:
                shutil.rmtree(path, ignore_errors=True)
                self._versions.pop(path, None)
                removed.append(path)
        return removed

    def folders(self) -> list[tuple[int, int | None, Path]]:
        """(step, version or None when not a gateway's, folder) of every complete checkpoint, oldest first."""
        out = []
        for step, path in checkpoint.complete(self.exp_dir):
            out.append((step, self._version_of(path), path))
        return out

    def _version_of(self, path: Path) -> int | None:
        state_file = path / checkpoint.TRAINER_STATE
        try:
            mtime = state_file.stat().st_mtime
        except OSError:
            return None
        cached = self._versions.get(path)
        if cached is not None and cached[0] == mtime:
            return cached[1]
        try:
            rollout = checkpoint.load_trainer_state(path).get("rollout") or {}
            version = rollout.get(KEY, {}).get("version")
        except Exception:  # noqa: BLE001 - an unreadable state: not a version this store removes or loads
            log.warning("gateway: cannot read %s", state_file, exc_info=True)
            version = None
        self._versions[path] = (mtime, version)
        return version

    def folder(self, version: int) -> Path | None:
        """The newest checkpoint folder holding `version`, None when none is kept."""
        return {v: path for _, v, path in self.folders()}.get(version)

    def newest(self) -> tuple[int, int | None, Path] | None:
        """(step, version, folder) of the newest checkpoint (the one `--resume` starts from), None when none."""
        found = self.folders()
        return found[-1] if found else None

    def kept(self) -> list[int]:
        """The versions that have a checkpoint, ascending."""
        return sorted({v for _, v, _ in self.folders() if v is not None})

    def prune(self, served: list[int], serving: int) -> list[Path]:
        """Remove every gateway checkpoint but the newest folder of each of the `keep` versions served last (and of
        `serving`) and the newest folder of all. `served`: the versions in the order they began to be served
        (`GatewayStore.versions()`). Returns the folders removed."""
        recent: list[int] = []
        for v in reversed(served):
            if v not in recent:
                recent.append(v)
        wanted = set(recent[:self.keep]) | {serving}
        found = self.folders()
        newest_of = {v: path for _, v, path in found}     # oldest first: the newest folder of each version wins
        keep_paths = {newest_of[v] for v in wanted if v in newest_of}
        if found:
            keep_paths.add(found[-1][2])
        removed = []
        for _, v, path in found:
            if v is not None and path not in keep_paths:
                shutil.rmtree(path, ignore_errors=True)
                self._versions.pop(path, None)
                removed.append(path)
        return removed


def fsync_tree(folder: Path) -> None:
    """fsync every file under `folder`, each folder, and `folder`'s parent (its rename), so that the checkpoint
    survives a power loss too. Raises OSError when a file cannot be opened."""
    for root, _dirs, files in os.walk(folder):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    for d in [*(Path(r) for r, _, _ in os.walk(folder)), folder.parent]:
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
