"""Per-step outputs: `metrics.jsonl`, TensorBoard scalars, `trajectories.jsonl` and the console line."""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Any, Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class MetricsLogger:
    """Per-step metrics to the chosen loggers: `exp_dir/metrics.jsonl` (jsonl), TensorBoard event files under
    `exp_dir/tensorboard`, Weights & Biases (wandb: offline under `exp_dir/wandb` unless WANDB_API_KEY or
    WANDB_MODE=online is set) and the console; plus every episode to `trajectories.jsonl`.

    Args:
        exp_dir: the experiment folder (created if missing).
        tensorboard: with `loggers` None: whether TensorBoard is on (console and jsonl always are).
        first_step: the step this attempt starts at; TensorBoard events of later steps, left by an
            interrupted attempt, are purged (the jsonl files are truncated by `checkpoint.truncate_jsonl`).
        loggers: names from `TrainerConfig.loggers` ("console", "tensorboard", "jsonl", "wandb").
        run_config: the run's `AjetConfig` (wandb's run name and config).
        console: the run's console (default: `run_console(loggers)`).

    Raises:
        ImportError: "wandb" is asked for but not installed (the config check names the extra first).
    """

    def __init__(self, exp_dir: Path, tensorboard: bool = True, first_step: int = 1, loggers: list[str] | None = None,
                 run_config: Any = None, console: Console | None = None):
        loggers = ["console", "jsonl"] + (["tensorboard"] if tensorboard else []) if loggers is None else loggers
        self.exp_dir = exp_dir
        exp_dir.mkdir(parents=True, exist_ok=True)
        self._metrics = open(exp_dir / "metrics.jsonl", "a", encoding="utf-8") if "jsonl" in loggers else None
        self._trajectories = open(exp_dir / "trajectories.jsonl", "a", encoding="utf-8")
        self._tb = None
        if "tensorboard" in loggers:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(exp_dir / "tensorboard"), purge_step=first_step)
        self._wandb = _start_wandb(exp_dir, run_config) if "wandb" in loggers else None
        self._episode_rows: list[list[Any]] = []
        self._step = 0
        self.console = console if console is not None else run_console(loggers)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Write one step's metrics. A NaN or +-Infinity value (a client's episode metric, a diverged loss)
        is written to `metrics.jsonl` as null, its key listed under `nonfinite`: the file stays strict JSON
        that every reader parses."""
        self._step = step
        if self._metrics is not None:
            bad = sorted(k for k, v in metrics.items() if _finite(v) != v)
            row = {"step": step, **{k: _finite(v) for k, v in metrics.items()}}
            if bad:
                row["nonfinite"] = bad
            self._metrics.write(json.dumps(row, allow_nan=False) + "\n")
            self._metrics.flush()
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)

    @contextlib.contextmanager
    def progress(self, label: str, total: int) -> Iterator[Callable[..., None]]:
        """A transient rich progress bar of `total` episodes; yields `advance(status=None)` to call per
        episode (`status`: a line shown after the bar, e.g. `ajet serve`'s clients and policy version)."""
        bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("episodes"),
                       TimeElapsedColumn(), TextColumn("{task.fields[status]}"), console=self.console, transient=True)
        task = bar.add_task(label, total=total, status="")
        with bar:
            yield lambda status=None: bar.update(task, advance=1, **({} if status is None else {"status": status}))

    def write_episode(self, step: int, record: dict[str, Any]) -> None:
        self._trajectories.write(json.dumps({"step": step, **record}) + "\n")
        if self._wandb is not None:
            samples = record.get("samples") or []
            self._episode_rows.append([
                record["episode_id"], record.get("group_id"), record.get("reward"),
                samples[0].get("advantage") if samples else None, len(record.get("calls") or []), len(samples),
                ((record.get("output") or {}).get("final_answer") or "")[:500],
                (record.get("error") or "").strip().splitlines()[-1][:300] if record.get("error") else None])

    def flush(self) -> None:
        self._trajectories.flush()
        if self._wandb is not None and self._episode_rows:   # this step's episodes as a wandb table
            import wandb

            table = wandb.Table(columns=["episode_id", "group_id", "reward", "advantage", "calls", "samples",
                                         "final_answer", "failure"], data=self._episode_rows)
            self._wandb.log({"episodes": table}, step=self._step)
            self._episode_rows = []

    def close(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
        self._trajectories.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def run_console(loggers: list[str]) -> Console:
    """The run's console on stdout (the step lines, status lines, progress): silent unless `loggers` has
    "console"; into a file or a pipe its lines are never hard-wrapped (`ajet.progress.unwrapped_when_piped`)."""
    from ajet.progress import unwrapped_when_piped

    return unwrapped_when_piped(Console(stderr=False, highlight=False, quiet="console" not in loggers))


def alert_console(console: Console) -> Console:
    """Where failures and invalid evaluations are said: `console`, or stderr when `console` is silent (no
    "console" logger), so that they are never unsaid."""
    from ajet.progress import unwrapped_when_piped

    return console if not console.quiet else unwrapped_when_piped(Console(stderr=True, highlight=False))


def _finite(v: Any) -> Any:
    """`v` with every NaN / +-Infinity float in it (also inside lists and dicts) replaced by None."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(_finite(x) for x in v)
    return v


def _start_wandb(exp_dir: Path, run_config: Any) -> Any:
    """A wandb run writing under `exp_dir/wandb`: offline (no network, no account) unless WANDB_API_KEY is set
    or WANDB_MODE says otherwise; `wandb sync exp_dir/wandb/offline-run-*` uploads it later."""
    import os

    import wandb

    mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
    name = getattr(run_config, "experiment_name", exp_dir.name)
    config = run_config.model_dump(mode="json") if hasattr(run_config, "model_dump") else {}
    return wandb.init(project=os.environ.get("WANDB_PROJECT", "ajet"), name=name, dir=str(exp_dir), mode=mode,
                      config=config, settings=wandb.Settings(console="off", silent=True))
