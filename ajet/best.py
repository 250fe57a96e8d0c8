"""The run's final model: the checkpoint with the best validation score (`trainer.keep_best`), else the last step's.

Selection (as TRL's `load_best_model_at_end` with `metric_for_best_model`): each validation (`trainer.val_freq`,
ajet/eval.py `Validator`) is a candidate, the one before step 1 (the initial policy, step 0) included. The candidate
whose `trainer.best_metric` is highest (`best_mode` max; lowest with min) is the best; a tie keeps the earlier step
(fewer updates for the same score). An invalid evaluation (`val/valid` 0: too many failed episodes, no score) is no
candidate. A new best's checkpoint is written at its step whatever `trainer.save_freq` says; step 0 needs none: the
initial model is the config's `model.path`.

`exp_dir/best.json` records the best so far (written after its checkpoint, so a resumed run finds both):

    {"step": 8, "metric": "val/pass@1", "value": 0.45, "mode": "max",
     "checkpoint": "checkpoints/step_8" (null for step 0), "model": the config's model.path}

`final_model(exp_dir)` is what `ajet eval --checkpoint EXP_DIR` evaluates: that best, else the newest checkpoint.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ajet.errors import ConfigError

BEST_FILE = "best.json"


@dataclass(frozen=True)
class Best:
    """One validated step of a run: `step` (0: the initial model), its `metric`'s `value`, the direction `mode`
    ("max" or "min"), its `checkpoint` folder relative to the experiment folder (None for step 0) and the config's
    `model` path (the initial model)."""

    step: int
    metric: str
    value: float
    mode: str
    checkpoint: str | None
    model: str

    def name(self) -> str:
        """How lines name it: "step 8 (checkpoints/step_8)" or "the initial model (step 0, MODEL)"."""
        if self.step == 0:
            return f"the initial model (step 0, {self.model})"
        return f"step {self.step} ({self.checkpoint})"


def is_better(value: float, best: float | None, mode: str) -> bool:
    """Whether `value` beats `best` (None: there is none yet) in direction `mode` ("max" or "min"); a tie does not
    (the earlier step stays the best), nor does NaN."""
    if math.isnan(value):
        return False
    if best is None:
        return True
    return value > best if mode == "max" else value < best


def keeps_best(cfg: Any) -> bool:
    """`trainer.keep_best`, resolved: None means on when the run validates (`trainer.val_freq` > 0), except in mode
    gateway (its gate chooses the served policy)."""
    t = cfg.trainer
    if t.keep_best is not None:
        return t.keep_best
    return bool(t.val_freq) and getattr(cfg, "mode", "train") != "gateway"


def score(step: int, metrics: dict[str, Any], metric: str) -> float | None:
    """The value of `metric` in the validation `metrics` (`val/*`) of `step`; None when no validation ran at that
    step (empty `metrics`) or it was invalid (`val/valid` 0: it has no score).

    Raises:
        ConfigError: a valid validation without `metric` (a misspelt name, `val/pass@4` with eval.n 1, a workflow
            metric the workflow does not report); the message lists the metrics it has.
    """
    if not metrics or not metrics.get("val/valid", 1.0):
        return None
    if metric not in metrics:
        have = ", ".join(sorted(k for k in metrics if k.startswith("val/") and k != "val/time_s"))
        raise ConfigError(f"trainer.best_metric {metric!r} is not a metric of the validation at step {step}; it "
                          f"has {have}: set trainer.best_metric to one of them")
    return float(metrics[metric])


class BestTracker:
    """The best validated step of a run so far (see the module docstring); `observe` each step's validation, then
    `keep` once its checkpoint is written.

    Args:
        exp_dir: the experiment folder (its `best.json`, read on resume).
        metric, mode: `trainer.best_metric` and `trainer.best_mode`.
        model: the config's `model.path` (the step-0 model).
        enabled: `keeps_best(cfg)`; when False, `observe` never selects anything.
    """

    def __init__(self, exp_dir: Path, metric: str, mode: str, model: str, enabled: bool = True):
        self.exp_dir, self.metric, self.mode, self.model, self.enabled = exp_dir, metric, mode, model, enabled
        self.best: Best | None = read_best(exp_dir) if enabled else None
        if self.best is not None and (self.best.metric, self.best.mode) != (metric, mode):
            self.best = None   # resumed under another metric: the earlier choice does not apply
        self._pending: Best | None = None

    def observe(self, step: int, metrics: dict[str, Any]) -> bool:
        """Take `step`'s validation `metrics` (`val/*`; empty when none ran). Returns True when it is the new best:
        its checkpoint must be written (step > 0), then `keep` called.

        Raises:
            ConfigError: see `score`.
        """
        if not self.enabled:
            return False
        value = score(step, metrics, self.metric)
        if value is None or not is_better(value, self.best.value if self.best else None, self.mode):
            return False
        self._pending = Best(step, self.metric, value, self.mode, None if step == 0 else f"checkpoints/step_{step}",
                             self.model)
        return True

    def keep(self) -> Best | None:
        """Make the step `observe` last selected the best (its checkpoint written) and record it in `best.json`
        (atomically: written to a temporary file, then renamed). Returns the best."""
        if self._pending is not None:
            self.best, self._pending = self._pending, None
            write_best(self.exp_dir, self.best)
        return self.best


def write_best(exp_dir: Path, best: Best) -> None:
    """`exp_dir/best.json` := `best`, atomically."""
    tmp = exp_dir / (BEST_FILE + ".tmp")
    tmp.write_text(json.dumps(asdict(best), indent=2) + "\n")
    os.replace(tmp, exp_dir / BEST_FILE)


def read_best(exp_dir: str | Path) -> Best | None:
    """The best recorded in `exp_dir/best.json`, or None (no file, or one that is not a record of a best)."""
    try:
        return Best(**json.loads((Path(exp_dir) / BEST_FILE).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def describe(best: Best) -> str:
    """How commands name a run's kept model: "step 8 (checkpoints/step_8), the best val/pass@1 51.6%"."""
    from ajet.progress import fmt_score

    return f"{best.name()}, the best val/{fmt_score(best.metric[len('val/'):], best.value)}"


def final_model(exp_dir: Path) -> tuple[str, Best | None]:
    """The model a finished (or interrupted) run ends with: (a path `model.path` takes, its `Best`) for a run that
    kept its best (the checkpoint folder, or the initial model's path for step 0), else (the newest checkpoint
    folder, None).

    Raises:
        ConfigError: `exp_dir` has neither a best nor a checkpoint, or its best's checkpoint folder is gone.
    """
    from ajet import checkpoint

    exp_dir = Path(exp_dir)
    best = read_best(exp_dir)
    if best is not None:
        if best.checkpoint is None:
            return best.model, best
        folder = exp_dir / best.checkpoint
        if not folder.is_dir():
            raise ConfigError(f"{exp_dir}: its best checkpoint {folder} (best.json) is missing")
        return str(folder), best
    newest = checkpoint.latest(exp_dir) if exp_dir.is_dir() else None
    if newest is None:
        raise ConfigError(f"{exp_dir}: no checkpoints/step_N folder and no best.json: not an experiment folder "
                          f"with a saved model")
    return str(newest), None
